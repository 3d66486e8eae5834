"""An RMSNorm over the hidden size on zenserve's kernel (engine/kernels/rms_norm.cpp), with the residual
add joined to it. torch's CPU rms_norm runs ~8 ops, each a pass over the rows: in a W2-like run on an
Intel Xeon it took 12% of the op time (BENCHMARKS.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import RmsNormKernels


class KernelRMSNorm(nn.Module):
    """Takes the place of a model's RMSNorm; other input (not 2-D and contiguous, another dtype) takes
    F.rms_norm as before."""

    def __init__(self, norm: nn.Module, kernels: RmsNormKernels):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.norm_kernel, self.add_norm_kernel = kernels
        self.register_buffer("weight_f32", norm.weight.detach().float().contiguous(), persistent=False)

    def _fits(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float32) and x.is_cpu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fits(x):
            return self.norm_kernel(x, self.weight_f32, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: residual += x, then x = norm(residual) (the model lets a fused kernel reuse both)."""
        if self._fits(x) and residual.is_contiguous() and residual.dtype == x.dtype and residual.shape == x.shape:
            self.add_norm_kernel(x, residual, self.weight_f32, self.eps)
            return x, residual
        residual = x + residual
        return self.forward(residual), residual
