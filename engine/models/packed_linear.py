"""Weight-only int4/int8 kernels for small batches, kept beside the dense weights.

At a handful of rows a linear layer is bound by reading its weights, so a 4-bit copy is several
times faster than bf16; from about a dozen rows on, the dense bf16 GEMM wins (BENCHMARKS.md,
"small-batch kernels"). `SmallBatchLinear` keeps both and picks per call by the row count.

Only weights the checkpoint already stored in 4 or 8 bits get a packed copy, recovered from
their dequantized float32 values:
- Q4_1 (w = d*q + m) and Q4_0 (w = d*(q - 8)), group 32, map exactly onto torch's int4 CPU
  kernel (w = (q - 8) * scale + zero per group of 32). Recovery is checked element by element;
  a tensor that does not round-trip stays dense only.
- Q8_0 (group-32 int8) is recovered exactly too, for zenserve's own kernel (engine/kernels,
  `int8_group_mm`). Where that kernel cannot be built it becomes per-row int8 for torch's
  `_weight_int8pack_mm`: not exact (one scale per row instead of per 32 values); the logit error
  this adds is measured in the tests.
A bf16 model's 4-bit weights run on zenserve's AVX512_BF16 kernel where the CPU has it
(`int4_tile_mm`: GGUF's float16 d and m kept as they are, up to MAX_ROWS_INT4_TILES rows, or
MAX_ROWS_INT4_TILES_AMX where it runs on AMX's tiles), else on
torch's int4 kernel. That one takes bf16 activations only (with float32 ones it has no vectorized path:
8-24x slower on a Zen 3), so a float32 model's 4-bit weights keep their Q4_1 groups for zenserve's own
kernel instead (`int4_group_mm`: q * d + m summed in float32), as its Q8_0 ones do; without the kernels
a float32 model stays dense.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GROUP_SIZE = 32  # GGML's block size for Q4_0/Q4_1/Q8_0, and a group size torch's int4 kernel takes

# Row counts up to which the packed kernel beats dense bf16 on this machine's 2 Zen 5 cores
# (ops/bench_kernels.py). The lm_head's int8 copy wins longer: its dense weight is 56 MB, but the
# int8 kernel's time grows with every row (2 threads, quiet: 2.5 vs 3.5 ms at 4 rows, 5.1 vs 4.0 at 8).
MAX_ROWS_INT4 = 4
# zenserve's group kernel for a float32 model's Q4_1 weights (int4_group_mm) against zentorch's prepacked
# float32 GEMM. With rows in blocks of four, in-engine steps of decodes on 2 Zen 3 cores: 35.8 against 48.9 ms
# at 8, 68.2 against 71.5 at 16, 132 against 130 at 32, 245 against 212 at 64, each layer's calls from Python
# (BENCHMARKS.md). Since steps of up to this many decodes also run their layers in one call
# (decode_layers), 20-32 decodes took 0.93-0.95x a step at 32 against 16 (alternated, two runs). From five
# rows the kernel now writes the weight out a panel at a time and runs every row against it: on 2 Zen 1
# cores (whose 128-bit units had made the GEMM win from 16 rows), 30 layers' projections 0.70-0.95x the
# GEMM's time at 5-32 rows, and in-engine steps of 24 / 32 decodes took 0.79x / 0.86x the time of steps
# with the GEMM past 16 rows (BENCHMARKS.md, "The Zen 1 a third time").
MAX_ROWS_INT4_GROUPS = 32
# Beside oneDNN's int8 GEMM (a float32 model's opt-in int8 activations, Int8RowsLinear) the group kernel
# keeps fewer: 30 layers' q/k/v, o and gate/up projections took 51.6 / 95.5 ms at 16 / 32 rows on it against
# 55.6 / 65.3 on the int8 GEMM (2 Zen 3 cores; BENCHMARKS.md).
MAX_ROWS_INT4_GROUPS_BESIDE_INT8 = 16
# Under compact weights the calls past the group kernel run torch's GEMM on the weight written out per call
# (Int4GroupsDense), slower than zentorch's prepacked one: in-engine, steps of 32 decodes took 0.63x the time
# on the group kernel, 64 decodes about the same (2 Zen 3 cores, alternated; BENCHMARKS.md).
MAX_ROWS_INT4_GROUPS_COMPACT = 32
# zenserve's bf16 kernel on the int4 weights (int4_tile_mm), against torch's int4 kernel and the dense bf16
# GEMM: 30 layers' projections, weights from memory, 2 Zen 5 cores: 1.98 / 2.65 / 5.68 ms at one row,
# 3.42 / 6.10 / 6.12 at 8, 6.02 / 11.5 / 7.21 at 16, 8.23 / 16.5 / 8.36 at 24. In-engine A/B (alternated
# blocks of 8 steps): 1 and 4 decodes 0.85x the step of torch's int4 kernel, 8 and 16 decodes 0.83x and
# 0.92x the dense GEMM's, 24 decodes 1.07x (BENCHMARKS.md).
MAX_ROWS_INT4_TILES = 16
# Where the tile kernel runs on AMX (Intel Xeons): 30 layers' projections, 2 Xeon cores, 6.1 / 9.9 / 20 ms at
# 16 / 32 / 64 rows against oneDNN's AMX GEMM over the dense bf16 weights' 13.4 / 15.3 / 17.3 (BENCHMARKS.md).
MAX_ROWS_INT4_TILES_AMX = 32
# Under compact weights a bf16 model's larger calls write their weight out before oneDNN's GEMM
# (CompactOneDnnLinear), so the tile kernel keeps more rows: 30 layers' projections, 2 Xeon cores, 11.2 / 16.5 /
# 25.3 / 32.0 ms at 33 / 64 / 96 / 128 rows against 19.7 / 21.1 / 25.0 / 26.7 (BENCHMARKS.md).
MAX_ROWS_INT4_TILES_AMX_COMPACT = 64
MAX_ROWS_INT8 = 5
# zenserve's group-int8 kernel on the 49152 x 576 lm_head: 1.0 ms at one row, 1.9 at four, against eager
# bf16's 3.5 at four (the MAX_ROWS_INT8 measurement) and zentorch's prepacked bf16 GEMM's 1.5 and 1.2 ms
# (so the zentorch worker keeps it for one row).
MAX_ROWS_INT8_GROUPS = 4
# A float32 model's Q8_0 lm_head on the same kernel (rows in blocks of four) against zentorch's prepacked
# float32 GEMM, 2 Zen 3 cores: 4.3 / 9.5 / 19.6 ms at 8 / 16 / 32 rows against 9.2 / 11.3 / 18.3; in-engine
# steps of 8 and 16 decodes 0.92x and 0.97x the time (BENCHMARKS.md).
MAX_ROWS_INT8_GROUPS_FLOAT32 = 16
# Where the CPU splits every 256-bit operation in two (a Zen 1), zentorch's prepacked GEMM catches up from about
# 5 rows: 2 Zen 1 cores, interleaved, 9.1 / 12.1 ms at 5 / 8 rows against the same, 17.3 / 26.0 at 12 / 16
# against 13.3 / 19.4 (and 2.9 against 6.8 at one row).
MAX_ROWS_INT8_GROUPS_FLOAT32_HALF_WIDTH = 8
# The Q8_0 lm_head of a bf16 model on AMX's tiles (int8_tile_mm), where oneDNN's bf16 GEMM serves larger
# calls: 49152 x 576, 2 Xeon cores, weights from memory (six copies in turn): 1.55 / 1.70 / 1.72 ms at
# 1 / 8 / 16 rows against oneDNN's 2.37 / 2.33 / 2.46; weights in L3: 0.94 / 1.08 / 1.27 against 1.34 /
# 1.35 / 1.49, and 2.00 against 1.87 at 32 rows. It takes one row too (in-engine 1.07 ms a batch-1 step
# against the group kernel's 1.29), so a bf16 model keeps no group copy beside it (BENCHMARKS.md).
MAX_ROWS_INT8_TILES = 16
# The same kernel on VDPBF16PS where the CPU has no AMX (AMD Zen 4 and 5), against the zentorch worker's lm_head
# before (int8_group_mm at one row, zentorch's prepacked bf16 GEMM beyond): SmolLM2 on 2 Zen 4 cores, in-engine
# decode steps at 300 positions took 0.98 / 0.86 / 0.89 / 0.92 / 0.93 / 0.95x the time at 1-6 decodes, but
# 1.02x at 8, where widening the int8 values costs more than the bytes it saves (BENCHMARKS.md).
MAX_ROWS_INT8_TILES_DOT = 6

_EXACT_INT4_TYPES = frozenset({"Q4_0", "Q4_1"})
_INT8_TYPES = frozenset({"Q8_0"})
PACKABLE_GGML_TYPES = _EXACT_INT4_TYPES | _INT8_TYPES  # GGML types a packed copy can be recovered from


@dataclass(frozen=True)
class Int4Groups:
    """Unpacked int4 groups of a [N, K] weight: w = (q - 8) * scale + zero, per GROUP_SIZE along K."""

    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K / GROUP_SIZE] float32
    zero: torch.Tensor  # [N, K / GROUP_SIZE] float32

    @staticmethod
    def concat(parts: list[Int4Groups]) -> Int4Groups:
        """Stack along N (rows): what fusing q/k/v or gate/up does to the weights."""
        return Int4Groups(
            torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), torch.cat([p.zero for p in parts])
        )


@dataclass(frozen=True)
class Int8Rows:
    """A [N, K] weight as int8 with one scale per row: w ≈ q * scale."""

    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32

    @staticmethod
    def concat(parts: list[Int8Rows]) -> Int8Rows:
        return Int8Rows(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))


@dataclass(frozen=True)
class Int8Groups:
    """A [N, K] weight as GGML's Q8_0 stores it: w = q * scale, one scale per GROUP_SIZE along K."""

    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K / GROUP_SIZE] float32

    @staticmethod
    def concat(parts: list[Int8Groups]) -> Int8Groups:
        return Int8Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return (self.q.float().view(n, k // GROUP_SIZE, GROUP_SIZE) * self.scale[..., None]).view(n, k)


PackableWeight = Int4Groups | Int8Rows | Int8Groups


def recover_packable(weight: torch.Tensor, ggml_type: str) -> PackableWeight | None:
    """The packed form of a float32 weight dequantized from `ggml_type`, or None if it has none."""
    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE:
        return None
    if ggml_type in _EXACT_INT4_TYPES:
        return _by_row_chunks(weight, lambda rows: _recover_int4(rows.float(), symmetric=ggml_type == "Q4_0"))
    if ggml_type in _INT8_TYPES:
        return _by_row_chunks(weight, lambda rows: _recover_int8_groups(rows.float())) or _int8_rows(weight.float())
    return None


# Rows recovered at a time: the recovery's float32 temporaries are a few times the rows' size, and for a
# whole 49152 x 576 embedding they raised the load's peak by some 300 MB.
_RECOVERY_CHUNK_ELEMENTS = 1 << 20


def _by_row_chunks(weight: torch.Tensor, recover: Callable[[torch.Tensor], PackableWeight | None]) -> PackableWeight | None:
    """`recover` over bounded row chunks of `weight`, the parts joined; None if any part has no packed form."""
    rows = max(1, _RECOVERY_CHUNK_ELEMENTS // weight.shape[1])
    parts = []
    for chunk in weight.split(rows):
        part = recover(chunk)
        if part is None:
            return None
        parts.append(part)
    return parts[0] if len(parts) == 1 else type(parts[0]).concat(parts)  # type: ignore[attr-defined]


def _recover_int8_groups(weight: torch.Tensor) -> Int8Groups | None:
    """Q8_0 quantizes a group with d = max|w| / 127, so the largest element holds q = ±127 and d follows."""
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    scale = groups.abs().amax(-1) / 127
    inv = torch.where(scale == 0, 0.0, 1.0 / scale)[..., None]
    q = groups.mul(inv).round_().clamp_(-127, 127)
    worst = q.mul(scale[..., None]).sub_(groups).abs_().amax(-1)
    if not bool((worst <= 1e-3 * scale + 1e-7).all()):
        return None
    return Int8Groups(q.reshape(n, k).to(torch.int8), scale)


def _recover_int4(weight: torch.Tensor, symmetric: bool) -> Int4Groups | None:
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    if symmetric:
        # Q4_0 puts the element of largest magnitude at q = 0, i.e. w = -8 d.
        extreme = groups.gather(-1, groups.abs().argmax(-1, keepdim=True)).squeeze(-1)
        scale = extreme / -8
        zero = torch.zeros_like(scale)
    else:
        # Q4_1: the group's minimum is m (q = 0) and its maximum is m + 15 d (q = 15).
        low, high = torch.aminmax(groups, dim=-1)
        scale = (high - low) / 15
        zero = low + 8 * scale
    inv = torch.where(scale == 0, 0.0, 1.0 / scale)[..., None]
    q = groups.sub(zero[..., None]).mul_(inv).round_().add_(8).clamp_(0, 15)
    recon = q.sub(8).mul_(scale[..., None]).add_(zero[..., None])
    # Exact up to float32 rounding of the recovery arithmetic; anything more is not a 4-bit tensor.
    worst = recon.sub_(groups).abs_().amax(-1)
    if not bool((worst <= 1e-3 * scale.abs() + 1e-7).all()):
        return None
    return Int4Groups(q.reshape(n, k).to(torch.uint8), scale, zero)


def _int8_rows(weight: torch.Tensor) -> Int8Rows:
    scale = weight.abs().amax(dim=1) / 127
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(weight / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Rows(q, scale)


class SmallBatchLinear(nn.Module):
    """A Linear with a packed weight-only copy used for inputs of at most `max_rows` rows.

    Wraps (and shares the parameters of) the dense Linear, so tied weights stay tied.
    """

    def __init__(self, dense: nn.Linear, packed: PackableWeight):
        super().__init__()
        self.dense = dense
        self.in_features, self.out_features = dense.in_features, dense.out_features
        # The activations' dtype the packed copy serves: the model's (bf16, or float32 on zenserve's kernels).
        self.compute_dtype = dense.weight.dtype
        if (isinstance(packed, Int8Groups) and self.compute_dtype == torch.bfloat16
                and (int8_tiles := _int8_tiles(packed)) is not None):
            from engine.kernels import int8_tile_mm_uses_amx

            self.kind = "int8_tiles"
            self.max_rows = MAX_ROWS_INT8_TILES if int8_tile_mm_uses_amx() else MAX_ROWS_INT8_TILES_DOT
            _, self.int8_tile_mm = int8_tiles
            self.register_buffer("packed_weight", int8_tiles[0], persistent=False)
            return
        if isinstance(packed, Int8Groups):
            from engine.kernels import load_int8_group_mm

            self.int8_group_mm = load_int8_group_mm()
            if self.int8_group_mm is None:  # no kernel: per-row int8 for torch's
                packed = _int8_rows(packed.dequantize())
        if isinstance(packed, Int8Groups):
            self.kind = "int8_groups"
            self.max_rows = MAX_ROWS_INT8_GROUPS_FLOAT32 if self.compute_dtype == torch.float32 else MAX_ROWS_INT8_GROUPS
            self.register_buffer("packed_weight", packed.q.contiguous(), persistent=False)
            self.register_buffer("group_scales", packed.scale.float().contiguous(), persistent=False)
        elif isinstance(packed, Int4Groups) and self.compute_dtype == torch.float32:
            from engine.kernels import load_int4_group_mm

            kernels = load_int4_group_mm()
            if kernels is None:
                raise ValueError("a float32 model's int4 copy needs zenserve's CPU kernels (float32_small_batch_kernels)")
            pack, self.int4_group_mm = kernels
            self.kind = "int4_groups"
            self.max_rows = MAX_ROWS_INT4_GROUPS
            self.register_buffer("packed_weight", pack(packed.q.contiguous()), persistent=False)
            self.register_buffer("group_scales", packed.scale.float().contiguous(), persistent=False)
            # w = (q - 8) * scale + zero = q * scale + (zero - 8 * scale): Q4_1's own minimum.
            self.register_buffer("group_mins", (packed.zero - 8 * packed.scale).float().contiguous(), persistent=False)
        elif (isinstance(packed, Int4Groups) and self.compute_dtype == torch.bfloat16
              and (tiles := _int4_tiles(packed)) is not None):
            from engine.kernels import int4_tile_mm_uses_amx

            self.kind = "int4_tiles"
            self.max_rows = MAX_ROWS_INT4_TILES_AMX if int4_tile_mm_uses_amx() else MAX_ROWS_INT4_TILES
            _, self.int4_tile_mm = tiles
            self.register_buffer("packed_weight", tiles[0], persistent=False)
        elif isinstance(packed, Int4Groups):
            self.kind = "int4"
            self.max_rows = MAX_ROWS_INT4
            packed_q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(packed.q.to(torch.int32), 1)
            scales_and_zeros = torch.stack([packed.scale.t(), packed.zero.t()], dim=-1)  # [K/G, N, 2]
            self.register_buffer("packed_weight", packed_q, persistent=False)
            self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16).contiguous(), persistent=False)
        else:
            self.kind = "int8"
            self.max_rows = MAX_ROWS_INT8
            self.register_buffer("packed_weight", packed.q.contiguous(), persistent=False)
            self.register_buffer("row_scales", packed.scale.to(torch.bfloat16), persistent=False)

    def quantize_activations_q8(self) -> bool:
        """A float32 model's Q4_1 copy takes its rows quantized to int8 a group at a time (int4_group_mm_q8,
        not exact: int8 activations, opt-in), as llama.cpp multiplies Q4_1; False where this copy is of
        another kind or the kernel is not built."""
        from engine.kernels import load_int4_group_mm_q8

        kernel = load_int4_group_mm_q8() if self.kind == "int4_groups" else None
        if kernel is None:
            return False
        self.kind, self.int4_group_mm_q8 = "int4_groups_q8", kernel
        return True

    @property
    def weight(self) -> torch.Tensor:
        return self.dense.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.dense.bias

    def forward(self, x: torch.Tensor, packed: bool = True) -> torch.Tensor:
        """`packed` False: the dense weights whatever the rows. The packed copy sums other products than the dense
        weights do, so a row's result would depend on how many rows its call had."""
        # The packed kernels are CPU ones: on a GPU (the cuda worker moves the model) the dense weights serve.
        if not packed or x.dim() != 2 or x.shape[0] > self.max_rows or x.dtype != self.compute_dtype or not x.is_cpu:
            return self.dense(x)
        x = x.contiguous()
        # torch.* bindings, not torch.ops.aten.*: ~1.2 µs less a call (1.9 vs 3.1 µs for a tiny op here),
        # 120 calls a batch-1 step.
        if self.kind == "int4_tiles":
            y = self.int4_tile_mm(x, self.packed_weight)
        elif self.kind == "int8_tiles":
            y = self.int8_tile_mm(x, self.packed_weight)
        elif self.kind == "int4":
            y = torch._weight_int4pack_mm_for_cpu(x, self.packed_weight, GROUP_SIZE, self.scales_and_zeros)
        elif self.kind == "int8_groups":
            y = self.int8_group_mm(x, self.packed_weight, self.group_scales)
        elif self.kind == "int4_groups":
            y = self.int4_group_mm(x, self.packed_weight, self.group_scales, self.group_mins)
        elif self.kind == "int4_groups_q8":
            y = self.int4_group_mm_q8(x, self.packed_weight, self.group_scales, self.group_mins)
        else:
            y = torch._weight_int8pack_mm(x, self.packed_weight, self.row_scales)
        if self.dense.bias is not None:
            y = y + self.dense.bias
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, packed={self.kind}, max_rows={self.max_rows}"


def project(linear: nn.Module, x: torch.Tensor, packed: bool) -> torch.Tensor:
    """linear(x), where `packed` False keeps a SmallBatchLinear on its dense weights at any row count
    (AttentionMetadata.packed_projections says when)."""
    if packed or not isinstance(linear, SmallBatchLinear):
        return linear.forward(x)
    return linear.forward(x, packed=False)


class DequantScratch:
    """One float32 buffer that the projections' per-call dense weights take turns in (Int4GroupsDense): a
    step runs its projections one after another on the worker's thread, so one weight's room serves all."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0)

    def reserve(self, numel: int) -> None:
        if numel > self._buffer.numel():
            self._buffer = torch.empty(numel)

    def weight(self, out_features: int, in_features: int) -> torch.Tensor:
        return self._buffer[: out_features * in_features].view(out_features, in_features)


class Int4GroupsDense(nn.Module):
    """The larger calls of a float32 model's Q4_1 projection (a SmallBatchLinear of kind "int4_groups"):
    the dense weight written out from the packed groups into `scratch` for each call, then torch's GEMM.

    In place of a dense float32 copy of every weight (405 MB for SmolLM2-135M's projections, eight times
    their packed bytes): ModelConfig.compact_weights. Writing a layer's 3.5 M weights out takes 0.45 ms on
    2 Zen 3 cores; the cost is torch's GEMM, slower in the engine than zentorch's over prepacked weights
    (a 158-token prefill step 1.2x, 64 decodes 1.45x; BENCHMARKS.md).
    NOTE: not zentorch's GEMM on the scratch buffer: it keeps a reordered copy of an unpacked weight by
    its address, and so answers with the first weight it saw there.
    """

    def __init__(self, packed: SmallBatchLinear, scratch: DequantScratch,
                 dequantize: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]):
        super().__init__()
        if packed.kind != "int4_groups":
            raise ValueError(f"Int4GroupsDense writes out int4_groups weights, not {packed.kind}")
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.packed_weight, self.group_scales, self.group_mins = packed.packed_weight, packed.group_scales, packed.group_mins
        self.bias = packed.dense.bias
        self.scratch, self.dequantize = scratch, dequantize
        scratch.reserve(self.out_features * self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of the weight, made on each read (for checks, not the step's path)."""
        weight = torch.empty(self.out_features, self.in_features)
        self.dequantize(self.packed_weight, self.group_scales, self.group_mins, weight)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.scratch.weight(self.out_features, self.in_features)
        self.dequantize(self.packed_weight, self.group_scales, self.group_mins, weight)
        return F.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, from int4 groups per call"


class Int8GroupsDense(nn.Module):
    """Every call of a float32 model's Q8_0 weight on zenserve's group kernel (rows in blocks of four): the
    lm_head under ModelConfig.compact_weights, which keeps no dense float32 copy (108 MB for SmolLM2-135M).
    Its calls are one row per sampled sequence."""

    def __init__(self, packed: SmallBatchLinear):
        super().__init__()
        if packed.kind != "int8_groups":
            raise ValueError(f"Int8GroupsDense runs int8_groups weights, not {packed.kind}")
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.packed_weight, self.group_scales = packed.packed_weight, packed.group_scales
        self.bias = packed.dense.bias
        self.int8_group_mm = packed.int8_group_mm

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of the weight, made on each read (for checks, not the step's path)."""
        return Int8Groups(self.packed_weight, self.group_scales).dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.int8_group_mm(x.contiguous(), self.packed_weight, self.group_scales)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, on int8 groups"


class Int8GroupsEmbedding(nn.Module):
    """An embedding table looked up from Q8_0 rows (q * scale per group of 32): a tied lm_head's packed
    copy serves as the table under ModelConfig.compact_weights, with no dense float32 one beside it."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.q, self.scales = q, scales
        self.num_embeddings, self.embedding_dim = q.shape

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of the table, made on each read (for checks, not the step's path)."""
        return Int8Groups(self.q, self.scales).dequantize()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.q.index_select(0, flat).float().view(flat.numel(), -1, GROUP_SIZE)
        rows.mul_(self.scales.index_select(0, flat)[..., None])
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, from int8 groups"


class Int8TilesDense(nn.Module):
    """Every call of a bf16 model's Q8_0 weight on AMX's tiles (a SmallBatchLinear of kind "int8_tiles", rows
    16 at a time): the lm_head under ModelConfig.compact_weights, which keeps no dense bf16 copy (57 MB for
    SmolLM2-135M). Its calls are one row per sampled sequence."""

    def __init__(self, packed: SmallBatchLinear):
        super().__init__()
        if packed.kind != "int8_tiles":
            raise ValueError(f"Int8TilesDense runs int8_tiles weights, not {packed.kind}")
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.packed_weight, self.int8_tile_mm = packed.packed_weight, packed.int8_tile_mm
        self.bias = packed.dense.bias

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of the weight, made on each read (for checks, not the step's path)."""
        return int8_tile_rows(self.packed_weight, torch.arange(self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.int8_tile_mm(x.contiguous(), self.packed_weight)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, on int8 tiles"


class Int8TilesEmbedding(nn.Module):
    """An embedding table looked up from a tied lm_head's Q8_0 tiles (Int8TilesDense): a bf16 model's under
    ModelConfig.compact_weights, with no dense bf16 table beside them."""

    def __init__(self, packed_weight: torch.Tensor):
        super().__init__()
        self.packed_weight = packed_weight
        self.num_embeddings = packed_weight.shape[0] * 16
        self.embedding_dim = packed_weight.shape[1] * GROUP_SIZE

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of the table, made on each read (for checks, not the step's path)."""
        return int8_tile_rows(self.packed_weight, torch.arange(self.num_embeddings))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return int8_tile_rows(self.packed_weight, ids.reshape(-1)).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, from int8 tiles"


def int8_tile_rows(packed_weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of the bf16 weight int8_tile_pack packed ([N / 16, K / 32, 576]: per block of 16 rows and group of
    32, 16 pairs of 16 rows' two int8 values, then the 16 rows' float32 scales): q * d in float32, as GGML's
    Q8_0 dequantizes, rounded to bf16, as the dense model's weights are."""
    count, groups = rows.numel(), packed_weight.shape[1]
    blocks = packed_weight.index_select(0, rows // 16)  # [R, G, 576]
    column = rows % 16
    picked = torch.arange(count)
    q = blocks[..., :512].view(count, groups, 16, 16, 2).permute(0, 3, 1, 2, 4)[picked, column]  # [R, G, 16, 2]
    scales = blocks[..., 512:].contiguous().view(torch.float32).view(count, groups, 16).permute(0, 2, 1)[picked, column]
    values = q.reshape(count, groups, GROUP_SIZE).view(torch.int8).float().mul_(scales[..., None])
    return values.view(count, groups * GROUP_SIZE).to(torch.bfloat16)


def dequantize_int4_groups_per_call(model: nn.Module) -> int:
    """Puts Int4GroupsDense in place of the dense Linear of each SmallBatchLinear of kind "int4_groups"
    (float32 models on zenserve's kernels), the Linear's weight then dropped, and lets the group kernel take
    up to MAX_ROWS_INT4_GROUPS_COMPACT rows; returns how many. Where the kernels are not built, nothing
    changes."""
    from engine.kernels import load_int4_group_dequantize

    dequantize = load_int4_group_dequantize()
    if dequantize is None:
        return 0
    scratch = DequantScratch()
    replaced = 0
    for module in list(model.modules()):
        if isinstance(module, SmallBatchLinear) and module.kind == "int4_groups" and type(module.dense) is nn.Linear:
            module.dense = Int4GroupsDense(module, scratch, dequantize)
            module.max_rows = max(module.max_rows, MAX_ROWS_INT4_GROUPS_COMPACT)
            replaced += 1
    return replaced


def _int4_tiles(packed: Int4Groups) -> tuple[torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] | None:
    """(the weight in int4_tile_mm's layout, the kernel), or None where the kernel is not built or the CPU
    lacks AVX512_BF16, N is not a multiple of 16, or a group's scale or minimum is not a float16 value
    (GGUF stores Q4_0's and Q4_1's that way, so recovered ones round to them)."""
    from engine.kernels import load_int4_tile_mm

    kernels = load_int4_tile_mm()
    if kernels is None or packed.q.shape[0] % 16:
        return None
    d = packed.scale.half().float()
    mins = (packed.zero - 8 * packed.scale).half().float()
    if not (d.isfinite().all() and mins.isfinite().all()):
        return None
    # The float16 values must give back the weights the recovery checked, to its own tolerance.
    n, k = packed.q.shape
    q = packed.q.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    checked = (q - 8) * packed.scale[..., None] + packed.zero[..., None]
    worst = (q * d[..., None] + mins[..., None]).sub_(checked).abs_().amax(-1)
    if not bool((worst <= 1e-3 * packed.scale.abs() + 1e-7).all()):
        return None
    pack, mm = kernels
    return pack(packed.q.contiguous(), d.contiguous(), mins.contiguous()), mm


def _int8_tiles(packed: Int8Groups) -> tuple[torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] | None:
    """(the weight in int8_tile_mm's layout, the kernel), or None where the kernel does not run here (neither
    AMX nor AVX512_BF16) or N is not a multiple of 16."""
    from engine.kernels import load_int8_tile_mm

    kernels = load_int8_tile_mm()
    if kernels is None or packed.q.shape[0] % 16:
        return None
    pack, mm = kernels
    return pack(packed.q.contiguous(), packed.scale.float().contiguous()), mm


def float32_small_batch_kernels() -> bool:
    """Whether a float32 model can keep packed copies: zenserve's kernels (int4 and int8 groups) built."""
    from engine.kernels import load_int4_group_mm, load_int8_group_mm

    return load_int4_group_mm() is not None and load_int8_group_mm() is not None


def fuse_packable(parts: list[PackableWeight | None]) -> PackableWeight | None:
    """The packed form of row-concatenated weights: only when every part has one of the same kind."""
    if not parts or any(p is None for p in parts):
        return None
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    return kind.concat(parts)  # type: ignore[arg-type]
