"""The CPU worker: torch eager, or with dense layers compiled by zentorch on AMD Zen."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from engine.kv_cache_spec import KVCacheLayout
from engine.worker.torch_worker import TorchWorker

log = logging.getLogger(__name__)


class CPUWorker(TorchWorker):
    name = "eager"

    def __init__(self, model: nn.Module, layout: KVCacheLayout, dtype: torch.dtype):
        super().__init__(model, layout, dtype, torch.device("cpu"))


class ZentorchWorker(CPUWorker):
    """Runs the dense (larger-batch) projections through zentorch's GEMMs on AMD Zen.

    Each dense Linear is compiled with the zentorch backend (dynamic shapes: one graph for every
    row count). The small-batch int4 kernels stay eager: zentorch rewrites torch's int4 op
    into its own weight-only kernel, measured slower at a few rows, and a compiled MLP around
    them was 5x slower than eager at batch 1 (BENCHMARKS.md). Attention stays eager too: its
    paged gathers vary per step. The lm_head is compiled too, for every row count: zentorch's
    bf16 GEMM beat the int8 copy even at one row (1.5 vs 1.9 ms) and dense bf16 at 8-32 rows
    (1.8-5.2 vs 4.3-7.6 ms), and is exact where the int8 copy is not.

    NOTE: zentorch prepacks a compiled Linear's weight *in place*: afterwards the parameter holds
    its blocked layout and only the compiled module computes with it. Nothing else may read
    those weights, so a lm_head tied to the embedding gets its own copy first."""

    name = "zentorch"

    def __init__(self, model: nn.Module, layout: KVCacheLayout, dtype: torch.dtype):
        import zentorch  # noqa: F401  (registers the "zentorch" backend)

        from engine.models.packed_linear import SmallBatchLinear

        compiled = []
        for layer in model.model.layers:
            for owner, attr in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                linear = getattr(owner, attr, None)
                if isinstance(linear, SmallBatchLinear):
                    linear.dense = torch.compile(linear.dense, backend="zentorch", dynamic=True)
                    compiled.append(linear.dense)
                elif isinstance(linear, nn.Linear):
                    setattr(owner, attr, torch.compile(linear, backend="zentorch", dynamic=True))
                    compiled.append(getattr(owner, attr))
        text_model = getattr(model, "language_model", model)  # a LLaVA model keeps its Llama inside
        text_model.lm_head = torch.compile(_own_copy(text_model.lm_head), backend="zentorch", dynamic=True)
        compiled.append(text_model.lm_head)
        super().__init__(model, layout, dtype)
        _warm_up(compiled, dtype)


def _own_copy(head: nn.Module) -> nn.Linear:
    """A dense Linear with its own weights, for a lm_head that is a Linear or a SmallBatchLinear
    (whose int8 copy is then dropped) and may share its weight with the embedding."""
    dense = getattr(head, "dense", head)
    copy = nn.Linear(dense.in_features, dense.out_features, bias=dense.bias is not None,
                     device=dense.weight.device, dtype=dense.weight.dtype)
    with torch.no_grad():
        copy.weight.copy_(dense.weight)
        if dense.bias is not None:
            copy.bias.copy_(dense.bias)
    return copy


def _warm_up(modules: list[nn.Module], dtype: torch.dtype) -> None:
    """Compile before the first request rather than during it: two row counts per module give
    dynamo its dynamic-shape graph (a first call alone specializes on the size it sees)."""
    started = time.perf_counter()
    with torch.inference_mode():
        for module in modules:
            for rows in (16, 48):
                module(torch.zeros(rows, module.in_features, dtype=dtype))
    log.info("zentorch: %d projections compiled in %.1f s", len(modules), time.perf_counter() - started)


def is_amd_zen() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            info = f.read(8192)
    except OSError:
        return False
    family = next((l.split(":")[1].strip() for l in info.splitlines() if l.startswith("cpu family")), "0")
    return "AuthenticAMD" in info and int(family) >= 23  # 0x17: Zen and later


def zentorch_available() -> bool:
    try:
        import zentorch  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is the same as none here
        return False
    return True
