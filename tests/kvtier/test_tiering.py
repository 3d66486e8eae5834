"""The tiering manager: promotions (RETRY -> HIT_PENDING -> HIT, deadlines), demotions (on eviction,
on store, never blocking), tier filters, events, and the event loop it shares."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

from kvtier.base import MEDIUM_CPU, MEDIUM_FS, MEDIUM_OBJ, LookupResult, ReqContext, make_offload_key
from kvtier.chunk_format import ModelFingerprint
from kvtier.cpu_tier import CPUOffloadingManager
from kvtier.fs_tier import FSTier
from kvtier.obj_tier import ObjTier
from kvtier.tiering import TieringOffloadingManager

FP = ModelFingerprint("test-model", "float32", 2, 2, 8, 16, 16)
NBYTES = 32 * 1024
CTX = ReqContext("r1")
HIT, HIT_PENDING, RETRY, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS


def key(i: int):
    return make_offload_key(i.to_bytes(32, "big"), 0)


def payload(i: int, nbytes: int = NBYTES) -> bytes:
    return bytes([i % 251]) * nbytes


class ArraySlots:
    """The CPU tier's bytes as plain byte arrays (the engine's KVHostBuffer in production)."""

    def __init__(self, num_slots: int, nbytes: int = NBYTES):
        self.slots = [bytearray(nbytes) for _ in range(num_slots)]

    def read(self, slot_id: int) -> bytes:
        return bytes(self.slots[slot_id])

    def write(self, slot_id: int, data) -> None:
        assert len(data) == len(self.slots[slot_id])
        self.slots[slot_id][:] = data

    def view(self, slot_id: int) -> memoryview:
        return memoryview(self.slots[slot_id])


class SlowFSTier(FSTier):
    """A filesystem tier whose reads and writes take `delay_s` longer (a slow disk: a read blocks
    its I/O thread, as a real one would)."""

    read_delay_s = 0.0
    write_delay_s = 0.0

    def _read_sync(self, path, consume):
        time.sleep(self.read_delay_s)
        return super()._read_sync(path, consume)

    async def _put(self, key, data):
        await asyncio.sleep(self.write_delay_s)
        await super()._put(key, data)


class StallingFSTier(FSTier):
    """A filesystem tier whose reads hang right after they were handed the CPU slot to write
    (a disk that stalls mid-read) until `go` is set."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.began = threading.Event()
        self.go = threading.Event()

    def _read_sync(self, key, target):
        tier = self

        class Stall:
            def begin(self, nbytes):
                view = target.begin(nbytes)
                tier.began.set()
                tier.go.wait(10)
                return view

            def end(self, ok):
                return target.end(ok)

        return super()._read_sync(key, Stall())


def make_manager(tmp_path, num_slots=2, tier_cls=FSTier, demote_on="evict", loop=None, tiers=None, nbytes=NBYTES,
                 **kwargs):
    slots = ArraySlots(num_slots, nbytes)
    tiers = tiers or [tier_cls(0, tmp_path / "fs", 1 << 30, FP, demote_on=demote_on)]
    manager = TieringOffloadingManager(CPUOffloadingManager(num_slots), tiers, slots, loop=loop, **kwargs)
    if loop is None:
        manager.start()
    return manager, slots


def store(manager, slots, ids, ctx=CTX, nbytes=NBYTES):
    """What the connector does for a store: reserve slots, copy the bytes, complete."""
    out = manager.prepare_store([key(i) for i in ids], ctx)
    assert out is not None
    for k, slot_id in zip(out.keys_to_store, out.slot_ids):
        slots.write(slot_id, payload(int.from_bytes(k[:32], "big"), nbytes))
    manager.complete_store(out.keys_to_store, ctx)
    return out


def wait_until(condition, timeout_s=5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def promote(manager, k, ctx=CTX, timeout_s=5.0) -> list[LookupResult]:
    """Look `k` up once per 'step' until HIT; the answers in order (repeats collapsed)."""
    answers = [manager.lookup(k, ctx)]
    deadline = time.monotonic() + timeout_s
    while answers[-1] is not HIT:
        assert answers[-1] is not MISS, answers
        assert time.monotonic() < deadline, answers
        manager.on_schedule_end()
        time.sleep(0.002)
        answer = manager.lookup(k, ctx)
        if answer is not answers[-1]:
            answers.append(answer)
    return answers


def demoted(manager, tmp_path, num_slots=2, ids=(0,)):
    """Store `ids`, then push them out of the CPU tier with new chunks; wait until the tier has them."""
    for i in ids:
        store(manager, manager.slots, [i])
    store(manager, manager.slots, [100 + i for i in range(num_slots)])
    wait_until(lambda: all(manager.tiers[0].contains(key(i)) for i in ids))


def test_a_chunk_evicted_from_the_cpu_tier_is_written_through_to_the_fs_tier(tmp_path):
    manager, slots = make_manager(tmp_path)
    store(manager, slots, [0])
    store(manager, slots, [1])
    manager.take_events()
    out = store(manager, slots, [2])
    assert out.evicted_keys == (key(0),)
    fs = manager.tiers[0]
    wait_until(lambda: fs.contains(key(0)))
    assert not fs.contains(key(1))  # still in the CPU tier: nothing to demote
    events = manager.take_events()
    assert [(e.medium, e.removed, e.keys) for e in events if e.medium == MEDIUM_FS] == [(MEDIUM_FS, False, (key(0),))]
    assert [(e.medium, e.removed) for e in events if e.keys == (key(0),)] == [(MEDIUM_CPU, True), (MEDIUM_FS, False)]
    assert manager.stats()["0:fs"].extra["demotions"] == 1
    manager.shutdown()


def test_a_promotion_answers_retry_then_hit_pending_then_hit_with_the_bytes_in_a_cpu_slot(tmp_path):
    manager, slots = make_manager(tmp_path)
    demoted(manager, tmp_path)
    manager.take_events()
    assert manager.lookup(key(0), CTX) is RETRY  # a slot is reserved and the read queued
    assert manager.lookup(key(0), CTX) is HIT_PENDING
    assert manager.has_pending_work()
    assert promote(manager, key(0))[-2:] == [HIT_PENDING, HIT]
    assert not manager.has_pending_work()
    (slot_id,) = manager.prepare_load([key(0)], CTX)
    assert slots.read(slot_id) == payload(0)
    manager.complete_load([key(0)], CTX)
    cpu_stored = [e for e in manager.take_events() if e.medium == MEDIUM_CPU and not e.removed]
    assert [e.keys for e in cpu_stored] == [(key(0),)]  # the promotion's CPU stored event
    stats = manager.stats()["0:fs"]
    assert (stats.extra["promotions"], stats.extra["promotion_timeouts"]) == (1, 0)
    manager.shutdown()


def test_a_promotion_past_its_deadline_is_abandoned_and_never_writes_the_reused_slot(tmp_path):
    manager, slots = make_manager(tmp_path, tier_cls=SlowFSTier, promotion_timeout_s=0.3, failure_backoff_s=0.6)
    demoted(manager, tmp_path)
    manager.tiers[0].read_delay_s = 0.8
    assert manager.lookup(key(0), CTX) is RETRY
    manager.on_schedule_end()  # the slow read starts
    used = manager.primary.num_used_slots
    time.sleep(0.35)
    assert not manager.has_pending_work()  # abandoned at its deadline: nothing to wait for
    assert manager.primary.num_used_slots == used - 1  # its slot is free again
    assert manager.lookup(key(0), CTX) is MISS  # the request recomputes; never an endless HIT_PENDING
    assert manager.stats()["0:fs"].extra["promotion_timeouts"] == 1
    out = store(manager, slots, [7])  # the freed slot is reused at once
    time.sleep(0.6)  # the abandoned read has finished by now
    assert slots.read(out.slot_ids[0]) == payload(7)
    manager.tiers[0].read_delay_s = 0.0
    assert promote(manager, key(0))[-1] is HIT  # after the backoff a new attempt succeeds
    manager.shutdown()


def test_a_promotion_abandoned_while_its_read_writes_the_slot_keeps_the_slot_until_the_read_ends(tmp_path):
    manager, slots = make_manager(tmp_path, tier_cls=StallingFSTier, promotion_timeout_s=0.3)
    demoted(manager, tmp_path)
    tier = manager.tiers[0]
    assert manager.lookup(key(0), CTX) is RETRY
    reserved = manager.primary.slot_of(key(0))
    manager.on_schedule_end()
    assert tier.began.wait(5)  # the read holds the slot now, and hangs
    time.sleep(0.35)
    assert not manager.has_pending_work()  # abandoned at its deadline all the same: nobody waits
    assert manager.lookup(key(0), CTX) is MISS
    assert manager.primary.num_free_slots == 0  # the hung read's slot is not handed out again
    out = store(manager, slots, [7])  # a store evicts a readable chunk instead
    assert out.slot_ids != (reserved,)
    tier.go.set()  # the read finishes writing the slot it kept
    wait_until(lambda: manager.has_pending_work() is False and manager.primary.num_free_slots == 1)
    assert slots.read(out.slot_ids[0]) == payload(7)
    assert slots.read(reserved) == payload(0)
    assert manager.stats()["0:fs"].extra["promotion_timeouts"] == 1
    assert store(manager, slots, [8]).slot_ids == (reserved,)  # given back: reused now
    manager.shutdown()


def test_reset_while_a_read_writes_a_slot_keeps_that_slot_out_of_use_until_the_read_ends(tmp_path):
    manager, slots = make_manager(tmp_path, tier_cls=StallingFSTier)
    demoted(manager, tmp_path)
    tier = manager.tiers[0]
    assert manager.lookup(key(0), CTX) is RETRY
    reserved = manager.primary.slot_of(key(0))
    manager.on_schedule_end()
    assert tier.began.wait(5)
    manager.reset_cache()
    out = store(manager, slots, [7])
    assert out.slot_ids != (reserved,) and manager.primary.num_free_slots == 0
    tier.go.set()
    wait_until(lambda: manager.has_pending_work() is False and manager.primary.num_free_slots == 1)
    assert slots.read(out.slot_ids[0]) == payload(7)
    manager.shutdown()


def test_promotion_seconds_count_the_wall_time_promotions_were_pending(tmp_path):
    manager, _ = make_manager(tmp_path, tier_cls=SlowFSTier)
    demoted(manager, tmp_path)
    stats = manager.stats()["0:fs"].extra
    assert stats["promotion_seconds"] == 0
    manager.tiers[0].read_delay_s = 0.1
    promote(manager, key(0))
    spent = manager.stats()["0:fs"].extra["promotion_seconds"]
    assert spent >= 0.1  # at least the slow read, however fast the machine
    time.sleep(0.05)
    assert manager.stats()["0:fs"].extra["promotion_seconds"] == spent  # nothing pending: no time counted
    manager.shutdown()


def test_still_pending_follows_a_promotion_until_it_lands(tmp_path):
    manager, _ = make_manager(tmp_path, tier_cls=SlowFSTier)
    demoted(manager, tmp_path)
    manager.tiers[0].read_delay_s = 0.2
    assert not manager.still_pending(key(0))
    assert manager.lookup(key(0), CTX) is RETRY
    assert manager.still_pending(key(0))  # queued
    manager.on_schedule_end()
    assert manager.still_pending(key(0))  # reading
    wait_until(lambda: not manager.still_pending(key(0)))
    assert manager.lookup(key(0), CTX) is HIT
    manager.shutdown()


def test_demotion_never_blocks_the_cpu_tier(tmp_path):
    manager, slots = make_manager(tmp_path, num_slots=8, tier_cls=SlowFSTier)
    manager.tiers[0].write_delay_s = 0.5
    store(manager, slots, range(8))
    started = time.perf_counter()
    out = store(manager, slots, range(10, 18))  # evicts 8 chunks, each written to a slow disk
    elapsed = time.perf_counter() - started
    assert len(out.evicted_keys) == 8
    assert elapsed < 0.1, f"prepare/complete_store took {elapsed:.3f} s"
    wait_until(lambda: all(manager.tiers[0].contains(key(i)) for i in range(8)))
    manager.shutdown()


def test_demote_on_store_writes_chunks_the_cpu_tier_still_holds(tmp_path):
    manager, slots = make_manager(tmp_path, demote_on="store")
    store(manager, slots, [0])
    wait_until(lambda: manager.tiers[0].contains(key(0)))
    assert manager.lookup(key(0), CTX) is HIT  # still in the CPU tier too
    manager.shutdown()


def test_snapshots_waiting_for_a_slow_tier_are_bounded(tmp_path):
    manager, slots = make_manager(tmp_path, num_slots=4, tier_cls=SlowFSTier, max_pending_demotion_bytes=2 * NBYTES)
    manager.tiers[0].write_delay_s = 0.3
    store(manager, slots, range(4))
    store(manager, slots, range(10, 14))
    assert manager.pending_demotion_bytes == 2 * NBYTES
    assert manager.stats()["0:fs"].extra["demotions_dropped"] == 2
    wait_until(lambda: manager.pending_demotion_bytes == 0)
    manager.shutdown()


def test_no_cpu_slot_for_a_promotion_is_a_miss(tmp_path):
    manager, slots = make_manager(tmp_path)
    demoted(manager, tmp_path)
    pinned = [key(100), key(101)]
    manager.prepare_load(pinned, CTX)  # every slot busy
    assert manager.lookup(key(0), CTX) is MISS
    assert manager.stats()["0:fs"].extra["promotion_allocation_failures"] == 1
    manager.complete_load(pinned, CTX)
    manager.shutdown()


@pytest.mark.parametrize(
    ("kv_load_tiers", "answer"),
    [
        ((), MISS),  # no tier at all
        (({"medium": "CPU"},), MISS),  # the CPU tier only: no promotion
        (({"medium": "STORAGE", "locality": "REMOTE"},), MISS),  # the fs tier is LOCAL
        (({"medium": "STORAGE", "locality": "LOCAL"},), RETRY),
        (({"locality": "LOCAL"},), RETRY),  # a missing key matches anything
        (({"medium": "TAPE"},), RETRY),  # every entry invalid: every tier
    ],
)
def test_a_requests_tier_filter_chooses_which_tiers_may_serve_it(tmp_path, kv_load_tiers, answer):
    manager, _ = make_manager(tmp_path)
    demoted(manager, tmp_path)
    assert manager.lookup(key(0), ReqContext("r2", kv_load_tiers=kv_load_tiers)) is answer
    manager.shutdown()


def test_a_prefix_longer_than_the_cpu_tier_loads_its_head_instead_of_thrashing(tmp_path):
    manager, _ = make_manager(tmp_path, num_slots=3)
    demoted(manager, tmp_path, num_slots=3, ids=range(5))
    keys = [key(i) for i in range(5)]
    for _ in range(500):  # the connector's maximal prefix lookup, once per step
        hits, defer = 0, False
        for k in keys:
            answer = manager.lookup(k, CTX)
            if answer is MISS:
                break
            if answer is HIT and not defer:
                hits += 1
            defer = defer or answer is not HIT
        manager.on_schedule_end()
        if not defer:
            break
        time.sleep(0.002)
    assert (hits, defer) == (3, False)  # the first three chunks, all in the CPU tier at once
    manager.shutdown()


def test_reset_forgets_the_cpu_tier_and_abandons_promotions_but_keeps_the_fs_tier(tmp_path):
    manager, _ = make_manager(tmp_path, tier_cls=SlowFSTier)
    demoted(manager, tmp_path)
    manager.tiers[0].read_delay_s = 0.3
    assert manager.lookup(key(0), CTX) is RETRY
    manager.on_schedule_end()
    manager.reset_cache()
    assert manager.primary.num_used_slots == 0
    assert manager.tiers[0].contains(key(0))
    manager.tiers[0].read_delay_s = 0.0
    assert promote(manager, key(0))[-1] is HIT
    manager.shutdown()


def test_shutdown_cancels_work_in_flight_and_stops_the_private_loop(tmp_path):
    manager, slots = make_manager(tmp_path, tier_cls=SlowFSTier)
    manager.tiers[0].write_delay_s = 30
    store(manager, slots, [0, 1])
    store(manager, slots, [2, 3])  # two demotions stuck on a very slow disk
    assert manager.pending_demotion_bytes == 2 * NBYTES
    thread = manager.tier_loop._thread
    started = time.perf_counter()
    manager.shutdown()
    assert time.perf_counter() - started < 5
    assert not thread.is_alive()


async def test_the_event_loop_never_stalls_while_the_manager_promotes_and_demotes_on_it(tmp_path):
    nbytes = 2 * 30 * 16 * 3 * 64 * 4  # ~0.7 MiB: a chunk of the embedded model
    loop = asyncio.get_running_loop()
    manager, slots = make_manager(tmp_path, num_slots=8, loop=loop, nbytes=nbytes)
    await asyncio.to_thread(manager.start)  # blocks until the tiers are open: not on the loop's thread
    worst = 0.0
    done = asyncio.Event()

    async def ticker():
        nonlocal worst
        while not done.is_set():
            started = time.perf_counter()
            await asyncio.sleep(0)
            worst = max(worst, time.perf_counter() - started)

    tick = asyncio.create_task(ticker())
    for batch in range(5):  # 40 chunks through 8 slots: 32 demotions
        store(manager, slots, range(batch * 8, batch * 8 + 8), nbytes=nbytes)
        await asyncio.sleep(0.01)
    fs = manager.tiers[0]
    while not all(fs.contains(key(i)) for i in range(32)):
        await asyncio.sleep(0.01)
    for i in range(4):  # promotions on the same loop
        answer = manager.lookup(key(i), CTX)
        while answer is not HIT:
            manager.on_schedule_end()
            await asyncio.sleep(0.005)
            answer = manager.lookup(key(i), CTX)
        (slot_id,) = manager.prepare_load([key(i)], CTX)
        assert slots.read(slot_id) == payload(i, nbytes)
        manager.complete_load([key(i)], CTX)
    done.set()
    await tick
    await manager.shutdown_async()
    assert worst < 0.2, f"the event loop stalled for {worst:.3f} s"


def test_the_object_tier_serves_what_the_filesystem_tier_lacks(tmp_path, s3_server):
    prefix = f"t-{uuid.uuid4().hex[:12]}"

    def obj_tier(index):
        return ObjTier(index, s3_server.endpoint, s3_server.bucket, 1 << 30, FP, prefix=prefix,
                       access_key=s3_server.access_key, secret_key=s3_server.secret_key)

    first, _ = make_manager(tmp_path, tiers=[FSTier(0, tmp_path / "a", 1 << 30, FP), obj_tier(1)])
    # Another replica, running already: its own (empty) disk, the same bucket.
    second, slots = make_manager(tmp_path, tiers=[FSTier(0, tmp_path / "b", 1 << 30, FP), obj_tier(1)])
    demoted(first, tmp_path)
    wait_until(lambda: first.tiers[1].contains(key(0)))  # written through to both tiers
    first.shutdown()
    # Not in the second's index yet: RETRY while it asks the bucket, RETRY as the promotion starts.
    assert promote(second, key(0)) == [RETRY, HIT_PENDING, HIT]
    (slot_id,) = second.prepare_load([key(0)], CTX)
    assert slots.read(slot_id) == payload(0)
    second.complete_load([key(0)], CTX)
    stats = second.stats()
    assert (stats["0:fs"].extra["promotions"], stats["1:obj"].extra["promotions"]) == (0, 1)
    events = second.take_events()
    assert any(e.medium == MEDIUM_OBJ and not e.removed and key(0) in e.keys for e in events)
    second.shutdown()


def test_a_thread_safe_lookup_from_another_thread_sees_completed_promotions(tmp_path):
    """The offline engine calls the manager from a plain thread while the tier loop runs on its own."""
    manager, _ = make_manager(tmp_path)
    demoted(manager, tmp_path)
    answers = []
    worker = threading.Thread(target=lambda: answers.extend(promote(manager, key(0))))
    worker.start()
    worker.join(10)
    assert answers[0] is RETRY and answers[-1] is HIT
    manager.shutdown()


def test_a_promotion_batch_tells_the_listener_once_when_its_last_chunk_lands(tmp_path):
    manager, slots = make_manager(tmp_path, num_slots=4)
    demoted(manager, tmp_path, num_slots=4, ids=(0, 1, 2))
    calls = []
    landed_when_called = []
    manager.set_progress_listener(lambda: (calls.append(time.monotonic()),
                                           landed_when_called.append(len(manager._completions))))
    assert [manager.lookup(key(i), CTX) for i in (0, 1, 2)] == [RETRY] * 3
    manager.on_schedule_end()  # one batch of three reads
    wait_until(lambda: calls)
    time.sleep(0.05)  # no further calls for this batch
    assert len(calls) == 1 and landed_when_called == [3]  # every chunk was queued before the call
    assert [manager.lookup(key(i), CTX) for i in (0, 1, 2)] == [HIT] * 3
    manager.shutdown()
