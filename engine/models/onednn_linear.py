"""A bf16 Linear on oneDNN's matmul with the weight reordered once into oneDNN's blocked layout.

On a CPU with AMX (Intel Xeon since Sapphire Rapids) oneDNN runs bf16 GEMMs on the tile unit, which
zenserve's AVX512_BF16 kernel (engine/kernels/bf16_linear.cpp) does not use. SmolLM2's projections x
30 layers, 2 Xeon cores (BENCHMARKS.md): 16 rows 11.7 ms against the kernel's 29.5, 64 rows 17.9
against 102, 286 rows (4 layers) 6.7 against 55.5. The weight reordered up front spares the per-call
reorder that torch's own Linear pays (16 rows: 19.5 ms, 64 rows: 29.4).

These are the ops torch's inductor emits for its own oneDNN fusions (`torch.ops.mkldnn`).
"""

from __future__ import annotations

import torch
from torch import nn

# oneDNN picks the blocked weight layout for a problem size; one layout serves every row count.
# On SmolLM2's shapes, the layout for 64 rows was as fast as each row count's own from 8 to 1,024.
_LAYOUT_ROWS = 64


class OneDnnLinear(nn.Module):
    """y = x W^T + b in bf16. The reordered weight is a copy: the source weight stays valid for whatever
    else holds it (a tied embedding)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), _LAYOUT_ROWS)
        self.register_buffer("blocked_weight", blocked, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.blocked_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, oneDNN blocked"
