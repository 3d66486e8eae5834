"""KV cache events with vLLM's field names: what routers learn about which blocks live where.

Hashes stay bytes here; the wire encoding (64-bit ints) is the publisher's job.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_hash import BlockHash

MEDIUM_GPU = "GPU"  # the engine's own KV pool (host memory on a CPU engine; see README)


@dataclass(frozen=True)
class BlockStored:
    """A run of full blocks became resident on a medium (in chain order)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: tuple | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = "full_attention"
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = 0
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
