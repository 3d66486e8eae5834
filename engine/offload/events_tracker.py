"""Self-describing offload KV events: a tier knows a chunk only by its offload key, so this
side table remembers, while the request is at hand, what a router needs to index the chunk.

Entries are created when a store job is built (`record_store`) and when a ready primary-tier
lookup HIT is seen (`record_lookup`, which is how promotions get described); never for
MISS, HIT_PENDING or RETRY. A stored event reads the entry; a removal consumes the entry's
residency and drops the entry once none is left. Keys without an entry get the placeholder
payload (block_size 0, no tokens); consumers must ignore removals of unknown hashes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.block_hash import BlockHash
from engine.block_pool import events_extra_keys
from engine.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from engine.multimodal.prefix_keys import request_block_extra_keys
from engine.offload.group import GroupOffloadConfig
from engine.request import Request
from kvtier.base import MEDIUM_CPU, OffloadingEvent, OffloadKey, offload_key_group, offload_key_hash

log = logging.getLogger(__name__)

Residency = tuple[str, str | None]  # (medium, ownership)


@dataclass(slots=True)
class _ChunkMetadata:
    block_hashes: tuple[BlockHash, ...]  # constituent per-block hashes; the last is the key's
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]  # every token of the chunk
    block_size: int  # tokens per block, not per chunk
    lora_name: str | None
    group_idx: int
    kv_cache_spec_kind: str
    extra_keys: tuple[tuple | None, ...] | None  # per block, as the engine's own events give them
    residencies: set[Residency] = field(default_factory=set)


class OffloadingEventsTracker:
    def __init__(self, enabled: bool):
        # True only when KV events are on and the offloading config opts in.
        self.self_describing_enabled = enabled
        self._pending_event_metadata: dict[OffloadKey, _ChunkMetadata] = {}
        self._warned_placeholder = False

    # ---- recording -------------------------------------------------------------------------
    def record_store(self, req: Request, group: GroupOffloadConfig, chunk_idx: int, key: OffloadKey) -> None:
        if not self._describable(group):
            return
        meta = self._pending_event_metadata.get(key)
        if meta is None:
            meta = self._pending_event_metadata[key] = self._build(req, group, chunk_idx)
        meta.residencies.add((MEDIUM_CPU, None))

    def record_lookup(self, req: Request, group: GroupOffloadConfig, chunk_idx: int, key: OffloadKey) -> None:
        """A ready primary-tier HIT: backfill metadata if absent (promotions bypass stores)."""
        if not self._describable(group):
            return
        if key not in self._pending_event_metadata:
            meta = self._pending_event_metadata[key] = self._build(req, group, chunk_idx)
            meta.residencies.add((MEDIUM_CPU, None))

    def reset(self) -> None:
        self._pending_event_metadata.clear()

    def _describable(self, group: GroupOffloadConfig) -> bool:
        return self.self_describing_enabled and group.sliding_window_size_in_chunks is None

    @staticmethod
    def _build(req: Request, group: GroupOffloadConfig, chunk_idx: int) -> _ChunkMetadata:
        hpc = group.hashes_per_chunk
        first = chunk_idx * hpc
        hashes = tuple(req.block_hashes[first : first + hpc])
        assert len(hashes) == hpc, "a chunk is recorded only once all its blocks are hashed"
        tpc = group.tokens_per_chunk
        bs = group.block_size
        per_block = [request_block_extra_keys(req.mm_items, req.cache_salt, i * bs, (i + 1) * bs)
                     for i in range(first, first + hpc)] if req.mm_items or req.cache_salt is not None else ()
        return _ChunkMetadata(
            block_hashes=hashes,
            parent_block_hash=req.block_hashes[first - 1] if first else None,
            token_ids=tuple(req.all_token_ids[chunk_idx * tpc : (chunk_idx + 1) * tpc]),
            block_size=group.block_size,
            lora_name=None,
            group_idx=group.group_idx,
            kv_cache_spec_kind=group.kv_cache_spec_kind,
            extra_keys=events_extra_keys(per_block),
        )

    # ---- translation -----------------------------------------------------------------------
    def take_events(self, events: Iterable[OffloadingEvent]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for event in events:
            if event.removed:
                out.extend(self._removed(event))
            else:
                out.extend(self._stored(key, event) for key in event.keys)
        return out

    def describe(self, key: OffloadKey, medium: str) -> BlockStored:
        """A stored event for a chunk already resident on `medium` (snapshots); no state changes."""
        return self._stored(key, OffloadingEvent((key,), medium, removed=False))

    def _stored(self, key: OffloadKey, event: OffloadingEvent) -> BlockStored:
        locality = event.locality.value if event.locality else None
        meta = self._pending_event_metadata.get(key) if self.self_describing_enabled else None
        if meta is None:
            if self.self_describing_enabled and not self._warned_placeholder:
                self._warned_placeholder = True
                log.info("offload stored event without metadata: placeholder payload (expected for "
                         "promotions not seen as a local HIT first)")
            return BlockStored(
                block_hashes=(BlockHash(offload_key_hash(key)),),
                parent_block_hash=None,
                token_ids=(),
                block_size=0,
                medium=event.medium,
                group_idx=offload_key_group(key),
                kv_cache_spec_kind=None,
                locality=locality,
                ownership=event.ownership,
            )
        if event.removal_expected:
            meta.residencies.add((event.medium, event.ownership))
        return BlockStored(
            block_hashes=meta.block_hashes,
            parent_block_hash=meta.parent_block_hash,
            token_ids=meta.token_ids,
            block_size=meta.block_size,
            medium=event.medium,
            lora_name=meta.lora_name,
            extra_keys=meta.extra_keys,
            group_idx=meta.group_idx,
            kv_cache_spec_kind=meta.kv_cache_spec_kind,
            locality=locality,
            ownership=event.ownership,
        )

    def _removed(self, event: OffloadingEvent) -> list[BlockRemoved]:
        by_group: dict[int, list[BlockHash]] = {}
        for key in event.keys:
            hashes = by_group.setdefault(offload_key_group(key), [])
            meta = self._pending_event_metadata.get(key) if self.self_describing_enabled else None
            if meta is None:
                hashes.append(BlockHash(offload_key_hash(key)))
                continue
            hashes.extend(meta.block_hashes)
            meta.residencies.discard((event.medium, event.ownership))
            if not meta.residencies:
                del self._pending_event_metadata[key]
        locality = event.locality.value if event.locality else None
        return [
            BlockRemoved(tuple(h), medium=event.medium, group_idx=g, locality=locality, ownership=event.ownership)
            for g, h in by_group.items()
        ]
