"""The CPU tier in front of ordered secondary tiers (filesystem, object store): SEMANTICS §3.8.

Every method of the contract runs on the engine's thread and returns at once; tier I/O runs as
tasks on the tier loop (`TierLoop`) and reports back through a thread-safe queue that the next
`lookup` / `on_schedule_end` / `take_events` / `has_pending_work` drains.

Promotion (secondary -> CPU), one chunk:

| step                                   | lookup answers | CPU slot                           |
|----------------------------------------|----------------|------------------------------------|
| CPU MISS, a secondary tier HIT         | RETRY          | allocated now, write pending        |
| queued; submitted by on_schedule_end   | HIT_PENDING    | read from the tier, then copied in  |
| done                                   | HIT            | readable (a CPU stored event)       |
| failed or past its deadline            | MISS           | freed; the key cools down for a while |

One step's promotions go to the tier loop together, one batch per tier; the tier reads each
chunk straight into its slot and checks it there, off the loop (the filesystem tier: a few
thread hops per batch, not a few per chunk).

A promotion past its deadline is abandoned (never an unbounded HIT_PENDING), and so is one whose
read failed. Its key leaves the CPU tier at once; its slot too, unless a read is writing it at
that moment (a read can hang, and one abandoned at its timeout goes on on its thread): then the
slot stays reserved until that read ends. So no read ever writes a slot that was handed out again,
and nobody waits for a read to abandon it.

Demotion (CPU -> secondary): when the CPU tier evicts a chunk (or, for tiers with
`demote_on == "store"`, when its store completes) its slot bytes are copied into a private
buffer right away (a memcpy; the slot may be reused by the very next store) and written to every
tier that lacks the chunk by a task. The CPU tier never waits for a tier; snapshots waiting to
be written are bounded by `max_pending_demotion_bytes` (beyond it a demotion is dropped).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.base import (
    MEDIUM_CPU,
    Locality,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    TierStats,
)
from kvtier.cpu_tier import CPUOffloadingManager
from kvtier.secondary_tier import (
    STAT_DEMOTIONS,
    STAT_DEMOTIONS_DROPPED,
    STAT_PROMOTION_ALLOCATION_FAILURES,
    STAT_PROMOTION_FAILURES,
    STAT_PROMOTION_SECONDS,
    STAT_PROMOTION_TIMEOUTS,
    STAT_PROMOTIONS,
    CheckFactory,
    SecondaryTier,
    TierStartupError,
)
from kvtier.tier_loop import TierLoop

log = logging.getLogger(__name__)

_MAX_COOLDOWN_KEYS = 65_536


class SlotBytes(Protocol):
    """Byte access to the CPU tier's slots (the engine's host buffer implements it)."""

    def read(self, slot_id: int) -> bytes:
        """A copy of the slot's bytes."""
        ...

    def view(self, slot_id: int) -> memoryview:
        """The whole slot's bytes, writable, without a copy."""
        ...


@dataclass(eq=False)
class _Promotion:
    """One chunk on its way into its CPU slot; the tier read lands it there (a `ReadTarget`).

    The lock orders the reader's begin/end against abandonment (engine thread), and is never
    held across I/O: an abandoned promotion whose reader is between begin and end keeps its
    slot reserved (`abandon_store`) and the reader gives it back at `end` (a RELEASE completion).
    """

    key: OffloadKey
    tier: SecondaryTier
    slot_id: int
    ctx: ReqContext
    deadline: float  # time.monotonic()
    slots: SlotBytes
    completions: deque
    lock: threading.Lock = field(default_factory=threading.Lock)
    reading: bool = False  # between begin and end: the reader writes the slot
    written: bool = False
    abandoned: bool = False

    def begin(self, nbytes: int) -> memoryview | None:
        view = self.slots.view(self.slot_id)
        if len(view) != nbytes:
            raise ValueError(f"a payload of {nbytes} bytes for a CPU slot of {len(view)}")
        with self.lock:
            if self.abandoned:
                return None
            self.reading = True
        return view

    def end(self, ok: bool) -> bool:
        with self.lock:
            self.reading = False
            if self.abandoned:
                self.completions.append((self, RELEASE))
                return False
            self.written = ok
        return ok


RELEASE = None  # a completion that gives an abandoned promotion's slot back


class TieringOffloadingManager(OffloadingManager):
    """A `CPUOffloadingManager` (primary) plus ordered `SecondaryTier`s.

    - `slots`: reads and writes the primary's slot bytes.
    - `loop`: the loop to run tier I/O on (the server's); None: a private loop on a daemon thread.
    - `promotion_timeout_s`: a promotion not done by then is abandoned (the request recomputes).
    - `failure_backoff_s`: after a failed or abandoned promotion the key is a MISS for this long.
    - `max_pending_demotion_bytes`: bound on snapshots waiting to be written to the tiers.

    Call `start()` (blocking; off the loop's thread) before use: it opens every tier and raises
    TierStartupError with a clear message if one cannot start.
    """

    def __init__(
        self,
        primary: CPUOffloadingManager,
        tiers: Sequence[SecondaryTier],
        slots: SlotBytes,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        promotion_timeout_s: float = 10.0,
        failure_backoff_s: float | None = None,
        max_pending_demotion_bytes: int = 256 << 20,
    ) -> None:
        if not tiers:
            raise ValueError("TieringOffloadingManager needs at least one secondary tier")
        if promotion_timeout_s <= 0:
            raise ValueError(f"promotion_timeout_s must be positive, got {promotion_timeout_s}")
        self.primary = primary
        self.tiers = list(tiers)
        self.slots = slots
        self.promotion_timeout_s = promotion_timeout_s
        self.failure_backoff_s = promotion_timeout_s if failure_backoff_s is None else failure_backoff_s
        self.max_pending_demotion_bytes = max_pending_demotion_bytes
        self.tier_loop = TierLoop(loop)
        # NOTE: in start order, so in deadline order too (one timeout for all).
        self._promotions: dict[OffloadKey, _Promotion] = {}  # write pending in the primary
        self._busy: dict[str, tuple[int, float]] = {}  # tier name -> (promotions pending, since when)
        self._queued: list[_Promotion] = []  # not yet submitted (on_schedule_end does)
        # (promotion, landed) or (promotion, RELEASE); appended on the tier loop and I/O threads
        self._completions: deque[tuple[_Promotion, bool | None]] = deque()
        self._slot_of: dict[OffloadKey, int] = {}  # every primary key's slot (to snapshot evictions)
        self._cooldown: dict[OffloadKey, float] = {}  # key -> monotonic time until which it is a MISS
        self._step_hits: dict[str, list[OffloadKey]] = {}  # request -> primary HITs this step
        self._pending_demotion_bytes = 0
        self._demotion_lock = threading.Lock()
        self._is_shut_down = False
        self._on_progress: Callable[[], None] = lambda: None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout_s: float | None = 120.0) -> None:
        """Open every tier (validate storage, rebuild indexes); TierStartupError if one cannot."""

        async def close_all() -> None:
            await asyncio.gather(*(tier.close() for tier in self.tiers), return_exceptions=True)

        async def open_all() -> None:
            results = await asyncio.gather(*(tier.open() for tier in self.tiers), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                await close_all()
                if isinstance(errors[0], TierStartupError):
                    raise errors[0]
                raise TierStartupError(f"a secondary tier failed to start: {errors[0]!r}") from errors[0]

        try:
            self.tier_loop.run_sync(open_all, timeout_s)
        except TimeoutError:
            try:
                self.tier_loop.run_sync(close_all, 10.0)
            finally:
                self.tier_loop.close()
            raise TierStartupError(f"secondary tiers did not start within {timeout_s} s") from None
        except BaseException:
            self.tier_loop.close()
            raise

    async def shutdown_async(self) -> None:
        """Cancel and await every tier task, close the tiers (from a coroutine on any loop)."""
        if not self.tier_loop.is_loop_thread():
            await asyncio.to_thread(self.shutdown)  # a private tier loop: wait for it on a thread
            return
        await self._close_on_loop()

    async def _close_on_loop(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        await self.tier_loop.close_async()
        await asyncio.gather(*(tier.close() for tier in self.tiers), return_exceptions=True)

    def shutdown(self) -> None:
        """From any thread but the tier loop's (there, await shutdown_async; here it can only cancel)."""
        if self._is_shut_down:
            return
        if self.tier_loop.is_loop_thread():
            log.warning("TieringOffloadingManager.shutdown() on the tier loop: cancelling without waiting; "
                        "await shutdown_async() instead")
            self._is_shut_down = True
            self.tier_loop.close()
            return
        if not self.tier_loop.loop.is_closed() and self.tier_loop.loop.is_running():
            try:
                self.tier_loop.run_sync(self._close_on_loop, timeout_s=15.0)
            except TimeoutError:
                log.warning("secondary tiers did not close within 15 s")
        self._is_shut_down = True
        self.tier_loop.close()

    # ---- lookups and promotions --------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self._apply_completions()
        tiers = self._allowed_tiers(ctx)
        if tiers is None:
            return LookupResult.MISS  # kv_load_tiers == []: no tier may serve this request
        result = self.primary.lookup(key, ctx)
        if result is not LookupResult.MISS:
            self._step_hits.setdefault(ctx.req_id, []).append(key)
            return result
        until = self._cooldown.get(key)
        if until is not None:
            if until > time.monotonic():
                return LookupResult.MISS
            del self._cooldown[key]
        retry = False
        for tier in tiers:
            answer = tier.lookup(key)
            if answer is LookupResult.HIT:
                return self._start_promotion(key, tier, ctx)
            retry = retry or answer is LookupResult.RETRY
        return LookupResult.RETRY if retry else LookupResult.MISS

    def _start_promotion(self, key: OffloadKey, tier: SecondaryTier, ctx: ReqContext) -> LookupResult:
        # NOTE: keys passed to prepare_store are never evicted: a promotion must not evict a chunk
        # this request found earlier in the same step, or a prefix longer than the CPU tier would
        # evict its own head forever (promote chunk n, evict chunk 0, promote chunk 0, ...).
        out = self._prepare_primary_store([key, *self._step_hits.get(ctx.req_id, ())], ctx)
        if out is None or key not in out.keys_to_store:
            tier.count(STAT_PROMOTION_ALLOCATION_FAILURES)
            return LookupResult.MISS
        now = time.monotonic()
        promotion = _Promotion(key, tier, out.slot_ids[0], ctx, now + self.promotion_timeout_s, self.slots,
                               self._completions)
        self._promotions[key] = promotion
        self._queued.append(promotion)
        pending, since = self._busy.get(tier.name, (0, now))
        self._busy[tier.name] = (pending + 1, since)
        return LookupResult.RETRY

    def set_progress_listener(self, listener: Callable[[], None]) -> None:
        self._on_progress = listener

    def _end_promotion(self, promotion: _Promotion) -> None:
        """It left `_promotions` (done, failed, abandoned): account the tier's busy time."""
        pending, since = self._busy[promotion.tier.name]
        if pending > 1:
            self._busy[promotion.tier.name] = (pending - 1, since)
            return
        del self._busy[promotion.tier.name]
        promotion.tier.count(STAT_PROMOTION_SECONDS, time.monotonic() - since)

    async def _promote_all(self, promotions: list[_Promotion]) -> None:
        by_tier: dict[SecondaryTier, list[_Promotion]] = {}
        for promotion in promotions:
            by_tier.setdefault(promotion.tier, []).append(promotion)
        await asyncio.gather(*(self._promote(tier, batch) for tier, batch in by_tier.items()))

    async def _promote(self, tier: SecondaryTier, batch: list[_Promotion]) -> None:
        """Read each chunk straight into its slot; each completion is queued as soon as it is
        known, from an I/O thread or the loop."""
        reported = [False] * len(batch)
        num_reported = itertools.count(1)  # NOTE: next() is atomic under the GIL; done runs on I/O threads

        def done(i: int, landed: bool) -> None:
            reported[i] = True
            self._completions.append((batch[i], landed))
            if next(num_reported) == len(batch):
                self._on_progress()  # once per batch: a wake-up per chunk would compete with the reads

        try:
            await tier.read_many_into([(p.key, p) for p in batch], done)
        except Exception:  # noqa: BLE001 - a failed promotion is a recompute, never a crash
            log.exception("promotions from tier %s failed", tier.name)
        finally:
            if not all(reported):
                for i, promotion in enumerate(batch):
                    if not reported[i]:
                        self._completions.append((promotion, False))
                self._on_progress()

    def _apply_completions(self) -> None:
        """Finished promotions become readable (or are dropped); overdue ones are abandoned."""
        while self._completions:
            promotion, ok = self._completions.popleft()
            if ok is RELEASE:
                self.primary.release_slot(promotion.slot_id)
                continue
            if self._promotions.get(promotion.key) is not promotion:
                continue  # abandoned earlier (deadline, reset)
            del self._promotions[promotion.key]
            self._end_promotion(promotion)
            if ok:
                self.primary.complete_store([promotion.key], promotion.ctx, success=True)
                promotion.tier.count(STAT_PROMOTIONS)
            else:
                self._drop_promotion(promotion)
                promotion.tier.count(STAT_PROMOTION_FAILURES)

    def _expire_promotions(self) -> None:
        now = time.monotonic()
        overdue = []
        for promotion in self._promotions.values():
            if promotion.deadline > now:
                break  # in deadline order: the rest are not due either
            overdue.append(promotion)
        for promotion in overdue:
            with promotion.lock:
                if promotion.written:
                    continue  # done, its completion is on the way
            log.warning("promotion of %s from tier %s missed its %.1f s deadline; recomputing",
                        promotion.key.hex()[:16], promotion.tier.name, self.promotion_timeout_s)
            del self._promotions[promotion.key]
            self._end_promotion(promotion)
            if promotion in self._queued:
                self._queued.remove(promotion)
            self._drop_promotion(promotion)
            promotion.tier.count(STAT_PROMOTION_TIMEOUTS)

    def _drop_promotion(self, promotion: _Promotion) -> None:
        self._abandon(promotion)
        self._slot_of.pop(promotion.key, None)
        if len(self._cooldown) >= _MAX_COOLDOWN_KEYS:
            now = time.monotonic()
            self._cooldown = {k: t for k, t in self._cooldown.items() if t > now}
        self._cooldown[promotion.key] = time.monotonic() + self.failure_backoff_s

    def _abandon(self, promotion: _Promotion) -> None:
        """The promotion will never write its slot; its key leaves the primary now, its slot now
        or, while its reader is writing it, when the reader is done."""
        with promotion.lock:
            promotion.abandoned = True
            reading = promotion.reading
        if reading:
            self.primary.abandon_store(promotion.key)
        else:
            self.primary.complete_store([promotion.key], promotion.ctx, success=False)

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[int]:
        return self.primary.prepare_load(keys, ctx)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.primary.complete_load(keys, ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.primary.touch(keys, ctx)
        for tier in self.tiers:
            tier.touch(list(keys))

    # ---- stores and demotions ----------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        self._apply_completions()
        return self._prepare_primary_store(keys, ctx)

    def _prepare_primary_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        out = self.primary.prepare_store(keys, ctx)
        if out is None:
            return None
        # NOTE: demote the evicted chunks before returning: the caller reuses their slots next.
        for key in out.evicted_keys:
            slot_id = self._slot_of.pop(key, None)
            if slot_id is not None:
                self._demote(key, slot_id, self.tiers)
        self._slot_of.update(zip(out.keys_to_store, out.slot_ids))
        return out

    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True) -> None:
        self._apply_completions()
        self.primary.complete_store(keys, ctx, success)
        if not success:
            for key in keys:
                self._slot_of.pop(key, None)
            return
        on_store = [tier for tier in self.tiers if tier.demote_on == "store"]
        if on_store:
            for key in dict.fromkeys(keys):
                self._demote(key, self._slot_of[key], on_store)

    def _demote(self, key: OffloadKey, slot_id: int, tiers: Sequence[SecondaryTier]) -> None:
        targets = [tier for tier in tiers if tier.wants(key)]
        if not targets:
            return
        data = self.slots.read(slot_id)
        with self._demotion_lock:
            if self._pending_demotion_bytes + len(data) > self.max_pending_demotion_bytes:
                for tier in targets:
                    tier.count(STAT_DEMOTIONS_DROPPED)
                return
            self._pending_demotion_bytes += len(data)
        self.tier_loop.submit(lambda: self._write_through(key, data, targets))

    async def _write_through(self, key: OffloadKey, data: bytes, targets: list[SecondaryTier]) -> None:
        try:
            results = await asyncio.gather(*(tier.write(key, data) for tier in targets))
            for tier, ok in zip(targets, results):
                if ok:
                    tier.count(STAT_DEMOTIONS)
        finally:
            with self._demotion_lock:
                self._pending_demotion_bytes -= len(data)

    @property
    def pending_demotion_bytes(self) -> int:
        with self._demotion_lock:
            return self._pending_demotion_bytes

    # ---- once per step and the rest of the contract ------------------------------------------

    def on_schedule_end(self) -> None:
        """Submit the promotions and existence checks this step's lookups asked for."""
        self._apply_completions()
        self._expire_promotions()
        self._step_hits.clear()
        queued, self._queued = self._queued, []
        if queued:  # NOTE: one wake-up of the tier loop for the whole step, not one per chunk
            self.tier_loop.submit(lambda: self._promote_all(queued))
        for tier in self.tiers:
            for check in tier.take_checks():
                self.tier_loop.submit(self._notifying(check))

    def _notifying(self, check: CheckFactory) -> CheckFactory:
        async def run() -> None:
            try:
                await check()
            finally:
                self._on_progress()

        return run

    def has_pending_work(self) -> bool:
        """Promotions or existence checks in flight (requests wait on them); not demotions."""
        self._apply_completions()
        self._expire_promotions()
        return bool(self._promotions) or any(tier.has_checks_in_flight for tier in self.tiers)

    def still_pending(self, key: OffloadKey) -> bool:
        self._apply_completions()
        self._expire_promotions()
        return self.primary.still_pending(key) or any(tier.is_checking(key) for tier in self.tiers)

    def take_events(self) -> list[OffloadingEvent]:
        self._apply_completions()
        self._expire_promotions()
        events = list(self.primary.take_events())
        for tier in self.tiers:
            events.extend(tier.take_events())
        return events

    def reset_cache(self) -> None:
        """Forget the CPU tier (abandoning promotions in flight); the secondary tiers keep their
        chunks: they are persistent and may be shared with other processes."""
        self._apply_completions()
        for promotion in list(self._promotions.values()):
            self._abandon(promotion)
            self._end_promotion(promotion)
        self._promotions.clear()
        self._queued.clear()
        self.primary.reset_cache()
        self._slot_of.clear()
        self._cooldown.clear()
        self._step_hits.clear()

    def keys(self) -> Iterator[OffloadKey]:
        """The CPU tier's readable keys (event snapshots describe these)."""
        return self.primary.keys()

    def stats(self) -> dict[str, TierStats]:
        """The CPU tier's counters (plus `pending_demotion_bytes`) and each secondary tier's, keyed
        by tier name ("cpu", "0:fs", "1:obj"), with `active_promotions` per tier."""
        stats = dict(self.primary.stats())
        stats["cpu"].extra["pending_demotion_bytes"] = self.pending_demotion_bytes
        for tier in self.tiers:
            tier_stats = stats[tier.name] = tier.stats()
            tier_stats.extra["active_promotions"] = sum(p.tier is tier for p in self._promotions.values())
        return stats

    # ---- request tier filter (kv_transfer_params.kv_load_tiers, SEMANTICS §3.9) ---------------

    def _allowed_tiers(self, ctx: ReqContext) -> list[SecondaryTier] | None:
        """The secondary tiers this request may load from; None: no tier at all.

        NOTE: the CPU tier is every load's last hop, so it is never filtered out on its own; a
        filter matching only CPU keeps lookups to the CPU tier.
        """
        filters = ctx.kv_load_tiers
        if filters is None:
            return self.tiers
        if len(filters) == 0:
            return None
        valid = [f for f in filters if _is_valid_filter(f)]
        if not valid:
            return self.tiers
        return [tier for tier in self.tiers if any(_matches(f, tier.medium, tier.locality) for f in valid)]


_FILTER_MEDIA = {MEDIUM_CPU, "STORAGE", "FS", "OBJ"}
_LOCALITIES = {locality.value for locality in Locality}


def _is_valid_filter(entry: object) -> bool:
    if not isinstance(entry, dict) or set(entry) - {"medium", "locality"}:
        return False
    return entry.get("medium", "STORAGE") in _FILTER_MEDIA and entry.get("locality", "LOCAL") in _LOCALITIES


def _matches(entry: dict, medium: str, locality: Locality) -> bool:
    wanted_medium = entry.get("medium")
    wanted_locality = entry.get("locality")
    medium_ok = wanted_medium is None or wanted_medium in ("STORAGE", medium)
    return medium_ok and (wanted_locality is None or wanted_locality == locality.value)

