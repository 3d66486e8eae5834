"""The tier contract: what the engine's offloading connector may ask of an offloading manager.

kvtier speaks offload keys (block hashes + KV group) and slot ids; it knows nothing of
requests, models or tensors. Every method is bookkeeping that is cheap enough to call
from the engine's step; byte copies happen elsewhere (a transfer thread).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NewType

# block hash bytes || KV group index (4 bytes, big-endian, unsigned)
OffloadKey = NewType("OffloadKey", bytes)

MEDIUM_CPU = "CPU"
MEDIUM_FS = "FS"
MEDIUM_OBJ = "OBJ"


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    return OffloadKey(block_hash + group_idx.to_bytes(4, "big", signed=False))


def offload_key_hash(key: OffloadKey) -> bytes:
    return key[:-4]


def offload_key_group(key: OffloadKey) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


class LookupResult(enum.Enum):
    HIT = "hit"  # present and readable
    HIT_PENDING = "hit_pending"  # present in the primary tier, its write still in flight
    RETRY = "retry"  # not known yet (an async check or a promotion just started)
    MISS = "miss"  # in no allowed tier


class Locality(enum.Enum):
    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


@dataclass(frozen=True)
class ReqContext:
    """What a tier may know of a request: its id and which tiers it may load from."""

    req_id: str
    kv_load_tiers: tuple[dict, ...] | None = None  # None: every tier


@dataclass(frozen=True)
class PrepareStoreOutput:
    keys_to_store: tuple[OffloadKey, ...]  # the subset not already present
    slot_ids: tuple[int, ...]  # primary-tier slots to write, aligned with keys_to_store
    evicted_keys: tuple[OffloadKey, ...]  # dropped to make room


@dataclass(frozen=True)
class OffloadingEvent:
    keys: tuple[OffloadKey, ...]
    medium: str
    removed: bool
    locality: Locality | None = None
    ownership: str | None = None  # which secondary tier produced it; None for the primary
    removal_expected: bool = False  # the tier will later report a matching removal


@dataclass
class TierStats:
    """Counters a tier accumulates; the connector turns them into metrics."""

    lookups: int = 0
    hits: int = 0
    stored_chunks: int = 0
    evicted_chunks: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class OffloadingManager(abc.ABC):
    """Bookkeeping of offloaded chunks across tiers.

    - lookup(key, ctx): HIT / HIT_PENDING / RETRY / MISS for one chunk; may start async work.
    - prepare_load(keys, ctx) -> slot ids: keys must be HIT; pins them (not evictable).
    - complete_load(keys, ctx): unpins.
    - touch(keys, ctx): mark recently used.
    - prepare_store(keys, ctx) -> PrepareStoreOutput | None: skips present keys, evicts unpinned
      ones to make room, reserves slots as write-pending (lookups answer HIT_PENDING). None: no
      room; nothing changed.
    - complete_store(keys, ctx, success): pending slots become readable (a stored event), or are
      dropped on failure.
    - take_events(): drains raw events.
    - still_pending(key): cheap check that a deferred lookup would defer again.
    - on_schedule_end(), has_pending_work(), reset_cache(), stats(), shutdown().
    """

    @abc.abstractmethod
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult: ...

    @abc.abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[int]: ...

    @abc.abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None: ...

    @abc.abstractmethod
    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None: ...

    @abc.abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None: ...

    @abc.abstractmethod
    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True) -> None: ...

    @abc.abstractmethod
    def take_events(self) -> Iterable[OffloadingEvent]: ...

    def on_schedule_end(self) -> None:
        """Once per engine step: flush batched work (promotions)."""

    def set_progress_listener(self, listener: Callable[[], None]) -> None:
        """`listener()` is called (from any thread) when async work that lookups wait on
        finishes: an engine waiting on it can look again at once instead of at its next poll."""

    def has_pending_work(self) -> bool:
        return False

    def still_pending(self, key: OffloadKey) -> bool:
        """True only if a lookup of `key` would still answer HIT_PENDING or RETRY (its store,
        promotion or existence check is not done): a caller waiting on it need not look up its
        other keys again yet. False when unsure."""
        return False

    @abc.abstractmethod
    def reset_cache(self) -> None: ...

    @abc.abstractmethod
    def stats(self) -> dict[str, TierStats]: ...

    def shutdown(self) -> None:
        """Release resources (threads, files, sessions)."""

    async def shutdown_async(self) -> None:
        """shutdown() for a caller on the event loop the manager's I/O runs on (it must not block it)."""
        self.shutdown()
