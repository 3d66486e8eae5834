"""The CPU worker: torch eager, or with its projections on zentorch's prepacked GEMMs on AMD Zen."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import PREFILL_KERNEL_MAX_CONTEXT_AVX2, PrefillChunk
from engine.cpu_features import has_avx2, has_avx512, has_avx512_bf16, splits_256_bit_vectors
from engine.kernels import (
    Bf16Linear,
    RmsNormKernels,
    load_bf16_linear,
    load_blocked_tile_linear,
    load_decode_attention_block,
    load_decode_layers,
    load_onednn_linear_split_rows,
    load_paged_decode_attention,
    load_paged_prefill_attention,
    load_rms_norm,
    load_rotary_embedding,
    load_row_argmax,
    load_silu_and_mul,
    load_write_kv_rows,
    paged_prefill_attention_scores_bf16,
    paged_prefill_attention_uses_amx,
)
from engine.errors import ConfigError
from engine.kv_cache_spec import KVCacheLayout
from engine.kv_quant import FP8_DTYPE
from engine.worker.zentorch_ops import load_zentorch_ops
from engine.models.bf16_linear import Bf16PairLinear, can_pack
from engine.models.int8_linear import (
    ROW_QUANTIZED_PROJECTIONS,
    ActivationRanges,
    Int8DynamicLinear,
    Int8RowsLinear,
    projection_paths,
)
from engine.models.decode_layers import plan_decode_layers
from engine.models.kernel_rms_norm import KernelRMSNorm
from engine.models.llama import RMSNorm
from engine.models.onednn_linear import (
    CompactOneDnnLinear,
    OneDnnLinear,
    onednn_serves_bf16,
    plan_row_splits,
    use_blocked_tiles,
    warm_row_counts,
)
from engine.models.pinned_attributes import pin_attributes
from engine.models.token_buckets import bucket_tokens, token_buckets
from engine.sampling import Sampler
from engine.worker.torch_worker import TorchWorker

log = logging.getLogger(__name__)

# Steps of up to this many tokens (the scheduler's default budget) meet primitives oneDNN built at start;
# a larger --max-num-batched-tokens builds the rest as its steps first need them.
WARM_TOKENS = 2048


class CPUWorker(TorchWorker):
    name = "eager"

    def __init__(self, model: nn.Module, layout: KVCacheLayout, dtype: torch.dtype, batch_invariant: bool = False):
        super().__init__(model, layout, dtype, torch.device("cpu"))
        self.batch_invariant = batch_invariant
        text_model = getattr(model, "language_model", model)
        if dtype == torch.bfloat16 and onednn_serves_bf16():
            # bf16 projections and the lm_head's larger calls on oneDNN's AMX GEMMs, 2.5-8x zenserve's
            # AVX512_BF16 kernel from 16 rows on an Intel Xeon (engine/models/onednn_linear.py).
            _replace_projections(model, lambda _, dense: _onednn_linear(dense))
            _replace_lm_head_dense(text_model, _onednn_linear)
            # Compact weights put memory first: oneDNN keeps 0.6-1 MB a primitive (60 buckets x 4 shapes took
            # 141 MB on SmolLM2), so their steps pad to about a quarter as many row counts.
            coarse = any(isinstance(m, CompactOneDnnLinear) for m in model.modules())
            layers = getattr(getattr(text_model, "model", None), "layers", ())
            projections = [m for layer in layers for m in layer.modules() if isinstance(m, OneDnnLinear)]
            # Prefill-sized calls of the layers' projections on zenserve's tile GEMM over the same weights
            # (0.68-0.92x oneDNN's time at 64-512 rows on 2 Xeon cores); the lm_head's stay on oneDNN, where
            # it did not gain. oneDNN then neither plans nor builds primitives for those row counts.
            tile_linear = load_blocked_tile_linear()
            tiled = use_blocked_tiles(projections, tile_linear) if tile_linear is not None else 0
            tile_rows = min((m.tile_rows for m in projections), default=0) if tiled == len(projections) else 0
            split_rows = load_onednn_linear_split_rows()
            if split_rows is not None:
                plan = plan_row_splits((m for m in model.modules() if isinstance(m, OneDnnLinear)), split_rows,
                                       buckets_met=lambda rows: rows > tile_rows and bucket_tokens(rows, coarse) == rows)
                log.info("oneDNN linears sharing out their rows (row buckets by out x in features): %s",
                         {f"{n}x{k}": sorted(b) for (n, k), b in plan.items()})
            # oneDNN builds a primitive per row count: steps past the tile GEMM's rows run at bucketed token
            # counts, each built now for the layers' projections (the lm_head's rows are the sampled sequences,
            # few counts); shorter steps run as they come.
            if hasattr(text_model, "pad_tokens"):
                text_model.pad_tokens = functools.partial(bucket_tokens, coarse=coarse, unpadded=tile_rows)
                start = time.perf_counter()
                buckets = token_buckets(WARM_TOKENS, coarse, tile_rows)
                calls = warm_row_counts(projections, buckets)
                log.info("oneDNN's primitives built for steps of up to %d tokens: %d calls in %.1f s; oneDNN serves "
                         "%d of their %d row counts past %d (elsewhere its sums differ from the tile GEMM's, "
                         "which serves those)", WARM_TOKENS, calls, time.perf_counter() - start,
                         min((len(m.onednn_rows) for m in projections), default=0), len(buckets), tile_rows)
        else:
            if hasattr(text_model, "pad_tokens"):  # a model another worker prepared keeps no padding
                text_model.pad_tokens = None
            # bf16 projections still on torch's Linear (the eager worker; the zentorch worker has put its
            # own in place) go to zenserve's AVX512_BF16 GEMM where the CPU has it.
            bf16_kernels = load_bf16_linear()
            _replace_projections(model, lambda _, dense: _bf16_pair_linear(dense, bf16_kernels))
        # Decode attention read in place from the paged cache (engine/kernels): at batch 1 it also
        # skips the gathered copy of the context every layer, 3-5x faster than the torch path.
        self.decode_kernel = load_paged_decode_attention()
        # Decode-only steps also run the rotary embedding and the cache write in the same call (at batch 1
        # ~40 small ops a layer fewer).
        supports = getattr(text_model, "supports_decode_block", None)
        if self.decode_kernel is not None and supports is not None and supports():
            self.decode_block = load_decode_attention_block()
        # Prefill chunks' causal attention read in place: no gathered context, no mask, keys past each
        # query skipped. For contexts of up to 512 positions (engine/attention.py), where it wins; 2,048 on a
        # CPU without AVX-512 (its AVX2 path against zentorch's AVX2 SDPA); for every context where a bf16
        # model over a bf16 or float8 cache runs on AMX, or scores on VDPBF16PS (AVX512_BF16: in-engine on 2
        # Zen 4 cores, prefill steps 0.77-0.91x the time of SDPA's past 512, from 1,024 cached + 32 new to
        # 2,048 + 2,048; BENCHMARKS.md).
        self.prefill_kernel = load_paged_prefill_attention()
        if (self.prefill_kernel is not None and dtype == torch.bfloat16
                and layout.groups[0].spec.dtype in (torch.bfloat16, FP8_DTYPE)
                and (paged_prefill_attention_uses_amx() or paged_prefill_attention_scores_bf16())):
            self.prefill_kernel_max_context = None
        elif self.prefill_kernel is not None and not has_avx512():
            self.prefill_kernel_max_context = PREFILL_KERNEL_MAX_CONTEXT_AVX2
        # Prefill steps' rotary embedding of q and k in one in-place pass instead of five torch ops (12% of
        # a 1,500-token prefill step on an Intel Xeon: BENCHMARKS.md).
        self.rope_kernel = load_rotary_embedding()
        # Steps without the decode block write their keys and values a row at a time instead of through
        # index_copy_ (about 0.1 us a row; a 172-token prefill 40.5 vs 41.2 ms on 2 Xeon cores).
        self.kv_write_kernel = load_write_kv_rows()
        # The MLP's activation in one pass, one rounding instead of two. A bf16 model on AVX512_BF16 takes
        # it for every call (16 values a step on zenserve's exp; 2 Xeon cores: 11 vs 26 us at 16 rows, 512
        # vs 942 us at 1,525; in-engine steps of 16 decodes 0.94x; on 2 Zen 4 cores 2.3 vs 6.0 us at one row,
        # 8.0 vs 22.8 at 16, 345 vs 616 at 1,040: BENCHMARKS.md). A float32 model on AVX2 alone (a Zen 3) too,
        # on glibc's AVX2 exp: 0.52-0.76x torch's time from 1 to 2,048 rows, and the decode-layers call then
        # serves steps of as many decodes as the group kernels take, not 4 (in-engine, alternated: 8 and 16
        # decodes 0.87x and 0.92x a step). Elsewhere decode-sized calls only: with glibc's vector exp, a Zen 5
        # A/B gave 1 and 4 decodes 0.97x but 16 decodes 1.02-1.03x.
        kernel = load_silu_and_mul()
        activation, kernel_rows = None, None
        if kernel is not None:
            every_call = silu_kernel_every_call(dtype)
            for layer in getattr(getattr(text_model, "model", None), "layers", ()):
                mlp = getattr(layer, "mlp", None)
                if hasattr(mlp, "silu_and_mul"):
                    if activation is None:  # one for every layer: the decode-layers plan checks it is this one
                        activation = kernel if every_call else functools.partial(
                            _silu_and_mul_small, kernel, type(mlp).silu_and_mul)
                        kernel_rows = None if every_call else MAX_ROWS_SILU_AND_MUL
                    mlp.silu_and_mul = activation
        # The layers' RMSNorms (and the residual add before each) in one pass over the rows, where the
        # worker has not put its own in place (zentorch's).
        norm_kernels = load_rms_norm()
        if norm_kernels is not None:
            _replace_rms_norms(text_model, norm_kernels)
        # Decode-only steps run all the layers in one call where every sublayer is on these kernels
        # (packed few-row weights: a bf16 model's on AVX512_BF16, a float32 model's on the group
        # kernels): the same kernels in the same order, without the Python between them.
        # Set either way: a model another worker prepared must not keep that worker's plan.
        # A bf16 model's steps of more decodes than its 4-bit copies serve (17-64) run on its dense projections
        # the same way: in-engine on a Zen 4, steps of 20-32 decodes 0.95x the time (10 alternated blocks each).
        if hasattr(text_model, "decode_layers"):
            decode_layers = load_decode_layers()
            planned = self.decode_block is not None and decode_layers is not None and activation is not None
            text_model.decode_layers = (
                plan_decode_layers(text_model.model.layers, activation, decode_layers, kernel_rows) if planned else None)
            text_model.decode_layers_dense = (
                plan_decode_layers(text_model.model.layers, activation, decode_layers, kernel_rows, dense=True)
                if planned else None)
        if batch_invariant:
            _batch_invariant_lm_head(text_model)
        # Greedy rows' argmax in one pass: 50 vs 327 us for 16 rows of 49,152 logits (torch's).
        self.sampler = Sampler(device=self.device, row_argmax=load_row_argmax())
        # Last, with every module in place: ~800 Module.__getattr__ lookups a step become plain ones
        # (in-engine A/B, interleaved: batch-1 steps 0.87-0.88x, 16 decodes 0.89x; BENCHMARKS.md).
        pin_attributes(model)


class ZentorchWorker(CPUWorker):
    """Runs the lm_head's larger batches on zentorch's GEMM (the weight prepacked once into its
    blocked layout, the op called directly), and the projections' too where the CPU has no
    AVX512_BF16 for zenserve's own bf16 GEMM (bit-equal to zentorch's, 0.88-0.92x a step of 5-32
    decodes: BENCHMARKS.md).

    Measured on SmolLM2's shapes (2 Zen 5 cores, bf16; BENCHMARKS.md): the prepacked
    `zentorch_linear_unary` beat eager mkldnn at every row count (4.0 vs 1.75 ms for the 56 MB
    lm_head at one row) and the same GEMM behind
    `torch.compile(backend="zentorch")` (dynamo's guards cost ~30 us a call, more than the GEMM at
    decode sizes). Projections with a small-batch int4 copy keep it for decode-sized calls (up to 16
    rows on zenserve's int4 kernel where the CPU has AVX512_BF16, else 4 on torch's): a decode step
    must stream every weight from memory, and 4-bit weights are a quarter of the bytes (19 vs 33 ms
    a batch-1 step with bf16 weights on a Zen 5). A Q8_0 lm_head keeps its exact copy for a few rows: in bf16
    on AVX512_BF16 its int8 tiles, up to six rows (MAX_ROWS_INT8_TILES_DOT), elsewhere its group-int8 copy for
    one row (zenserve's kernel: 1.0 vs 1.5 ms; bf16 on zentorch wins from four rows). The per-row int8 copy
    torch's kernel needs (no compiler) is dropped: bf16 on zentorch is as fast at one row and exact.
    Decode attention runs on zenserve's kernel (CPUWorker), prefill attention too where the kernel serves
    the chunk's context (CPUWorker), else on zentorch's SDPA. With `activation_ranges` (int8 activations, opt-in), the projections' larger
    calls run on zentorch's int8 GEMM instead (engine/models/int8_linear.py).
    """

    name = "zentorch"

    def __init__(self, model: nn.Module, layout: KVCacheLayout, dtype: torch.dtype,
                 activation_ranges: ActivationRanges | None = None, batch_invariant: bool = False):
        if not load_zentorch_ops():
            raise ConfigError("the zentorch worker needs zentorch, which is not installed or does not load")
        self.prefill_sdpa = zentorch_prefill_sdpa
        # Decode attention's two bf16 batched matmuls on zentorch's bmm: in-engine A/B, interleaved, steps
        # of 1-16 decodes took 0.91-0.96x the time with torch.bmm (BENCHMARKS.md).
        self.decode_bmm = torch.ops.zentorch.zentorch_bmm

        from engine.models.packed_linear import (
            MAX_ROWS_INT4_GROUPS_BESIDE_INT8,
            MAX_ROWS_INT8_GROUPS_FLOAT32_HALF_WIDTH,
            SmallBatchLinear,
        )

        if activation_ranges is None:
            # zenserve's AVX512_BF16 GEMM where the CPU has it (bit-equal, faster up to a few hundred
            # rows and even at 2,048), else zentorch's prepacked one.
            bf16_kernels = load_bf16_linear()
            _replace_projections(model, lambda _, dense: _bf16_pair_linear(dense, bf16_kernels)
                                 or ZentorchLinear(dense.weight, dense.bias))
        elif dtype == torch.bfloat16:  # int8 activations (ModelConfig.quantize_activations): bf16 weights dropped
            _replace_projections(model, lambda path, dense: Int8DynamicLinear(
                dense.weight, dense.bias, activation_ranges.absmax[path]))
        else:  # a float32 model's int8 activations: 7 bits a row on oneDNN's GEMM, the down projection float32
            _replace_projections(model, lambda path, dense: Int8RowsLinear(
                dense.weight, dense.bias, activation_ranges.absmax[path])
                if path.rsplit(".", 1)[1] in ROW_QUANTIZED_PROJECTIONS else ZentorchLinear(dense.weight, dense.bias))
            for module in model.modules():
                if isinstance(module, SmallBatchLinear) and isinstance(module.dense, Int8RowsLinear):
                    module.max_rows = min(module.max_rows, MAX_ROWS_INT4_GROUPS_BESIDE_INT8)
                # The few-row calls too: the Q4_1 copies on int8 rows a group of 32 at a time, summed in
                # integers as llama.cpp does (int4_group_mm_q8). The exact group kernel is bound by
                # widening and converting the weights on AVX2: on a Zen 1, 30 layers' projections alone took 11.6
                # ms at one row (a served token 17.4), 1.7x the integer dot's time (BENCHMARKS.md, "A Zen 1 machine").
                if isinstance(module, SmallBatchLinear):
                    module.quantize_activations_q8()
        # The norms stay for zenserve's kernel (CPUWorker), which lets a decode-only step run its layers in one
        # call (decode_layers). Zen 4, in-engine, alternated: batch-1 steps 0.78x, 16 decodes 0.93x the time
        # with zentorch's norms and the Python loop; the norms alone were faster at decode sizes (1 row 1.6 vs
        # 2.7 us) and within 30 us a 1,024-row prefill call (BENCHMARKS.md). On AVX2 zentorch's took 3-11x as
        # long. zentorch's serve only where zenserve's kernel is not built.
        if has_avx512() and load_rms_norm() is None:
            for layer in model.model.layers:
                layer.input_layernorm = ZentorchRMSNorm(layer.input_layernorm)
                layer.post_attention_layernorm = ZentorchRMSNorm(layer.post_attention_layernorm)
            model.model.norm = ZentorchRMSNorm(model.model.norm)
        text_model = getattr(model, "language_model", model)  # a LLaVA model keeps its Llama inside
        head = text_model.lm_head
        # bf16 with int8 activations too: int8 there took a step of 16 decodes from 0.78x to 0.74x but
        # cut the greedy tokens that matched float32's from a median of 12 to 9 (BENCHMARKS.md).
        # Compact weights leave no dense lm_head (the Q8_0 kernel serves every call): nothing to prepack.
        dense = getattr(head, "dense", head)
        if batch_invariant:
            pass  # CPUWorker puts the lm_head on a kernel whose rows do not depend on the call's
        elif type(dense) is nn.Linear and isinstance(head, SmallBatchLinear) and head.kind in ("int8_tiles", "int8_groups"):
            # The Q8_0 copy keeps its few rows: the tiles' cap was measured against this GEMM.
            head.dense = ZentorchLinear(dense.weight, dense.bias)
            if head.kind == "int8_groups" and dtype == torch.bfloat16:
                # Q8_0 on zenserve's group kernel wins at one row only (1.0 vs 1.5 ms; 1.9 vs 1.2 at four). In
                # float32 it wins at four too (Zen 3: 2.1 vs 30 ms for torch's GEMM).
                head.max_rows = 1
            elif head.kind == "int8_groups" and splits_256_bit_vectors():
                head.max_rows = min(head.max_rows, MAX_ROWS_INT8_GROUPS_FLOAT32_HALF_WIDTH)
        elif type(dense) is nn.Linear:
            text_model.lm_head = ZentorchLinear(dense.weight, dense.bias)
        super().__init__(model, layout, dtype, batch_invariant)


def _replace_projections(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module | None]) -> None:
    """Puts `make(path, dense)` in place of each projection still on torch's Linear (None: leave it).
    A SmallBatchLinear keeps its packed copy for the few-row calls and takes the new module as its
    dense one."""
    from engine.models.packed_linear import SmallBatchLinear

    for path, owner, attr in projection_paths(model):
        linear = getattr(owner, attr)
        dense = linear.dense if isinstance(linear, SmallBatchLinear) else linear
        if type(dense) is not nn.Linear:
            continue
        large = make(path, dense)
        if large is None:
            continue
        if dense is linear:
            setattr(owner, attr, large)
        else:
            linear.dense = large


def _bf16_pair_linear(dense: nn.Linear, bf16_kernels: tuple[Callable[[torch.Tensor], torch.Tensor], Bf16Linear] | None
                      ) -> Bf16PairLinear | None:
    """`dense` on zenserve's AVX512_BF16 GEMM, or None where the CPU, dtype or shape do not allow it."""
    if bf16_kernels is None or dense.weight.dtype != torch.bfloat16 or not can_pack(dense.weight):
        return None
    return Bf16PairLinear(dense.weight, dense.bias, bf16_kernels)


def _replace_rms_norms(text_model: nn.Module, kernels: RmsNormKernels) -> None:
    inner = getattr(text_model, "model", None)
    for layer in getattr(inner, "layers", ()):
        for name in ("input_layernorm", "post_attention_layernorm"):
            if type(getattr(layer, name, None)) is RMSNorm:
                setattr(layer, name, KernelRMSNorm(getattr(layer, name), kernels))
    if type(getattr(inner, "norm", None)) is RMSNorm:
        inner.norm = KernelRMSNorm(inner.norm, kernels)


def _onednn_linear(dense: nn.Linear) -> OneDnnLinear | None:
    return OneDnnLinear(dense.weight, dense.bias) if dense.weight.dtype == torch.bfloat16 else None


def _replace_lm_head_dense(text_model: nn.Module, make: Callable[[nn.Linear], nn.Module | None]) -> None:
    """The lm_head's dense calls (a SmallBatchLinear keeps its few-row copy) on `make(dense)`."""
    from engine.models.packed_linear import SmallBatchLinear

    head = text_model.lm_head
    dense = head.dense if isinstance(head, SmallBatchLinear) else head
    if type(dense) is not nn.Linear or (large := make(dense)) is None:
        return
    if dense is head:
        text_model.lm_head = large
    else:
        head.dense = large


def _batch_invariant_lm_head(text_model: nn.Module) -> None:
    """The lm_head's every call on one kernel whose sums for a row do not depend on the call's other rows: its
    dense weights (a packed copy serves few rows only), on zenserve's tile GEMM where oneDNN holds them (oneDNN's
    own GEMM sums some row counts in another order), else on zenserve's AVX512_BF16 GEMM where it takes them."""
    from engine.models.packed_linear import SmallBatchLinear

    head = text_model.lm_head
    dense = head.dense if isinstance(head, SmallBatchLinear) else head
    if isinstance(dense, OneDnnLinear) and (tile_linear := load_blocked_tile_linear()) is not None:
        use_blocked_tiles([dense], tile_linear, max_rows=MAX_LM_HEAD_ROWS)
    elif type(dense) is nn.Linear and (pair := _bf16_pair_linear(dense, load_bf16_linear())) is not None:
        dense = pair
    text_model.lm_head = dense


# The lm_head's rows are the step's sampled sequences: at most max_num_seqs.
MAX_LM_HEAD_ROWS = 1 << 16
MAX_ROWS_SILU_AND_MUL = 4


def silu_kernel_every_call(dtype: torch.dtype) -> bool:
    """Whether the MLP's activation runs on zenserve's kernel at every row count (else for up to
    MAX_ROWS_SILU_AND_MUL rows): a bf16 model on AVX512_BF16, a float32 model where AVX2 is the widest
    (CPUWorker's comment has the measurements)."""
    return (dtype == torch.bfloat16 and has_avx512_bf16()) or (dtype == torch.float32 and has_avx2() and not has_avx512())


def _silu_and_mul_small(kernel: Callable[[torch.Tensor], torch.Tensor], default: Callable[[torch.Tensor], torch.Tensor],
                        gate_up: torch.Tensor) -> torch.Tensor:
    return kernel(gate_up) if gate_up.shape[0] <= MAX_ROWS_SILU_AND_MUL else default(gate_up)


def zentorch_prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk, scale: float
                          ) -> torch.Tensor:
    """Prefill attention on zentorch's flash kernel: ~2x torch's CPU flash kernel on SmolLM2's heads
    (158 causal tokens 486 vs 1,068 us a layer; 32 tokens over 1,056 cached 460 vs 912 us). A masked
    chunk (a cached prefix, a sliding window) takes an additive float mask: zentorch refuses bool
    ones, and its own is_causal aligns the diagonal top-left, wrong when keys outnumber queries."""
    mask = None if chunk.mask is None else chunk.additive_mask(q.dtype)
    out, _ = torch.ops.zentorch.zentorch_sdpa(q, k, v, 0.0, chunk.mask is None, attn_mask=mask, scale=scale)
    return out


class ZentorchRMSNorm(nn.Module):
    """An RMSNorm over the hidden size on zentorch's kernel: 3-4x F.rms_norm on SmolLM2's rows
    (5 vs 15 us at one row, 13 vs 50 us at 158), 61 of them a step. NOTE: only for contiguous 2-D
    input: measured wrong on a transposed view and NaN on 3-D input, which take F.rms_norm."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous():
            return torch.ops.zentorch.zentorch_rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the norm in one in-place kernel: residual += x, then x = norm(residual).
        (2.7 vs 6.1 us at one row, 4.8 vs 9.6 at 16, 14 vs 25 at 158.)"""
        if x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() and x.dtype == residual.dtype:
            torch.ops.zentorch.zentorch_add_rms_norm_(x, self.weight, residual, self.eps)
            return x, residual
        residual = x + residual
        return self.forward(residual), residual


class ZentorchLinear(nn.Module):
    """y = x W^T + b on zentorch's GEMM, W prepacked into its blocked layout at construction.

    NOTE: the prepacked tensor is a copy: the source weight stays valid for whatever else holds it
    (a lm_head tied to the embedding). Prepacking through torch.compile instead rewrites the
    parameter in place, after which only the compiled module can use it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            packed = torch.ops.zentorch.zentorch_weight_prepack_for_linear(weight.detach())
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.zentorch.zentorch_linear_unary(
            x.contiguous(), self.packed_weight, self.bias, is_weight_prepacked=True
        )

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def zentorch_available() -> bool:
    return load_zentorch_ops()
