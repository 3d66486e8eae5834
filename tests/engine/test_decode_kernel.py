"""The C++ decode-attention kernel (engine/kernels) against a float64 reference and the torch path."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import engine.kernels as kernels
from engine.attention import build_attention_metadata, paged_attention
from tests.engine.test_attention import BLOCK, reference


@pytest.fixture(scope="module")
def kernel(cpu_kernels):
    return kernels.load_paged_decode_attention()


# bf16 with head sizes 64 and 128 and groups of 1-8 take the AVX-512 path; other shapes and dtypes the
# generic loop.
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 4e-3), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim",
    [(9, 3, 64), (8, 1, 64), (12, 6, 128), (4, 4, 128), (10, 1, 64), (9, 3, 16), (6, 2, 80)],
)
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_the_kernel_matches_per_head_attention(kernel, dtype, tolerance, num_heads, num_kv_heads, head_dim, sliding_window):
    torch.manual_seed(0)
    k_cache = torch.randn(40 * BLOCK, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(40 * BLOCK, num_kv_heads, head_dim).to(dtype)
    # Scattered blocks, different lengths (one of a single token), padding in the slot table.
    contexts = [([7, 2, 30], 11), ([5], 1), ([1, 9, 3, 12, 20], 18), ([33, 34, 35, 36, 37, 38, 39], 26)]
    meta, positions = build_attention_metadata(
        contexts, [], BLOCK, sliding_window, torch.device("cpu"), decode_kernel=kernel
    )
    q = torch.randn(len(contexts), num_heads, head_dim).to(dtype)
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    slots = [[b * BLOCK + i for b in blocks for i in range(BLOCK)][:n] for blocks, n in contexts]
    expected = reference(q, k_cache, v_cache, slots, positions.tolist(), head_dim**-0.5, sliding_window)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.allclose(out.double(), expected, atol=tolerance, rtol=tolerance), (out.double() - expected).abs().max()
    # At least as close as the torch path it replaces.
    torch_path = paged_attention(q, k_cache, v_cache, dataclasses.replace(meta, decode_kernel=None), head_dim**-0.5)
    kernel_error = (out.double() - expected).abs().max()
    assert kernel_error <= (torch_path.double() - expected).abs().max() + 1e-6


def test_a_query_that_is_a_view_of_the_fused_projection_reads_its_strides(kernel):
    """The model hands attention q as a slice of the fused qkv output (rows farther apart than H * hd)."""
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    k_cache = torch.randn(16 * BLOCK, num_kv_heads, head_dim).bfloat16()
    v_cache = torch.randn(16 * BLOCK, num_kv_heads, head_dim).bfloat16()
    fused = torch.randn(2, num_heads + 2 * num_kv_heads, head_dim).bfloat16()
    q = fused[:, :num_heads]
    assert not q.is_contiguous()
    meta, _ = build_attention_metadata([([3, 4], 7), ([9], 2)], [], BLOCK, None, torch.device("cpu"), decode_kernel=kernel)
    out = paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(out, paged_attention(q.contiguous(), k_cache, v_cache, meta, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_millions_apart_give_the_winning_value_not_nan(kernel, dtype):
    """The kernels build with -ffast-math: exp of a hugely negative score must still be 0."""
    k_cache = torch.zeros(8, 1, 64, dtype=dtype)
    v_cache = torch.zeros(8, 1, 64, dtype=dtype)
    k_cache[0], k_cache[1], k_cache[2] = 100, -100, 50
    v_cache[0], v_cache[1], v_cache[2] = 1, 2, 3
    q = torch.full((1, 1, 64), 1000.0).to(dtype)  # scores 6.4e6, -6.4e6 and 3.2e6
    out = kernel(q, k_cache, v_cache, torch.arange(8).view(1, 8), torch.tensor([3]), 0, 1.0)
    assert torch.equal(out, torch.ones_like(out))


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 2, 128)])
def test_bf16_keys_scored_sixteen_positions_at_a_time_keep_each_position_its_score(kernel, num_heads, num_kv_heads, head_dim):
    """bf16 keys are scored 16 positions at a time, reduced together (exact multiples and tails)."""
    torch.manual_seed(2)
    k_cache = torch.randn(64 * BLOCK, num_kv_heads, head_dim).bfloat16()
    v_cache = torch.randn(64 * BLOCK, num_kv_heads, head_dim).bfloat16()
    order = torch.randperm(64).tolist()
    contexts = [(order[0:4], 16), (order[4:12], 32), (order[12:21], 33), (order[21:33], 47)]
    meta, positions = build_attention_metadata(contexts, [], BLOCK, None, torch.device("cpu"), decode_kernel=kernel)
    q = torch.randn(len(contexts), num_heads, head_dim).bfloat16()
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    slots = [[b * BLOCK + i for b in blocks for i in range(BLOCK)][:n] for blocks, n in contexts]
    expected = reference(q, k_cache, v_cache, slots, positions.tolist(), head_dim**-0.5)
    assert torch.allclose(out.double(), expected, atol=1.6e-2, rtol=1.6e-2), (out.double() - expected).abs().max()


@pytest.mark.parametrize("winner", [0, 5, 13, 15, 16, 19])
def test_the_one_key_that_wins_inside_a_group_of_sixteen_gives_its_value(kernel, winner):
    """Each lane of the 16-position reduction is its own position's score: a single winning key's value."""
    k_cache = torch.zeros(32, 1, 64, dtype=torch.bfloat16)
    v_cache = torch.arange(32, dtype=torch.bfloat16).view(32, 1, 1).expand(32, 1, 64).contiguous()
    k_cache[winner] = 1
    q = torch.full((1, 1, 64), 8.0).bfloat16()  # the winner's score 512, the others' 0
    out = kernel(q, k_cache, v_cache, torch.arange(32).view(1, 32), torch.tensor([20]), 0, 1.0)
    assert torch.equal(out, torch.full_like(out, float(winner)))


@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (3, 3), (8, 1), (16, 2)])
@pytest.mark.parametrize("sliding_window", [None, 21])
def test_bf16_64_wide_heads_on_every_context_shape(kernel, num_heads, num_kv_heads, sliding_window):
    """bf16 heads of 64 (on AMX's tiles where the CPU has them): contexts inside one block, at and around
    multiples of 16 and 32 (the tiles' positions), on consecutive blocks (keys loaded in place) and on
    scattered ones (gathered), long enough for the prefetch to run ahead."""
    torch.manual_seed(3)
    pool_blocks, block = 64, 16  # the engine's blocks: 16 slots
    k_cache = torch.randn(pool_blocks * block, num_kv_heads, 64).bfloat16()
    v_cache = torch.randn(pool_blocks * block, num_kv_heads, 64).bfloat16()
    order = torch.randperm(pool_blocks).tolist()
    contexts = [([4], 3), ([5, 6], 31), ([10, 11], 32), ([12, 13, 14], 33), (list(range(20, 42)), 350),
                (order[0:9], 129), (order[9:13], 64), (order[13:39], 401)]
    slot_lists = [[b * block + i for b in blocks for i in range(block)][:n] for blocks, n in contexts]
    slot_lists.append(torch.randperm(pool_blocks * block)[:77].tolist())  # no two positions in neighbouring slots
    lens = torch.tensor([len(s) for s in slot_lists])
    slots = torch.zeros(len(slot_lists), int(lens.max()), dtype=torch.int64)
    for i, s in enumerate(slot_lists):
        slots[i, : len(s)] = torch.tensor(s)
    q = torch.randn(len(slot_lists), num_heads, 64).bfloat16()
    out = kernel(q, k_cache, v_cache, slots, lens, sliding_window or 0, 0.125)
    expected = reference(q, k_cache, v_cache, slot_lists, (lens - 1).tolist(), 0.125, sliding_window)
    assert torch.allclose(out.double(), expected, atol=1.6e-2, rtol=1.6e-2), (out.double() - expected).abs().max()
    # Within a bf16 rounding or two of the float32 kernel's answer on the same inputs.
    exact = kernel(q.float(), k_cache.float(), v_cache.float(), slots, lens, sliding_window or 0, 0.125)
    assert (out.float() - exact).abs().max() <= 2 * 2**-8 * exact.abs().max()


def test_decode_attention_runs_on_the_tiles_where_the_cpu_has_amx(cpu_kernels):
    from engine.cpu_features import has_amx_bf16

    assert kernels.paged_decode_attention_uses_amx() == has_amx_bf16()


def test_bad_arguments_raise_instead_of_reading_out_of_bounds(kernel):
    q = torch.randn(1, 9, 64).bfloat16()
    cache = torch.randn(8, 3, 64).bfloat16()
    slots = torch.arange(4).view(1, 4)
    with pytest.raises(RuntimeError, match="context length"):
        kernel(q, cache, cache, slots, torch.tensor([5]), 0, 0.125)  # more context than slots
    with pytest.raises(RuntimeError, match="context length"):
        kernel(q, cache, cache, slots, torch.tensor([0]), 0, 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel(q.float(), cache, cache, slots, torch.tensor([4]), 0, 0.125)
    with pytest.raises(RuntimeError, match="multiple"):
        kernel(torch.randn(1, 8, 64).bfloat16(), cache, cache, slots, torch.tensor([4]), 0, 0.125)


def test_cpu_workers_read_decode_attention_in_place(kernel):
    from engine.config import ModelConfig
    from engine.kv_cache_spec import make_kv_cache_layout
    from engine.worker.cpu import CPUWorker

    from engine.model_loader import load_model

    loaded = load_model(ModelConfig())
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 2**22)
    worker = CPUWorker(loaded.model, layout, loaded.dtype)
    assert worker.decode_kernel is kernel


def test_without_a_compiler_decode_attention_stays_on_torch_ops(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(**_):
        raise RuntimeError("g++: not found")

    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="engine.kernels"):
        assert kernels.load_paged_decode_attention() is None
    assert "g++: not found" in caplog.text
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setenv("ZENSERVE_NO_CPU_KERNELS", "1")
    assert kernels.load_paged_decode_attention() is None


@pytest.fixture(scope="module")
def block_kernel(kernel):
    return kernels.load_decode_attention_block()


def _rope_tables(max_positions: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., hd] in float64, rotate-half layout; cos, sin [..., hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.double() + rotated * sin.double()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (6, 2, 80)])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_the_attention_block_rotates_writes_the_cache_and_attends(
    block_kernel, dtype, tolerance, num_heads, num_kv_heads, head_dim, sliding_window
):
    torch.manual_seed(4)
    k_cache = torch.randn(40 * BLOCK, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(40 * BLOCK, num_kv_heads, head_dim).to(dtype)
    contexts = [([7, 2, 30], 11), ([5], 1), ([1, 9, 3, 12, 20], 18)]
    meta, positions = build_attention_metadata(
        contexts, [], BLOCK, sliding_window, torch.device("cpu"), decode_kernel=kernels.load_paged_decode_attention(),
        decode_block=block_kernel,
    )
    assert meta.decode_block is block_kernel and torch.equal(meta.decode_positions, positions)
    cos, sin = _rope_tables(64, head_dim)
    qkv = torch.randn(len(contexts), (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out = block_kernel(qkv, cos, sin, positions, k_cache, v_cache, meta.slot_mapping, meta.decode_slots,
                       meta.decode_context_lens, num_heads, meta.sliding_window, head_dim**-0.5)
    assert out.shape == (len(contexts), num_heads * head_dim) and out.dtype == dtype

    heads = qkv.double().view(len(contexts), num_heads + 2 * num_kv_heads, head_dim)
    rows_cos, rows_sin = cos[positions][:, None], sin[positions][:, None]
    q = _rope64(heads[:, :num_heads], rows_cos, rows_sin)
    k = _rope64(heads[:, num_heads : num_heads + num_kv_heads], rows_cos, rows_sin)
    v = heads[:, num_heads + num_kv_heads :]
    written = meta.slot_mapping
    assert torch.allclose(k_cache[written].double(), k, atol=tolerance, rtol=tolerance)
    assert torch.equal(v_cache[written].double(), v)  # copied as is
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(k_cache[untouched], k_before[untouched]) and torch.equal(v_cache[untouched], v_before[untouched])

    slots = [[b * BLOCK + i for b in blocks for i in range(BLOCK)][:n] for blocks, n in contexts]
    expected = reference(q, k_cache, v_cache, slots, positions.tolist(), head_dim**-0.5, sliding_window)
    assert torch.allclose(out.double().view_as(expected), expected, atol=tolerance, rtol=tolerance)


def test_the_attention_block_refuses_positions_and_slots_it_cannot_hold(block_kernel):
    cos, sin = _rope_tables(8, 64)
    cache = torch.zeros(8, 3, 64).bfloat16()
    qkv = torch.randn(1, 15 * 64).bfloat16()
    slots, lens = torch.arange(4).view(1, 4), torch.tensor([4])
    with pytest.raises(RuntimeError, match="rotary table"):
        block_kernel(qkv, cos, sin, torch.tensor([8]), cache, cache.clone(), torch.tensor([3]), slots, lens, 9, 0, 0.125)
    with pytest.raises(RuntimeError, match="write slot"):
        block_kernel(qkv, cos, sin, torch.tensor([3]), cache, cache.clone(), torch.tensor([8]), slots, lens, 9, 0, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        block_kernel(qkv, cos.bfloat16(), sin.bfloat16(), torch.tensor([3]), cache, cache.clone(), torch.tensor([3]),
                     slots, lens, 9, 0, 0.125)


def test_decode_only_steps_of_a_llama_model_use_the_block_and_mixed_steps_do_not(block_kernel):
    from engine.config import ModelConfig
    from engine.kv_cache_spec import make_kv_cache_layout
    from engine.model_loader import load_model
    from engine.worker.cpu import CPUWorker

    loaded = load_model(ModelConfig())
    worker = CPUWorker(loaded.model, make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 2**22), loaded.dtype)
    assert worker.decode_block is block_kernel
    decode_only, _ = build_attention_metadata([([0], 3)], [], 16, None, torch.device("cpu"), decode_block=block_kernel)
    mixed, _ = build_attention_metadata([([0], 3)], [([1], 0, 4)], 16, None, torch.device("cpu"), decode_block=block_kernel)
    assert decode_only.decode_block is block_kernel and mixed.decode_block is None
