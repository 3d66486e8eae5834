"""The CPU tier's bookkeeping: which offload key lives in which slot of the host buffer.

The engine side allocates the buffer (`num_slots` chunks) and copies bytes; this class only hands
out slot ids, tracks each key's state and picks eviction victims through a `CachePolicy`.

| state          | vLLM ref_cnt | lookup      | evictable | leaves by                          |
|----------------|--------------|-------------|-----------|------------------------------------|
| write pending  | -1           | HIT_PENDING | no        | complete_store (ok: readable; failed: dropped) |
| readable       | 0            | HIT         | yes       | eviction, reset_cache              |
| pinned (n > 0) | n            | HIT         | no        | complete_load n times              |

A write-pending key can also be abandoned while its writer may still be writing (a promotion
past its deadline): the key goes at once, its slot only at `release_slot`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvtier.base import (
    MEDIUM_CPU,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    TierStats,
)
from kvtier.policy import make_policy

STAT_SKIPPED_STORES = "skipped_stores"  # keys refused by store_threshold
STAT_HIT_PENDING = "hit_pending"  # lookups answered HIT_PENDING (not counted in hits)


@dataclass
class _Entry:
    slot_id: int
    is_ready: bool  # False: its write is still in flight
    num_pins: int = 0  # loads in flight reading the slot

    @property
    def is_evictable(self) -> bool:
        return self.is_ready and self.num_pins == 0


class CPUOffloadingManager(OffloadingManager):
    """A fixed pool of `num_slots` chunk slots with LRU or ARC eviction.

    Slots are handed out fresh (0, 1, ..., num_slots - 1) first, then recycled oldest-freed first.
    `store_threshold` >= 2 admits a key to `prepare_store` only once it has been looked up that
    many times (counts kept in an LRU table of `max_tracker_size` keys); 0 and 1 admit everything.
    Events accumulate until `take_events`, which the owner must call every step.
    """

    def __init__(
        self,
        num_slots: int,
        eviction_policy: str = "lru",
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        if store_threshold < 0:
            raise ValueError(f"store_threshold must be >= 0, got {store_threshold}")
        if max_tracker_size < 1:
            raise ValueError(f"max_tracker_size must be at least 1, got {max_tracker_size}")
        self.num_slots = num_slots
        self.eviction_policy = eviction_policy
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._policy = make_policy(eviction_policy, num_slots)
        self._entries: dict[OffloadKey, _Entry] = {}
        self._unevictable: set[OffloadKey] = set()  # write pending or pinned
        self._num_fresh_slots_used = 0
        self._free_slot_ids: deque[int] = deque()
        self._reserved_slot_ids: set[int] = set()  # abandoned stores whose writer may still write
        self._lookup_counts: OrderedDict[OffloadKey, int] = OrderedDict()  # LRU first
        self._events: list[OffloadingEvent] = []
        self._stats = TierStats(extra={STAT_SKIPPED_STORES: 0, STAT_HIT_PENDING: 0})

    # --- introspection -------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - self._num_fresh_slots_used + len(self._free_slot_ids)

    @property
    def num_used_slots(self) -> int:
        return len(self._entries)

    def slot_of(self, key: OffloadKey) -> int | None:
        """The slot holding `key` (readable or write pending), or None."""
        entry = self._entries.get(key)
        return None if entry is None else entry.slot_id

    def keys(self) -> Iterator[OffloadKey]:
        """The readable keys, as a snapshot (safe to mutate the manager while iterating)."""
        return iter([key for key, entry in self._entries.items() if entry.is_ready])

    # --- lookups and loads ---------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        if self.store_threshold >= 2:
            self._count_lookup(key)
        self._stats.lookups += 1
        entry = self._entries.get(key)
        if entry is None:
            return LookupResult.MISS
        if not entry.is_ready:
            self._stats.extra[STAT_HIT_PENDING] += 1
            return LookupResult.HIT_PENDING
        self._stats.hits += 1
        return LookupResult.HIT

    def still_pending(self, key: OffloadKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and not entry.is_ready

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[int]:
        """Pins each key (once per occurrence) and returns its slot id; all keys must be HIT."""
        keys = list(keys)
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.is_ready:
                state = "absent" if entry is None else "write pending"
                raise ValueError(f"prepare_load of a key that is not a HIT ({state}): {key!r}")
        slot_ids = []
        for key in keys:
            entry = self._entries[key]
            entry.num_pins += 1
            self._unevictable.add(key)
            slot_ids.append(entry.slot_id)
        return slot_ids

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Unpins each key once per occurrence; raises (changing nothing) on a key not pinned enough."""
        keys = list(keys)
        for key, count in Counter(keys).items():
            entry = self._entries.get(key)
            if entry is None or entry.num_pins < count:
                raise ValueError(f"complete_load of a key with fewer than {count} pin(s): {key!r}")
        for key in keys:
            entry = self._entries[key]
            entry.num_pins -= 1
            if entry.is_evictable:
                self._unevictable.discard(key)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        # NOTE: reversed, so that a prefix's first chunk ends up most recently used: its later
        # chunks are worthless without it (a prefix lookup stops at the first MISS).
        # Write-pending keys are skipped: touching a key in the step that stores it is not a reuse
        # (ARC would promote it to T2 and defeat scan resistance).
        for key in reversed(list(keys)):
            entry = self._entries.get(key)
            if entry is not None and entry.is_ready:
                self._policy.touch(key)

    # --- stores --------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        keys = list(dict.fromkeys(keys))
        candidates = [key for key in keys if key not in self._entries]
        new_keys = candidates
        if self.store_threshold >= 2:
            new_keys = [k for k in candidates if self._lookup_counts.get(k, 0) >= self.store_threshold]
        num_to_evict = len(new_keys) - self.num_free_slots
        evicted: list[OffloadKey] = []
        if num_to_evict > 0:
            if num_to_evict > len(self._entries) - len(self._unevictable):
                return None
            victims = self._policy.evict(num_to_evict, self._unevictable.union(keys))
            if victims is None:
                return None
            evicted = victims
        # Decided: from here on nothing can fail.
        self._stats.extra[STAT_SKIPPED_STORES] += len(candidates) - len(new_keys)
        for key in evicted:
            self._free_slot_ids.append(self._entries.pop(key).slot_id)
        if evicted:
            self._stats.evicted_chunks += len(evicted)
            self._events.append(OffloadingEvent(keys=tuple(evicted), medium=MEDIUM_CPU, removed=True))
        slot_ids = [self._allocate_slot() for _ in new_keys]
        for key, slot_id in zip(new_keys, slot_ids):
            self._entries[key] = _Entry(slot_id=slot_id, is_ready=False)
            self._unevictable.add(key)
        for key in reversed(new_keys):  # NOTE: reversed for the reason given in touch()
            self._policy.insert(key)
        return PrepareStoreOutput(keys_to_store=tuple(new_keys), slot_ids=tuple(slot_ids), evicted_keys=tuple(evicted))

    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True) -> None:
        keys = list(dict.fromkeys(keys))
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.is_ready:
                state = "absent" if entry is None else "already readable"
                raise ValueError(f"complete_store of a key that is not write pending ({state}): {key!r}")
        for key in keys:
            if success:
                self._entries[key].is_ready = True
                self._unevictable.discard(key)
            else:
                self._free_slot_ids.append(self._entries.pop(key).slot_id)
                self._unevictable.discard(key)
                self._policy.remove(key)
        if success and keys:
            self._stats.stored_chunks += len(keys)
            self._events.append(OffloadingEvent(keys=tuple(keys), medium=MEDIUM_CPU, removed=False))

    def abandon_store(self, key: OffloadKey) -> int:
        """Drop a write-pending key as a failed complete_store would, but keep its slot out of
        use until `release_slot` (its writer may still be writing it); returns the slot id."""
        entry = self._entries.get(key)
        if entry is None or entry.is_ready:
            state = "absent" if entry is None else "already readable"
            raise ValueError(f"abandon_store of a key that is not write pending ({state}): {key!r}")
        del self._entries[key]
        self._unevictable.discard(key)
        self._policy.remove(key)
        self._reserved_slot_ids.add(entry.slot_id)
        return entry.slot_id

    def release_slot(self, slot_id: int) -> None:
        """The writer of an abandoned store is done: its slot may be reused."""
        self._reserved_slot_ids.remove(slot_id)
        self._free_slot_ids.append(slot_id)

    def _allocate_slot(self) -> int:
        if self._num_fresh_slots_used < self.num_slots:
            self._num_fresh_slots_used += 1
            return self._num_fresh_slots_used - 1
        return self._free_slot_ids.popleft()

    def _count_lookup(self, key: OffloadKey) -> None:
        if key in self._lookup_counts:
            self._lookup_counts[key] += 1
            self._lookup_counts.move_to_end(key)
            return
        if len(self._lookup_counts) >= self.max_tracker_size:
            self._lookup_counts.popitem(last=False)
        self._lookup_counts[key] = 1

    # --- the rest of the contract --------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """Drops every key and frees every slot but those `abandon_store` reserved; emits nothing
        (the engine announces the clear).

        The connector must flush in-flight loads and stores first: a pinned or write-pending key
        here means a transfer could still touch a slot that is about to be reused.
        """
        num_pending = sum(1 for entry in self._entries.values() if not entry.is_ready)
        num_pinned = sum(1 for entry in self._entries.values() if entry.num_pins)
        if num_pending or num_pinned:
            raise RuntimeError(
                f"reset_cache with transfers in flight ({num_pending} write-pending, {num_pinned} pinned keys); "
                "flush loads and stores before resetting"
            )
        self._entries.clear()
        self._unevictable.clear()
        self._policy.clear()
        self._num_fresh_slots_used = 0
        self._free_slot_ids.clear()
        if self._reserved_slot_ids:  # NOTE: still being written: never handed out before release_slot
            self._num_fresh_slots_used = self.num_slots
            self._free_slot_ids.extend(i for i in range(self.num_slots) if i not in self._reserved_slot_ids)
        self._lookup_counts.clear()
        self._events.clear()

    def stats(self) -> dict[str, TierStats]:
        """A copy of the cumulative counters, plus slot gauges in `extra`."""
        extra = dict(self._stats.extra)
        extra["num_used_slots"] = self.num_used_slots
        extra["num_slots"] = self.num_slots
        return {"cpu": dataclasses.replace(self._stats, extra=extra)}
