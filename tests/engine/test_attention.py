"""Paged attention against a plain per-sequence, per-head reference in float64."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.attention import build_attention_metadata, paged_attention, torch_prefill_sdpa
from engine.cpu_features import has_native_bf16
from engine.worker.cpu import zentorch_available

BLOCK = 4


def reference(q, k_cache, v_cache, slots_per_seq, query_positions, scale, sliding_window=None):
    """q: [T, H, hd]; one (context slots, query position) per row."""
    out = []
    group = q.shape[1] // k_cache.shape[1]
    for row, (slots, pos) in enumerate(zip(slots_per_seq, query_positions, strict=True)):
        keys = k_cache[slots].double().repeat_interleave(group, dim=1)  # [L, H, hd]
        values = v_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[row].double(), keys) * scale
        positions = torch.arange(len(slots))
        allowed = positions <= pos
        if sliding_window:
            allowed &= positions > pos - sliding_window
        scores[:, ~allowed] = -math.inf
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 4), (8, 1), (12, 6)])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_decodes_of_different_lengths_match_per_head_attention(dtype, tolerance, num_heads, num_kv_heads, sliding_window):
    torch.manual_seed(0)
    head_dim, num_blocks = 16, 40
    k_cache = torch.randn(num_blocks * BLOCK, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks * BLOCK, num_kv_heads, head_dim).to(dtype)
    # Three sequences of different lengths on scattered blocks (padding exercised).
    contexts = [([7, 2, 30], 11), ([5], 1), ([1, 9, 3, 12, 20], 18)]
    meta, positions = build_attention_metadata(contexts, [], BLOCK, sliding_window, torch.device("cpu"))
    q = torch.randn(len(contexts), num_heads, head_dim).to(dtype)
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    slots = [[b * BLOCK + i for b in blocks for i in range(BLOCK)][:n] for blocks, n in contexts]
    expected = reference(q, k_cache, v_cache, slots, positions.tolist(), head_dim**-0.5, sliding_window)
    assert out.dtype == dtype
    assert torch.allclose(out.double(), expected, atol=tolerance, rtol=tolerance), (out.double() - expected).abs().max()


def _prefill_kernels():
    kernels = [pytest.param(torch_prefill_sdpa, id="torch")]
    if zentorch_available():
        from engine.worker.cpu import zentorch_prefill_sdpa

        kernels.append(pytest.param(zentorch_prefill_sdpa, id="zentorch"))
    return kernels


@pytest.mark.parametrize("prefill_sdpa", _prefill_kernels())
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_a_decode_beside_prefill_chunks_matches_the_reference(prefill_sdpa, dtype, tolerance, sliding_window):
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim = 9, 3, 16
    k_cache = torch.randn(64 * BLOCK, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(64 * BLOCK, num_kv_heads, head_dim).to(dtype)
    decode = ([3, 8], 6)
    chunk = ([10, 11, 12], 5, 4)  # positions 5..8 of a 9-token context (a cached prefix: a mask)
    fresh = ([20, 21], 0, 7)  # a whole 7-token prompt (plain causal unless the window cuts it)
    meta, positions = build_attention_metadata(
        [decode], [chunk, fresh], BLOCK, sliding_window, torch.device("cpu"), prefill_sdpa
    )
    q = torch.randn(12, num_heads, head_dim).to(dtype)
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    decode_slots = [b * BLOCK + i for b in decode[0] for i in range(BLOCK)][:6]
    chunk_slots = [b * BLOCK + i for b in chunk[0] for i in range(BLOCK)][:9]
    fresh_slots = [b * BLOCK + i for b in fresh[0] for i in range(BLOCK)][:7]
    expected = reference(
        q, k_cache, v_cache, [decode_slots] + [chunk_slots] * 4 + [fresh_slots] * 7, positions.tolist(),
        head_dim**-0.5, sliding_window,
    )
    assert torch.allclose(out.double(), expected, atol=tolerance, rtol=tolerance), (out.double() - expected).abs().max()


def test_the_decode_head_pair_mask_is_built_once_per_step_and_marks_padding_and_other_heads():
    contexts = [([0, 1, 2, 3, 4], 20), ([5, 6], 5)]  # 20 and 5 tokens of context: the second is padded to 20
    meta, _ = build_attention_metadata(contexts, [], BLOCK, None, torch.device("cpu"))
    blocked = meta.decode_blocked_pairs(2)
    assert meta.decode_blocked_pairs(2) is blocked  # every layer of the step shares it
    assert blocked.shape == (2, 2, 1, 20, 2)
    # Query heads of KV head 0 see only KV head 0's keys, and only the real context.
    assert not blocked[0, 0, 0, :, 0].any() and blocked[0, 0, 0, :, 1].all()
    assert not blocked[1, 1, 0, :5, 1].any() and blocked[1, 1, 0, 5:, 1].all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_a_lone_decode_on_blocks_in_a_row_reads_a_view_with_the_same_result(dtype, sliding_window):
    torch.manual_seed(2)
    num_heads, num_kv_heads, head_dim = 9, 3, 16
    k_cache = torch.randn(40 * BLOCK, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(40 * BLOCK, num_kv_heads, head_dim).to(dtype)
    contexts = [([6, 7, 8, 3], 11)]  # 11 tokens use blocks 6, 7, 8 (the unused 4th block does not matter)
    meta, positions = build_attention_metadata(contexts, [], BLOCK, sliding_window, torch.device("cpu"))
    assert meta.decode_context_start == 6 * BLOCK
    q = torch.randn(1, num_heads, head_dim).to(dtype)
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    gathered = paged_attention(q, k_cache, v_cache, dataclasses.replace(meta, decode_context_start=None), head_dim**-0.5)
    assert torch.equal(out, gathered)
    slots = [6 * BLOCK + i for i in range(11)]
    expected = reference(q, k_cache, v_cache, [slots], positions.tolist(), head_dim**-0.5, sliding_window)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_decodes_off_a_single_run_of_blocks_are_gathered():
    def start(contexts):
        return build_attention_metadata(contexts, [], BLOCK, None, torch.device("cpu"))[0].decode_context_start

    assert start([([6, 8, 9], 11)]) is None  # a gap
    assert start([([6, 7], 5), ([8, 9], 5)]) is None  # two decodes: one batched gather
    assert start([([6, 7], 5)]) == 6 * BLOCK


def _decode_bmms():
    kernels = [pytest.param(torch.bmm, id="torch")]
    if zentorch_available() and has_native_bf16():  # zentorch's bf16 bmm needs AVX512_BF16 (the worker's too)
        kernels.append(pytest.param(torch.ops.zentorch.zentorch_bmm, id="zentorch"))
    return kernels


@pytest.mark.parametrize("decode_bmm", _decode_bmms())
def test_decode_bmm_kernels_match_the_reference(decode_bmm):
    """The worker's bmm (zentorch's on Zen) runs 16-bit decode attention, batched and alone."""
    torch.manual_seed(3)
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    k_cache = torch.randn(64 * BLOCK, num_kv_heads, head_dim).to(torch.bfloat16)
    v_cache = torch.randn(64 * BLOCK, num_kv_heads, head_dim).to(torch.bfloat16)
    for contexts in ([([7, 2, 30], 11), ([5], 1), ([1, 9, 3, 12, 20], 18)], [([10, 11, 12, 13], 15)]):
        meta, positions = build_attention_metadata(
            contexts, [], BLOCK, None, torch.device("cpu"), decode_bmm=decode_bmm
        )
        q = torch.randn(len(contexts), num_heads, head_dim).to(torch.bfloat16)
        out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
        slots = [[b * BLOCK + i for b in blocks for i in range(BLOCK)][:n] for blocks, n in contexts]
        expected = reference(q, k_cache, v_cache, slots, positions.tolist(), head_dim**-0.5)
        assert torch.allclose(out.double(), expected, atol=3e-2, rtol=3e-2), (out.double() - expected).abs().max()


def test_a_lone_prefill_chunk_returns_the_kernels_output_and_several_are_copied_into_the_steps():
    # The kernel here is a stand-in that records each call's queries and returns a fresh tensor of them
    # plus the chunk's start: a lone chunk's result must be that tensor itself, several chunks' must be
    # assembled row for row in the step's order.
    calls = []

    def kernel(q, k_cache, v_cache, slots, start, window, scale):
        result = q + start
        calls.append(result)
        return result

    k_cache = v_cache = torch.zeros(64, 3, 64)
    lone, _ = build_attention_metadata([], [([0, 1], 2, 5)], 16, None, torch.device("cpu"), prefill_kernel=kernel)
    q = torch.randn(5, 9, 64)
    out = paged_attention(q, k_cache, v_cache, lone, 0.125)
    assert out is calls[-1] and torch.equal(out, q + 2)

    two, _ = build_attention_metadata([], [([0], 0, 3), ([1, 2], 4, 6)], 16, None, torch.device("cpu"),
                                      prefill_kernel=kernel)
    q = torch.randn(9, 9, 64)
    out = paged_attention(q, k_cache, v_cache, two, 0.125)
    assert all(out is not c for c in calls[-2:])
    assert torch.equal(out[:3], q[:3]) and torch.equal(out[3:], q[3:] + 4)
