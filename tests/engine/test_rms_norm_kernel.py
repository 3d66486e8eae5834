"""zenserve's RMSNorm kernel and its residual-add form (engine/kernels/rms_norm.cpp, KernelRMSNorm)
against F.rms_norm and a float64 reference."""

from __future__ import annotations

import pytest
import torch

import engine.kernels as kernels
from engine.config import ModelConfig
from engine.kv_cache_spec import make_kv_cache_layout
from engine.model_loader import load_model
from engine.models.kernel_rms_norm import KernelRMSNorm
from engine.models.llama import RMSNorm
from engine.worker import create_worker
from engine.worker.cpu import zentorch_available


@pytest.fixture(scope="module")
def norm_kernels(cpu_kernels):
    return kernels.load_rms_norm()


def _norm(width: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(width, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return norm.to(dtype)


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, width", [(1, 576), (16, 576), (158, 576), (3, 37)])
def test_the_kernel_matches_f_rms_norm(norm_kernels, dtype, rows, width):
    norm = _norm(width, dtype, rows + width)
    x = (torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
    fused = KernelRMSNorm(norm, norm_kernels)
    y = fused(x)
    expected = norm(x)  # F.rms_norm
    assert y.dtype == dtype and y.shape == x.shape
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-20
    assert ((y.double() - expected.double()).abs() <= expected.double().abs() * ulp + 1e-6).all()
    exact = _reference(x, norm.weight, norm.eps)
    assert ((y.double() - exact).abs() <= exact.abs() * ulp + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_add_form_updates_the_residual_and_normalizes_it_in_place(norm_kernels, dtype):
    norm = _norm(576, dtype, 1)
    g = torch.Generator().manual_seed(2)
    x, residual = torch.randn(9, 576, generator=g).to(dtype), torch.randn(9, 576, generator=g).to(dtype)
    expected_residual = x + residual
    expected = norm(expected_residual)
    out, new_residual = KernelRMSNorm(norm, norm_kernels).add_forward(x.clone(), residual)
    assert new_residual.data_ptr() == residual.data_ptr()  # in place
    assert torch.equal(new_residual, expected_residual)  # rounded as torch's add rounds it
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-20
    assert ((out.double() - expected.double()).abs() <= expected.double().abs() * ulp + 1e-6).all()


def test_other_shapes_take_f_rms_norm(norm_kernels):
    norm = _norm(64, torch.bfloat16, 3)
    fused = KernelRMSNorm(norm, norm_kernels)
    batch = torch.randn(2, 5, 64).bfloat16()
    assert torch.equal(fused(batch), norm(batch))
    transposed = torch.randn(64, 7).bfloat16().t()
    assert torch.equal(fused(transposed), norm(transposed))
    x, residual = torch.randn(2, 5, 64).bfloat16(), torch.randn(2, 5, 64).bfloat16()
    out, new_residual = fused.add_forward(x, residual)
    assert torch.equal(new_residual, x + residual) and torch.equal(out, norm(x + residual))


def test_the_eager_worker_puts_the_layers_norms_on_the_kernel(norm_kernels):
    loaded = load_model(ModelConfig(dtype="bfloat16"))
    layer = loaded.model.model.layers[0]
    before = layer.input_layernorm
    x = torch.randn(4, before.weight.shape[0]).bfloat16()
    expected = before(x)
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 4 * 1024 * 1024)
    create_worker("eager", loaded.model, layout, loaded.dtype)
    assert isinstance(layer.input_layernorm, KernelRMSNorm) and isinstance(layer.post_attention_layernorm, KernelRMSNorm)
    assert isinstance(loaded.model.model.norm, KernelRMSNorm)
    y = layer.input_layernorm(x)
    assert ((y.float() - expected.float()).abs() <= expected.float().abs() * 2**-7 + 1e-6).all()


@pytest.mark.skipif(not zentorch_available(), reason="zentorch is not installed")
@pytest.mark.parametrize("avx512", [False, True])
@pytest.mark.parametrize("built", [True, False])
def test_the_zentorch_worker_takes_zentorchs_norms_only_where_zenserves_kernel_is_not_built(
        monkeypatch, norm_kernels, avx512, built):
    # zenserve's kernel lets decode-only steps run their layers in one call (faster on a Zen 4, BENCHMARKS.md);
    # zentorch's norms, 3-11x slower than it on AVX2, stand in for it on AVX-512 only.
    import engine.worker.cpu as cpu

    monkeypatch.setattr(cpu, "has_avx512", lambda: avx512)
    if not built:
        monkeypatch.setattr(cpu, "load_rms_norm", lambda: None)
    loaded = load_model(ModelConfig(dtype="float32"))
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 4 * 1024 * 1024)
    create_worker("zentorch", loaded.model, layout, loaded.dtype)
    expected = cpu.ZentorchRMSNorm if avx512 and not built else KernelRMSNorm if built else RMSNorm
    for layer in loaded.model.model.layers:
        assert type(layer.input_layernorm) is expected and type(layer.post_attention_layernorm) is expected
    assert type(loaded.model.model.norm) is expected
