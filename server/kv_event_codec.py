"""KV events on the wire: vLLM's field names with a "type" tag, hashes as 64-bit ints."""

from __future__ import annotations

from typing import Any

from engine.block_hash import block_hash_to_int
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

EVENT_VERSION = 1


def encode_event(event: KVCacheEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": [block_hash_to_int(h) for h in event.block_hashes],
            "parent_block_hash": None if event.parent_block_hash is None else block_hash_to_int(event.parent_block_hash),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
            "extra_keys": event.extra_keys,
            "group_idx": event.group_idx,
            "kv_cache_spec_kind": event.kv_cache_spec_kind,
            "kv_cache_spec_sliding_window": event.kv_cache_spec_sliding_window,
            "locality": event.locality,
            "ownership": event.ownership,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [block_hash_to_int(h) for h in event.block_hashes],
            "medium": event.medium,
            "group_idx": event.group_idx,
            "locality": event.locality,
            "ownership": event.ownership,
        }
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(seq: int, ts: float, events: list[KVCacheEvent], **extra: Any) -> dict[str, Any]:
    return {
        "seq": seq,
        "ts": ts,
        "events": [encode_event(e) for e in events],
        "data_parallel_rank": None,
        "event_version": EVENT_VERSION,
        **extra,
    }
