"""The C++ prefill-chunk attention kernel (engine/kernels) against a float64 reference and the torch path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import engine.kernels as kernels
from engine.attention import build_attention_metadata, paged_attention
from engine.kv_quant import dequantize_rows, quantize_rows
from tests.engine.test_attention import BLOCK, reference


@pytest.fixture(scope="module")
def kernel(cpu_kernels):
    found = kernels.load_paged_prefill_attention()
    if found is None:  # the kernels built (cpu_kernels), so the CPU has neither AVX-512 nor AVX2 with FMA
        pytest.skip("the prefill kernel needs AVX-512 or AVX2 with FMA")
    return found


def _caches(num_kv_heads: int, head_dim: int, dtype: torch.dtype, int8: bool):
    torch.manual_seed(0)
    k = torch.randn(48 * BLOCK, num_kv_heads, head_dim) * 2
    v = torch.randn(48 * BLOCK, num_kv_heads, head_dim)
    if int8:
        return quantize_rows(k), quantize_rows(v)
    return k.to(dtype), v.to(dtype)


# G = 16 query heads a KV head is more than the 12 score rows a task keeps in registers.
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 1.6e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 1, 64), (12, 6, 128), (16, 1, 64)])
@pytest.mark.parametrize("start, length", [(0, 37), (13, 21), (40, 1)])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("int8", [False, True])
def test_the_kernel_matches_causal_per_head_attention(
    kernel, dtype, tolerance, num_heads, num_kv_heads, head_dim, start, length, sliding_window, int8
):
    k_cache, v_cache = _caches(num_kv_heads, head_dim, dtype, int8)
    blocks = [11, 3, 40, 7, 22, 5, 30, 2, 45, 17, 9, 1, 33, 28, 19][: -(-(start + length) // BLOCK)]
    meta, positions = build_attention_metadata([], [(blocks, start, length)], BLOCK, sliding_window, torch.device("cpu"),
                                               prefill_kernel=kernel)
    q = torch.randn(length, num_heads, head_dim).to(dtype)
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    slots = meta.prefills[0].context_slots.tolist()
    k, v = (dequantize_rows(k_cache, torch.float64), dequantize_rows(v_cache, torch.float64)) if int8 else (k_cache, v_cache)
    expected = reference(q, k, v, [slots] * length, positions.tolist(), head_dim**-0.5, sliding_window)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.allclose(out.double(), expected, atol=tolerance, rtol=tolerance), (out.double() - expected).abs().max()
    # At least about as close as the torch path it replaces (gather, mask, SDPA), give or take a few float32
    # rounding steps: on an Intel Xeon torch's float32 SDPA came within 2-3.5e-7 of float64 where the kernel's
    # exp and sums left 1.3-1.6e-6.
    torch_path = paged_attention(q, k_cache, v_cache, dataclasses.replace(meta, prefill_kernel=None), head_dim**-0.5)
    slack = 32 * torch.finfo(torch.float32).eps
    assert (out.double() - expected).abs().max() <= (torch_path.double() - expected).abs().max() * 1.5 + slack


def test_calls_of_growing_and_shrinking_contexts_each_match_the_reference(kernel):
    # The kernel keeps its keys and values in a buffer that outlives a call: each call must size it for
    # its own context and read nothing a longer call left in it.
    torch.manual_seed(1)
    k_cache = torch.randn(192, 3, 64).half() * 2
    v_cache = torch.randn(192, 3, 64).half()
    order = torch.randperm(192)
    for start, length in [(5, 4), (150, 40), (0, 3), (37, 2), (90, 100), (20, 7)]:
        slots = order[: start + length]
        q = torch.randn(length, 9, 64)
        out = kernel(q, k_cache, v_cache, slots, start, 0, 0.125)
        expected = reference(q, k_cache, v_cache, [slots.tolist()] * length, range(start, start + length), 0.125)
        assert torch.allclose(out.double(), expected, atol=1e-5, rtol=1e-5), (start, length)


def test_a_query_that_is_a_view_of_the_fused_projection_reads_its_strides(kernel):
    k_cache, v_cache = _caches(3, 64, torch.bfloat16, False)
    fused = torch.randn(20, 9 + 2 * 3, 64).bfloat16()
    q = fused[:, :9]
    assert not q.is_contiguous()
    slots = torch.arange(30, 50)
    assert torch.equal(kernel(q, k_cache, v_cache, slots, 0, 0, 0.125), kernel(q.contiguous(), k_cache, v_cache, slots, 0, 0, 0.125))


def test_bad_arguments_raise_instead_of_reading_out_of_bounds(kernel):
    q = torch.randn(4, 9, 64).bfloat16()
    cache = torch.randn(8, 3, 64).bfloat16()
    with pytest.raises(RuntimeError, match="slot outside"):
        kernel(q, cache, cache, torch.tensor([0, 1, 2, 8]), 0, 0, 0.125)
    with pytest.raises(RuntimeError, match="start"):
        kernel(q, cache, cache, torch.arange(4), 1, 0, 0.125)  # 5 positions, 4 slots
    with pytest.raises(RuntimeError, match="head sizes"):
        kernel(torch.randn(4, 9, 80).bfloat16(), torch.randn(8, 3, 80).bfloat16(), torch.randn(8, 3, 80).bfloat16(),
               torch.arange(4), 0, 0, 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel(q.float(), cache, cache, torch.arange(4), 0, 0, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the AMX path where the CPU has it
def test_scores_millions_apart_give_the_winning_value_not_nan(kernel, dtype):
    """The kernels build with -ffast-math: exp of a hugely negative score must still be 0."""
    k_cache = torch.zeros(8, 1, 64)
    v_cache = torch.zeros(8, 1, 64)
    k_cache[0], k_cache[1], k_cache[2] = 100, -100, 50
    v_cache[0], v_cache[1], v_cache[2] = 1, 2, 3
    q = torch.full((1, 1, 64), 1000.0)  # scores 6.4e6, -6.4e6 and 3.2e6 for the query at position 2
    out = kernel(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), torch.arange(3), 2, 0, 1.0)
    assert torch.equal(out, torch.ones_like(out))


# Spans of several 16-position query blocks and 32-key blocks (the AMX path's tiles, where the CPU has
# AMX), windows that start inside a block and ones wider than a block.
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("start, length", [(0, 70), (45, 50), (300, 17)])
@pytest.mark.parametrize("sliding_window", [None, 9, 40])
def test_bf16_chunks_across_many_query_and_key_blocks_match_the_reference(kernel, head_dim, start, length, sliding_window):
    torch.manual_seed(5)
    k_cache = (torch.randn(400, 2, head_dim) * 2).bfloat16()
    v_cache = torch.randn(400, 2, head_dim).bfloat16()
    slots = torch.randperm(k_cache.shape[0])[: start + length]
    q = torch.randn(length, 6, head_dim).bfloat16()
    out = kernel(q, k_cache, v_cache, slots, start, sliding_window or 0, head_dim**-0.5)
    positions = list(range(start, start + length))
    expected = reference(q, k_cache, v_cache, [slots.tolist()] * length, positions, head_dim**-0.5, sliding_window)
    assert torch.allclose(out.double(), expected, atol=1.6e-2, rtol=1.6e-2), (out.double() - expected).abs().max()


def test_cpu_workers_run_prefill_chunks_on_it(kernel, smollm_fp32):
    from engine.kv_cache_spec import make_kv_cache_layout
    from engine.worker.cpu import CPUWorker

    worker = CPUWorker(smollm_fp32.model, make_kv_cache_layout(smollm_fp32.arch, 16, smollm_fp32.dtype, 2**22), smollm_fp32.dtype)
    assert worker.prefill_kernel is kernel


def test_a_long_context_is_right_on_the_kernel_but_served_by_sdpa(kernel):
    """Beyond PREFILL_KERNEL_MAX_CONTEXT the engine keeps the worker's SDPA (faster there, but for the AMX
    path, which lifts the limit); the op itself stays exact at any length."""
    from engine.attention import PREFILL_KERNEL_MAX_CONTEXT

    torch.manual_seed(3)
    k_cache, v_cache = torch.randn(2, 256 * BLOCK, 3, 64).bfloat16()
    start, length = PREFILL_KERNEL_MAX_CONTEXT + 100, 20
    slots = torch.randperm(k_cache.shape[0])[: start + length]
    q = torch.randn(length, 9, 64).bfloat16()
    out = kernel(q, k_cache, v_cache, slots, start, 0, 0.125)
    expected = reference(q, k_cache, v_cache, [slots.tolist()] * length, list(range(start, start + length)), 0.125)
    assert torch.allclose(out.double(), expected, atol=1.6e-2, rtol=1.6e-2)

    calls = []

    def sdpa(q, k, v, chunk, scale):
        calls.append(chunk.query_len)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale)

    blocks = torch.randperm(k_cache.shape[0] // BLOCK)[: -(-(start + length) // BLOCK)].tolist()
    for context, limit, expect_sdpa in ((PREFILL_KERNEL_MAX_CONTEXT, PREFILL_KERNEL_MAX_CONTEXT, False),
                                        (start + length, PREFILL_KERNEL_MAX_CONTEXT, True), (start + length, None, False)):
        meta, _ = build_attention_metadata([], [(blocks, context - length, length)], BLOCK, None, torch.device("cpu"),
                                           prefill_sdpa=sdpa, prefill_kernel=kernel, prefill_kernel_max_context=limit)
        calls.clear()
        paged_attention(q, k_cache, v_cache, meta, 0.125)
        assert calls == ([length] if expect_sdpa else [])


@pytest.mark.parametrize("dtype, kv_cache_dtype", [(torch.bfloat16, None), (torch.bfloat16, torch.int8),
                                                   (torch.bfloat16, torch.float8_e4m3fn), (torch.float32, None)])
def test_the_cpu_worker_lifts_the_context_limit_on_amx_and_raises_it_on_avx2(kernel, dtype, kv_cache_dtype):
    from engine.attention import PREFILL_KERNEL_MAX_CONTEXT, PREFILL_KERNEL_MAX_CONTEXT_AVX2
    from engine.cpu_features import has_avx512
    from engine.config import ModelConfig
    from engine.kv_cache_spec import make_kv_cache_layout
    from engine.model_loader import load_model
    from engine.worker.cpu import CPUWorker

    loaded = load_model(ModelConfig(dtype=str(dtype).removeprefix("torch.")))
    layout = make_kv_cache_layout(loaded.arch, 16, kv_cache_dtype or dtype, 2**22)
    worker = CPUWorker(loaded.model, layout, dtype)
    bf16_over_bf16_or_fp8 = dtype == torch.bfloat16 and kv_cache_dtype in (None, torch.float8_e4m3fn)
    lifted = bf16_over_bf16_or_fp8 and (kernels.paged_prefill_attention_uses_amx() or kernels.paged_prefill_attention_scores_bf16())
    limit = PREFILL_KERNEL_MAX_CONTEXT if has_avx512() else PREFILL_KERNEL_MAX_CONTEXT_AVX2
    assert worker.prefill_kernel_max_context == (None if lifted else limit)


def test_bf16_scores_are_built_wherever_the_cpu_has_avx512_bf16(kernel):
    """The VDPBF16PS scores (and with them the lifted context limit) come with -march=native on every
    AVX512_BF16 CPU, and only there."""
    from engine.cpu_features import has_avx512_bf16

    assert kernels.paged_prefill_attention_scores_bf16() == has_avx512_bf16()


@pytest.mark.parametrize("start, length", [(0, 300), (1_000, 32), (600, 700)])
def test_bf16_chunks_over_long_contexts_match_the_reference_and_the_float32_scores(kernel, start, length):
    """Long contexts, which the worker now serves on the kernel where it scores on VDPBF16PS: within bf16's
    rounding of the output, as the float32 query over the widened cache (the float32 FMA path) gives it."""
    torch.manual_seed(11)
    k_cache, v_cache = (torch.randn(2, 2_048, 3, 64) * torch.tensor([2.0, 1.0])[:, None, None, None]).bfloat16()
    slots = torch.randperm(k_cache.shape[0])[: start + length]
    q = torch.randn(length, 9, 64).bfloat16()
    out = kernel(q, k_cache, v_cache, slots, start, 0, 0.125)
    expected = reference(q, k_cache, v_cache, [slots.tolist()] * length, list(range(start, start + length)), 0.125)
    float32_scores = kernel(q.float(), k_cache.half(), v_cache.half(), slots, start, 0, 0.125)
    assert torch.allclose(out.double(), expected, atol=1.6e-2, rtol=1.6e-2), (out.double() - expected).abs().max()
    # bf16's half-unit of the output's largest values, no more: the scores themselves agree to float32 rounding
    assert (out.double() - float32_scores.double()).abs().max() <= 2**-8 * expected.abs().max() + 1e-6


def test_scores_that_rise_block_after_block_rescale_the_sums_each_time(kernel):
    """Every 32-key block holds a new maximum, 2 to 3 e-folds above the last: the AMX path's running sums
    are rescaled at every block (its exp2 taken on base-2 scores), and the output must still be the
    softmax's, weighted towards the latest keys."""
    torch.manual_seed(7)
    length = 200
    direction = torch.nn.functional.normalize(torch.randn(64), dim=0)
    k_cache = (torch.arange(length).float()[:, None, None] * 0.6 * direction + 0.3 * torch.randn(length, 1, 64)).bfloat16()
    v_cache = torch.randn(length, 1, 64).bfloat16()
    q = (direction * 8 + 0.1 * torch.randn(length, 2, 64)).bfloat16()
    slots = torch.arange(length)
    out = kernel(q, k_cache, v_cache, slots, 0, 0, 64**-0.5)
    expected = reference(q, k_cache, v_cache, [slots.tolist()] * length, list(range(length)), 64**-0.5, None)
    assert torch.allclose(out.double(), expected, atol=1.6e-2, rtol=1.6e-2), (out.double() - expected).abs().max()


def test_bf16_calls_of_shrinking_then_growing_contexts_each_match_the_reference(kernel):
    """The packed keys and values live in a buffer the calling thread keeps between calls: a short call
    after a long one must not read the long one's leftovers, nor a long one after it overrun the buffer."""
    torch.manual_seed(8)
    k_cache = (torch.randn(1200, 3, 64) * 2).bfloat16()
    v_cache = torch.randn(1200, 3, 64).bfloat16()
    for start, length in [(1000, 100), (0, 20), (5, 40), (700, 450)]:
        slots = torch.randperm(k_cache.shape[0])[: start + length]
        q = torch.randn(length, 9, 64).bfloat16()
        out = kernel(q, k_cache, v_cache, slots, start, 0, 0.125)
        positions = list(range(start, start + length))
        expected = reference(q, k_cache, v_cache, [slots.tolist()] * length, positions, 0.125, None)
        assert torch.allclose(out.double(), expected, atol=1.6e-2, rtol=1.6e-2), (start, length)
