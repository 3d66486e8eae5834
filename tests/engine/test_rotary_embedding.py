"""The in-place rotary embedding of prefill steps (engine/kernels/rotary_embedding.cpp) against float64,
torch's ops and the engine's torch path."""

from __future__ import annotations

import pytest
import torch

import engine.kernels as kernels
from engine.models.rope import apply_rope


@pytest.fixture(scope="module")
def kernel(cpu_kernels):
    return kernels.load_rotary_embedding()


def _tables(head_dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    freqs = torch.outer(positions.double(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _exact(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xd = x.double()
    rotated = torch.cat((-xd[..., half:], xd[..., :half]), dim=-1)
    return xd * cos[:, None] + rotated * sin[:, None]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2**-8)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_q_and_k_of_the_fused_projection_rotate_in_place_and_v_stays(kernel, dtype, tolerance, head_dim):
    torch.manual_seed(0)
    T, heads, kv_heads = 37, 9, 3
    qkv = (torch.randn(T, (heads + 2 * kv_heads) * head_dim) * 3).to(dtype)
    before = qkv.clone()
    positions = torch.randint(0, 8000, (T,))
    cos, sin = _tables(head_dim, positions)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(T, heads + kv_heads, head_dim)  # strided rows
    out = kernel(qk, cos.float(), sin.float())
    assert out.data_ptr() == qk.data_ptr()
    exact = _exact(before[:, : (heads + kv_heads) * head_dim].view(T, heads + kv_heads, head_dim), cos.float().double(),
                   sin.float().double())
    error = (qk.double() - exact).abs() / exact.abs().clamp_min(1)
    assert error.max() <= tolerance
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], before[:, (heads + kv_heads) * head_dim :])
    if dtype == torch.bfloat16:  # one rounding, not torch's five: at least as close to float64
        torch_path = apply_rope(before[:, : (heads + kv_heads) * head_dim].view(T, heads + kv_heads, head_dim),
                                cos.to(dtype)[:, None], sin.to(dtype)[:, None])
        torch_error = (torch_path.double() - exact).abs() / exact.abs().clamp_min(1)
        assert error.mean() < torch_error.mean()


def test_the_tables_and_shapes_are_checked(kernel):
    x = torch.randn(4, 3, 64)
    cos = torch.ones(4, 64)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(x, cos.double(), cos.double())
    with pytest.raises(RuntimeError, match="one row per row"):
        kernel(x, torch.ones(5, 64), torch.ones(5, 64))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(torch.randn(4, 64, 3).transpose(1, 2), cos, cos)


def test_the_embedded_model_prefills_on_it_as_on_torchs_ops(kernel, smollm_fp32):
    from engine.attention import build_attention_metadata
    from engine.kv_cache_spec import make_kv_cache_layout

    model = smollm_fp32.model
    layout = make_kv_cache_layout(smollm_fp32.arch, 16, torch.float32, 2**22)
    spec = layout.groups[0].spec
    calls = []

    def counted(x, cos, sin):
        calls.append(x.shape)
        return kernel(x, cos, sin)

    logits = []
    for rope_kernel in (None, counted):
        caches = [(torch.zeros(64, spec.num_kv_heads, spec.cache_row_size), torch.zeros(64, spec.num_kv_heads, spec.cache_row_size))
                  for _ in range(layout.num_layers)]
        meta, positions = build_attention_metadata([], [([0, 1], 0, 20)], 16, None, torch.device("cpu"), rope_kernel=rope_kernel)
        with torch.inference_mode():
            hidden = model(torch.arange(100, 120), positions, caches, meta)
            logits.append(model.compute_logits(hidden[-1:]))
    assert len(calls) == smollm_fp32.arch.num_hidden_layers  # q and k as one view, once a layer
    assert torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    assert logits[0].argmax() == logits[1].argmax()
