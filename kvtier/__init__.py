"""KV-cache offloading tiers: the contract (base), the CPU tier, eviction policies, the config, and
secondary tiers (fs_tier, obj_tier: import them directly; they pull in aiofiles / aiobotocore)
behind the CPU tier (tiering)."""

from kvtier.base import (
    MEDIUM_CPU,
    MEDIUM_FS,
    MEDIUM_OBJ,
    Locality,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    TierStats,
    make_offload_key,
    offload_key_group,
    offload_key_hash,
)
from kvtier.chunk_format import ModelFingerprint
from kvtier.config import (
    CPU_SPEC,
    TIERING_SPEC,
    OffloadingConfig,
    SecondaryTierConfig,
    parse_offloading_config,
    parse_size,
)
from kvtier.cpu_tier import CPUOffloadingManager
from kvtier.policy import ARCPolicy, CachePolicy, LRUPolicy, make_policy
from kvtier.secondary_tier import SecondaryTier, TierStartupError
from kvtier.tiering import SlotBytes, TieringOffloadingManager


def create_offloading_manager(config: OffloadingConfig, num_slots: int) -> OffloadingManager:
    """The manager `config.spec_name` names, over a CPU tier of `num_slots` chunk slots.

    `num_slots` comes from `config.num_slots(bytes_per_chunk)` once the engine knows a chunk's size.
    """
    if config.secondary_tiers:
        # NOTE: secondary tiers need the slot bytes, the model fingerprint and an event loop:
        # engine.offload.factory.build_connector builds a TieringOffloadingManager with them.
        raise NotImplementedError(f"{TIERING_SPEC} with secondary_tiers: build a TieringOffloadingManager")
    return CPUOffloadingManager(
        num_slots,
        eviction_policy=config.eviction_policy,
        store_threshold=config.store_threshold,
        max_tracker_size=config.max_tracker_size,
    )


__all__ = [
    "ARCPolicy",
    "CPUOffloadingManager",
    "CPU_SPEC",
    "CachePolicy",
    "LRUPolicy",
    "Locality",
    "LookupResult",
    "ModelFingerprint",
    "MEDIUM_CPU",
    "MEDIUM_FS",
    "MEDIUM_OBJ",
    "OffloadKey",
    "OffloadingConfig",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
    "SecondaryTier",
    "SecondaryTierConfig",
    "SlotBytes",
    "TIERING_SPEC",
    "TierStartupError",
    "TierStats",
    "TieringOffloadingManager",
    "create_offloading_manager",
    "make_offload_key",
    "make_policy",
    "offload_key_group",
    "offload_key_hash",
    "parse_offloading_config",
    "parse_size",
]
