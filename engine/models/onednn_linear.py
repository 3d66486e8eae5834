"""A bf16 Linear on oneDNN's matmul with the weight reordered once into oneDNN's blocked layout.

On a CPU with AMX (Intel Xeon since Sapphire Rapids) oneDNN runs bf16 GEMMs on the tile unit, which
zenserve's AVX512_BF16 kernel (engine/kernels/bf16_linear.cpp) does not use. SmolLM2's projections x
30 layers, 2 Xeon cores (BENCHMARKS.md): 16 rows 11.7 ms against the kernel's 29.5, 64 rows 17.9
against 102, 286 rows (4 layers) 6.7 against 55.5. The weight reordered up front spares the per-call
reorder that torch's own Linear pays (16 rows: 19.5 ms, 64 rows: 29.4).

These are the ops torch's inductor emits for its own oneDNN fusions (`torch.ops.mkldnn`).

For some shapes and row counts oneDNN's own threading leaves cores idle; there the rows are shared out
among the threads instead (engine/kernels/onednn_rows.cpp), at the row counts `plan_row_splits`
measured a gain for when the worker started.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from engine.kernels import OneDnnSplitRows

# oneDNN picks the blocked weight layout for a problem size; one layout serves every row count.
# On SmolLM2's shapes, the layout for 64 rows was as fast as each row count's own from 8 to 1,024.
_LAYOUT_ROWS = 64

# Row counts are planned in buckets of this many rows: on 2 Xeon cores the row counts where oneDNN's
# threading idled a core formed windows some hundreds of rows wide (onednn_rows.cpp).
ROW_BUCKET = 128
# Buckets measured: beyond, oneDNN's own threading used both cores on every shape measured.
MAX_PLANNED_ROWS = 1536
# A split must take at most this share of oneDNN's time: a clear gain, not the machine's noise.
SPLIT_GAIN = 0.85
# Weights larger than this are never split: each thread would stream all of it (the lm_head's 57 MB).
MAX_SPLIT_WEIGHT_BYTES = 16 * 2**20


def row_bucket(rows: int) -> int:
    return max(1, round(rows / ROW_BUCKET)) * ROW_BUCKET


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
        # Row buckets whose calls share out their rows (plan_row_splits), and the kernel that does.
        self.split_buckets: frozenset[int] = frozenset()
        self.split_rows: OneDnnSplitRows | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_buckets and x.dim() == 2 and row_bucket(x.shape[0]) in self.split_buckets:
            return self.split_rows(x, self.blocked_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.blocked_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        split = f", rows split at {sorted(self.split_buckets)}" if self.split_buckets else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, oneDNN blocked{split}"


def best_times(first: Callable[[], object], second: Callable[[], object], repeats: int = 5) -> tuple[float, float]:
    """The fastest of `repeats` calls of each, in seconds, the two alternated (after one unmeasured
    call each) so that a noisy moment of the machine falls on both."""
    first(), second()
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, call in enumerate((first, second)):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def plan_row_splits(
    linears: Iterable[OneDnnLinear],
    split_rows: OneDnnSplitRows,
    time_both: Callable[[Callable[[], object], Callable[[], object]], tuple[float, float]] = best_times,
) -> dict[tuple[int, int], frozenset[int]]:
    """Time oneDNN's threading against shared-out rows for each weight shape among `linears` (on its first
    layer, random inputs of each bucket's row count up to MAX_PLANNED_ROWS), and give every layer of that
    shape the buckets where sharing out took at most SPLIT_GAIN of the time. Returns the plan by
    (out_features, in_features)."""
    by_shape: dict[tuple[int, int], list[OneDnnLinear]] = {}
    for linear in linears:
        if linear.out_features * linear.in_features * 2 <= MAX_SPLIT_WEIGHT_BYTES:
            by_shape.setdefault((linear.out_features, linear.in_features), []).append(linear)
    plan: dict[tuple[int, int], frozenset[int]] = {}
    inputs = torch.Generator().manual_seed(0)  # the global generator's state is the user's
    with torch.no_grad():
        for shape, layers in by_shape.items():
            first = layers[0]
            buckets = set()
            for rows in range(ROW_BUCKET, MAX_PLANNED_ROWS + 1, ROW_BUCKET):
                x = torch.randn(rows, first.in_features, generator=inputs).to(torch.bfloat16)
                own, shared = time_both(
                    lambda: torch.ops.mkldnn._linear_pointwise(x, first.blocked_weight, first.bias, "none", [], ""),
                    lambda: split_rows(x, first.blocked_weight, first.bias))
                if shared <= SPLIT_GAIN * own:
                    buckets.add(rows)
            plan[shape] = frozenset(buckets)
            for linear in layers:
                linear.split_buckets, linear.split_rows = plan[shape], split_rows
    return plan


def warm_row_counts(linears: Iterable[OneDnnLinear], row_counts: Iterable[int]) -> int:
    """Run one linear of each weight shape at each row count, so that oneDNN has built and cached its
    primitives (2-3 ms each when first met) before serving; the row split plan applies as in serving.
    Returns the calls made."""
    first_of_shape: dict[tuple[int, int], OneDnnLinear] = {}
    for linear in linears:
        first_of_shape.setdefault((linear.out_features, linear.in_features), linear)
    calls = 0
    with torch.no_grad():
        for rows in row_counts:
            for linear in first_of_shape.values():
                linear(torch.zeros(rows, linear.in_features, dtype=torch.bfloat16))
                calls += 1
    return calls
