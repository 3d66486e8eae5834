"""int4_group_mm_q8: a float32 model's Q4_1 weights times its rows quantized to int8 a group of 32 at a
time, summed in integers (int8 activations, opt-in; engine/kernels/int4_group_mm.cpp)."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.models.packed_linear import Int4Groups, SmallBatchLinear

GROUP = 32


def _weights(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d = torch.rand(n, k // GROUP, generator=g) * 0.02
    mins = -torch.rand(n, k // GROUP, generator=g) * 0.1
    return q, d, mins


def _dense(q: torch.Tensor, d: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.double().view(n, -1, GROUP) * d.double()[..., None] + mins.double()[..., None]).view(n, k)


def _quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """Each group of 32 of each row as the kernel takes it: round(x / s) * s, s = absmax / 127."""
    groups = x.double().view(x.shape[0], -1, GROUP)
    scale = groups.abs().amax(-1, keepdim=True).float().double() / 127
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.round(groups / safe) * scale).view_as(x.double())


@pytest.mark.parametrize("rows,n,k", [(1, 96, 576), (3, 64, 64), (4, 40, 1536), (6, 96, 576), (9, 33, 96)])
def test_it_is_the_product_of_the_group_quantized_rows_and_the_dequantized_weight(cpu_kernels, rows, n, k):
    pack, _ = kernels.load_int4_group_mm()
    mm_q8 = kernels.load_int4_group_mm_q8()
    q, d, mins = _weights(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + 1)) * 3
    x[0, :GROUP] = 0  # a group with no range
    w = _dense(q, d, mins)
    y = mm_q8(x, pack(q), d, mins)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    # The minima's term takes x's exact group sums; the scales' term the quantized x.
    groups = x.double().view(rows, -1, GROUP)
    wq = q.double().view(n, -1, GROUP) * d.double()[..., None]
    expected = (torch.einsum("mgi,ngi->mn", _quantized_rows(x).view(rows, -1, GROUP), wq)
                + groups.sum(-1) @ mins.double().t())
    assert torch.allclose(y.double(), expected, atol=1e-5 * expected.abs().max().item(), rtol=0), (y - expected).abs().max()
    # And within int8's rounding of the exact product: half a level a value, times the weights.
    exact = x.double() @ w.t()
    level = groups.abs().amax(-1) / 127  # [rows, groups]
    bound = 0.5 * (level[:, None, :] * wq.abs().sum(-1)[None]).sum(-1)  # [rows, n]
    assert ((y.double() - exact).abs() <= bound * 1.001 + 1e-5).all()
    assert not torch.equal(y, kernels.load_int4_group_mm()[1](x, pack(q), d, mins))  # it did quantize


def test_bf16_rows_come_back_in_bf16(cpu_kernels):
    pack, mm = kernels.load_int4_group_mm()
    q, d, mins = _weights(48, 128, seed=3)
    x = torch.randn(2, 128).to(torch.bfloat16)
    y = kernels.load_int4_group_mm_q8()(x, pack(q), d, mins)
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), kernels.load_int4_group_mm_q8()(x.float(), pack(q), d, mins).to(torch.bfloat16).float())


def test_it_refuses_a_weight_that_does_not_fit_x(cpu_kernels):
    pack, _ = kernels.load_int4_group_mm()
    q, d, mins = _weights(8, 64, seed=4)
    with pytest.raises(RuntimeError, match="K as x's"):
        kernels.load_int4_group_mm_q8()(torch.randn(1, 96), pack(q), d, mins)


def test_only_a_float32_q4_1_copy_switches_to_int8_groups(cpu_kernels):
    q, d, mins = _weights(64, 128, seed=5)
    # Int4Groups keeps zero as Q4_1's minimum plus 8 scales (w = (q - 8) * scale + zero).
    packed = Int4Groups(q, d, mins + 8 * d)
    dense = torch.nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        dense.weight.copy_(_dense(q, d, mins).float())
    linear = SmallBatchLinear(dense, packed)
    assert linear.kind == "int4_groups"
    x = torch.randn(2, 128)
    exact = linear(x)
    assert linear.quantize_activations_q8() and linear.kind == "int4_groups_q8"
    y = linear(x)
    assert torch.equal(y, kernels.load_int4_group_mm_q8()(x, linear.packed_weight, linear.group_scales,
                                                                linear.group_mins))
    assert not torch.equal(y, exact) and torch.allclose(y, exact, atol=0.05 * exact.abs().max().item())
    assert not linear.quantize_activations_q8()  # once only: it is no longer the exact kind
    # Calls past the copy's rows stay on the dense weight.
    big = torch.randn(linear.max_rows + 1, 128)
    assert torch.equal(linear(big), dense(big))
