"""Build the offloading connector for an engine from its kv-offloading config."""

from __future__ import annotations

import logging

from engine.block_pool import BlockPool
from engine.kv_cache_spec import KVCacheLayout, SlidingWindowSpec
from engine.offload.connector import OffloadingConnector
from engine.offload.events_tracker import OffloadingEventsTracker
from engine.offload.group import GroupOffloadConfig
from engine.offload.transfer import KVCaches, KVHostBuffer
from kvtier.config import OffloadingConfig
from kvtier.cpu_tier import CPUOffloadingManager

log = logging.getLogger(__name__)


def build_connector(
    config: OffloadingConfig,
    layout: KVCacheLayout,
    pool: BlockPool,
    kv_caches: KVCaches,
    enable_kv_events: bool,
) -> OffloadingConnector:
    if config.secondary_tiers:
        raise NotImplementedError("secondary tiers (fs, obj) are not wired into the engine yet")
    spec = layout.groups[0].spec
    blocks_per_chunk = config.blocks_per_chunk_for(spec.block_size)
    window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
    tokens_per_chunk = spec.block_size * blocks_per_chunk
    group = GroupOffloadConfig(
        group_idx=0,
        block_size=spec.block_size,
        blocks_per_chunk=blocks_per_chunk,
        kv_cache_spec_kind=spec.kind,
        sliding_window=window,
        sliding_window_size_in_chunks=None if window is None else -(-window // tokens_per_chunk),
    )
    bytes_per_chunk = spec.page_size_bytes * layout.num_layers * blocks_per_chunk
    num_slots = config.num_slots(bytes_per_chunk)
    host = KVHostBuffer(num_slots, layout.num_layers, tokens_per_chunk, spec.num_kv_heads, spec.head_size, spec.dtype)
    manager = CPUOffloadingManager(
        num_slots,
        eviction_policy=config.eviction_policy,
        store_threshold=config.store_threshold,
        max_tracker_size=config.max_tracker_size,
    )
    log.info(
        "KV offloading: CPU tier of %d chunks x %d tokens (%.0f MiB, %s eviction)",
        num_slots, tokens_per_chunk, num_slots * bytes_per_chunk / 2**20, config.eviction_policy,
    )
    return OffloadingConnector(
        manager,
        host,
        group,
        pool,
        kv_caches,
        offload_prompt_only=config.offload_prompt_only,
        lookup_deadline_s=config.lookup_deadline_s,
        events=OffloadingEventsTracker(enable_kv_events and config.self_describing_kv_events),
    )
