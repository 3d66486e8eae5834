"""The offloading connector with a real CPU tier, block pool and scheduler, and a fake model
whose KV rows are a known function of (token, position), so loaded bytes can be checked."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from engine.block_pool import BlockPool
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import BlockStored
from engine.offload.connector import OffloadingConnector
from engine.offload.events_tracker import OffloadingEventsTracker
from engine.offload.group import GroupOffloadConfig
from engine.offload.transfer import KVHostBuffer
from engine.request import Request, RequestId, RequestStatus, SamplingParams
from engine.scheduler import Scheduler
from kvtier.base import MEDIUM_CPU, LookupResult, ReqContext, make_offload_key
from kvtier.cpu_tier import CPUOffloadingManager

BS = 4
_seq = itertools.count()


class Rig:
    """A scheduler + connector over fake KV tensors: 2 layers, 1 KV head, head dim 2."""

    def __init__(self, num_blocks=16, blocks_per_chunk=1, cpu_chunks=8, deadline_s=10.0,
                 prompt_only=True, manager=None, events=True, budget=64):
        self.pool = BlockPool(num_blocks, True, True)
        self.kv = KVCacheManager(self.pool, BS, True, compute_hashes=True)
        self.kv_caches = [(torch.zeros(num_blocks * BS, 1, 2), torch.zeros(num_blocks * BS, 1, 2)) for _ in range(2)]
        self.group = GroupOffloadConfig(0, BS, blocks_per_chunk)
        self.manager = manager or CPUOffloadingManager(cpu_chunks)
        self.host = KVHostBuffer(cpu_chunks, 2, BS * blocks_per_chunk, 1, 2, torch.float32)
        self.connector = OffloadingConnector(
            self.manager, self.host, self.group, self.pool, self.kv_caches,
            offload_prompt_only=prompt_only, lookup_deadline_s=deadline_s,
            events=OffloadingEventsTracker(events),
        )
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), self.kv,
                                   connector=self.connector)
        self.computed_positions: dict[str, list[int]] = {}

    def add(self, prompt, max_tokens=2, rid=None, **kw) -> Request:
        req = Request(RequestId(rid or f"r{next(_seq)}"), list(prompt), SamplingParams(max_tokens=max_tokens),
                      frozenset({2}), next(_seq), 1000, **kw)
        self.scheduler.add_request(req)
        return req

    def step(self):
        out = self.scheduler.schedule()
        sampled = []
        for seq in out.sequences:
            for i, tok in enumerate(seq.token_ids):
                pos = seq.start_position + i
                slot = seq.block_ids[pos // BS] * BS + pos % BS
                for layer, (k, v) in enumerate(self.kv_caches):
                    k[slot] = _kv_value(tok, pos, layer)
                    v[slot] = -_kv_value(tok, pos, layer)
                self.computed_positions.setdefault(seq.request_id, []).append(pos)
            sampled.append(7 if seq.needs_sample else None)
        self.scheduler.update(out, sampled)
        return out

    def run(self, max_steps=50):
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished() and not self.connector.has_pending_work():
                return
            self.step()
            self.connector.flush()
        raise AssertionError("did not finish")

    def kv_rows(self, req: Request, positions) -> torch.Tensor:
        slots = [req.block_ids[p // BS] * BS + p % BS for p in positions]
        return torch.stack([k[slots] for k, _ in self.kv_caches])

    def evict_engine_cache(self):
        assert self.kv.reset_prefix_cache()


def _kv_value(token: int, position: int, layer: int) -> torch.Tensor:
    return torch.tensor([[token * 1000.0 + position, layer + 0.5]])


def expected_rows(tokens, positions):
    return torch.stack([torch.stack([_kv_value(tokens[p], p, layer) for p in positions]) for layer in range(2)])


PROMPT = list(range(10, 23))  # 13 tokens: 3 full blocks, the last token never loaded


def test_prompt_chunks_are_stored_after_prefill_with_their_bytes():
    rig = Rig()
    req = rig.add(PROMPT, max_tokens=1)
    rig.run()
    keys = [make_offload_key(req.block_hashes[i], 0) for i in range(3)]
    assert all(rig.manager.lookup(k, None) is LookupResult.HIT for k in keys)
    slot = rig.manager.slot_of(keys[1])
    assert torch.equal(rig.host.data[slot, 1, 0].flatten(0, -1)[::2],
                       torch.tensor([PROMPT[p] * 1000.0 + p for p in range(4, 8)]))
    assert rig.connector.stats.stores == 1 and rig.connector.stats.stored_bytes == 3 * rig.host.bytes_per_chunk


def test_a_prefix_evicted_from_the_engine_is_loaded_from_the_cpu_tier():
    rig = Rig()
    rig.add(PROMPT, max_tokens=1)
    rig.run()
    rig.evict_engine_cache()
    req = rig.add(PROMPT, max_tokens=3)
    out = rig.scheduler.schedule()
    assert out.is_empty and req.status == RequestStatus.WAITING_FOR_KV
    rig.connector.flush()
    rig.step()  # the load landed: only the last token is computed
    assert rig.computed_positions[req.request_id] == [12]
    assert req.num_cached_tokens == 12
    assert torch.equal(rig.kv_rows(req, range(12)), expected_rows(PROMPT, range(12)))
    assert rig.connector.stats.loads == 1 and rig.connector.stats.lookup_hit_chunks == 3


def test_chunks_of_two_blocks_load_past_a_partial_engine_hit():
    rig = Rig(blocks_per_chunk=2)
    prompt = list(range(30, 47))  # 17 tokens: chunks [0,8) and [8,16)
    rig.add(prompt, max_tokens=1)
    rig.run()
    rig.evict_engine_cache()
    # Re-populate only the engine's first block, so the engine hit ends inside chunk 0.
    warm = rig.add(prompt[:5], max_tokens=1)
    rig.run()
    assert warm.is_finished
    req = rig.add(prompt, max_tokens=3)
    rig.scheduler.schedule()
    assert req.status == RequestStatus.WAITING_FOR_KV and req.num_computed_tokens == 4
    rig.connector.flush()
    rig.step()
    assert rig.computed_positions[req.request_id] == [16]
    assert torch.equal(rig.kv_rows(req, range(16)), expected_rows(prompt, range(16)))


def test_max_offload_tokens_caps_and_zero_disables_stores():
    rig = Rig()
    capped = rig.add(PROMPT, max_tokens=1, max_offload_tokens=5)
    rig.run()
    assert rig.manager.num_used_slots == 1  # only the first whole chunk fits in 5 tokens
    rig2 = Rig()
    rig2.add(PROMPT, max_tokens=1, max_offload_tokens=0)
    rig2.run()
    assert rig2.manager.num_used_slots == 0
    assert rig2.connector.take_events() == [] and not rig2.connector.events._pending_event_metadata
    assert capped.is_finished


def test_decode_chunks_are_stored_only_when_prompt_only_is_off():
    rig = Rig(prompt_only=True)
    rig.add(list(range(10, 18)), max_tokens=6)  # 8 prompt + 6 out: a third block fills in decode
    rig.run()
    assert rig.manager.num_used_slots == 2
    rig = Rig(prompt_only=False)
    rig.add(list(range(10, 18)), max_tokens=6)
    rig.run()
    assert rig.manager.num_used_slots == 3


def test_stored_and_loaded_chunks_produce_self_describing_cpu_events():
    rig = Rig()
    req = rig.add(PROMPT, max_tokens=1)
    rig.run()
    events = [e for e in rig.scheduler.take_kv_events() if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
    assert [e.block_hashes for e in events] == [(h,) for h in req.block_hashes[:3]]
    assert events[0].token_ids == tuple(PROMPT[:4]) and events[2].parent_block_hash == req.block_hashes[1]


def test_abort_while_loading_keeps_the_blocks_fenced_until_the_copy_lands():
    rig = Rig()
    rig.add(PROMPT, max_tokens=1)
    rig.run()
    rig.evict_engine_cache()
    req = rig.add(PROMPT, max_tokens=1)
    rig.scheduler.schedule()
    block_ids = list(req.block_ids)
    assert rig.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED)
    loaded_blocks = block_ids[:3]
    assert all(rig.pool.blocks[b].ref_cnt == 1 for b in loaded_blocks)  # the load's fence
    assert all(b not in rig.pool.free_block_ids() for b in loaded_blocks)
    rig.connector.flush()
    rig.scheduler.schedule()
    assert all(rig.pool.blocks[b].ref_cnt == 0 for b in loaded_blocks)
    assert not rig.scheduler.has_unfinished()


def test_two_requests_loading_the_same_prefix_both_complete():
    rig = Rig()
    rig.add(PROMPT, max_tokens=1)
    rig.run()
    rig.evict_engine_cache()
    a = rig.add(PROMPT, max_tokens=1)
    b = rig.add(PROMPT, max_tokens=1)
    rig.scheduler.schedule()
    assert a.status == b.status == RequestStatus.WAITING_FOR_KV
    rig.run()
    assert a.is_finished and b.is_finished and a.num_cached_tokens == b.num_cached_tokens == 12
    assert rig.connector.stats.loads == 2


def test_store_fence_keeps_source_blocks_until_the_store_completes():
    rig = Rig()
    release = threading.Event()
    real_store = rig.host.store

    def held_store(*args):
        release.wait(5)  # the copy is "in flight" until the test lets it finish
        return real_store(*args)

    rig.host.store = held_store
    req = rig.add(PROMPT, max_tokens=2)
    rig.step()  # prefill: the store job for 3 chunks is submitted and held
    blocks = list(req.block_ids[:3])
    rig.step()  # the request finishes and frees its blocks
    assert req.is_finished and rig.connector.transfer.num_in_flight == 1
    assert [rig.pool.blocks[b].ref_cnt for b in blocks] == [1, 1, 1]  # the store's fence
    assert not set(blocks) & set(rig.pool.free_block_ids())
    release.set()
    rig.connector.flush()
    rig.scheduler.schedule()
    assert [rig.pool.blocks[b].ref_cnt for b in blocks] == [0, 0, 0]
    assert set(blocks) <= set(rig.pool.free_block_ids())


class _AlwaysPending(CPUOffloadingManager):
    def lookup(self, key, ctx):
        return LookupResult.HIT_PENDING


def test_a_pending_lookup_defers_then_gives_up_after_the_deadline():
    rig = Rig(manager=_AlwaysPending(8), deadline_s=0.05)
    req = rig.add(PROMPT, max_tokens=1)
    assert rig.scheduler.schedule().is_empty and req.status == RequestStatus.WAITING
    time.sleep(0.1)
    out = rig.scheduler.schedule()  # past the deadline: recompute instead of waiting on
    assert [s.request_id for s in out.sequences] == [req.request_id] and out.sequences[0].start_position == 0
    assert req.status == RequestStatus.RUNNING and rig.connector.stats.deadline_expired == 1


def test_a_deferred_request_does_not_block_others():
    rig = Rig(manager=_AlwaysPending(8))
    deferred = rig.add(PROMPT, max_tokens=1)
    short = rig.add([5, 6, 7], max_tokens=1)  # no full chunk: no lookup
    out = rig.scheduler.schedule()
    assert [s.request_id for s in out.sequences] == [short.request_id]
    assert rig.scheduler.waiting[0] is deferred


def test_reset_flushes_loads_in_flight_then_clears_the_tier():
    rig = Rig()
    rig.add(PROMPT, max_tokens=1)
    rig.run()
    rig.evict_engine_cache()
    req = rig.add(PROMPT, max_tokens=1)
    rig.scheduler.schedule()
    assert req.status == RequestStatus.WAITING_FOR_KV
    rig.connector.flush()
    rig.scheduler.finish_loads_now()
    assert req.status == RequestStatus.WAITING
    rig.run()
    assert rig.kv.reset_prefix_cache()
    rig.connector.reset()
    assert rig.manager.num_used_slots == 0


class _Scripted(CPUOffloadingManager):
    def __init__(self, results):
        super().__init__(8)
        self.results = results
        self.calls = 0

    def lookup(self, key, ctx):
        self.calls += 1
        return self.results.get(key[:1], LookupResult.MISS)


class _RecordingTracker(OffloadingEventsTracker):
    def __init__(self):
        super().__init__(True)
        self.calls = []

    def record_lookup(self, req, group, chunk_idx, key):
        self.calls.append((chunk_idx, key))


def _lookup(results: dict[int, LookupResult], n: int, start: int = 0):
    manager = _Scripted({bytes([k]): v for k, v in results.items()})
    rig = Rig(manager=manager)
    tracker = _RecordingTracker()
    rig.connector.events = tracker
    keys = [make_offload_key(bytes([i + 1]) * 32, 0) for i in range(n)]
    req = Request(RequestId("q"), [1] * 64, SamplingParams(), frozenset({2}), 0, 100)
    got, pending = rig.connector._maximal_prefix_lookup(keys, None, req, start)
    assert (got is None) == (pending is not None)
    return got, manager.calls, [(c, k) for c, k in tracker.calls], keys


H, P, R, M = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS


@pytest.mark.parametrize(
    ("results", "n", "expected", "calls"),
    [
        ({1: H, 2: H}, 2, 2, 2),  # all hit
        ({}, 2, 0, 1),  # all miss: the first MISS stops
        ({1: H, 2: H}, 3, 2, 3),  # partial prefix
        ({2: H}, 2, 0, 1),  # miss then hit
        ({1: H}, 1, 1, 1),
        ({}, 0, 0, 0),  # empty
        ({1: R, 2: H}, 2, None, 2),  # retry defers
        ({1: H, 2: R}, 2, None, 2),  # retry after a hit defers
        ({1: P, 2: H}, 2, None, 2),  # pending defers
        ({1: P, 2: M, 3: H}, 3, None, 2),  # pending does not stop the scan; a miss does
        ({1: R, 2: M, 3: H}, 3, None, 2),
    ],
)
def test_maximal_prefix_lookup(results, n, expected, calls):
    got, num_calls, _, _ = _lookup(results, n)
    assert got == expected and num_calls == calls


def test_a_deferred_lookup_names_the_last_key_it_waits_on():
    manager = _Scripted({bytes([1]): P, bytes([2]): H, bytes([3]): R, bytes([4]): H})
    keys = [make_offload_key(bytes([i + 1]) * 32, 0) for i in range(4)]
    req = Request(RequestId("q"), [1] * 64, SamplingParams(), frozenset({2}), 0, 100)
    assert Rig(manager=manager).connector._maximal_prefix_lookup(keys, None, req, 0, record=False) == (None, keys[2])


class _Counting(CPUOffloadingManager):
    def __init__(self, num_slots):
        super().__init__(num_slots)
        self.calls = 0

    def lookup(self, key, ctx):
        self.calls += 1
        return super().lookup(key, ctx)


def test_a_deferred_request_is_looked_up_again_only_once_what_it_waits_on_is_done():
    manager = _Counting(8)
    rig = Rig(manager=manager)
    req = rig.add(PROMPT, max_tokens=1)
    rig.kv.update_block_hashes(req)
    keys = [make_offload_key(req.block_hashes[i], 0) for i in range(3)]
    ctx = ReqContext("elsewhere")
    manager.prepare_store(keys[:2], ctx)  # two chunks on their way into the tier (write pending)
    assert rig.scheduler.schedule().is_empty and req.status == RequestStatus.WAITING
    scanned = manager.calls
    assert scanned == 3  # pending, pending, miss: deferred on the second chunk
    for _ in range(3):
        assert rig.scheduler.schedule().is_empty
    assert manager.calls == scanned  # nothing it waits on is done: no chunk was looked up again
    manager.complete_store(keys[:1], ctx)
    assert rig.scheduler.schedule().is_empty and manager.calls == scanned  # still waiting on the second
    manager.complete_store(keys[1:2], ctx)
    rig.scheduler.schedule()
    assert manager.calls > scanned and req.status == RequestStatus.WAITING_FOR_KV
    assert rig.connector.stats.lookup_hit_chunks == 2
    rig.connector.flush()
    rig.scheduler.finish_loads_now()


def test_lookup_records_absolute_chunk_indices_for_hits_only():
    _, _, recorded, keys = _lookup({1: H, 2: H}, 2, start=3)
    assert recorded == [(3, keys[0]), (4, keys[1])]
    _, _, recorded, keys = _lookup({1: R, 2: H}, 2)
    assert recorded == [(1, keys[1])]
    _, _, recorded, _ = _lookup({1: P}, 1)
    assert recorded == []
    _, _, recorded, _ = _lookup({}, 2)
    assert recorded == []


def test_a_failed_load_falls_back_to_recompute():
    rig = Rig()
    rig.add(PROMPT, max_tokens=1)
    rig.run()
    rig.evict_engine_cache()

    def broken(*args):
        raise OSError("simulated copy failure")

    rig.host.load = broken
    req = rig.add(PROMPT, max_tokens=3)
    rig.scheduler.schedule()
    assert req.status == RequestStatus.WAITING_FOR_KV
    rig.connector.flush()
    rig.step()
    assert rig.connector.stats.load_failures == 1
    assert rig.computed_positions[req.request_id] == list(range(13))  # everything recomputed
    assert torch.equal(rig.kv_rows(req, range(13)), expected_rows(PROMPT, range(13)))


def test_a_preempted_request_resumes_from_the_cpu_tier():
    rig = Rig(num_blocks=8, budget=64)
    a = rig.add(list(range(100, 113)), max_tokens=12)  # 13 prompt tokens: 4 blocks soon
    b = rig.add(list(range(200, 213)), max_tokens=12)
    for _ in range(6):
        rig.step()
        rig.connector.flush()
    assert rig.scheduler.num_preemptions >= 1
    rig.run(max_steps=200)
    assert a.is_finished and b.is_finished
    # b was preempted after computing positions 0..15; it resumed at 12 (its three full prompt
    # blocks came back as cached KV), not from 0, and finished with the same number of tokens.
    positions = rig.computed_positions[b.request_id]
    assert b.num_preemptions == 1 and positions[:16] == list(range(16)) and positions[16] == 12
    assert b.num_output_tokens == 12
