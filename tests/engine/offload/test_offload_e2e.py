"""End to end on the embedded model: a prefix evicted from a deliberately small engine cache is
served from the CPU tier, with output identical to a run without offloading."""

from __future__ import annotations

from dataclasses import replace

from engine.config import CacheConfig
from engine.llm import LLM
from engine.request import SamplingParams
from kvtier.config import parse_offloading_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompt(llm: LLM, topic: str, words: int) -> list[int]:
    text = f"Here are some notes about {topic}: " + " ".join(f"{topic}-{i}" for i in range(words))
    return llm.tokenizer.encode(text + "\nSummarise them.")


def test_an_evicted_prefix_is_served_from_the_cpu_tier(smollm_fp32, engine_config):
    bytes_per_block = 2 * 16 * 3 * 64 * 4 * smollm_fp32.arch.num_hidden_layers
    small = replace(engine_config, cache=CacheConfig(kv_cache_memory_bytes=40 * bytes_per_block))
    plain = LLM(config=small, loaded=smollm_fp32)
    offload = LLM(
        config=replace(small, offload=parse_offloading_config({"cpu_bytes_to_use": "128M"})),
        loaded=smollm_fp32,
    )
    shared = _prompt(plain, "rivers", 120)  # ~ 400 tokens: 25 of the 40 engine blocks
    (reference,) = plain.generate([shared], GREEDY)

    offload.generate([shared], GREEDY)
    for topic in ("mountains", "deserts"):  # push the shared prefix out of the engine cache
        offload.generate([_prompt(offload, topic, 120)], GREEDY)
    engine = offload.engine
    assert engine.kv.find_prefix_hit(_request_like(engine, shared)).num_tokens < 64
    loads_before = engine.connector.stats.loads

    (served,) = offload.generate([shared], GREEDY)
    assert served.samples[0].token_ids == reference.samples[0].token_ids
    assert engine.connector.stats.loads == loads_before + 1
    assert served.num_cached_tokens == (len(shared) - 1) // 16 * 16  # every full block but the last token
    engine.shutdown()


def _request_like(engine, token_ids):
    from engine.request import Request, RequestId

    req = Request(RequestId("probe"), list(token_ids), SamplingParams(), frozenset(), 0, 10**6)
    return req
