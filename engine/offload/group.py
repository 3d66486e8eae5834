"""How one KV cache group is cut into offload chunks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupOffloadConfig:
    group_idx: int
    block_size: int  # engine tokens per block (= per hash)
    blocks_per_chunk: int
    kv_cache_spec_kind: str = "full_attention"
    sliding_window: int | None = None
    sliding_window_size_in_chunks: int | None = None  # None: full attention

    @property
    def hashes_per_chunk(self) -> int:
        return self.blocks_per_chunk

    @property
    def tokens_per_chunk(self) -> int:
        return self.block_size * self.blocks_per_chunk
