"""The bf16 GEMM on AVX512_BF16 pair products (engine/kernels/bf16_linear.cpp, Bf16PairLinear)."""

from __future__ import annotations

import pytest
import torch

import engine.kernels as kernels
from engine.config import ModelConfig
from engine.kv_cache_spec import make_kv_cache_layout
from engine.model_loader import load_model
from engine.models.bf16_linear import Bf16PairLinear, can_pack
from engine.models.packed_linear import SmallBatchLinear
from engine.worker import create_worker
from engine.worker.cpu import zentorch_available


@pytest.fixture(scope="module")
def bf16_kernels(cpu_kernels):
    found = kernels.load_bf16_linear()
    if found is None:
        pytest.skip("this CPU has no AVX512_BF16")
    return found


def _exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y if bias is None else y + bias.double()


# Row counts around the kernel's tiles (up to 32 rows a call: tiles of at most 12, split evenly, so 13 is
# 7 + 6 and 25 is 9 + 9 + 7; 8 beyond) and 64-row tasks;
# shapes with one 16-column block, an odd number of them (a lone block after the pairs), and SmolLM2's.
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 12, 13, 25, 32, 33, 64, 65, 130])
@pytest.mark.parametrize("out_features, in_features", [(16, 2), (48, 10), (960, 576), (576, 1536)])
def test_bf16_linear_is_one_rounding_of_the_exact_product(bf16_kernels, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * out_features + in_features)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    layer = Bf16PairLinear(w, bias, bf16_kernels)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    exact = _exact(x, w, bias.float())
    # bf16 rounding (2^-9 relative) plus float32 summation over K terms.
    tolerance = exact.abs() * 2**-8 + 1e-5 * in_features
    assert ((y.double() - exact).abs() <= tolerance).all()


def test_a_rows_result_does_not_depend_on_the_calls_row_count(bf16_kernels):
    """Calls of up to 32 rows take tiles of at most 12 rows with a prefetch, larger ones 8-row tiles: every row
    sums its products in the same order either way, so a decode's output does not change with the
    batch it ran in."""
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(960, 576, generator=g) * 0.05).bfloat16()
    layer = Bf16PairLinear(w, torch.randn(960, generator=g).bfloat16(), bf16_kernels)
    x = torch.randn(40, 576, generator=g).bfloat16()
    many = layer(x)
    for rows in (1, 7, 12, 13, 32):
        assert torch.equal(layer(x[:rows]), many[:rows])


def test_bf16_linear_reads_strided_rows_and_3d_input(bf16_kernels):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=g).bfloat16()
    layer = Bf16PairLinear(w, None, bf16_kernels)
    wide = torch.randn(10, 128, generator=g).bfloat16()
    strided = wide[:, :64]  # row stride 128
    assert torch.equal(layer(strided), layer(strided.contiguous()))
    batch = torch.randn(2, 5, 64, generator=g).bfloat16()
    assert torch.equal(layer(batch), layer(batch.reshape(10, 64)).view(2, 5, 32))


@pytest.mark.skipif(not zentorch_available(), reason="zentorch is not installed")
@pytest.mark.parametrize("rows", [1, 12, 16, 29, 172])
def test_bf16_linear_matches_zentorch_to_the_bit(bf16_kernels, rows):
    """Swapping zentorch's GEMM for this one leaves the served bf16 model's outputs unchanged."""
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(3072, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    packed = torch.ops.zentorch.zentorch_weight_prepack_for_linear(w)
    expected = torch.ops.zentorch.zentorch_linear_unary(x, packed, None, is_weight_prepacked=True)
    assert torch.equal(Bf16PairLinear(w, None, bf16_kernels)(x), expected)


def test_bf16_linear_rejects_shapes_it_cannot_pack(bf16_kernels):
    pack, linear = bf16_kernels
    assert not can_pack(torch.zeros(24, 8)) and not can_pack(torch.zeros(16, 7)) and can_pack(torch.zeros(32, 8))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        pack(torch.zeros(24, 8, dtype=torch.bfloat16))
    packed = pack(torch.zeros(16, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="columns"):
        linear(torch.zeros(2, 10, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        linear(torch.zeros(2, 8), packed, None)


@pytest.mark.skipif(not zentorch_available(), reason="zentorch is not installed")
def test_zentorch_worker_runs_bf16_projections_on_the_kernel(bf16_kernels):
    loaded = load_model(ModelConfig(dtype="bfloat16"))
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 4 * 1024 * 1024)
    create_worker("zentorch", loaded.model, layout, loaded.dtype)
    attn = loaded.model.model.layers[0].self_attn
    # The int4 copy keeps the few-row calls; the kernel takes the rest.
    assert isinstance(attn.qkv_proj, SmallBatchLinear) and isinstance(attn.qkv_proj.dense, Bf16PairLinear)
    x = torch.randn(attn.qkv_proj.max_rows + 1, attn.qkv_proj.in_features).bfloat16()
    assert torch.equal(attn.qkv_proj(x), attn.qkv_proj.dense(x))


def test_eager_worker_runs_bf16_projections_on_the_kernel(bf16_kernels, monkeypatch):
    import engine.models.onednn_linear as onednn_linear

    # A CPU with AMX puts them on oneDNN instead (tests/engine/test_onednn_linear.py): here, one without.
    monkeypatch.setattr(onednn_linear, "has_amx_bf16", lambda: False)
    loaded = load_model(ModelConfig(dtype="bfloat16"))
    mlp = loaded.model.model.layers[0].mlp
    torch_linear = mlp.gate_up_proj.dense
    x = torch.randn(mlp.gate_up_proj.max_rows + 1, torch_linear.in_features).bfloat16()  # past the int4 copy
    expected = _exact(x, torch_linear.weight, None)
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 4 * 1024 * 1024)
    create_worker("eager", loaded.model, layout, loaded.dtype)
    assert isinstance(mlp.gate_up_proj.dense, Bf16PairLinear) and isinstance(mlp.down_proj.dense, Bf16PairLinear)
    assert ((mlp.gate_up_proj(x).double() - expected).abs() <= expected.abs() * 2**-8 + 1e-2).all()


def test_float32_models_keep_torchs_linear(bf16_kernels):
    # A model of its own: the session's shared one may already be another worker's (on a Zen the `auto`
    # worker of an earlier test put zentorch's GEMM in place there).
    loaded = load_model(ModelConfig(dtype="float32"))
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 4 * 1024 * 1024)
    create_worker("eager", loaded.model, layout, loaded.dtype)
    o_proj = loaded.model.model.layers[0].self_attn.o_proj
    # Where the few-row 4-bit kernels build, the projection is a SmallBatchLinear: its larger calls
    # stay on torch's float32 Linear all the same.
    assert type(getattr(o_proj, "dense", o_proj)) is torch.nn.Linear
