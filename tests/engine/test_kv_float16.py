"""The float16 KV cache under a float32 model (`--kv-cache-dtype float16`): the kernels read its rows in
place and write them as torch's cast does, the torch paths round and widen them, and an engine with it
holds twice the tokens and answers as with its float32 cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import engine.kernels as kernels
from engine.attention import build_attention_metadata, paged_attention, write_kv
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.errors import ConfigError
from engine.kv_cache_spec import make_kv_cache_layout
from engine.kv_quant import kv_cache_torch_dtype
from tests.engine.test_attention import BLOCK, reference
from tests.engine.test_decode_kernel import _rope64, _rope_tables
from tests.engine.test_int8_activations import _mean_kl
from tests.engine.test_kv_quant import _prefill_logits
from tests.engine.test_model_parity import CHATS, chat_ids


@pytest.fixture(scope="module")
def kernel(cpu_kernels):
    return kernels.load_paged_decode_attention()


def _float16_caches(num_slots: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return (torch.randn(num_slots, num_kv_heads, head_dim) * 3).half(), torch.randn(num_slots, num_kv_heads, head_dim).half()


# Head sizes 64 and 128 take the AVX2 path on a CPU without AVX-512, 80 the generic loop (as does every
# float32 query on AVX-512).
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (12, 6, 128), (6, 2, 80)])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_the_kernel_reads_float16_rows_in_place(kernel, num_heads, num_kv_heads, head_dim, sliding_window):
    k_cache, v_cache = _float16_caches(40 * BLOCK, num_kv_heads, head_dim)
    contexts = [([7, 2, 30], 11), ([5], 1), ([1, 9, 3, 12, 20], 18), ([33, 34, 35, 36, 37, 38, 39], 26)]
    meta, positions = build_attention_metadata(contexts, [], BLOCK, sliding_window, torch.device("cpu"), decode_kernel=kernel)
    q = torch.randn(len(contexts), num_heads, head_dim)
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    slots = [[b * BLOCK + i for b in blocks for i in range(BLOCK)][:n] for blocks, n in contexts]
    expected = reference(q, k_cache.double(), v_cache.double(), slots, positions.tolist(), head_dim**-0.5, sliding_window)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert torch.allclose(out.double(), expected, atol=1e-5, rtol=1e-5), (out.double() - expected).abs().max()
    # The torch path (gather, widen, attend) agrees.
    torch_path = paged_attention(q, k_cache, v_cache, dataclasses.replace(meta, decode_kernel=None), head_dim**-0.5)
    assert torch.allclose(torch_path.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_kernel_refuses_float16_rows_under_a_bf16_query(kernel):
    cache = torch.zeros(8, 3, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="float16 rows under a float32 q"):
        kernel(torch.randn(1, 9, 64).bfloat16(), cache, cache, torch.arange(4).view(1, 4), torch.tensor([4]), 0, 0.125)


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_the_attention_block_writes_what_torchs_cast_of_a_float32_row_gives(kernel, sliding_window):
    block = kernels.load_decode_attention_block()
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    k_cache, v_cache = _float16_caches(40 * BLOCK, num_kv_heads, head_dim)
    k_fp32 = torch.zeros(40 * BLOCK, num_kv_heads, head_dim)
    v_fp32 = torch.zeros_like(k_fp32)
    contexts = [([7, 2, 30], 11), ([5], 1), ([1, 9, 3, 12, 20], 18)]
    meta, positions = build_attention_metadata(contexts, [], BLOCK, sliding_window, torch.device("cpu"),
                                               decode_kernel=kernel, decode_block=block)
    cos, sin = _rope_tables(64, head_dim)
    qkv = torch.randn(len(contexts), (num_heads + 2 * num_kv_heads) * head_dim) * 4
    qkv[1, -2] = 3e-6  # below float16's normal range: a subnormal
    k_before, v_before = k_cache.clone(), v_cache.clone()
    args = (meta.slot_mapping, meta.decode_slots, meta.decode_context_lens, num_heads, meta.sliding_window, head_dim**-0.5)
    block(qkv, cos, sin, positions, k_fp32, v_fp32, *args)
    out = block(qkv, cos, sin, positions, k_cache, v_cache, *args)
    written = meta.slot_mapping
    assert torch.equal(k_cache[written], k_fp32[written].half())
    assert torch.equal(v_cache[written], v_fp32[written].half())
    assert 0 < v_cache[written][1].flatten()[-2].abs() < torch.finfo(torch.float16).tiny  # the subnormal kept
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(k_cache[untouched], k_before[untouched]) and torch.equal(v_cache[untouched], v_before[untouched])

    heads = qkv.double().view(len(contexts), num_heads + 2 * num_kv_heads, head_dim)
    q = _rope64(heads[:, :num_heads], cos[positions][:, None], sin[positions][:, None]).float()
    slots = [[b * BLOCK + i for b in blocks for i in range(BLOCK)][:n] for blocks, n in contexts]
    expected = reference(q, k_cache.double(), v_cache.double(), slots, positions.tolist(), head_dim**-0.5, sliding_window)
    assert torch.allclose(out.double().view_as(expected), expected, atol=1e-4, rtol=1e-5)


def test_the_block_rounds_overflow_to_inf_as_torch_does(kernel):
    block = kernels.load_decode_attention_block()
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(1, (num_heads + 2 * num_kv_heads) * head_dim)
    qkv[0, -1] = 1e5  # the last KV head's value row
    cos, sin = _rope_tables(8, head_dim)
    k_cache = torch.zeros(4, num_kv_heads, head_dim, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    block(qkv, cos, sin, torch.tensor([0]), k_cache, v_cache, torch.tensor([2]), torch.tensor([[2]]), torch.tensor([1]),
          num_heads, 0, 0.125)
    assert v_cache[2, -1, -1].item() == float("inf") == qkv[0, -1:].half().float().item()


def test_prefill_writes_rounded_rows_and_reads_them_back():
    torch.manual_seed(2)
    k_cache = torch.zeros(8 * BLOCK, 3, 64, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(20, 3, 64), torch.randn(20, 3, 64)
    meta, _ = build_attention_metadata([], [([6, 2, 0, 7, 3], 0, 20)], BLOCK, None, torch.device("cpu"))
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    assert torch.equal(k_cache[meta.slot_mapping], k.half()) and torch.equal(v_cache[meta.slot_mapping], v.half())
    q = torch.randn(20, 9, 64)
    out = paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert out.dtype == torch.float32
    slots = meta.slot_mapping.tolist()
    expected = reference(q, k_cache.double(), v_cache.double(), [slots] * 20, list(range(20)), 0.125)
    assert torch.allclose(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_prefill_kernel_reads_float16_rows_where_it_runs(cpu_kernels):
    kernel = kernels.load_paged_prefill_attention()
    if kernel is None:
        pytest.skip("the prefill kernel needs AVX-512 or AVX2 with FMA")
    k_cache, v_cache = _float16_caches(48 * BLOCK, 3, 64)
    blocks = [11, 3, 40, 7, 22, 5, 30, 2, 45, 17, 9, 1, 33][: -(-50 // BLOCK)]  # 13 + 37 positions
    meta, positions = build_attention_metadata([], [(blocks, 13, 37)], BLOCK, None, torch.device("cpu"), prefill_kernel=kernel)
    q = torch.randn(37, 9, 64)
    out = paged_attention(q, k_cache, v_cache, meta, 0.125)
    slots = meta.prefills[0].context_slots.tolist()
    expected = reference(q, k_cache.double(), v_cache.double(), [slots] * 37, positions.tolist(), 0.125)
    assert torch.allclose(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_auto_is_float16_for_a_float32_model_on_the_cpu_workers_only():
    assert kv_cache_torch_dtype("auto", torch.float32, cpu_worker=True) == torch.float16
    assert kv_cache_torch_dtype("auto", torch.float32, cpu_worker=False) == torch.float32
    assert kv_cache_torch_dtype("auto", torch.bfloat16, cpu_worker=True) == torch.bfloat16


def test_float16_serves_float32_models_only_and_holds_twice_the_tokens(smollm_fp32):
    assert kv_cache_torch_dtype("float16", torch.float32, cpu_worker=True) == torch.float16
    assert kv_cache_torch_dtype("model", torch.float32, cpu_worker=True) == torch.float32
    with pytest.raises(ConfigError, match="float16 KV cache serves float32 models"):
        kv_cache_torch_dtype("float16", torch.bfloat16, cpu_worker=True)
    arch = smollm_fp32.arch
    fp32 = make_kv_cache_layout(arch, 16, torch.float32, 64 * 1024 * 1024)
    fp16 = make_kv_cache_layout(arch, 16, torch.float16, 64 * 1024 * 1024)
    assert fp16.groups[0].spec.page_size_bytes * 2 == fp32.groups[0].spec.page_size_bytes
    assert fp16.num_blocks == 2 * fp32.num_blocks
    from engine.worker import create_worker

    with pytest.raises(ConfigError, match="CPU workers only"):
        create_worker("cuda", smollm_fp32.model, fp16, smollm_fp32.dtype)


def test_a_float16_cache_keeps_the_float32_models_logits(smollm_fp32):
    # float16 keeps 11 bits of each K and V value: measured next-token KL from the float32 cache
    # 0.5-1.6e-6 on these prompts (a bf16 model's own: 1.5-2e-3). One position of 140 took its runner-up,
    # where float32's top two stood 0.0008 apart.
    for messages in CHATS:
        ids = chat_ids(smollm_fp32, messages)
        ref = _prefill_logits(smollm_fp32, ids, torch.float32)
        mine = _prefill_logits(smollm_fp32, ids, torch.float16)
        assert not torch.equal(mine, ref)  # the rows were rounded
        assert _mean_kl(mine, ref) < 1e-5
        top2 = ref.log_softmax(-1).topk(2).values
        clear = top2[:, 0] - top2[:, 1] > 0.01
        assert torch.equal(mine.argmax(-1)[clear], ref.argmax(-1)[clear])


def _greedy_tokens(worker: str, kv_cache_dtype: str, prompt: list[int], max_tokens: int) -> tuple[list[int], object]:
    from engine.core import EngineCore
    from engine.model_loader import load_model
    from engine.request import SamplingParams

    config = EngineConfig(model=ModelConfig(dtype="float32"),
                          cache=CacheConfig(kv_cache_memory_bytes=32 * 1024**2, kv_cache_dtype=kv_cache_dtype),
                          worker=worker)
    core = EngineCore(config, load_model(config.model))
    core.add_request("q", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    tokens: list[int] = []
    while core.has_unfinished():
        for out in core.step():
            tokens += out.new_token_ids
    return tokens, core


@pytest.mark.parametrize("worker", ["zentorch", "eager"])
def test_an_engine_with_a_float16_cache_decodes_as_with_its_float32_one(smollm_fp32, worker):
    if worker == "zentorch":
        from engine.worker.cpu import zentorch_available

        if not zentorch_available():
            pytest.skip("zentorch is not installed")
    prompt = chat_ids(smollm_fp32, CHATS[1])
    expected, fp32_core = _greedy_tokens(worker, "model", prompt, 24)
    tokens, core = _greedy_tokens(worker, "float16", prompt, 24)
    assert core.worker.decode_block is not None and core.worker.kv_caches[0][0].dtype == torch.float16
    assert core.layout.num_blocks // 2 == fp32_core.layout.num_blocks  # twice the tokens, to a block
    assert tokens == expected
