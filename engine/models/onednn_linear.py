"""A bf16 Linear on oneDNN's matmul with the weight reordered once into oneDNN's blocked layout.

On a CPU with AMX (Intel Xeon since Sapphire Rapids) oneDNN runs bf16 GEMMs on the tile unit, which
zenserve's AVX512_BF16 kernel (engine/kernels/bf16_linear.cpp) does not use. SmolLM2's projections x
30 layers, 2 Xeon cores (BENCHMARKS.md): 16 rows 11.7 ms against the kernel's 29.5, 64 rows 17.9
against 102, 286 rows (4 layers) 6.7 against 55.5. The weight reordered up front spares the per-call
reorder that torch's own Linear pays (16 rows: 19.5 ms, 64 rows: 29.4).

These are the ops torch's inductor emits for its own oneDNN fusions (`torch.ops.mkldnn`).

For some shapes and row counts oneDNN's own threading leaves cores idle; there the rows are shared out
among the threads instead (engine/kernels/onednn_rows.cpp), at the row counts `plan_row_splits`
measured a gain for when the worker started.

Calls of up to MAX_ROWS_BLOCKED_TILES rows (a short prompt, a cached prefix's suffix) run zenserve's own tile
GEMM over the same blocked weight instead, where `use_blocked_tiles` found it reads that layout right.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from engine.cpu_features import has_amx_bf16
from engine.heap import release_free_heap
from engine.kernels import BlockedTileLinear, OneDnnSplitRows, load_int4_tile_dequantize

log = logging.getLogger(__name__)

# oneDNN picks the blocked weight layout for a problem size; one layout serves every row count.
# On SmolLM2's shapes, the layout for 64 rows was as fast as each row count's own from 8 to 1,024.
_LAYOUT_ROWS = 64

# Row counts are planned in buckets of this many rows: on 2 Xeon cores the row counts where oneDNN's
# threading idled a core formed windows some hundreds of rows wide (onednn_rows.cpp).
ROW_BUCKET = 128
# Buckets measured: beyond, oneDNN's own threading used both cores on every shape measured.
MAX_PLANNED_ROWS = 1536
# A split must take at most this share of oneDNN's time: a clear gain, not the machine's noise.
SPLIT_GAIN = 0.85
# Weights larger than this are never split: each thread would stream all of it (the lm_head's 57 MB).
MAX_SPLIT_WEIGHT_BYTES = 16 * 2**20
# Calls up to this many rows take zenserve's tile GEMM (engine/kernels/blocked_tile_linear.cpp): on 2 Xeon
# cores SmolLM2's projections x 30 layers took 0.68-0.92x oneDNN's time at 64-512 rows, 1.01-1.09x at 1,024
# and 1.25x at 2,048 (BENCHMARKS.md).
MAX_ROWS_BLOCKED_TILES = 512


def row_bucket(rows: int) -> int:
    return max(1, round(rows / ROW_BUCKET)) * ROW_BUCKET


class OneDnnLinear(nn.Module):
    """y = x W^T + b in bf16. The reordered weight is a copy: the source weight stays valid for whatever
    else holds it (a tied embedding)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), _LAYOUT_ROWS)
        self.register_buffer("blocked_weight", blocked, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16), persistent=False)
        # Row buckets whose calls share out their rows (plan_row_splits), and the kernel that does.
        self.split_buckets: frozenset[int] = frozenset()
        self.split_rows: OneDnnSplitRows | None = None
        # Calls of up to tile_rows rows run on tile_linear (use_blocked_tiles); 0: none.
        self.tile_rows = 0
        self.tile_linear: BlockedTileLinear | None = None
        # Row counts past tile_rows that oneDNN serves (warm_row_counts found its sums the tile GEMM's); the
        # others run on the tile GEMM too.
        self.onednn_rows: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Past tile_rows, oneDNN serves only the row counts where it sums each row as the tile GEMM does: a
        # row's result then never depends on how many rows its call had (a prompt's, whether cached or not).
        tiles = (self.tile_rows and x.dim() == 2 and x.stride(1) == 1
                 and (x.shape[0] <= self.tile_rows or x.shape[0] not in self.onednn_rows))
        return self._matmul(x, bool(tiles))

    def _matmul(self, x: torch.Tensor, tiles: bool) -> torch.Tensor:
        if tiles:
            return self.tile_linear(x, self.blocked_weight, self.bias)
        if self.split_buckets and x.dim() == 2 and row_bucket(x.shape[0]) in self.split_buckets:
            return self.split_rows(x, self.blocked_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.blocked_weight, self.bias, "none", [], "")

    def onednn_agrees(self, x: torch.Tensor) -> bool:
        """Whether oneDNN's path (with any row split) gives the tile GEMM's result to the bit on x [rows, in]
        (the first call at a row count also builds oneDNN's primitives for it)."""
        return self.tile_rows > 0 and torch.equal(self._matmul(x, False), self._matmul(x, True))

    def extra_repr(self) -> str:
        split = f", rows split at {sorted(self.split_buckets)}" if self.split_buckets else ""
        tiles = f", tiles up to {self.tile_rows} rows" if self.tile_rows else ""
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"oneDNN blocked{split}{tiles}")

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain [out, in] bf16 tensor, a copy (for checks, not the step's path)."""
        return self.blocked_weight.to_dense()


class BlockedScratch:
    """One blocked bf16 weight per shape that the compact projections of that shape take turns in
    (CompactOneDnnLinear): a step runs its projections one after another on the worker's thread."""

    def __init__(self) -> None:
        self._by_shape: dict[tuple[int, int], torch.Tensor] = {}

    def weight(self, out_features: int, in_features: int) -> torch.Tensor:
        key = (out_features, in_features)
        if key not in self._by_shape:
            with torch.no_grad():
                self._by_shape[key] = torch.ops.mkldnn._reorder_linear_weight(
                    torch.zeros(key, dtype=torch.bfloat16), _LAYOUT_ROWS)
        return self._by_shape[key]


class CompactOneDnnLinear(OneDnnLinear):
    """A bf16 projection kept in 4 bits only (ModelConfig.compact_weights on a CPU with AMX): each call writes
    the weight out of its int4 tiles (a SmallBatchLinear of kind "int4_tiles", which serves the few-row
    calls) into the blocked buffer of its shape, then runs oneDNN's GEMM on it as OneDnnLinear does. The
    written weights are the dense bf16 model's to the bit. In place of a blocked bf16 copy of every weight
    (200 MB for SmolLM2-135M's projections): writing a layer's 3.5 M weights out took 0.21 ms on 2 Xeon
    cores (BENCHMARKS.md)."""

    def __init__(self, packed_weight: torch.Tensor, bias: torch.Tensor | None, blocked: torch.Tensor,
                 dequantize: Callable[[torch.Tensor, torch.Tensor], None]):
        """`blocked`: the BlockedScratch buffer of this weight's shape, which every call refills."""
        nn.Module.__init__(self)
        self.out_features, self.in_features = blocked.shape
        self.packed_weight, self.dequantize = packed_weight, dequantize
        self.blocked_weight = blocked  # shared: not a buffer of this module
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16), persistent=False)
        self.split_buckets = frozenset()
        self.split_rows = None
        self.tile_rows = 0
        self.tile_linear = None
        self.onednn_rows = frozenset()

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of the weight, made on each read (for checks, not the step's path)."""
        weight = torch.empty(self.out_features, self.in_features, dtype=torch.bfloat16)
        self.dequantize(self.packed_weight, weight)
        return weight

    def dense_weight(self) -> torch.Tensor:
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.dequantize(self.packed_weight, self.blocked_weight)
        return super().forward(x)

    def onednn_agrees(self, x: torch.Tensor) -> bool:
        self.dequantize(self.packed_weight, self.blocked_weight)
        return super().onednn_agrees(x)

    def extra_repr(self) -> str:
        return super().extra_repr().replace("oneDNN blocked", "oneDNN blocked from int4 tiles per call")


def onednn_serves_bf16() -> bool:
    """AMX in the CPU and oneDNN in torch: bf16 GEMMs on the tile unit."""
    return has_amx_bf16() and torch.backends.mkldnn.is_available()


def dequantize_int4_tiles_per_call(model: nn.Module) -> int:
    """Puts CompactOneDnnLinear in place of the dense Linear of each SmallBatchLinear of kind "int4_tiles" (a
    bf16 model's 4-bit projections), where oneDNN serves bf16 on AMX and the kernel writes oneDNN's blocked
    layout (checked once a shape against oneDNN's own reorder), the tile kernel then taking up to
    MAX_ROWS_INT4_TILES_AMX_COMPACT rows; returns how many. The dense weights go."""
    from engine.models.packed_linear import MAX_ROWS_INT4_TILES_AMX_COMPACT, SmallBatchLinear

    dequantize = load_int4_tile_dequantize()
    if dequantize is None or not onednn_serves_bf16():
        return 0
    scratch = BlockedScratch()
    checked: dict[tuple[int, int], bool] = {}
    replaced = 0
    for module in list(model.modules()):
        if not (isinstance(module, SmallBatchLinear) and module.kind == "int4_tiles" and type(module.dense) is nn.Linear):
            continue
        shape = (module.out_features, module.in_features)
        if shape not in checked:
            checked[shape] = _blocked_layout_matches(module.packed_weight, scratch.weight(*shape), dequantize)
            if not checked[shape]:
                log.warning("oneDNN's blocked layout for %dx%d weights is not the one zenserve writes: they stay dense",
                            *shape)
        if checked[shape]:
            module.dense = CompactOneDnnLinear(module.packed_weight, module.dense.bias, scratch.weight(*shape),
                                               dequantize)
            module.max_rows = max(module.max_rows, MAX_ROWS_INT4_TILES_AMX_COMPACT)
            replaced += 1
    return replaced


def _blocked_layout_matches(packed_weight: torch.Tensor, blocked: torch.Tensor,
                            dequantize: Callable[[torch.Tensor, torch.Tensor], None]) -> bool:
    """Whether the weights written into `blocked` read back (through oneDNN's reorder to plain) as the same
    weights written out plainly."""
    plain = torch.empty(blocked.shape, dtype=torch.bfloat16)
    dequantize(packed_weight, plain)
    dequantize(packed_weight, blocked)
    return torch.equal(blocked.to_dense(), plain)


def use_blocked_tiles(linears: Iterable[OneDnnLinear], kernel: BlockedTileLinear,
                      max_rows: int = MAX_ROWS_BLOCKED_TILES) -> int:
    """Gives calls of up to `max_rows` rows of each of `linears` to `kernel`, zenserve's tile GEMM over the
    blocked weight, where its shape suits the kernel (both sizes multiples of 32) and the kernel's result on it
    matches the exact product (checked once a shape: the kernel assumes the [N / 32][K / 2][32][2] layout
    that oneDNN chose on the CPUs measured). Returns how many linears it took."""
    verdict: dict[tuple[int, int], bool] = {}
    taken = 0
    for linear in linears:
        shape = (linear.out_features, linear.in_features)
        if shape not in verdict:
            whole_tiles = shape[0] % 32 == 0 and shape[1] % 32 == 0
            verdict[shape] = whole_tiles and _tiles_match(linear, kernel)
            if whole_tiles and not verdict[shape]:
                log.warning("zenserve's tile GEMM does not read oneDNN's blocked layout of %dx%d weights: "
                            "they stay on oneDNN's GEMM", *shape)
        if verdict[shape]:
            linear.tile_linear, linear.tile_rows = kernel, max_rows
            taken += 1
    return taken


def _tiles_match(linear: OneDnnLinear, kernel: BlockedTileLinear) -> bool:
    """Whether `kernel` over the linear's blocked weight gives its exact product (rows of 2 x 16 + 1: both tile
    halves and a short one) to within a bf16 rounding; a misread layout puts every output far off."""
    inputs = torch.Generator().manual_seed(0)  # the global generator's state is the user's
    with torch.no_grad():
        x = torch.randn(33, linear.in_features, generator=inputs).to(torch.bfloat16)
        exact = x.double() @ linear.dense_weight().double().t()
        if linear.bias is not None:
            exact += linear.bias.double()
        if isinstance(linear, CompactOneDnnLinear):  # its blocked buffer holds whichever weight ran last
            linear.dequantize(linear.packed_weight, linear.blocked_weight)
        y = kernel(x, linear.blocked_weight, linear.bias).double()
    return bool(((y - exact).abs() <= exact.abs() * 2**-8 + 1e-5 * linear.in_features).all())


def best_times(first: Callable[[], object], second: Callable[[], object], repeats: int = 5) -> tuple[float, float]:
    """The fastest of `repeats` calls of each, in seconds, the two alternated (after one unmeasured
    call each) so that a noisy moment of the machine falls on both."""
    first(), second()
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, call in enumerate((first, second)):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def plan_row_splits(
    linears: Iterable[OneDnnLinear],
    split_rows: OneDnnSplitRows,
    time_both: Callable[[Callable[[], object], Callable[[], object]], tuple[float, float]] = best_times,
    buckets_met: Callable[[int], bool] = lambda rows: True,
) -> dict[tuple[int, int], frozenset[int]]:
    """Time oneDNN's threading against shared-out rows for each weight shape among `linears` (on its first
    layer, random inputs of each bucket's row count up to MAX_PLANNED_ROWS that `buckets_met` says steps run
    at: each row count timed leaves its primitives in oneDNN's cache), and give every layer of that shape the
    buckets where sharing out took at most SPLIT_GAIN of the time. Returns the plan by (out_features,
    in_features)."""
    by_shape: dict[tuple[int, int], list[OneDnnLinear]] = {}
    for linear in linears:
        if linear.out_features * linear.in_features * 2 <= MAX_SPLIT_WEIGHT_BYTES:
            by_shape.setdefault((linear.out_features, linear.in_features), []).append(linear)
    plan: dict[tuple[int, int], frozenset[int]] = {}
    inputs = torch.Generator().manual_seed(0)  # the global generator's state is the user's
    with torch.no_grad():
        for shape, layers in by_shape.items():
            first = layers[0]
            buckets = set()
            for rows in filter(buckets_met, range(ROW_BUCKET, MAX_PLANNED_ROWS + 1, ROW_BUCKET)):
                x = torch.randn(rows, first.in_features, generator=inputs).to(torch.bfloat16)
                own, shared = time_both(
                    lambda: torch.ops.mkldnn._linear_pointwise(x, first.blocked_weight, first.bias, "none", [], ""),
                    lambda: split_rows(x, first.blocked_weight, first.bias))
                if shared <= SPLIT_GAIN * own:
                    buckets.add(rows)
                release_free_heap()  # the timed calls' inputs and outputs, among the primitives oneDNN keeps
            plan[shape] = frozenset(buckets)
            for linear in layers:
                linear.split_buckets, linear.split_rows = plan[shape], split_rows
    return plan


def warm_row_counts(linears: Iterable[OneDnnLinear], row_counts: Iterable[int]) -> int:
    """Run one linear of each weight shape at each row count, so that oneDNN has built and cached its
    primitives (2-3 ms each when first met) before serving; the row split plan applies as in serving. Where
    the linears have the tile GEMM, oneDNN then serves those of the row counts at which its result is the tile
    GEMM's to the bit (its kernels sum some counts in another order), the tile GEMM the rest.
    Returns the calls made."""
    linears = list(linears)
    first_of_shape: dict[tuple[int, int], OneDnnLinear] = {}
    for linear in linears:
        first_of_shape.setdefault((linear.out_features, linear.in_features), linear)
    agreed: dict[tuple[int, int], set[int]] = {shape: set() for shape in first_of_shape}
    inputs = torch.Generator().manual_seed(0)  # the global generator's state is the user's
    calls = 0
    with torch.no_grad():
        for rows in row_counts:
            for shape, linear in first_of_shape.items():
                x = torch.randn(rows, linear.in_features, generator=inputs).to(torch.bfloat16)
                if linear.tile_rows:
                    if linear.onednn_agrees(x):
                        agreed[shape].add(rows)
                else:
                    linear(x)
                calls += 1
            # Each row count's activations are freed among the primitives built for it, which glibc cannot
            # give back from under: without this, the warm-up raised the peak by 220-250 MB (BENCHMARKS.md).
            release_free_heap()
    for linear in linears:
        linear.onednn_rows = frozenset(agreed[(linear.out_features, linear.in_features)])
    return calls
