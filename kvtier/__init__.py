"""KV-cache offloading tiers: the contract (base), the CPU tier, eviction policies and the config."""

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


def create_offloading_manager(config: OffloadingConfig, num_slots: int) -> OffloadingManager:
    """The manager `config.spec_name` names, over a CPU tier of `num_slots` chunk slots.

    `num_slots` comes from `config.num_slots(bytes_per_chunk)` once the engine knows a chunk's size.
    """
    if config.secondary_tiers:
        # NOTE: the tiering manager (secondary fs/obj tiers) is issue 5.
        raise NotImplementedError(f"{TIERING_SPEC} with secondary_tiers is not implemented yet")
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
    "MEDIUM_CPU",
    "MEDIUM_FS",
    "MEDIUM_OBJ",
    "OffloadKey",
    "OffloadingConfig",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
    "SecondaryTierConfig",
    "TIERING_SPEC",
    "TierStats",
    "create_offloading_manager",
    "make_offload_key",
    "make_policy",
    "offload_key_group",
    "offload_key_hash",
    "parse_offloading_config",
    "parse_size",
]
