"""The asyncio engine: streaming deltas, cancellation frees blocks, the loop never stalls."""

from __future__ import annotations

import asyncio
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

    await asyncio.gather(probe(), load())
    assert worst < 0.2, f"the loop stalled for {worst:.3f} s"


async def test_health_reports_progress(engine):
    assert engine.is_making_progress(deadline_s=5.0)
    await engine.shutdown()
    assert not engine.is_making_progress(deadline_s=5.0)
