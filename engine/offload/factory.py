"""Build the offloading connector for an engine from its kv-offloading config."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
import logging

import torch

from engine.block_pool import BlockPool
from engine.kv_cache_spec import KVCacheLayout, SlidingWindowSpec
from engine.offload.connector import OffloadingConnector
from engine.offload.events_tracker import OffloadingEventsTracker
from engine.offload.group import GroupOffloadConfig
from engine.offload.transfer import HostSlotBytes, KVCaches, KVHostBuffer
from kvtier.base import OffloadingManager
from kvtier.chunk_format import ModelFingerprint
from kvtier.config import OffloadingConfig, SecondaryTierConfig
from kvtier.cpu_tier import CPUOffloadingManager
from kvtier.secondary_tier import SecondaryTier

log = logging.getLogger(__name__)


def build_connector(
    config: OffloadingConfig,
    layout: KVCacheLayout,
    pool: BlockPool,
    kv_caches: KVCaches,
    enable_kv_events: bool,
    model_id: str | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
    executor: ThreadPoolExecutor | None = None,
) -> OffloadingConnector:
    """The connector over a CPU tier, plus the secondary tiers of `config.secondary_tiers`.

    With secondary tiers, `model_id` (the loaded model's identity; it goes into the chunks'
    fingerprint with the KV shape and chunking) is required, and `loop` is the event loop their
    I/O runs on (None: a private one on a daemon thread). The tiers are opened here: a bad path or
    an unreachable bucket raises TierStartupError.
    """
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
    host = KVHostBuffer(num_slots, layout.num_layers, tokens_per_chunk, spec.num_kv_heads, spec.cache_row_size, spec.dtype)
    manager: OffloadingManager = CPUOffloadingManager(
        num_slots,
        eviction_policy=config.eviction_policy,
        store_threshold=config.store_threshold,
        max_tracker_size=config.max_tracker_size,
    )
    log.info(
        "KV offloading: CPU tier of %d chunks x %d tokens (%.0f MiB, %s eviction)",
        num_slots, tokens_per_chunk, num_slots * bytes_per_chunk / 2**20, config.eviction_policy,
    )
    if config.secondary_tiers:
        if model_id is None:
            raise ValueError("secondary tiers need the model id (for the chunks' fingerprint)")
        fingerprint = model_fingerprint(model_id, layout, tokens_per_chunk)
        from kvtier.tiering import TieringOffloadingManager

        tiering = TieringOffloadingManager(
            manager,
            [make_secondary_tier(i, tier, fingerprint) for i, tier in enumerate(config.secondary_tiers)],
            HostSlotBytes(host),
            loop=loop,
            promotion_timeout_s=config.lookup_deadline_s,
        )
        tiering.start()
        manager = tiering
        log.info("KV offloading: secondary tiers %s (fingerprint %s)",
                 ", ".join(tier.name for tier in tiering.tiers), fingerprint.digest)
    return OffloadingConnector(
        manager,
        host,
        group,
        pool,
        kv_caches,
        offload_prompt_only=config.offload_prompt_only,
        lookup_deadline_s=config.lookup_deadline_s,
        events=OffloadingEventsTracker(enable_kv_events and config.self_describing_kv_events),
        executor=executor,
    )


def model_fingerprint(
    model_id: str, layout: KVCacheLayout, tokens_per_chunk: int
) -> ModelFingerprint:
    """What two processes must share to share offloaded chunks (model, KV dtype and shape, chunking)."""
    spec = layout.groups[0].spec
    return ModelFingerprint(
        model_id=model_id,
        # int8 rows carry their scales (engine/kv_quant.py): named so, as their own format.
        dtype="int8_rowscale" if spec.dtype == torch.int8 else str(spec.dtype).removeprefix("torch."),
        num_layers=layout.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        block_size=spec.block_size,
        tokens_per_chunk=tokens_per_chunk,
    )


def make_secondary_tier(index: int, config: SecondaryTierConfig, fingerprint: ModelFingerprint) -> SecondaryTier:
    """The tier one `secondary_tiers` entry describes (not opened yet)."""
    if config.type == "fs":
        from kvtier.fs_tier import FSTier

        return FSTier(index, config.path, config.capacity_bytes, fingerprint, config.effective_locality, config.demote_on)
    from kvtier.obj_tier import ObjTier

    return ObjTier(
        index, config.endpoint, config.bucket, config.capacity_bytes, fingerprint,
        prefix=config.prefix, access_key=config.access_key, secret_key=config.secret_key, region=config.region,
        locality=config.effective_locality, demote_on=config.demote_on,
    )
