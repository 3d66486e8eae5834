"""A bf16 Linear on zenserve's AVX512_BF16 kernel (engine/kernels/bf16_linear.cpp).

The weight is packed once so that one 64-byte load holds two K-neighbours of 16 output columns, the
operand layout of VDPBF16PS (bf16 pair products summed in float32). On SmolLM2's projections, 30
layers' weights read from memory, 2 Zen 5 cores: 16 rows 14.5 ms against zentorch's prepacked GEMM
15.5-19 ms, 8 rows 12.3 vs 15.0, 172 rows 104 vs 111, and within 3% at 2,048 (BENCHMARKS.md). Its
sums match zentorch's to the bit on those shapes; both round the float32 sums to bf16 once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.kernels import Bf16Linear

PACKED_COLUMNS = 16  # the kernel's column block: out_features must be a multiple


def can_pack(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight's shape: [N, K] with N a multiple of 16 and K even."""
    n, k = weight.shape
    return n % PACKED_COLUMNS == 0 and k % 2 == 0


class Bf16PairLinear(nn.Module):
    """y = x W^T + b, bf16 in and out. The packed tensor is a copy: the source weight stays valid
    for whatever else holds it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernels: tuple[Callable[[torch.Tensor], torch.Tensor], Bf16Linear]):
        super().__init__()
        pack, self.kernel = kernels
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            packed = pack(weight.detach().to(torch.bfloat16))
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.kernel(x.reshape(-1, x.shape[-1]).contiguous(), self.packed_weight, self.bias).view(
                *x.shape[:-1], self.out_features)
        return self.kernel(x if x.stride(-1) == 1 else x.contiguous(), self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, bf16 pairs"
