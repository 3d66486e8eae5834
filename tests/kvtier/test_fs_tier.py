"""The filesystem tier: crash-safe writes, index rebuild, corruption, capacity by bytes, events."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import threading
import time

import pytest

from kvtier.base import MEDIUM_FS, Locality, LookupResult, make_offload_key
from kvtier import core_pinned_pool
from kvtier.chunk_format import ModelFingerprint, encode_chunk
from kvtier.fs_tier import FSTier
from kvtier.secondary_tier import TierStartupError

FP = ModelFingerprint("test-model", "float32", 2, 2, 8, 16, 16)
PAYLOAD_LEN = 64 * 1024


def key(i: int):
    return make_offload_key(i.to_bytes(32, "big"), 0)


def payload(i: int) -> bytes:
    return bytes([i % 256]) * PAYLOAD_LEN


OBJECT_LEN = len(encode_chunk(FP, key(0), payload(0)))


async def open_tier(path, capacity=64 * OBJECT_LEN, fingerprint=FP) -> FSTier:
    tier = FSTier(0, path, capacity, fingerprint)
    await tier.open()
    return tier


async def test_a_written_chunk_reads_back_and_is_a_hit(tmp_path):
    tier = await open_tier(tmp_path)
    assert tier.lookup(key(1)) is LookupResult.MISS
    assert await tier.write(key(1), payload(1))
    assert tier.lookup(key(1)) is LookupResult.HIT
    assert bytes(await tier.read(key(1))) == payload(1)
    path = tier.path_of(key(1))
    assert path == tmp_path / FP.digest / key(1).hex()[:2] / f"{key(1).hex()}.chunk"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    stats = tier.stats()
    assert (stats.stored_chunks, stats.extra["bytes_written"], stats.extra["bytes_read"]) == (1, OBJECT_LEN, OBJECT_LEN)
    assert stats.extra["healthy"] == 1
    await tier.close()


async def test_stores_and_evictions_emit_fs_events_with_ownership_and_locality(tmp_path):
    tier = await open_tier(tmp_path, capacity=3 * OBJECT_LEN)
    for i in range(3):
        await tier.write(key(i), payload(i))
    tier.touch([key(0)])  # 1 is now least recently used
    tier.take_events()
    await tier.write(key(3), payload(3))
    stored, removed = tier.take_events()
    assert (stored.keys, stored.removed, stored.medium) == ((key(3),), False, MEDIUM_FS)
    assert (stored.ownership, stored.locality, stored.removal_expected) == ("0:fs", Locality.LOCAL, True)
    assert (removed.keys, removed.removed, removed.medium, removed.ownership) == ((key(1),), True, MEDIUM_FS, "0:fs")
    assert not tier.path_of(key(1)).exists()
    assert tier.lookup(key(1)) is LookupResult.MISS
    assert tier.stats().extra["used_bytes"] == 3 * OBJECT_LEN
    assert tier.stats().evicted_chunks == 1


async def test_capacity_counts_bytes_not_chunks(tmp_path):
    tier = await open_tier(tmp_path, capacity=2 * OBJECT_LEN + 100)
    big = make_offload_key(b"b" * 32, 0)
    await tier.write(key(0), payload(0))
    await tier.write(key(1), payload(1))
    await tier.write(big, b"x" * (PAYLOAD_LEN // 2))  # half a chunk: one full chunk must go
    assert [tier.contains(k) for k in (key(0), key(1), big)] == [False, True, True]
    assert not await tier.write(key(9), b"x" * (3 * OBJECT_LEN))  # larger than the tier: skipped


async def test_restart_rebuilds_the_index_in_lru_order(tmp_path):
    tier = await open_tier(tmp_path)
    for i in range(3):
        await tier.write(key(i), payload(i))
        os.utime(tier.path_of(key(i)), (1000 + i, 1000 + i))
    os.utime(tier.path_of(key(0)), (2000, 2000))  # 0 used last
    await tier.close()
    again = await open_tier(tmp_path, capacity=3 * OBJECT_LEN)
    (announced,) = again.take_events()
    assert set(announced.keys) == {key(0), key(1), key(2)} and not announced.removed
    await again.write(key(3), payload(3))
    assert [again.contains(key(i)) for i in range(4)] == [True, False, True, True]  # 1 was the oldest
    assert bytes(await again.read(key(0))) == payload(0)


async def test_start_removes_truncated_corrupt_foreign_and_stale_temp_files_only(tmp_path):
    tier = await open_tier(tmp_path)
    for i in range(6):
        await tier.write(key(i), payload(i))
    await tier.close()
    paths = [tier.path_of(key(i)) for i in range(6)]
    with open(paths[1], "r+b") as f:
        f.truncate(OBJECT_LEN - 10)  # truncated
    with open(paths[2], "r+b") as f:
        f.seek(30)
        f.write(b"\xff")  # corrupt header
    foreign = dataclasses.replace(FP, model_id="another-model")
    paths[3].write_bytes(encode_chunk(foreign, key(3), payload(3)))  # another model's bytes under our name
    paths[4].write_bytes(encode_chunk(FP, key(5), payload(5)))  # another key's bytes
    stale = paths[0].with_name(paths[0].name + ".123.abcd.tmp")
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 3600,) * 2)
    fresh = paths[0].with_name(paths[0].name + ".456.ef01.tmp")  # maybe a live writer's
    fresh.write_bytes(b"partial")
    junk = paths[0].parent / "notes.txt"
    junk.write_text("?")
    other_model_dir = tmp_path / foreign.digest / "00"
    other_model_dir.mkdir(parents=True)
    (other_model_dir / "x.chunk").write_bytes(b"another model's tier")

    again = await open_tier(tmp_path)
    assert [again.contains(key(i)) for i in range(6)] == [True, False, False, False, False, True]
    assert [p.exists() for p in paths] == [True, False, False, False, False, True]
    assert not stale.exists() and fresh.exists() and not junk.exists()
    assert (other_model_dir / "x.chunk").exists()  # another fingerprint's directory is not ours


async def test_a_checksum_failure_on_read_is_a_miss_and_deletes_the_file(tmp_path):
    tier = await open_tier(tmp_path)
    await tier.write(key(1), payload(1))
    tier.take_events()
    with open(tier.path_of(key(1)), "r+b") as f:
        f.seek(OBJECT_LEN - 1)
        f.write(b"\x00" if payload(1)[-1] else b"\x01")
    assert await tier.read(key(1)) is None
    assert not tier.path_of(key(1)).exists()
    assert tier.lookup(key(1)) is LookupResult.MISS
    (removed,) = tier.take_events()
    assert removed.removed and removed.keys == (key(1),)
    assert tier.stats().extra["corrupt_chunks"] == 1


async def test_a_file_deleted_behind_the_tiers_back_is_a_miss(tmp_path):
    tier = await open_tier(tmp_path)
    await tier.write(key(1), payload(1))
    tier.path_of(key(1)).unlink()
    assert await tier.read(key(1)) is None
    assert tier.lookup(key(1)) is LookupResult.MISS


async def test_an_unwritable_path_fails_at_start_with_a_clear_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(TierStartupError, match="not a writable directory"):
        await open_tier(not_a_dir / "tier")


class FillingDiskFSTier(FSTier):
    """A filesystem tier whose disk reports itself full (ENOSPC on write) while `full` is set."""

    full = False

    async def _put(self, key, data):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        await super()._put(key, data)

    async def _probe(self):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        await super()._probe()


async def test_a_full_disk_stops_writes_keeps_serving_reads_and_recovers(tmp_path):
    tier = FillingDiskFSTier(0, tmp_path, 64 * OBJECT_LEN, FP, probe_backoff_s=(0.05, 0.1))
    await tier.open()
    assert await tier.write(key(1), payload(1))
    tier.full = True
    assert not await tier.write(key(2), payload(2))
    assert tier.is_healthy is False and not tier.wants(key(3))  # later writes are skipped, not tried
    assert tier.lookup(key(1)) is LookupResult.HIT and bytes(await tier.read(key(1))) == payload(1)
    assert not list(tier.path_of(key(2)).parent.glob("*.tmp"))  # no partial file left behind
    tier.full = False
    deadline = time.monotonic() + 10
    while not tier.is_healthy:
        assert time.monotonic() < deadline, "never recovered"
        await asyncio.sleep(0.02)
    assert await tier.write(key(2), payload(2)) and bytes(await tier.read(key(2))) == payload(2)
    await tier.close()


async def test_start_evicts_the_oldest_chunks_beyond_capacity(tmp_path):
    tier = await open_tier(tmp_path)
    for i in range(4):
        await tier.write(key(i), payload(i))
        os.utime(tier.path_of(key(i)), (1000 + i, 1000 + i))
    smaller = await open_tier(tmp_path, capacity=2 * OBJECT_LEN)
    assert [smaller.contains(key(i)) for i in range(4)] == [False, False, True, True]
    assert not tier.path_of(key(0)).exists()


async def test_the_loop_never_stalls_while_many_chunks_are_written_and_read(tmp_path):
    big_fp = ModelFingerprint("test-model", "float32", 30, 3, 64, 16, 16)  # ~0.7 MiB chunks, as SmolLM2's
    tier = FSTier(0, tmp_path, 1 << 30, big_fp)
    await tier.open()
    chunk = os.urandom(2 * 30 * 16 * 3 * 64 * 4)
    worst = 0.0
    done = asyncio.Event()

    async def ticker():
        nonlocal worst
        while not done.is_set():
            started = time.perf_counter()
            await asyncio.sleep(0)
            worst = max(worst, time.perf_counter() - started)

    tick = asyncio.create_task(ticker())
    assert all(await asyncio.gather(*(tier.write(key(i), chunk) for i in range(32))))
    read = await asyncio.gather(*(tier.read(key(i)) for i in range(32)))
    done.set()
    await tick
    assert all(bytes(r) == chunk for r in read)
    assert worst < 0.2, f"the event loop stalled for {worst:.3f} s"


class Target:
    """A ReadTarget over a bytearray that records its calls; `decline` makes begin refuse."""

    def __init__(self, decline=False):
        self.data = bytearray(PAYLOAD_LEN)
        self.decline = decline
        self.calls = []

    def begin(self, nbytes):
        self.calls.append(("begin", nbytes))
        return None if self.decline else memoryview(self.data)

    def end(self, ok):
        self.calls.append(("end", ok))
        return ok


async def test_a_batch_read_lands_each_chunk_in_its_target_and_reports_each_once(tmp_path):
    tier = await open_tier(tmp_path)
    for i in range(6):
        await tier.write(key(i), payload(i))
    tier.path_of(key(1)).unlink()  # gone behind the tier's back
    with open(tier.path_of(key(2)), "r+b") as f:  # a flipped payload byte
        f.seek(OBJECT_LEN - 1)
        f.write(b"\x00" if payload(2)[-1] else b"\x01")
    targets = [Target(decline=i == 3) for i in range(6)] + [Target()]
    items = [(key(i), targets[i]) for i in range(6)] + [(key(99), targets[6])]  # 99: never written
    reports = []
    await tier.read_many_into(items, lambda i, landed: reports.append((i, landed)))
    assert sorted(reports) == [(0, True), (1, False), (2, False), (3, False), (4, True), (5, True), (6, False)]
    for i in (0, 4, 5):
        assert bytes(targets[i].data) == payload(i) and targets[i].calls == [("begin", PAYLOAD_LEN), ("end", True)]
    assert targets[2].calls == [("begin", PAYLOAD_LEN), ("end", False)]  # checked in place, then refused
    assert targets[3].calls == [("begin", PAYLOAD_LEN)] and not any(targets[3].data)  # declined: nothing written
    assert targets[1].calls == targets[6].calls == []
    assert not tier.path_of(key(2)).exists() and not tier.contains(key(2)) and not tier.contains(key(1))
    stats = tier.stats().extra
    assert (stats["corrupt_chunks"], stats["bytes_read"]) == (1, 4 * OBJECT_LEN)  # 0, 3, 4, 5 read whole


@pytest.mark.parametrize("cores, workers", [(8, 3), (2, 2)])
async def test_a_batch_read_takes_one_thread_hop_per_worker_not_per_chunk(tmp_path, monkeypatch, cores, workers):
    # At most max_concurrent_reads workers, and no more than the process may use cores.
    monkeypatch.setattr(core_pinned_pool, "usable_cpus", lambda: list(range(cores)))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: None)  # the cores are made up
    tier = FSTier(0, tmp_path, 64 * OBJECT_LEN, FP, max_concurrent_reads=3)
    await tier.open()
    for i in range(20):
        await tier.write(key(i), payload(i))
    hops = []
    submit = tier._read_pool.submit

    def counting(fn, *args):
        hops.append(fn)
        return submit(fn, *args)

    monkeypatch.setattr(tier._read_pool, "submit", counting)
    targets = [Target() for _ in range(20)]
    reports = []
    await tier.read_many_into([(key(i), t) for i, t in enumerate(targets)], lambda i, ok: reports.append(ok))
    assert reports == [True] * 20 and all(bytes(t.data) == payload(i) for i, t in enumerate(targets))
    assert len(hops) == workers
    await tier.close()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
async def test_read_workers_run_each_on_its_own_core(tmp_path):
    before = os.sched_getaffinity(0)
    tier = await open_tier(tmp_path)
    pool = tier._read_pool
    barrier = threading.Barrier(pool.num_workers)

    def where() -> frozenset[int]:
        barrier.wait(timeout=10)  # every worker busy at once: one task each
        return frozenset(os.sched_getaffinity(0))

    loop = asyncio.get_running_loop()
    cores = await asyncio.gather(*(loop.run_in_executor(pool, where) for _ in range(pool.num_workers)))
    assert all(len(c) == 1 for c in cores) and len(set(cores)) == pool.num_workers
    assert os.sched_getaffinity(0) == before  # the loop's thread is left alone
    await tier.close()


async def test_a_truncated_payload_is_a_miss_and_deleted(tmp_path):
    tier = await open_tier(tmp_path)
    await tier.write(key(1), payload(1))
    with open(tier.path_of(key(1)), "r+b") as f:
        f.truncate(OBJECT_LEN - 100)
    target = Target()
    assert not await tier.read_into(key(1), target)
    # Read whole at its indexed size, the short read is refused: the target is told it did not land.
    assert target.calls[-1] == ("end", False)
    assert not tier.path_of(key(1)).exists() and tier.stats().extra["corrupt_chunks"] == 1
