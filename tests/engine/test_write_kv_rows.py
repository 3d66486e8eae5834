"""The cache write of steps without the decode block (engine/kernels/write_kv_rows.cpp) against torch's
index_copy_, and the engine's write_kv choosing between them."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.attention import write_kv


@pytest.fixture(scope="module")
def kernel(cpu_kernels):
    return kernels.load_write_kv_rows()


def _caches(dtype, slots=64, heads=3, dim=64):
    return torch.zeros(slots, heads, dim, dtype=dtype), torch.zeros(slots, heads, dim, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_rows_of_the_fused_projection_land_in_their_slots_as_index_copy_puts_them(kernel, dtype, rows):
    torch.manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).to(dtype)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)  # strided rows, as the model's
    v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    slots = torch.randperm(256)[:rows]  # scattered, as blocks are
    expected_k, expected_v = _caches(dtype, 256)
    expected_k.index_copy_(0, slots, k)
    expected_v.index_copy_(0, slots, v)
    k_cache, v_cache = _caches(dtype, 256)
    k_cache[slots] = 7  # stale rows are overwritten
    kernel(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_heads_apart_in_memory_are_copied_one_at_a_time(kernel):
    k_cache, v_cache = _caches(torch.float32)
    wide = torch.randn(4, 3, 128)
    k, v = wide[:, :, :64], wide[:, :, 64:]  # each head's 64 values, then a gap of 64
    slots = torch.tensor([5, 0, 63, 17])
    kernel(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    assert k_cache.count_nonzero() == k.count_nonzero()


def test_bad_slots_and_shapes_are_refused_before_anything_is_written(kernel):
    k_cache, v_cache = _caches(torch.float32)
    k = torch.randn(2, 3, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(k_cache, v_cache, k, k, torch.tensor([3, 64]))
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(k_cache, v_cache, k, k, torch.tensor([-1, 3]))
    assert k_cache.count_nonzero() == 0
    with pytest.raises(RuntimeError, match="dtype"):
        kernel(k_cache, v_cache, k.double(), k.double(), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="one per row"):
        kernel(k_cache, v_cache, k, k, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="KVH and D"):
        kernel(k_cache, v_cache, torch.randn(2, 4, 64), torch.randn(2, 4, 64), torch.tensor([0, 1]))


def test_write_kv_takes_the_kernel_for_the_caches_own_dtype_only(kernel):
    calls = []

    def counted(*args):
        calls.append(args[2].dtype)
        kernel(*args)

    k = torch.randn(6, 3, 64)
    slots = torch.tensor([9, 2, 4, 0, 11, 30])
    same = _caches(torch.float32)
    write_kv(*same, k, k * 2, slots, counted)
    assert calls == [torch.float32]
    assert torch.equal(same[0][slots], k) and torch.equal(same[1][slots], k * 2)
    # A float16 cache under a float32 model: converted, then written by index_copy_ as before.
    half = _caches(torch.float16)
    write_kv(*half, k, k, slots, counted)
    assert calls == [torch.float32]
    assert torch.equal(half[0][slots], k.half())
