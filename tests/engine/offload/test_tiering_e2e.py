"""End to end on the embedded model with secondary tiers: a prefix evicted from the engine cache and
from a small CPU tier is promoted back from the filesystem tier (the async engine, tier I/O on
its loop); a fresh engine (another replica)
pointing at the same directory or bucket serves a prefix the first one computed. Output is
identical to a run without offloading."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import replace

import pytest

from engine.async_engine import AsyncEngine
from engine.config import CacheConfig
from engine.core import EngineCore
from engine.llm import LLM
from engine.request import SamplingParams
from kvtier.config import parse_offloading_config
from kvtier.secondary_tier import TierStartupError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _prompt(llm: LLM | EngineCore, topic: str, words: int) -> list[int]:
    text = f"Here are some notes about {topic}: " + " ".join(f"{topic}-{i}" for i in range(words))
    return llm.tokenizer.encode(text + "\nSummarise them.")


@pytest.fixture(scope="module")
def small_config(smollm_fp32, engine_config):
    bytes_per_block = 2 * 16 * 3 * 64 * 4 * smollm_fp32.arch.num_hidden_layers
    return replace(engine_config, cache=CacheConfig(kv_cache_memory_bytes=24 * bytes_per_block, kv_cache_dtype="model")), bytes_per_block


@pytest.fixture(scope="module")
def shared_and_reference(smollm_fp32, small_config):
    config, _ = small_config
    plain = LLM(config=config, loaded=smollm_fp32)
    shared = _prompt(plain, "rivers", 70)  # ~ 300 tokens: 18 full chunks of 16
    (reference,) = plain.generate([shared], GREEDY)
    return shared, reference.samples[0].token_ids


def _tiered(smollm_fp32, small_config, num_cpu_chunks: int, tier: dict) -> LLM:
    config, bytes_per_block = small_config
    offload = parse_offloading_config({"cpu_bytes_to_use": num_cpu_chunks * bytes_per_block, "secondary_tiers": [tier]})
    return LLM(config=replace(config, offload=offload), loaded=smollm_fp32)


def _wait_for_demotions(llm: LLM, timeout_s: float = 20.0) -> None:
    manager = llm.engine.connector.manager
    deadline = time.monotonic() + timeout_s
    while manager.pending_demotion_bytes:
        assert time.monotonic() < deadline, "demotions did not finish"
        time.sleep(0.01)


async def test_the_async_engine_serves_an_evicted_prefix_from_the_fs_tier_without_stalling_its_loop(
    smollm_fp32, small_config, shared_and_reference, tmp_path
):
    shared, reference = shared_and_reference
    config, bytes_per_block = small_config
    offload = parse_offloading_config({
        "cpu_bytes_to_use": 24 * bytes_per_block,
        "secondary_tiers": [{"type": "fs", "path": str(tmp_path), "capacity_bytes": "256M"}],
    })
    loop = asyncio.get_running_loop()
    # The tiers do their I/O on this loop (as under the server); the core is built on a thread.
    core = await asyncio.to_thread(EngineCore, replace(config, offload=offload), smollm_fp32, loop)
    engine = AsyncEngine(core)
    engine.start()
    worst = 0.0
    done = asyncio.Event()

    async def ticker():
        # NOTE: 10 ms ticks, not a sleep(0) spin: a spinning loop would take the GIL from the
        # forward pass and slow the whole test down. A stall shows as a late tick all the same.
        nonlocal worst
        while not done.is_set():
            started = time.perf_counter()
            await asyncio.sleep(0.01)
            worst = max(worst, time.perf_counter() - started - 0.01)

    async def generate(prompt):
        token_ids, last = [], None
        async for out in engine.generate(prompt, GREEDY):
            token_ids += out.new_token_ids
            last = out
        return token_ids, last.num_cached_tokens

    tick = asyncio.create_task(ticker())
    try:
        await generate(shared)
        for topic in ("mountains", "deserts"):  # 36 more chunks through 24 CPU slots and 24 engine blocks
            await generate(_prompt(core, topic, 70))
        manager = core.connector.manager
        while manager.pending_demotion_bytes:
            await asyncio.sleep(0.01)
        num_chunks = (len(shared) - 1) // 16
        assert manager.stats()["0:fs"].extra["demotions"] >= num_chunks

        token_ids, num_cached_tokens = await generate(shared)
        assert token_ids == reference
        assert num_cached_tokens == num_chunks * 16  # every full block but the last token
        assert manager.stats()["0:fs"].extra["promotions"] == num_chunks
    finally:
        done.set()
        await tick
        await engine.shutdown()
    assert worst < 0.2, f"the event loop stalled for {worst:.3f} s"


@pytest.mark.parametrize("medium", ["fs", "obj"])
def test_a_second_engine_serves_a_prefix_the_first_one_computed(
    smollm_fp32, small_config, shared_and_reference, tmp_path, medium, request
):
    shared, reference = shared_and_reference
    if medium == "fs":
        tier = {"type": "fs", "path": str(tmp_path), "capacity_bytes": "256M", "demote_on": "store"}
    else:
        s3 = request.getfixturevalue("s3_server")
        tier = {"type": "obj", "endpoint": s3.endpoint, "bucket": s3.bucket, "prefix": f"e2e-{uuid.uuid4().hex[:8]}",
                "access_key": s3.access_key, "secret_key": s3.secret_key, "capacity_bytes": "256M",
                "demote_on": "store"}
    first = _tiered(smollm_fp32, small_config, 24, tier)
    try:
        first.generate([shared], GREEDY)
        _wait_for_demotions(first)
    finally:
        first.engine.shutdown()

    second = _tiered(smollm_fp32, small_config, 24, tier)  # its own engine cache and CPU tier
    try:
        (served,) = second.generate([shared], GREEDY)
        assert served.samples[0].token_ids == reference
        num_chunks = (len(shared) - 1) // 16
        assert served.num_cached_tokens == num_chunks * 16
        assert second.engine.connector.manager.stats()[f"0:{medium}"].extra["promotions"] == num_chunks
    finally:
        second.engine.shutdown()


def test_an_unusable_tier_stops_the_engine_at_start_with_a_clear_error(smollm_fp32, small_config, tmp_path):
    (tmp_path / "file").write_text("")
    tier = {"type": "fs", "path": str(tmp_path / "file" / "kv"), "capacity_bytes": "1G"}
    with pytest.raises(TierStartupError, match="not a writable directory"):
        _tiered(smollm_fp32, small_config, 24, tier)
    assert not [t for t in threading.enumerate() if t.name == "zenserve-kvtier-io"]  # nothing left running
