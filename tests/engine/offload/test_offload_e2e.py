"""End to end on the embedded model: a prefix evicted from a deliberately small engine cache is
served from the CPU tier, with output identical to a run without offloading."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.config import CacheConfig
from engine.kv_cache_spec import make_kv_cache_layout
from engine.llm import LLM
from engine.request import SamplingParams
from kvtier.config import parse_offloading_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompt(llm: LLM, topic: str, words: int) -> list[int]:
    text = f"Here are some notes about {topic}: " + " ".join(f"{topic}-{i}" for i in range(words))
    return llm.tokenizer.encode(text + "\nSummarise them.")


# int8: the rows' scales travel with them through the CPU tier (engine/kv_quant.py); float16: a float32
# model's rows in half the bytes.
@pytest.mark.parametrize("kv_cache_dtype", ["model", "int8", "float16"])
def test_an_evicted_prefix_is_served_from_the_cpu_tier(smollm_fp32, engine_config, kv_cache_dtype):
    kv_dtype = {"int8": torch.int8, "float16": torch.float16}.get(kv_cache_dtype, smollm_fp32.dtype)
    bytes_per_block = make_kv_cache_layout(smollm_fp32.arch, 16, kv_dtype, 1 << 30).groups[0].spec.page_size_bytes
    bytes_per_block *= smollm_fp32.arch.num_hidden_layers
    small = replace(engine_config, cache=CacheConfig(kv_cache_memory_bytes=40 * bytes_per_block, kv_cache_dtype=kv_cache_dtype))
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
    assert engine.layout.num_blocks == 40 and engine.worker.kv_caches[0][0].dtype == kv_dtype
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
