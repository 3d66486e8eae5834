"""A decode-only step's decoder layers as one kernel call (engine/kernels/decode_layers.cpp).

Where every layer runs on zenserve's kernels at decode sizes (packed few-row weights: a bf16 model's
on the tile kernels, a float32 model's on the Q4_1 and Q8_0 group kernels; the fused norms and
activation, the decode-attention block), the op runs the same kernels in the same order as
LlamaForCausalLM's Python loop, so the result is the loop's bit for bit; only the Python between the
calls goes (8 calls a layer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.models.bf16_linear import Bf16PairLinear
from engine.models.kernel_rms_norm import KernelRMSNorm
from engine.models.packed_linear import SmallBatchLinear

# The op's codes for the packed layouts it runs (decode_layers.cpp), and the compute dtype each serves.
PROJECTION_KINDS = {"int4_tiles": 0, "int8_tiles": 1, "int4_groups": 2, "int8_groups": 3, "int4_groups_q8": 4}
KIND_DTYPES = {"int4_tiles": torch.bfloat16, "int8_tiles": torch.bfloat16,
               "int4_groups": torch.float32, "int8_groups": torch.float32, "int4_groups_q8": torch.float32}
# The op's code for bf16_linear's packed pairs (Bf16PairLinear): a bf16 model's dense projections, which serve
# the calls past its packed copies' rows.
BF16_PAIRS_KIND = 5
# Decodes a step up to which the dense plan runs (measured at 20, 25 and 32; beyond, the Python between the
# calls is a smaller share of the step).
MAX_ROWS_BF16_PAIRS = 64

DecodeLayersOp = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class DecodeLayersPlan:
    op: DecodeLayersOp
    # 14 a layer: the input and post-attention norms, then 3 a projection (q/k/v, o, gate/up, down): packed
    # weight, group scales, group minima (empty where the kind has none)
    tensors: list[torch.Tensor]
    kinds: list[int]  # 4 a layer: the projections' PROJECTION_KINDS
    eps: list[float]  # 2 a layer: the norms'
    num_heads: int
    scale: float
    max_rows: int  # the fewest rows any projection's packed copy (or the activation's kernel) serves
    # A dense plan's: the most rows any projection's packed copy serves, which the Python loop runs there
    # (the plan serves calls of more)
    min_rows: int = 0

    def run(self, x: torch.Tensor, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor,
            sin: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last MLP's output, the residual stream) for embeddings `x` of at most max_rows decodes;
        `x` becomes the stream (updated in place)."""
        return self.op(
            x, self.tensors, self.kinds, self.eps, [k for k, _ in kv_caches], [v for _, v in kv_caches], cos, sin,
            meta.decode_positions, meta.slot_mapping, meta.decode_slots, meta.decode_context_lens, self.num_heads,
            meta.sliding_window, self.scale,
        )


def plan_decode_layers(layers: Sequence[nn.Module], silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
                       op: DecodeLayersOp, silu_kernel_rows: int | None = None,
                       dense: bool = False) -> DecodeLayersPlan | None:
    """The plan for Llama decoder `layers` whose every sublayer the op runs as the Python loop would (the
    norms on KernelRMSNorm, the MLPs' activation `silu_and_mul`, which is the op's silu_and_mul kernel for
    calls of up to `silu_kernel_rows` rows (None: all), the fused projections packed for the tile kernels
    (bf16) or the group kernels (float32) without a bias, all of one family), else None. `dense`: the plan
    for the steps past the packed copies' rows instead, where every projection's dense module is a
    Bf16PairLinear without a bias (up to MAX_ROWS_BF16_PAIRS decodes)."""
    tensors: list[torch.Tensor] = []
    kinds: list[int] = []
    eps: list[float] = []
    max_rows: list[int] = []
    packed_rows = 0
    heads: set[tuple[int, float]] = set()
    dtypes: set[torch.dtype] = set()
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(type(n) is KernelRMSNorm for n in norms) or mlp.silu_and_mul is not silu_and_mul:
            return None
        planned = _dense_projections(projections) if dense else _packed_projections(projections)
        if planned is None:
            return None
        if dense:
            packed_rows = max([packed_rows, *(p.max_rows for p in projections if isinstance(p, SmallBatchLinear))])
        tensors += [norms[0].weight_f32, norms[1].weight_f32, *planned.tensors]
        kinds += planned.kinds
        eps += [float(norms[0].eps), float(norms[1].eps)]
        max_rows.append(planned.max_rows)
        heads.add((attn.num_heads, attn.scale))
        dtypes.update(planned.dtypes)
    if len(heads) != 1 or len(dtypes) != 1:
        return None
    ((num_heads, scale),) = heads
    rows = min(max_rows) if silu_kernel_rows is None else min(*max_rows, silu_kernel_rows)
    if packed_rows >= rows:
        return None
    return DecodeLayersPlan(op, tensors, kinds, eps, num_heads, scale, rows, packed_rows)


class _LayerProjections(NamedTuple):
    """One layer's four projections as the op takes them."""

    tensors: list[torch.Tensor]  # 3 a projection: packed weight, group scales, group minima (empty where none)
    kinds: list[int]
    max_rows: int
    dtypes: set[torch.dtype]


def _packed_projections(projections: Sequence[nn.Module]) -> _LayerProjections | None:
    """The projections' packed copies, where each is of a kind the op runs, in its dtype and without a bias."""
    if not all(isinstance(p, SmallBatchLinear) and p.kind in PROJECTION_KINDS and p.bias is None
               and p.compute_dtype == KIND_DTYPES[p.kind] for p in projections):
        return None
    tensors = [t for p in projections for t in (p.packed_weight, *_group_tensors(p))]
    return _LayerProjections(tensors, [PROJECTION_KINDS[p.kind] for p in projections],
                             min(p.max_rows for p in projections), {p.compute_dtype for p in projections})


def _dense_projections(projections: Sequence[nn.Module]) -> _LayerProjections | None:
    """The projections' dense modules, where each is a Bf16PairLinear without a bias."""
    pairs = [p.dense if isinstance(p, SmallBatchLinear) else p for p in projections]
    if not all(type(p) is Bf16PairLinear and p.bias is None for p in pairs):
        return None
    tensors = [t for p in pairs for t in (p.packed_weight, torch.empty(0), torch.empty(0))]
    return _LayerProjections(tensors, [BF16_PAIRS_KIND] * len(pairs), MAX_ROWS_BF16_PAIRS, {torch.bfloat16})


def _group_tensors(projection: SmallBatchLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, minima) of a group kind's projection; empty tensors, the op's placeholders, where the kind
    has none."""
    if projection.kind in ("int4_groups", "int4_groups_q8"):
        return projection.group_scales, projection.group_mins
    if projection.kind == "int8_groups":
        return projection.group_scales, torch.empty(0)
    return torch.empty(0), torch.empty(0)
