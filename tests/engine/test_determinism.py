"""bf16 greedy output does not depend on how a prompt reaches the model.

By default: cold, a full or partial prefix-cache hit, chunked prefill at any budget, or a load from the CPU
tier give the same first-token logits and the same 32 greedy tokens, to the bit. In the batch-invariant mode
(EngineConfig.batch_invariant) also whatever else shares the steps, preemption and recompute, and a later turn
that hits the blocks of generated tokens. Each case runs on every CPU worker this machine has, with zenserve's
kernels and without. The float32 checks of the same cases are in test_engine.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.cpu_features import has_native_bf16
from engine.kv_cache_spec import make_kv_cache_layout
from engine.llm import LLM
from engine.model_loader import load_model
from engine.models.onednn_linear import onednn_serves_bf16
from engine.request import SamplingParams
from engine.worker.zentorch_ops import load_zentorch_ops
from kvtier.config import parse_offloading_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not has_native_bf16(), reason="bf16 is served where the CPU computes it (AVX512_BF16 or AMX)"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
TOPICS = ["rivers", "prime numbers", "bread", "the moon", "chess", "volcanoes", "jazz", "owls"]


def _variants() -> list:
    variants = [pytest.param(("eager", True), id="eager"), pytest.param(("eager", False), id="eager-no-kernels")]
    zentorch = pytest.mark.skipif(not load_zentorch_ops(), reason="zentorch is not installed or does not load")
    variants.append(pytest.param(("zentorch", True), id="zentorch", marks=zentorch))
    return variants


class Served:
    """A bf16 model prepared by one worker kind, with or without zenserve's kernels (each variant loads its own:
    a worker rewrites the model it serves)."""

    def __init__(self, worker: str, kernels: bool, monkeypatch: pytest.MonkeyPatch):
        self.worker, self.kernels, self.monkeypatch = worker, kernels, monkeypatch
        self.loaded = load_model(ModelConfig(dtype="bfloat16"))
        self.config = EngineConfig(
            model=ModelConfig(dtype="bfloat16"),
            cache=CacheConfig(kv_cache_memory_bytes=64 * 2**20, kv_cache_dtype="model"),
            scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048),
            worker=worker,
        )

    def llm(self, config: EngineConfig | None = None, **sections) -> LLM:
        config = config or self.config
        for section, values in sections.items():
            config = replace(config, **{section: replace(getattr(config, section), **values)})
        return LLM(config=config, loaded=self.loaded)


@pytest.fixture(scope="module", params=_variants())
def served(request):
    worker, kernels = request.param
    with pytest.MonkeyPatch.context() as monkeypatch:
        if not kernels:  # read by every kernel loader, the model's packed copies' and the worker's
            monkeypatch.setenv("ZENSERVE_NO_CPU_KERNELS", "1")
        yield Served(worker, kernels, monkeypatch)


def chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                                add_special_tokens=False)


def target(llm: LLM) -> list[int]:
    """73 tokens: four full blocks and a partial one."""
    return chat(llm, "Describe a busy city street in the morning, in a few sentences. " * 3)


def others(llm: LLM, n: int) -> list[list[int]]:
    return [chat(llm, f"Tell me {'a lot ' * (i % 5)}about {TOPICS[i % len(TOPICS)]}.") for i in range(n)]


def first_logits_and_tokens(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, list[int], int]:
    """The logits the first token was sampled from, the 32 greedy tokens, and the prompt's cached tokens."""
    model = llm.engine.worker.model
    seen: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def recording(hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        logits = compute_logits(hidden, float32)
        seen.append(logits.detach().clone())
        return logits

    model.compute_logits = recording
    try:
        (result,) = llm.generate([prompt], GREEDY)
    finally:
        del model.compute_logits
    return seen[0][-1], result.samples[0].token_ids, result.num_cached_tokens


@pytest.fixture
def exact(served, request) -> None:
    """Without zenserve's kernels a bf16 model on AMX runs every projection on oneDNN's GEMM, whose kernels sum
    some row counts in another order (engine/models/onednn_linear.py): there a row's result depends on its
    call's rows, and these checks are known to fail (strict: one that passes says the limit is gone)."""
    if not served.kernels and onednn_serves_bf16():
        request.applymarker(pytest.mark.xfail(strict=True, reason="oneDNN's bf16 GEMM is not row-invariant"))


@pytest.fixture(scope="module")
def cold(served):
    llm = served.llm()
    prompt = target(llm)
    logits, tokens, cached = first_logits_and_tokens(llm, prompt)
    assert cached == 0
    return prompt, logits, tokens


def assert_same(cold, got) -> None:
    _, logits, tokens = cold
    assert torch.equal(got[0], logits), f"first-token logits differ by up to {(got[0].float() - logits.float()).abs().max()}"
    assert got[1] == tokens


def test_a_full_prefix_cache_hit_computes_what_a_cold_prefill_did(served, cold, exact):
    llm = served.llm()
    prompt = cold[0]
    assert_same(cold, first_logits_and_tokens(llm, prompt))
    again = first_logits_and_tokens(llm, prompt)
    assert again[2] == (len(prompt) - 1) // 16 * 16  # every full block: the last token alone is computed
    assert_same(cold, again)


def test_a_partial_prefix_cache_hit_computes_what_a_cold_prefill_did(served, cold, exact):
    llm = served.llm()
    prompt = cold[0]
    llm.generate([prompt[:40]], SamplingParams(temperature=0.0, max_tokens=1))
    got = first_logits_and_tokens(llm, prompt)
    assert got[2] == 32
    assert_same(cold, got)


@pytest.mark.parametrize("budget", [7, 64])
def test_chunked_prefill_computes_what_a_cold_prefill_did(served, cold, exact, budget):
    llm = served.llm(scheduler={"max_num_batched_tokens": budget})
    assert_same(cold, first_logits_and_tokens(llm, cold[0]))


def test_a_prefix_loaded_from_the_cpu_tier_computes_what_a_cold_prefill_did(served, cold, exact):
    llm = served.llm(replace(served.config, offload=parse_offloading_config({"cpu_bytes_to_use": "64M"})))
    engine = llm.engine
    prompt = cold[0]
    assert_same(cold, first_logits_and_tokens(llm, prompt))
    engine.connector.flush()
    assert engine.kv.reset_prefix_cache()  # the engine's own cache only: the CPU tier keeps the prompt's chunks
    loads = engine.connector.stats.loads
    got = first_logits_and_tokens(llm, prompt)
    assert engine.connector.stats.loads == loads + 1 and got[2] == (len(prompt) - 1) // 16 * 16
    assert_same(cold, got)
    engine.shutdown()


def test_blocks_of_generated_tokens_are_not_published_by_default(served, cold):
    """Their K/V came from decode steps: a later turn that hit them would compute other tokens than one that
    recomputed them, so only the prompt's blocks join the prefix cache."""
    llm = served.llm()
    prompt = cold[0]
    (first,) = llm.generate([prompt], GREEDY)
    turn = prompt + first.samples[0].token_ids + chat(llm, "And in the evening?")
    (second,) = llm.generate([turn], SamplingParams(temperature=0.0, max_tokens=1))
    assert second.num_cached_tokens == len(prompt) // 16 * 16


@pytest.fixture(scope="module")
def invariant(served):
    """The batch-invariant mode on the same worker (a model of its own: the mode prepares its lm_head)."""
    loaded = load_model(ModelConfig(dtype="bfloat16"))
    config = replace(served.config, batch_invariant=True)

    def make(**sections) -> LLM:
        c = config
        for section, values in sections.items():
            c = replace(c, **{section: replace(getattr(c, section), **values)})
        return LLM(config=c, loaded=loaded)

    llm = make()
    prompt = target(llm)
    (alone,) = llm.generate([prompt], GREEDY)
    return make, prompt, alone.samples[0].token_ids


def test_batch_invariant_output_does_not_depend_on_the_batch(invariant, exact):
    make, prompt, alone = invariant
    llm = make()
    rest = others(llm, 15)
    results = llm.generate(rest[:7] + [prompt] + rest[7:], GREEDY)
    assert results[7].samples[0].token_ids == alone
    # Decoding beside prompts in the same steps: a small budget chunks them over many steps.
    llm = make(scheduler={"max_num_batched_tokens": 24})
    results = llm.generate([prompt, *rest[:3]], GREEDY)
    assert results[0].samples[0].token_ids == alone


def test_batch_invariant_output_survives_preemption_and_recompute(invariant, served):
    make, prompt, alone = invariant
    spec = make_kv_cache_layout(served.loaded.arch, 16, torch.bfloat16, 1 << 30).groups[0].spec
    # 10 blocks: too few for the four to finish together.
    llm = make(cache={"kv_cache_memory_bytes": 10 * spec.page_size_bytes * served.loaded.arch.num_hidden_layers})
    results = llm.generate([prompt, *others(llm, 3)], GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert results[0].samples[0].token_ids == alone


def test_batch_invariant_blocks_of_generated_tokens_serve_the_next_turn_exactly(invariant, exact):
    make, prompt, alone = invariant
    llm = make()
    llm.generate([prompt], GREEDY)
    turn = prompt + alone + chat(llm, "And in the evening?")
    (hit,) = llm.generate([turn], GREEDY)
    assert hit.num_cached_tokens == (len(prompt) + len(alone)) // 16 * 16
    (cold,) = make().generate([turn], GREEDY)
    assert hit.samples[0].token_ids == cold.samples[0].token_ids
