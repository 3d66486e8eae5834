"""What the KV cache holds, per group of layers, and the rules derived from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelArchConfig
from engine.kv_quant import cache_row_size


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def kind(self) -> str:
        return "full_attention"

    @property
    def cache_row_size(self) -> int:
        """Elements of one head's K or V row in the cache (int8 rows carry their scale)."""
        return cache_row_size(self.head_size, self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: K and V."""
        return 2 * self.block_size * self.num_kv_heads * self.cache_row_size * _itemsize(self.dtype)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 0

    @property
    def kind(self) -> str:
        return "sliding_window"


@dataclass(frozen=True)
class KVCacheGroup:
    group_id: int
    spec: FullAttentionSpec
    layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheLayout:
    """Groups sharing one block pool: a block id addresses the same page in every layer."""

    groups: tuple[KVCacheGroup, ...]
    num_blocks: int

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    @property
    def needs_zeroing(self) -> bool:
        return needs_kv_cache_zeroing(tuple(g.spec for g in self.groups))

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_ids) for g in self.groups)


def needs_kv_cache_zeroing(specs: tuple[FullAttentionSpec, ...]) -> bool:
    """Whether newly allocated (non-hit) blocks must be zeroed before use.

    Stale bytes only matter when the kernels can read them: mixed precisions across groups
    sharing one pool, or block-dropping (sliding) layers with quantized KV. Uniform
    unquantized full-attention caches skip it.
    """
    dtypes = {s.dtype for s in specs}
    if len(dtypes) > 1:
        return True
    quantized = any(_itemsize(d) == 1 for d in dtypes)
    has_sliding = any(isinstance(s, SlidingWindowSpec) for s in specs)
    return quantized and has_sliding


def make_kv_cache_layout(
    arch: ModelArchConfig, block_size: int, dtype: torch.dtype, memory_bytes: int
) -> KVCacheLayout:
    spec: FullAttentionSpec
    if arch.sliding_window:
        spec = SlidingWindowSpec(
            block_size, arch.num_key_value_heads, arch.head_dim, dtype, arch.sliding_window
        )
    else:
        spec = FullAttentionSpec(block_size, arch.num_key_value_heads, arch.head_dim, dtype)
    group = KVCacheGroup(0, spec, tuple(range(arch.num_hidden_layers)))
    bytes_per_block = spec.page_size_bytes * arch.num_hidden_layers
    num_blocks = memory_bytes // bytes_per_block
    return KVCacheLayout((group,), num_blocks)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
