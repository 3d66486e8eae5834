"""The one-pass gated activation (engine/kernels/silu_and_mul.cpp) against float64 and torch's ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.kernels as kernels
from engine.models.llama import MLP


@pytest.fixture(scope="module")
def kernel(cpu_kernels):
    return kernels.load_silu_and_mul()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_silu_and_mul_matches_float64_at_least_as_closely_as_torch(kernel, dtype, tolerance, rows):
    torch.manual_seed(0)
    gate_up = (torch.randn(rows, 2 * 200) * 4).to(dtype)  # large gates: silu's tails and exp's range
    exact = F.silu(gate_up[:, :200].double()) * gate_up[:, 200:].double()
    out = kernel(gate_up)
    assert out.shape == (rows, 200) and out.dtype == dtype
    error = (out.double() - exact).abs() / exact.abs().clamp_min(1)
    assert error.max() <= tolerance
    if dtype != torch.float32:  # one rounding instead of two (float32: both within a few ulp)
        torch_error = (MLP.silu_and_mul(gate_up).double() - exact).abs() / exact.abs().clamp_min(1)
        assert error.max() <= torch_error.max() + 1e-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_stays_finite_where_exp_overflows(kernel, dtype):
    """silu's limits (0 far below zero, the gate far above), not NaN from an overflowing exp."""
    gates = torch.tensor([-1e4, -100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, 1e4] * 2)
    gate_up = torch.cat([gates, torch.full_like(gates, 2.0)])[None].to(dtype)
    out = kernel(gate_up).double()
    expected = (F.silu(gates.to(dtype).double()) * 2.0)[None]
    assert torch.isfinite(out).all()
    assert torch.allclose(out, expected, rtol=1e-2, atol=1e-6)


def test_silu_and_mul_reads_rows_of_a_wider_tensor(kernel):
    wide = torch.randn(3, 2 * 64 + 32).bfloat16()
    view = wide[:, : 2 * 64]
    assert not view.is_contiguous()
    assert torch.equal(kernel(view), kernel(view.contiguous()))
    with pytest.raises(RuntimeError, match="2 I"):
        kernel(torch.randn(2, 7))


@pytest.mark.parametrize("dtype, avx512_bf16, avx512, every_call", [
    ("bfloat16", True, True, True), ("bfloat16", False, True, False),
    ("float32", False, False, True),  # AVX2 alone (a Zen 3): glibc's AVX2 exp beats torch's at every size
    ("float32", True, True, False),
])
def test_cpu_workers_use_it_for_every_call_where_it_wins_else_for_decode_sized_ones(kernel, monkeypatch, dtype,
                                                                                    avx512_bf16, avx512, every_call):
    from engine.config import ModelConfig
    from engine.kv_cache_spec import make_kv_cache_layout
    from engine.model_loader import load_model
    import engine.worker.cpu as cpu

    monkeypatch.setattr(cpu, "has_avx512_bf16", lambda: avx512_bf16)
    monkeypatch.setattr(cpu, "has_avx512", lambda: avx512)
    monkeypatch.setattr(cpu, "has_avx2", lambda: True)
    loaded = load_model(ModelConfig(dtype=dtype))
    cpu.CPUWorker(loaded.model, make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 2**22), loaded.dtype)
    mlp = loaded.model.model.layers[0].mlp
    torch.manual_seed(1)
    small = (torch.randn(cpu.MAX_ROWS_SILU_AND_MUL, 64) * 4).to(loaded.dtype)
    large = (torch.randn(cpu.MAX_ROWS_SILU_AND_MUL + 1, 64) * 4).to(loaded.dtype)
    assert torch.equal(mlp.silu_and_mul(small), kernel(small))
    assert torch.equal(mlp.silu_and_mul(large), kernel(large) if every_call else MLP.silu_and_mul(large))
    assert not torch.equal(kernel(large), MLP.silu_and_mul(large))  # the two paths round differently
