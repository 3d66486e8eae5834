"""The asyncio engine: streaming deltas, cancellation frees blocks, the loop never stalls."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.core import EngineCore
from engine.errors import InvalidRequestError
from engine.request import SamplingParams


@pytest.fixture
async def engine(smollm_fp32, engine_config):
    eng = AsyncEngine(EngineCore(engine_config, smollm_fp32))
    eng.start()
    yield eng
    await eng.shutdown()


def chat_text(engine, text):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


async def test_streamed_deltas_add_up_to_the_offline_result(engine, make_llm):
    prompt = chat_text(engine, "Name three fruits.")
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens, text, finish = [], "", None
    async for out in engine.generate(prompt, params):
        tokens += out.new_token_ids
        text += out.text
        finish = out.finish_reason
    (offline,) = make_llm().generate([engine.tokenizer.encode(prompt)], params)
    assert tokens == offline.samples[0].token_ids and text == offline.samples[0].text
    assert finish == "length"


async def test_concurrent_requests_all_complete(engine):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def run(i):
        n = 0
        async for out in engine.generate(chat_text(engine, f"Count to {i}"), params):
            n += len(out.new_token_ids)
        return n

    assert await asyncio.gather(*(run(i) for i in range(6))) == [8] * 6


async def test_cancelling_the_consumer_aborts_and_frees_blocks(engine):
    free_before = engine.core.pool.num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def consume():
        async for _ in engine.generate(chat_text(engine, "Write a long story."), params):
            pass

    task = asyncio.create_task(consume())
    while engine.num_steps < 3:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not engine.core.has_unfinished()
    assert engine.core.pool.num_free_blocks == free_before


async def test_bad_input_raises_before_streaming_and_the_engine_keeps_serving(engine):
    with pytest.raises(InvalidRequestError):
        async for _ in engine.generate([], SamplingParams()):
            pass
    outs = [o async for o in engine.generate("Hi", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))]
    assert sum(len(o.new_token_ids) for o in outs) == 2


async def test_the_event_loop_never_stalls_during_forward_passes(engine):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    done = asyncio.Event()
    worst = 0.0
    # The whole test session's objects (dozens of models' worth) out of the collector's sight. Late in the full
    # suite this probe saw the loop stall 0.24-0.27 s (never when run alone); a full collection over that heap
    # is the suspected cause, not confirmed. The engine's own garbage is still collected, and a forward pass
    # run on the loop would still stall it far past the limit.
    gc.collect()
    gc.freeze()

    async def probe():
        nonlocal worst
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0)
            worst = max(worst, time.perf_counter() - t)

    async def load():
        async def one(i):
            async for _ in engine.generate(chat_text(engine, "Tell me about " + "bees " * (40 * i)), params):
                pass
        await asyncio.gather(*(one(i) for i in range(4)))
        done.set()

    try:
        await asyncio.gather(probe(), load())
    finally:
        gc.unfreeze()
    assert worst < 0.2, f"the loop stalled for {worst:.3f} s"


async def test_health_reports_progress(engine):
    assert engine.is_making_progress(deadline_s=5.0)
    await engine.shutdown()
    assert not engine.is_making_progress(deadline_s=5.0)


def _record_steps(core):
    """Wrap the worker so each executed step is recorded as (decodes, prefill chunks)."""
    steps = []
    execute = core.worker.execute

    def spy(batch):
        seqs = batch.scheduler_output.sequences
        decodes = sum(1 for s in seqs if s.num_tokens == 1 and s.start_position > 0)
        chunks = [(s.start_position, s.num_tokens) for s in seqs if not (s.num_tokens == 1 and s.start_position > 0)]
        steps.append((decodes, chunks))
        return execute(batch)

    core.worker.execute = spy
    return steps


def test_warm_up_runs_every_kind_of_step_and_leaves_no_trace(smollm_fp32, engine_config):
    from dataclasses import replace

    core = EngineCore(replace(engine_config, enable_kv_events=True), smollm_fp32)
    steps = _record_steps(core)
    free = core.pool.num_free_blocks
    assert core.warm_up() == len(steps)
    assert any(chunks and start == 0 for _, chunks in steps for start, _ in chunks)  # a fresh prefill
    assert any(start > 0 for _, chunks in steps for start, _ in chunks)  # a chunk over a cached prefix
    assert any(d and chunks for d, chunks in steps)  # decodes and a prefill in one step
    pure_decode_sizes = {d for d, chunks in steps if not chunks}
    assert set(range(1, 9)) <= pure_decode_sizes
    # Nothing is left over: no request, no block, no cached prefix, no event, no counter.
    assert not core.has_unfinished() and core.pool.num_free_blocks == free
    assert core.take_kv_events() == []
    assert core.kv.num_queried_tokens == core.kv.num_hit_tokens == core.scheduler.num_preemptions == 0
    words = core.tokenizer.encode(" zenserve warm-up" * 64, add_special_tokens=False)
    core.add_request("after", words[:80], SamplingParams(temperature=0.0, max_tokens=1))
    (out,) = core.step()
    assert out.num_cached_tokens == 0


def test_warm_up_passes_a_small_max_waiting_which_still_holds_afterwards(smollm_fp32, engine_config):
    from dataclasses import replace

    from engine.errors import QueueFullError

    # Warm-up queues 8 requests at once; a server started with --max-waiting 2 must still start.
    config = replace(engine_config, scheduler=replace(engine_config.scheduler, max_waiting=2))
    core = EngineCore(config, smollm_fp32)
    assert core.warm_up() > 0
    params = SamplingParams(temperature=0.0, max_tokens=1)
    core.add_request("a", [1, 2, 3], params)
    core.add_request("b", [1, 2, 3], params)
    with pytest.raises(QueueFullError):
        core.add_request("c", [1, 2, 3], params)


async def test_create_warms_up_on_the_compute_thread_before_serving(smollm_fp32, engine_config, monkeypatch):
    import threading

    seen = {}
    warm_up = EngineCore.warm_up

    def spy(self, *args, **kwargs):
        seen["thread"] = threading.current_thread().name
        return warm_up(self, *args, **kwargs)

    monkeypatch.setattr(EngineCore, "warm_up", spy)
    engine = await AsyncEngine.create(engine_config, loaded=smollm_fp32)
    try:
        assert seen["thread"].startswith("zenserve-worker")  # the one thread that runs forward passes
        outs = [o async for o in engine.generate("Hi", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))]
        assert sum(len(o.new_token_ids) for o in outs) == 2
    finally:
        await engine.shutdown()
    seen.clear()
    engine = await AsyncEngine.create(engine_config, loaded=smollm_fp32, warm_up=False)
    await engine.shutdown()
    assert seen == {}


async def test_the_next_step_is_launched_before_a_steps_outputs_reach_the_consumer(engine, monkeypatch):
    """The next step is scheduled and handed to the worker thread before a step's deltas go out: each
    delta but the last arrives once the step after it has been launched."""
    core = engine.core
    prepare_step = core.prepare_step
    launched = 0

    def counting_prepare_step():
        nonlocal launched
        batch = prepare_step()
        launched += batch is not None
        return batch

    monkeypatch.setattr(core, "prepare_step", counting_prepare_step)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    seen = []  # (tokens received so far, steps launched by then)
    received = 0
    async for out in engine.generate(chat_text(engine, "Count to ten."), params):
        received += len(out.new_token_ids)
        seen.append((received, launched))
    assert received == 6
    # Step k yields token k; when token k < 6 arrives, step k + 1 is already on the worker thread.
    assert all(steps >= tokens + 1 for tokens, steps in seen if tokens < 6), seen
