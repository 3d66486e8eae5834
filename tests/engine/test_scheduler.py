"""Scheduler and KV cache manager policy, with tiny configs and no model."""

import itertools

from engine.block_pool import BlockPool
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestId, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, check_stop

BS = 4
_seq = itertools.count()


def make_request(rid, num_prompt, max_tokens=8, priority=0, prompt=None, **params):
    return Request(
        request_id=RequestId(rid),
        prompt_token_ids=prompt if prompt is not None else [100 + i for i in range(num_prompt)],
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=frozenset({2}),
        arrival_seq=next(_seq),
        max_total_len=64,
        priority=priority,
    )


def make_scheduler(num_blocks=32, max_tokens=64, max_seqs=8, caching=True, prefill_cap=0, publish_generated=False):
    pool = BlockPool(num_blocks, enable_caching=caching)
    kv = KVCacheManager(pool, BS, enable_caching=caching, publish_generated=publish_generated)
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, max_prefill_tokens_while_decoding=prefill_cap
    )
    return Scheduler(config, kv)


def run_step(sched, token=7):
    out = sched.schedule()
    sampled = [token if s.needs_sample else None for s in out.sequences]
    finished = sched.update(out, sampled)
    return out, finished


def test_prefill_then_decode_and_block_tables():
    sched = make_scheduler()
    req = make_request("a", 6)
    sched.add_request(req)
    out, _ = run_step(sched)
    (seq,) = out.sequences
    assert seq.token_ids == tuple(req.prompt_token_ids) and seq.start_position == 0
    assert seq.needs_sample and len(seq.block_ids) == 2
    out, _ = run_step(sched)
    (seq,) = out.sequences
    assert seq.token_ids == (7,) and seq.start_position == 6
    assert req.num_computed_tokens == 7 and req.output_token_ids == [7, 7]


def test_chunked_prefill_respects_the_token_budget_and_samples_only_at_the_end():
    sched = make_scheduler(max_tokens=4)
    req = make_request("a", 10)
    sched.add_request(req)
    sizes, samples = [], []
    for _ in range(3):
        out, _ = run_step(sched)
        sizes.append(out.num_batched_tokens)
        samples.append(out.sequences[0].needs_sample)
    assert sizes == [4, 4, 2]
    assert samples == [False, False, True]
    assert req.output_token_ids == [7]


def test_running_decodes_come_before_new_prefills():
    sched = make_scheduler(max_tokens=5)
    a = make_request("a", 4)
    sched.add_request(a)
    run_step(sched)
    b = make_request("b", 8)
    sched.add_request(b)
    out, _ = run_step(sched)
    assert [s.request_id for s in out.sequences] == ["a", "b"]
    assert [s.num_tokens for s in out.sequences] == [1, 4]


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 4))
    out, _ = run_step(sched)
    assert [s.request_id for s in out.sequences] == ["a", "b"]
    assert sched.num_waiting == 1


def test_preemption_evicts_the_newest_and_it_resumes_with_its_output():
    sched = make_scheduler(num_blocks=4, max_tokens=64)
    a = make_request("a", 7, max_tokens=20)
    b = make_request("b", 7, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # each holds 2 blocks (7 prompt tokens + room for the 8th)
    run_step(sched)  # both decode into their 8th slot: still 2 blocks each
    out = sched.schedule()  # the 9th token needs a 3rd block each: b (newest) is preempted
    assert out.preempted_request_ids == ("b",)
    assert [s.request_id for s in out.sequences] == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.waiting[0] is b and b.output_token_ids == [7, 7]
    sched.update(out, [7])
    sched.finish_request(RequestId("a"), RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(sched)
    (seq,) = out.sequences
    # Resumed: prompt and earlier output are recomputed (prefix hits shorten it).
    assert seq.request_id == "b"
    assert seq.start_position + seq.num_tokens == 9 and seq.needs_sample


def test_preemption_prefers_the_lowest_priority():
    sched = make_scheduler(num_blocks=4)
    low = make_request("low", 7, priority=5)
    high = make_request("high", 7, priority=0)
    sched.add_request(low)
    sched.add_request(high)
    run_step(sched)
    run_step(sched)
    out = sched.schedule()
    assert out.preempted_request_ids == ("low",)
    assert [s.request_id for s in out.sequences] == ["high"]


def test_prefix_hit_skips_cached_blocks_but_never_the_last_token():
    sched = make_scheduler()
    prompt = list(range(10, 22))  # 12 tokens = 3 full blocks
    a = make_request("a", 0, max_tokens=1, prompt=prompt)
    sched.add_request(a)
    run_step(sched)
    assert a.is_finished
    b = make_request("b", 0, prompt=list(prompt))
    sched.add_request(b)
    out = sched.schedule()
    (seq,) = out.sequences
    # All 3 blocks are cached, but the last token must be recomputed: hit = 2 blocks.
    assert b.num_cached_tokens == 8 and seq.start_position == 8 and seq.num_tokens == 4
    c = make_request("c", 0, prompt=prompt[:8] + [99, 98, 97, 96, 95])
    sched.add_request(c)
    sched.update(out, [7])
    out = sched.schedule()
    assert c.num_cached_tokens == 8


def test_hit_blocks_are_shared_and_reference_counted():
    sched = make_scheduler()
    prompt = list(range(30, 39))  # 9 tokens
    a = make_request("a", 0, prompt=prompt)
    sched.add_request(a)
    run_step(sched)
    b = make_request("b", 0, prompt=list(prompt))
    sched.add_request(b)
    run_step(sched)
    assert a.block_ids[:2] == b.block_ids[:2]
    assert a.block_ids[2] != b.block_ids[2]
    pool = sched.kv.pool
    assert [pool.blocks[i].ref_cnt for i in a.block_ids[:2]] == [2, 2]
    sched.finish_request(RequestId("a"), RequestStatus.FINISHED_ABORTED)
    assert [pool.blocks[i].ref_cnt for i in b.block_ids[:2]] == [1, 1]


def test_abort_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=8)
    a = make_request("a", 9)
    sched.add_request(a)
    run_step(sched)
    assert sched.kv.pool.num_free_blocks == 5
    assert sched.finish_request(RequestId("a"), RequestStatus.FINISHED_ABORTED)
    assert sched.kv.pool.num_free_blocks == 8 and a.block_ids == []
    assert not sched.finish_request(RequestId("a"), RequestStatus.FINISHED_ABORTED)


def test_a_request_finished_while_its_step_ran_is_not_updated():
    sched = make_scheduler()
    a = make_request("a", 4)
    sched.add_request(a)
    out = sched.schedule()
    sched.finish_request(RequestId("a"), RequestStatus.FINISHED_ABORTED)
    assert sched.update(out, [7]) == [] and a.output_token_ids == []


def test_finishes_on_eos_max_tokens_and_context_limit():
    sched = make_scheduler()
    a = make_request("a", 4, max_tokens=3)
    sched.add_request(a)
    _, fin = run_step(sched, token=2)
    assert [(f.request_id, f.status) for f in fin] == [("a", RequestStatus.FINISHED_STOPPED)]
    b = make_request("b", 4, max_tokens=2)
    sched.add_request(b)
    run_step(sched)
    _, fin = run_step(sched)
    assert fin[0].status == RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 2


def test_check_stop_rules():
    r = make_request("r", 4, max_tokens=10, min_tokens=2)
    r.append_output_token(2)
    assert check_stop(r, 2) is None  # below min_tokens
    r.append_output_token(2)
    assert check_stop(r, 2) == RequestStatus.FINISHED_STOPPED
    ign = make_request("i", 4, max_tokens=10, ignore_eos=True)
    ign.append_output_token(2)
    assert check_stop(ign, 2) is None
    stop_id = make_request("s", 4, max_tokens=10, stop_token_ids=[9])
    stop_id.append_output_token(9)
    assert check_stop(stop_id, 9) == RequestStatus.FINISHED_STOPPED
    ctx = make_request("c", 63, max_tokens=None)
    ctx.append_output_token(5)
    assert check_stop(ctx, 5) == RequestStatus.FINISHED_LENGTH


def test_eviction_reports_removed_blocks_to_the_event_hooks():
    sched = make_scheduler(num_blocks=3)
    a = make_request("a", 0, max_tokens=1, prompt=list(range(8)))  # 2 full blocks + 1 slot
    sched.add_request(a)
    run_step(sched)
    events = sched.take_kv_events()
    assert len(events) == 1 and len(events[0].block_hashes) == 2
    b = make_request("b", 0, max_tokens=1, prompt=list(range(50, 61)))
    sched.add_request(b)
    run_step(sched)
    kinds = [type(e).__name__ for e in sched.take_kv_events()]
    assert kinds.count("BlockRemoved") == 2


def start_decoding(sched, n, prompt_len=3):
    """n requests past their prefill, decoding one token per step."""
    reqs = [make_request(f"d{i}", prompt_len, max_tokens=1000) for i in range(n)]
    for r in reqs:
        sched.add_request(r)
    while any(r.num_output_tokens == 0 for r in reqs):
        run_step(sched)
    return reqs


def test_a_new_request_is_scheduled_in_the_step_after_its_arrival_while_32_requests_decode():
    sched = make_scheduler(num_blocks=512, max_tokens=2048, max_seqs=64, prefill_cap=512)
    decoding = start_decoding(sched, 32)
    new = make_request("new", 40)
    sched.add_request(new)
    out, _ = run_step(sched)
    by_id = {s.request_id: s for s in out.sequences}
    assert all(by_id[r.request_id].num_tokens == 1 for r in decoding)
    assert by_id["new"].num_tokens == 40 and by_id["new"].needs_sample
    assert new.num_output_tokens == 1  # its first token comes out of that very step


def test_prefill_is_capped_while_requests_decode_and_the_decodes_run_every_step():
    sched = make_scheduler(num_blocks=128, max_tokens=64, max_seqs=16, prefill_cap=8)
    decoding = start_decoding(sched, 2)
    a, b = make_request("a", 20), make_request("b", 0, prompt=[500 + i for i in range(6)])
    sched.add_request(a)
    sched.add_request(b)
    chunks = []
    while b.num_output_tokens == 0:
        out, _ = run_step(sched)
        assert {r.request_id for r in decoding} <= {s.request_id for s in out.sequences}
        chunks.append([(s.request_id, s.num_tokens) for s in out.sequences if s.request_id in ("a", "b")])
    # 8 prefill tokens a step, first come first served: a in 8 + 8 + 4, then b starts.
    assert chunks == [[("a", 8)], [("a", 8)], [("a", 4), ("b", 4)], [("a", 1), ("b", 2)]]


def test_without_decodes_a_prompt_takes_the_whole_step_budget():
    sched = make_scheduler(num_blocks=64, max_tokens=64, prefill_cap=8)
    a = make_request("a", 40)
    sched.add_request(a)
    out, _ = run_step(sched)
    assert out.num_batched_tokens == 40 and a.num_output_tokens == 1


def test_a_zero_cap_leaves_only_the_step_budget():
    sched = make_scheduler(num_blocks=128, max_tokens=64, max_seqs=16, prefill_cap=0)
    start_decoding(sched, 2)
    a = make_request("a", 40)
    sched.add_request(a)
    out, _ = run_step(sched)
    assert out.num_batched_tokens == 42 and a.num_output_tokens == 1


def test_a_resumed_preempted_request_counts_as_prefill_until_it_has_caught_up():
    sched = make_scheduler(num_blocks=4, max_tokens=64, prefill_cap=8)
    a = make_request("a", 7, max_tokens=20)
    b = make_request("b", 7, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    run_step(sched)
    out, _ = run_step(sched)  # b is preempted for a's third block
    assert out.preempted_request_ids == ("b",)
    sched.finish_request(RequestId("a"), RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(sched)
    (seq,) = out.sequences
    # No request decodes, so b recomputes its 9 tokens (8 cached) in one step, uncapped.
    assert seq.request_id == "b" and seq.start_position + seq.num_tokens == 9 and seq.needs_sample


def test_token_ids_between_is_the_slice_of_all_token_ids():
    request = make_request("r", 5, prompt=[10, 11, 12, 13, 14])
    request.output_token_ids.extend([20, 21, 22])
    for start, end in [(0, 5), (2, 5), (5, 7), (6, 7), (3, 8), (0, 8), (4, 4)]:
        assert request.token_ids_between(start, end) == request.all_token_ids[start:end]


def test_a_decode_that_fills_a_block_publishes_it_without_a_new_block():
    """allocate_slots' fast path (no new block) must still publish the block the step completes (where blocks of
    generated tokens are published: the batch-invariant mode)."""
    sched = make_scheduler(num_blocks=8, publish_generated=True)
    request = make_request("r", 2 * BS - 2, max_tokens=4)
    sched.add_request(request)
    run_step(sched)  # the prompt: two blocks, the second with two free slots
    run_step(sched)  # a decode at position 2 BS - 2
    assert sched.kv.pool.num_free_blocks == 8 - 2
    assert sched.kv.pool.get_cached_block(request.block_hashes[0]) is not None
    # The second block's tokens are all known (its hash exists), but its last slot's K/V is not computed yet.
    assert len(request.block_hashes) == 2 and sched.kv.pool.get_cached_block(request.block_hashes[1]) is None
    run_step(sched)  # the decode at position 2 BS - 1 completes the second block
    assert sched.kv.pool.num_free_blocks == 8 - 2
    assert sched.kv.pool.get_cached_block(request.block_hashes[1]) is not None


def test_only_generated_tokens_are_scheduled_as_decodes():
    """A prompt's last token computed alone (a full prefix-cache hit, a one-token chunk) is still a prompt row:
    the worker's decode paths sum in another order, so it must not take them."""
    sched = make_scheduler()
    first = make_request("a", 9, max_tokens=2)
    sched.add_request(first)
    out, _ = run_step(sched)
    assert [s.is_decode for s in out.sequences] == [False]
    out, _ = run_step(sched)
    assert [(s.num_tokens, s.is_decode) for s in out.sequences] == [(1, True)]
    hit = make_request("b", 9, max_tokens=2, prompt=first.prompt_token_ids)
    sched.add_request(hit)
    out, _ = run_step(sched)
    (seq,) = out.sequences
    assert (seq.start_position, seq.num_tokens, seq.is_decode) == (8, 1, False)  # 8 cached, the last computed


def test_blocks_of_generated_tokens_join_the_prefix_cache_only_when_published_on_request():
    for publish_generated, hit_tokens in ((False, 8), (True, 12)):
        pool = BlockPool(32, enable_caching=True)
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64),
                          KVCacheManager(pool, BS, publish_generated=publish_generated))
        first = make_request("a", 9, max_tokens=5)
        sched.add_request(first)
        while sched.has_unfinished():
            run_step(sched)
        # The next turn: the prompt, the reply (blocks 3 and 4 hold generated tokens), a new message.
        turn = make_request("b", 0, prompt=first.prompt_token_ids + first.output_token_ids + [300, 301, 302])
        sched.add_request(turn)
        run_step(sched)
        assert turn.num_cached_tokens == hit_tokens
