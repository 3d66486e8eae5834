"""The cuda worker on a GPU: float32 logits as transformers computes them, greedy tokens as the eager
CPU worker decodes them through chunked prefill and preemption, bfloat16 (a GPU's default) close to
float32, seeded sampling, and a served chat completion. Skipped without a CUDA GPU: CI has none."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.attention import build_attention_metadata
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core import EngineCore
from engine.kv_cache_spec import make_kv_cache_layout
from engine.llm import LLM
from engine.model_loader import load_model
from engine.models.packed_linear import SmallBatchLinear
from engine.request import SamplingParams
from engine.worker import create_worker

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to five."}],
    [{"role": "user", "content": "def fib(n):\n    # complete this"}],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def chat_ids(loaded, messages) -> list[int]:
    text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def prefill_logits(loaded, worker_kind: str, token_ids: list[int]) -> torch.Tensor:
    """All-position float32 logits of one prefill through a worker's paged cache, on the CPU."""
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 16 * 1024 * 1024)
    worker = create_worker(worker_kind, loaded.model, layout, loaded.dtype)
    num_blocks = -(-len(token_ids) // 16)
    meta, positions = build_attention_metadata(
        [], [(list(range(num_blocks)), 0, len(token_ids))], 16, None, worker.device
    )
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(token_ids, device=worker.device), positions, worker.kv_caches, meta)
        return loaded.model.compute_logits(hidden).float().cpu()


def engine_config(worker: str, dtype: str = "float32", **scheduler) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(dtype=dtype),
        cache=CacheConfig(kv_cache_memory_bytes=32 * 1024 * 1024, kv_cache_dtype="model"),
        scheduler=SchedulerConfig(**{"max_num_seqs": 16, "max_num_batched_tokens": 512, **scheduler}),
        worker=worker,
    )


def mixed_prompts(loaded, n: int) -> list[list[int]]:
    topics = ["rivers", "prime numbers", "bread", "the moon", "chess", "volcanoes", "jazz", "owls"]
    return [chat_ids(loaded, [{"role": "user", "content": f"Tell me {'a lot ' * (i % 5)}about {topics[i % 8]}."}])
            for i in range(n)]


@pytest.fixture(scope="module")
def hf_reference(smollm_fp32):
    transformers = pytest.importorskip("transformers")
    path = smollm_fp32.source
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    logits = []
    with torch.inference_mode():
        for messages in CHATS:
            logits.append(model(torch.tensor([chat_ids(smollm_fp32, messages)])).logits[0].float())
    return logits


def test_on_a_gpu_auto_means_bfloat16_and_no_cpu_packed_copies():
    loaded = load_model(ModelConfig(), "cuda")
    assert loaded.dtype == torch.bfloat16
    # The 4/8-bit packed copies run on CPU kernels only: a GPU model keeps its dense weights alone.
    assert not any(isinstance(m, SmallBatchLinear) for m in loaded.model.modules())
    core = EngineCore(engine_config("auto", "auto"))
    assert core.worker.name == "cuda" and core.loaded.dtype == torch.bfloat16
    assert core.worker.kv_caches[0][0].is_cuda and core.worker.kv_caches[0][0].dtype == torch.bfloat16


def test_float32_logits_match_transformers(smollm_fp32, hf_reference):
    loaded = load_model(ModelConfig(dtype="float32"), "cuda")
    for messages, ref in zip(CHATS, hf_reference, strict=True):
        mine = prefill_logits(loaded, "cuda", chat_ids(smollm_fp32, messages))
        # The CPU worker's tolerance (tests/engine/test_model_parity.py): cuBLAS's float32 GEMMs
        # (TF32 is off by default) round no coarser than the CPU's.
        assert torch.allclose(mine, ref, atol=2e-3, rtol=1e-4), (mine - ref).abs().max()


def test_bfloat16_keeps_the_float32_next_token_distribution(smollm_fp32, hf_reference):
    loaded = load_model(ModelConfig(dtype="bfloat16"), "cuda")
    kls, agree, positions = [], 0, 0
    for messages, ref in zip(CHATS, hf_reference, strict=True):
        mine = prefill_logits(loaded, "cuda", chat_ids(smollm_fp32, messages))
        ref_logp, logp = ref.log_softmax(-1), mine.log_softmax(-1)
        kls.append((ref_logp.exp() * (ref_logp - logp)).sum(-1))
        agree += int((mine.argmax(-1) == ref.argmax(-1)).sum())
        positions += ref.shape[0]
    kl = torch.cat(kls)
    # bf16 weights and activations: the eager CPU worker's bf16 on these prompts gives a mean KL of 0.0018
    # (0.0031 with the first ten layers alone) and the same top token at 99-100% of positions; a wrong
    # kernel gives whole nats and chance agreement.
    assert kl.mean() < 0.02, kl.mean()
    assert agree / positions > 0.9, agree / positions


def test_greedy_tokens_match_eager_through_chunked_prefill_and_preemption(smollm_fp32):
    prompts = mixed_prompts(smollm_fp32, 6)
    # 33-token steps chunk every prompt; 12 blocks of 16 cannot hold six growing sequences at once.
    bytes_per_block = 2 * 16 * smollm_fp32.arch.num_key_value_heads * 64 * 4 * smollm_fp32.arch.num_hidden_layers
    tokens = {}
    for worker in ("eager", "cuda"):
        config = engine_config(worker, max_num_batched_tokens=33)
        config = EngineConfig(model=config.model, scheduler=config.scheduler, worker=worker,
                              cache=CacheConfig(kv_cache_memory_bytes=12 * bytes_per_block, kv_cache_dtype="model"))
        llm = LLM(config=config, loaded=load_model(ModelConfig(dtype="float32"), "cuda" if worker == "cuda" else "cpu"))
        assert llm.engine.worker.name == worker
        tokens[worker] = [r.samples[0].token_ids for r in llm.generate(prompts, GREEDY)]
        assert llm.engine.scheduler.num_preemptions > 0
        if worker == "cuda":
            assert_replayed_graphs(llm.engine.worker)
    assert tokens["cuda"] == tokens["eager"]


def assert_replayed_graphs(worker) -> None:
    graphs = worker.decode_graphs
    assert graphs is not None and graphs.replays > 0, "decode steps ran eagerly"
    assert graphs.buckets and all(b.graph is not None for b in graphs.buckets.values())


def test_long_contexts_decode_through_larger_graph_buckets_as_eager_does(smollm_fp32):
    # One prompt past 512 tokens among short ones: each decode step's context bucket is 1,024 positions.
    long_text = " ".join(f"Item {i}: a {['red', 'blue', 'green'][i % 3]} box." for i in range(60))
    prompts = [chat_ids(smollm_fp32, [{"role": "user", "content": long_text + " Which boxes are blue?"}])]
    prompts += mixed_prompts(smollm_fp32, 4)
    assert len(prompts[0]) > 512
    tokens = {}
    for worker in ("eager", "cuda"):
        llm = LLM(config=engine_config(worker), loaded=load_model(ModelConfig(dtype="float32"),
                                                                   "cuda" if worker == "cuda" else "cpu"))
        tokens[worker] = [r.samples[0].token_ids for r in llm.generate(prompts, GREEDY)]
        if worker == "cuda":
            assert_replayed_graphs(llm.engine.worker)
            assert 1024 in {context for _, context in llm.engine.worker.decode_graphs.buckets}
    assert tokens["cuda"] == tokens["eager"]


def test_enforce_eager_runs_every_step_without_graphs_and_decodes_alike(smollm_fp32):
    prompts = mixed_prompts(smollm_fp32, 3)
    tokens = {}
    for cuda_graphs in (False, True):
        config = replace(engine_config("cuda"), cuda_graphs=cuda_graphs)
        llm = LLM(config=config, loaded=load_model(ModelConfig(dtype="float32"), "cuda"))
        assert (llm.engine.worker.decode_graphs is not None) == cuda_graphs
        tokens[cuda_graphs] = [r.samples[0].token_ids for r in llm.generate(prompts, GREEDY)]
    assert tokens[True] == tokens[False]


def test_warm_up_captures_the_short_context_buckets_that_serving_then_replays(smollm_fp32):
    core = EngineCore(engine_config("cuda", "bfloat16"), load_model(ModelConfig(dtype="bfloat16"), "cuda"))
    core.warm_up()
    graphs = core.worker.decode_graphs
    prepared = set(graphs.buckets)
    assert prepared == {(b, c) for b in (1, 2, 4, 8, 16) for c in (256, 512, 1024)}  # max_num_seqs 16
    assert all(bucket.graph is not None for bucket in graphs.buckets.values())
    replays = graphs.replays
    for i, prompt in enumerate(mixed_prompts(smollm_fp32, 12)):
        core.add_request(f"r{i}", prompt, GREEDY)
    while core.has_unfinished():
        core.step()
    assert graphs.replays > replays and set(graphs.buckets) == prepared  # nothing captured while serving


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    # float32: bf16 logits move with the batch's shape by more than a sampled token's margin.
    llm = LLM(config=engine_config("cuda"), loaded=load_model(ModelConfig(dtype="float32"), "cuda"))
    prompts = mixed_prompts(llm.engine.loaded, 5)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    (alone,) = llm.generate([prompts[2]], params)
    batch = llm.generate(prompts, params)
    assert batch[2].samples[0].token_ids == alone.samples[0].token_ids
    other = llm.generate([prompts[2]], SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=99,
                                                        ignore_eos=True))
    assert other[0].samples[0].token_ids != alone.samples[0].token_ids


async def test_a_served_chat_completion_streams_what_it_answers_whole():
    from aiohttp.test_utils import TestClient, TestServer

    from server.app import create_app
    from server.config import ServerConfig

    engine = AsyncEngine(EngineCore(engine_config("cuda", "bfloat16")))
    engine.start()
    client = TestClient(TestServer(create_app(ServerConfig(), engine=engine), host="127.0.0.1"))
    await client.start_server()
    try:
        models = await (await client.get("/v1/models")).json()
        body = {"model": models["data"][0]["id"], "messages": CHATS[0], "temperature": 0, "max_tokens": 12,
                "ignore_eos": True}
        whole = await client.post("/v1/chat/completions", json=body)
        assert whole.status == 200, await whole.text()
        answer = await whole.json()
        assert answer["usage"]["completion_tokens"] == 12 and answer["choices"][0]["finish_reason"] == "length"
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status == 200
        pieces = []
        async for line in streamed.content:
            if line.startswith(b"data: {"):
                delta = orjson.loads(line[6:])["choices"]
                if delta and delta[0]["delta"].get("content"):
                    pieces.append(delta[0]["delta"]["content"])
        assert "".join(pieces) == answer["choices"][0]["message"]["content"] != ""
    finally:
        await client.close()
        await engine.shutdown()
