"""What the filesystem and object-store tiers share: an in-memory index (LRU by bytes), capacity
eviction, events, counters and health.

A tier has two faces:

| face  | methods                                                   | called from                         |
|-------|-----------------------------------------------------------|-------------------------------------|
| sync  | lookup, wants, touch, take_checks, take_events, stats     | any thread (the engine's); never blocks on I/O |
| async | open, read, write, close                                  | coroutines on the tier event loop   |

The index is the tier's truth for lookups: a key is a HIT once its object was written whole (temp
name + rename, or one S3 put) and indexed, and stays one until evicted, found missing or found
corrupt. Index and counters sit behind one `threading.Lock`, held only for dict operations.

Health: an outage of the storage (S3 down, a full disk) is detected by a failing operation, stops
the affected traffic (`all`: lookups MISS and writes are skipped; `writes`: writes are skipped,
reads go on) and starts a probe task that retries with exponential backoff until the storage
answers again.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from enum import Enum
from typing import Any, ClassVar, Final, Literal, Protocol

import numpy as np

from kvtier.base import Locality, LookupResult, OffloadingEvent, OffloadKey, TierStats
from kvtier.chunk_format import ChunkFormatError, ModelFingerprint, decode_chunk, encode_chunk

log = logging.getLogger(__name__)

# TierStats.extra names (the metrics the lead exports per tier)
STAT_BYTES_READ = "bytes_read"
STAT_BYTES_WRITTEN = "bytes_written"
STAT_READ_SECONDS = "read_seconds"
STAT_WRITE_SECONDS = "write_seconds"
STAT_PROMOTIONS = "promotions"  # chunks read back into the CPU tier
# wall time with at least one of the tier's promotions pending, from the lookup that started it
# until the lookup that saw it done (a HIT) or its failure: promoted bytes / this = read bandwidth
STAT_PROMOTION_SECONDS = "promotion_seconds"
STAT_PROMOTION_TIMEOUTS = "promotion_timeouts"  # abandoned at their deadline
STAT_PROMOTION_FAILURES = "promotion_failures"  # read failed, missing or corrupt
STAT_PROMOTION_ALLOCATION_FAILURES = "promotion_allocation_failures"  # no CPU slot for a hit
STAT_DEMOTIONS = "demotions"  # chunks written from the CPU tier
STAT_DEMOTIONS_DROPPED = "demotions_dropped"  # not written: unhealthy tier or too many bytes pending
STAT_FAILURES = "failures"  # failed storage operations of any kind
STAT_CORRUPT_CHUNKS = "corrupt_chunks"  # found corrupt (checksum, header) and deleted
STAT_HEALTHY = "healthy"  # 1 / 0
STAT_USED_BYTES = "used_bytes"
STAT_CAPACITY_BYTES = "capacity_bytes"
STAT_NUM_CHUNKS = "num_chunks"

_COUNTERS = (
    STAT_BYTES_READ, STAT_BYTES_WRITTEN, STAT_READ_SECONDS, STAT_WRITE_SECONDS, STAT_PROMOTIONS, STAT_PROMOTION_SECONDS,
    STAT_PROMOTION_TIMEOUTS, STAT_PROMOTION_FAILURES, STAT_PROMOTION_ALLOCATION_FAILURES, STAT_DEMOTIONS,
    STAT_DEMOTIONS_DROPPED, STAT_FAILURES, STAT_CORRUPT_CHUNKS,
)

Outage = Literal["all", "writes"]
# A coroutine factory: the manager submits it to the tier loop (creating the coroutine there).
CheckFactory = Callable[[], Coroutine[Any, Any, None]]


class Missing(Enum):
    MISSING = "missing"


MISSING: Final = Missing.MISSING  # what `_get` returns for an object that does not exist


class ReadTarget(Protocol):
    """Where a read lands a chunk's payload; both methods are called on an I/O thread.

    `begin(nbytes)` returns writable memory of exactly `nbytes` (or None: skip this read, nothing
    is written). The payload is then written into it and checked; `end(ok)` follows every `begin`
    that returned memory, ok=False when the payload there is incomplete or failed its checksum.
    `end` returns whether the payload landed (the read's result).
    """

    def begin(self, nbytes: int) -> memoryview | None: ...

    def end(self, ok: bool) -> bool: ...


class BytesTarget:
    """Lands a payload in a new bytearray (`data`)."""

    def __init__(self) -> None:
        self.data: bytearray | None = None

    def begin(self, nbytes: int) -> memoryview:
        self.data = bytearray(nbytes)
        return memoryview(self.data)

    def end(self, ok: bool) -> bool:
        return ok


def copy_bytes(dest: memoryview, src: bytes | bytearray | memoryview) -> None:
    """dest[:] = src without holding the GIL (numpy releases it; a memoryview copy holds it)."""
    if len(dest) != len(src):
        raise ValueError(f"target holds {len(dest)} bytes, the payload has {len(src)}")
    np.copyto(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class TierStartupError(RuntimeError):
    """A secondary tier cannot start: unwritable path, unreachable endpoint or bucket, bad credentials."""


class SecondaryTier(abc.ABC):
    """One tier behind the CPU tier, addressed by offload key, holding whole encoded chunks.

    Subclasses provide the storage primitives (`_open_storage`, `_get`, `_put`, `_delete`,
    `_probe`, `_outage_of`); this class owns the index, capacity, events, counters and health.
    """

    medium: ClassVar[str]
    type_name: ClassVar[str]

    def __init__(
        self,
        index: int,
        capacity_bytes: int,
        fingerprint: ModelFingerprint,
        locality: Locality,
        demote_on: str = "evict",
        *,
        max_concurrent_reads: int = 8,
        max_concurrent_writes: int = 4,
        op_timeout_s: float = 30.0,
        probe_backoff_s: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.name = f"{index}:{self.type_name}"  # the `ownership` of its events, the metrics' tier label
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.locality = locality
        self.demote_on = demote_on
        self.op_timeout_s = op_timeout_s
        self._probe_backoff_s = probe_backoff_s
        self._max_concurrent_reads = max_concurrent_reads
        self._max_concurrent_writes = max_concurrent_writes
        self._read_slots: asyncio.Semaphore | None = None  # made in open(), on the tier loop
        self._write_slots: asyncio.Semaphore | None = None
        self._lock = threading.Lock()
        self._index: OrderedDict[OffloadKey, int] = OrderedDict()  # key -> object bytes, LRU first
        self._used_bytes = 0
        self._num_readers: Counter[OffloadKey] = Counter()  # reads in flight: not evicted under them
        self._writing: set[OffloadKey] = set()
        self._events: list[OffloadingEvent] = []
        self._stats = TierStats(extra=dict.fromkeys(_COUNTERS, 0))
        self._outage: Outage | None = None
        self._recovery: asyncio.Task | None = None

    # ---- sync face: any thread, no I/O -------------------------------------------------------

    def lookup(self, key: OffloadKey) -> LookupResult:
        """HIT if indexed, else MISS (the object tier may answer RETRY while it asks the store)."""
        with self._lock:
            self._stats.lookups += 1
            if self._outage == "all":
                return LookupResult.MISS
            if key in self._index:
                self._index.move_to_end(key)
                self._stats.hits += 1
                return LookupResult.HIT
            return self._lookup_unindexed(key)

    def _lookup_unindexed(self, key: OffloadKey) -> LookupResult:
        """Called with the lock held for a key the index lacks."""
        return LookupResult.MISS

    def take_checks(self) -> list[CheckFactory]:
        """Existence checks that lookups asked for (answered RETRY); the manager runs them."""
        return []

    @property
    def has_checks_in_flight(self) -> bool:
        """Lookups answered RETRY and their answer is not in yet."""
        return False

    def is_checking(self, key: OffloadKey) -> bool:
        """A lookup of `key` answered RETRY and its answer is not in yet."""
        return False

    def wants(self, key: OffloadKey) -> bool:
        """Would a write of `key` be useful now (absent, not being written, writes healthy)?"""
        with self._lock:
            return self._outage is None and key not in self._index and key not in self._writing

    def touch(self, keys: list[OffloadKey]) -> None:
        with self._lock:
            for key in reversed(keys):
                if key in self._index:
                    self._index.move_to_end(key)

    def contains(self, key: OffloadKey) -> bool:
        with self._lock:
            return key in self._index

    @property
    def is_healthy(self) -> bool:
        return self._outage is None

    def count(self, stat: str, n: float = 1) -> None:
        """Add to one of the tier's counters (the manager counts promotions here)."""
        with self._lock:
            self._stats.extra[stat] += n

    def take_events(self) -> list[OffloadingEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def stats(self) -> TierStats:
        with self._lock:
            extra = dict(self._stats.extra)
            extra[STAT_HEALTHY] = int(self._outage is None)
            extra[STAT_USED_BYTES] = self._used_bytes
            extra[STAT_CAPACITY_BYTES] = self.capacity_bytes
            extra[STAT_NUM_CHUNKS] = len(self._index)
            return TierStats(self._stats.lookups, self._stats.hits, self._stats.stored_chunks,
                             self._stats.evicted_chunks, extra)

    # ---- async face: the tier loop -----------------------------------------------------------

    async def open(self) -> None:
        """Check the storage, rebuild the index from what it holds (oldest first), enforce capacity.

        Raises TierStartupError with a message naming the tier and what is wrong.
        """
        self._read_slots = asyncio.Semaphore(self._max_concurrent_reads)
        self._write_slots = asyncio.Semaphore(self._max_concurrent_writes)
        entries = await self._open_storage()
        entries.sort(key=lambda entry: entry[2])
        victims: list[OffloadKey] = []
        with self._lock:
            for key, size, _ in entries:
                self._index[key] = size
                self._used_bytes += size
            while self._used_bytes > self.capacity_bytes and self._index:
                key, size = self._index.popitem(last=False)
                self._used_bytes -= size
                victims.append(key)
            if self._index:
                self._events.append(self._event(tuple(self._index), removed=False))
        for key in victims:
            await self._delete_quietly(key)
        log.info("tier %s: %d chunks (%.1f MiB of %.1f MiB) found at start; %d evicted over capacity",
                 self.name, len(self._index), self._used_bytes / 2**20, self.capacity_bytes / 2**20, len(victims))

    async def read(self, key: OffloadKey) -> bytearray | None:
        """A copy of the verified payload of `key`, or None (see `read_into`)."""
        target = BytesTarget()
        return target.data if await self.read_into(key, target) else None

    async def read_into(self, key: OffloadKey, target: ReadTarget) -> bool:
        """Land the verified payload of `key` in `target` (see ReadTarget); False when the key is
        not indexed, gone, corrupt (then deleted), declined by the target, or its read failed.

        The checksum and the copy (for a file, the read too) run in one hop to an I/O thread: none
        of it on the loop. A read abandoned at `op_timeout_s` may go on on its thread: a target
        that must not be written late guards itself in `begin` (the tiering manager's does).
        """
        if not self._begin_read(key):
            return False
        started = time.perf_counter()
        nbytes = 0
        try:
            assert self._read_slots is not None, "open() first"
            async with self._read_slots:
                got = await asyncio.wait_for(self._get(key, target), self.op_timeout_s)
            if got is MISSING:
                self._gone(key)
                return False
            landed, nbytes = got
            return landed
        except ChunkFormatError as error:
            self._corrupt(key, error)
            await self._delete_quietly(key)
            return False
        except Exception as error:  # noqa: BLE001 - any storage error is a miss, never a crash
            self._fail("read", key, error)
            return False
        finally:
            self._end_read(key, nbytes, started)

    async def read_many_into(self, items: Sequence[tuple[OffloadKey, ReadTarget]],
                             done: Callable[[int, bool], None]) -> None:
        """`read_into` for each (key, target), concurrently; `done(i, landed)` is called once per
        item, as soon as item i is done, from the loop or an I/O thread."""

        async def one(i: int, key: OffloadKey, target: ReadTarget) -> None:
            landed = False
            try:
                landed = await self.read_into(key, target)
            finally:
                done(i, landed)

        await asyncio.gather(*(one(i, key, target) for i, (key, target) in enumerate(items)))

    def _land(self, data: memoryview, key: OffloadKey, target: ReadTarget) -> tuple[bool, int]:
        """Check a whole object fetched into memory and copy its payload into `target` (an I/O
        thread): (landed, object bytes). Raises ChunkFormatError."""
        payload = decode_chunk(data, self.fingerprint, key)
        dest = target.begin(len(payload))
        if dest is None:
            return False, len(data)
        ok = False
        try:
            copy_bytes(dest, payload)
            ok = True
        finally:
            landed = target.end(ok)
        return landed, len(data)

    # Read bookkeeping, shared by every read path (any thread).

    def _begin_read(self, key: OffloadKey) -> bool:
        """False if the read cannot start (not indexed, outage); else the key is safe from eviction
        until `_end_read`."""
        with self._lock:
            if key not in self._index or self._outage == "all":
                return False
            self._num_readers[key] += 1
            return True

    def _indexed_size(self, key: OffloadKey) -> int | None:
        """The object's size as written or indexed at start; None if it is not indexed."""
        with self._lock:
            return self._index.get(key)

    def _end_read(self, key: OffloadKey, nbytes: int, started: float) -> None:
        with self._lock:
            self._num_readers[key] -= 1
            if self._num_readers[key] <= 0:
                del self._num_readers[key]
            if nbytes:
                self._stats.extra[STAT_BYTES_READ] += nbytes
                self._stats.extra[STAT_READ_SECONDS] += time.perf_counter() - started

    def _gone(self, key: OffloadKey) -> None:
        log.info("tier %s: chunk %s is gone from storage", self.name, key.hex()[:16])
        self._forget(key)

    def _corrupt(self, key: OffloadKey, error: ChunkFormatError) -> None:
        """Count and forget a chunk that failed its checks; the caller deletes it."""
        log.warning("tier %s: chunk %s is unreadable (%s); deleting it", self.name, key.hex()[:16], error)
        self.count(STAT_CORRUPT_CHUNKS)
        self._forget(key)

    async def write(self, key: OffloadKey, payload: bytes | memoryview) -> bool:
        """Encode (on a thread) and store `key` whole; index it and evict LRU chunks past capacity.

        False when skipped (present, already being written, unhealthy, larger than the tier) or failed.
        """
        with self._lock:
            if self._outage is not None or key in self._index or key in self._writing:
                return False
            self._writing.add(key)
        try:
            data = await asyncio.to_thread(encode_chunk, self.fingerprint, key, payload)
            if len(data) > self.capacity_bytes:
                return False
            assert self._write_slots is not None, "open() first"
            async with self._write_slots:
                started = time.perf_counter()
                await asyncio.wait_for(self._put(key, data), self.op_timeout_s)
                seconds = time.perf_counter() - started
        except Exception as error:  # noqa: BLE001 - a failed write loses a copy, never a request
            self._fail("write", key, error)
            return False
        finally:
            with self._lock:
                self._writing.discard(key)
        victims = self._commit(key, len(data), seconds)
        for victim in victims:
            await self._delete_quietly(victim)
        return True

    async def close(self) -> None:
        if self._recovery is not None:
            self._recovery.cancel()
            await asyncio.gather(self._recovery, return_exceptions=True)
            self._recovery = None
        await self._close_storage()

    # ---- internals ---------------------------------------------------------------------------

    def _event(self, keys: tuple[OffloadKey, ...], removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys=keys, medium=self.medium, removed=removed, locality=self.locality, ownership=self.name,
            removal_expected=not removed,
        )

    def _commit(self, key: OffloadKey, size: int, write_seconds: float | None) -> list[OffloadKey]:
        """Index a chunk (written by us, or found in storage: write_seconds None); pick LRU victims
        (never one being read) until within capacity. The caller deletes the victims."""
        victims: list[OffloadKey] = []
        with self._lock:
            if key in self._index:
                return victims
            self._index[key] = size
            self._used_bytes += size
            if write_seconds is not None:
                self._stats.stored_chunks += 1
                self._stats.extra[STAT_BYTES_WRITTEN] += size
                self._stats.extra[STAT_WRITE_SECONDS] += write_seconds
            self._events.append(self._event((key,), removed=False))
            if self._used_bytes > self.capacity_bytes:
                for candidate in list(self._index):
                    if self._used_bytes <= self.capacity_bytes:
                        break
                    if candidate == key or candidate in self._num_readers:
                        continue
                    self._used_bytes -= self._index.pop(candidate)
                    victims.append(candidate)
            if victims:
                self._stats.evicted_chunks += len(victims)
                self._events.append(self._event(tuple(victims), removed=True))
        return victims

    def _forget(self, key: OffloadKey) -> None:
        """Drop a key found missing or corrupt; announce its removal."""
        with self._lock:
            size = self._index.pop(key, None)
            if size is None:
                return
            self._used_bytes -= size
            self._events.append(self._event((key,), removed=True))

    async def _delete_quietly(self, key: OffloadKey) -> None:
        try:
            await asyncio.wait_for(self._delete(key), self.op_timeout_s)
        except Exception as error:  # noqa: BLE001 - a leftover object is rebuilt or overwritten later
            self._fail("delete", key, error)

    def _fail(self, op: str, key: OffloadKey | None, error: BaseException) -> None:
        self.count(STAT_FAILURES)
        outage = self._outage_of(op, error)
        log.warning("tier %s: %s of %s failed: %r%s", self.name, op, "-" if key is None else key.hex()[:16],
                    error, f" (outage: {outage})" if outage else "")
        if outage is not None:
            self._start_outage(outage)

    def _start_outage(self, outage: Outage) -> None:
        """Stop the affected traffic and probe (backoff) until the storage answers. Tier loop only."""
        with self._lock:
            if self._outage == "all" or self._outage == outage:
                return
            self._outage = outage
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.get_running_loop().create_task(self._recover(), name=f"kvtier-{self.name}-probe")

    async def _recover(self) -> None:
        delay, longest = self._probe_backoff_s
        while True:
            await asyncio.sleep(delay)
            try:
                await asyncio.wait_for(self._probe(), self.op_timeout_s)
            except Exception as error:  # noqa: BLE001
                log.info("tier %s: still unavailable (%r); next probe in %.1f s", self.name, error, delay)
                delay = min(delay * 2, longest)
                continue
            with self._lock:
                self._outage = None
            log.warning("tier %s: available again", self.name)
            return

    # ---- storage primitives ------------------------------------------------------------------

    @abc.abstractmethod
    async def _open_storage(self) -> list[tuple[OffloadKey, int, float]]:
        """Validate the storage (TierStartupError) and list its valid chunks: (key, bytes, mtime)."""

    @abc.abstractmethod
    async def _get(self, key: OffloadKey, target: ReadTarget) -> tuple[bool, int] | Missing:
        """Fetch the object, check it and land its payload in `target` (checksum and copy on an
        I/O thread, never on the loop): (landed, object bytes read); MISSING if it does not exist;
        ChunkFormatError if it is not a valid chunk of this key."""

    @abc.abstractmethod
    async def _put(self, key: OffloadKey, data: bytes) -> None:
        """Store the object whole: readers see the old state or all of it, never a part."""

    @abc.abstractmethod
    async def _delete(self, key: OffloadKey) -> None:
        """Remove the object; absent is fine."""

    @abc.abstractmethod
    async def _probe(self) -> None:
        """Raise unless the storage works again (used while in an outage)."""

    @abc.abstractmethod
    def _outage_of(self, op: str, error: BaseException) -> Outage | None:
        """Which outage (if any) a failed operation means."""

    async def _close_storage(self) -> None:
        """Release clients and sessions."""
