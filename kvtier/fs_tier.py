"""The filesystem tier: one file per chunk under `<path>/<fingerprint digest>/<hh>/<key hex>.chunk`.

Writes go to `<name>.<pid>.<random>.tmp` in the same directory, are fsynced, renamed over the
final name and the directory is fsynced: a reader (or a restarted process) sees a whole chunk
or none. Writes, renames and deletes go through aiofiles; the directory scan at start and fsyncs
run on threads. Reads do not use aiofiles: one thread hop opens a file, checks its header, reads
the payload straight into the target (the CPU tier's slot) and checks its CRC there, and a
promotion batch reads many files per hop. With aiofiles a chunk took five hops (open, read, close,
checksum, copy) and two more copies. Reads run on the tier's own pool: one worker per core, each
pinned to its core (see `CorePinnedPool`).

At start the index is rebuilt from the fingerprint's directory (other fingerprints' directories
are left alone: another model may share the root). Removed while scanning: stale temp files,
names that are not chunk names, and chunks whose header is truncated, corrupt or foreign (another
fingerprint or format version). The payload checksum is checked on every read; a mismatch is a
miss and the file is deleted.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import aiofiles
import aiofiles.os

from kvtier.base import MEDIUM_FS, Locality, OffloadKey
from kvtier.chunk_format import (
    HEADER_SIZE,
    ChunkFormatError,
    ModelFingerprint,
    check_header,
    chunk_relpath,
    crc32,
    header_prefix_len,
    key_from_hex,
    parse_header,
)
from kvtier.core_pinned_pool import CorePinnedPool
from kvtier.secondary_tier import MISSING, Missing, Outage, ReadTarget, SecondaryTier, TierStartupError

log = logging.getLogger(__name__)

CHUNK_SUFFIX = ".chunk"
TEMP_SUFFIX = ".tmp"
# NOTE: a temp file younger than this may be another live process's write in flight (several
# processes may share a directory); older ones are leftovers of a crash.
STALE_TEMP_S = 60.0
_FULL_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


class FSTier(SecondaryTier):
    medium = MEDIUM_FS
    type_name = "fs"

    def __init__(
        self,
        index: int,
        path: str | os.PathLike,
        capacity_bytes: int,
        fingerprint: ModelFingerprint,
        locality: Locality = Locality.LOCAL,
        demote_on: str = "evict",
        **kwargs,
    ) -> None:
        super().__init__(index, capacity_bytes, fingerprint, locality, demote_on, **kwargs)
        self.root = Path(path).expanduser()
        self.dir = self.root / fingerprint.digest
        self._dir_str = str(self.dir)  # NOTE: building a Path per read cost a fifth of a page-cache read
        # NOTE: no more read workers than cores, each on its own core. Each chunk's read releases
        # and retakes the GIL several times (open, read, CRC, close); threads stacked on one core
        # run in turn (2 cores, a promotion of 124 chunks of 369 KB: 19-30 ms with 8 workers,
        # 13-16 ms with 2 unpinned, 7-10 ms with 2 pinned).
        self._read_pool = CorePinnedPool(self._max_concurrent_reads, thread_name_prefix=f"kvtier-{self.name}-read")

    def path_of(self, key: OffloadKey) -> Path:
        return self.dir / chunk_relpath(key)

    # ---- storage primitives ------------------------------------------------------------------

    async def _open_storage(self) -> list[tuple[OffloadKey, int, float]]:
        return await asyncio.to_thread(self._open_sync)

    def _open_sync(self) -> list[tuple[OffloadKey, int, float]]:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            _probe_write(self.dir)
        except OSError as error:
            raise TierStartupError(
                f"secondary tier {self.name}: path {str(self.root)!r} is not a writable directory: {error}"
            ) from None
        entries: list[tuple[OffloadKey, int, float]] = []
        removed: dict[str, int] = {}
        for sub in _scandir(self.dir):
            if not sub.is_dir(follow_symlinks=False):
                if not sub.name.startswith(".probe-"):
                    _remove(Path(sub.path), removed, "foreign")
                continue
            for entry in _scandir(Path(sub.path)):
                reason, chunk = self._check_file(entry)
                if chunk is not None:
                    entries.append(chunk)
                elif reason is not None:
                    _remove(Path(entry.path), removed, reason)
        if removed:
            log.warning("tier %s: removed at start: %s", self.name,
                        ", ".join(f"{n} {reason}" for reason, n in sorted(removed.items())))
        room = shutil.disk_usage(self.dir).free + sum(size for _, size, _ in entries)
        if room < self.capacity_bytes:
            log.warning("tier %s: capacity %.1f GiB, but the disk at %s has room for %.1f GiB; writes pause "
                        "while it is full", self.name, self.capacity_bytes / 2**30, self.root, room / 2**30)
        return entries

    def _check_file(self, entry: os.DirEntry) -> tuple[str | None, tuple[OffloadKey, int, float] | None]:
        """(reason to remove, None) or (None, (key, size, mtime)); (None, None) leaves it alone."""
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            return None, None
        if entry.name.endswith(TEMP_SUFFIX):
            return ("temp" if time.time() - st.st_mtime > STALE_TEMP_S else None), None
        key = key_from_hex(entry.name[: -len(CHUNK_SUFFIX)]) if entry.name.endswith(CHUNK_SUFFIX) else None
        if key is None or not entry.is_file(follow_symlinks=False):
            return "foreign", None
        try:
            with open(entry.path, "rb") as f:
                head = f.read(HEADER_SIZE)
                head += f.read(header_prefix_len(head) - HEADER_SIZE)
            check_header(parse_header(head), self.fingerprint, key, st.st_size)
        except ChunkFormatError as error:
            return error.reason, None
        except OSError as error:
            log.warning("tier %s: cannot read %s at start: %r", self.name, entry.path, error)
            return None, None
        return None, (key, st.st_size, st.st_mtime)

    async def read_many_into(self, items: Sequence[tuple[OffloadKey, ReadTarget]],
                             done: Callable[[int, bool], None]) -> None:
        """`read_into` for each (key, target): the items are dealt out (0, n, 2n, ...: the head of
        a prefix first) to at most `max_concurrent_reads` workers, each one thread hop for all of
        its share. NOTE: a thread hop costs 50-170 us on a busy 2-core machine, as much as reading
        a chunk from the page cache: one per chunk halved the bandwidth."""
        workers = min(self._read_pool.num_workers, len(items))
        indexed = [(i, key, target) for i, (key, target) in enumerate(items)]
        await asyncio.gather(*(self._read_share(indexed[w::workers], done) for w in range(workers)))

    async def _read_share(self, share: list[tuple[int, OffloadKey, ReadTarget]], done: Callable[[int, bool], None]) -> None:
        reported: set[int] = set()
        reported_lock = threading.Lock()

        def report(i: int, landed: bool) -> None:
            with reported_lock:
                if i in reported:
                    return
                reported.add(i)
            done(i, landed)

        assert self._read_slots is not None, "open() first"
        try:
            async with self._read_slots:
                corrupt, errors = await asyncio.wait_for(
                    self._on_read_pool(self._read_share_sync, share, report), self.op_timeout_s
                )
        except Exception as error:  # noqa: BLE001 - a timeout (the thread goes on; its late reports are dropped)
            for i, _, _ in share:
                report(i, False)
            self._fail("read", None, error)
            return
        except BaseException:  # cancelled (shutdown): never leave an item unreported
            for i, _, _ in share:
                report(i, False)
            raise
        for key in corrupt:
            await self._delete_quietly(key)
        for key, error in errors:
            self._fail("read", key, error)

    def _read_share_sync(self, share: list[tuple[int, OffloadKey, ReadTarget]], report: Callable[[int, bool], None]
                         ) -> tuple[list[OffloadKey], list[tuple[OffloadKey, Exception]]]:
        """Read each item in turn and report it at once (on this thread); returns what the loop
        finishes: corrupt keys to delete, failures to count."""
        corrupt: list[OffloadKey] = []
        errors: list[tuple[OffloadKey, Exception]] = []
        for i, key, target in share:
            landed = False
            try:
                landed = self._read_one_sync(key, target, corrupt, errors)
            finally:
                report(i, landed)
        return corrupt, errors

    def _read_one_sync(self, key: OffloadKey, target: ReadTarget, corrupt: list, errors: list) -> bool:
        if not self._begin_read(key):
            return False
        started = time.perf_counter()
        nbytes = 0
        try:
            got = self._read_sync(key, target)
            if got is MISSING:
                self._gone(key)
                return False
            landed, nbytes = got
            return landed
        except ChunkFormatError as error:
            self._corrupt(key, error)
            corrupt.append(key)
            return False
        except Exception as error:  # noqa: BLE001 - any storage error is a miss, never a crash
            errors.append((key, error))
            return False
        finally:
            self._end_read(key, nbytes, started)

    async def _get(self, key: OffloadKey, target: ReadTarget) -> tuple[bool, int] | Missing:
        return await self._on_read_pool(self._read_sync, key, target)

    def _on_read_pool(self, fn, *args) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self._read_pool, fn, *args)

    def _read_sync(self, key: OffloadKey, target: ReadTarget) -> tuple[bool, int] | Missing:
        """Read the payload straight into the target and check header and CRC there (a worker
        thread). NOTE: no intermediate buffer: copying each chunk from one cost a third of the time
        per chunk and held the GIL."""
        try:
            fd = os.open(os.path.join(self._dir_str, chunk_relpath(key)), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return MISSING
        try:
            size = self._indexed_size(key)
            if size is None:
                return MISSING  # evicted meanwhile: no longer this tier's
            return self._read_whole(fd, key, target, size)
        finally:
            os.close(fd)

    def _read_whole(self, fd: int, key: OffloadKey, target: ReadTarget, size: int) -> tuple[bool, int]:
        """Header and payload in one preadv at the size the index recorded (every header of this
        tier has the same length): no fstat and no separate header read, two system calls fewer per
        chunk, each of which gave up and retook the GIL. The payload lands before the header is
        checked, so a failed check ends the target with ok=False. Only the recorded size is read:
        bytes appended to the file afterwards are not seen (the index rebuild at start checks sizes)."""
        head_len = HEADER_SIZE + len(key) + len(self.fingerprint.canonical)
        if size <= head_len:
            raise ChunkFormatError("truncated", f"{size} bytes, less than a header")
        dest = target.begin(size - head_len)
        if dest is None:
            return False, size
        ok = False
        try:
            head = bytearray(head_len)
            got = os.preadv(fd, [head, dest], 0)
            if got < size:
                raise ChunkFormatError("truncated", f"{got} bytes, the index recorded {size}")
            header = parse_header(head)
            check_header(header, self.fingerprint, key, size)
            if crc32(dest) != header.payload_crc:
                raise ChunkFormatError("corrupt", "payload checksum mismatch")
            ok = True
        finally:
            landed = target.end(ok)
        return landed, size

    async def _put(self, key: OffloadKey, data: bytes) -> None:
        path = self.path_of(key)
        temp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")
        await aiofiles.os.makedirs(path.parent, exist_ok=True)
        try:
            async with aiofiles.open(temp, "wb") as f:
                await f.write(data)
                await f.flush()
                await asyncio.to_thread(os.fsync, f.fileno())
            await aiofiles.os.replace(temp, path)
        except asyncio.CancelledError:
            temp.unlink(missing_ok=True)  # NOTE: cancelled at shutdown: no await left; one small unlink
            raise
        except Exception:
            await _remove_async(temp)
            raise
        await asyncio.to_thread(_fsync_dir, path.parent)  # the rename survives a crash

    async def _delete(self, key: OffloadKey) -> None:
        try:
            await aiofiles.os.remove(self.path_of(key))
        except FileNotFoundError:
            pass

    async def _probe(self) -> None:
        await asyncio.to_thread(_probe_write, self.dir)

    async def _close_storage(self) -> None:
        # NOTE: no wait: a read abandoned at its timeout may still run; its late report is dropped.
        self._read_pool.shutdown(wait=False, cancel_futures=True)

    def _outage_of(self, op: str, error: BaseException) -> Outage | None:
        # NOTE: a full or read-only disk stops writes only; reads of what is there go on.
        if op == "write" and isinstance(error, OSError) and error.errno in _FULL_DISK_ERRNOS:
            return "writes"
        return None


def _scandir(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _remove(path: Path, removed: dict[str, int], reason: str) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except OSError as error:
        log.warning("cannot remove %s (%s): %r", path, reason, error)
        return
    removed[reason] = removed.get(reason, 0) + 1


async def _remove_async(path: Path) -> None:
    try:
        await aiofiles.os.remove(path)
    except OSError:
        pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _probe_write(directory: Path) -> None:
    """Create, fsync and remove a small file: raises OSError unless the directory is writable."""
    probe = directory / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"zenserve")
        os.fsync(fd)
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
