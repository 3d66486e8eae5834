"""Workers by name: eager and zentorch on the CPU, cuda on a GPU."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import WorkerKind
from engine.cpu_features import has_native_bf16, is_amd_zen
from engine.errors import ConfigError
from engine.kv_cache_spec import KVCacheLayout
from engine.models.int8_linear import ActivationRanges
from engine.worker.base import StepBatch, TokenLogprobs, Worker, WorkerOutput

__all__ = ["StepBatch", "TokenLogprobs", "Worker", "WorkerOutput", "create_worker", "resolve_worker_kind"]


def resolve_worker_kind(kind: WorkerKind, dtype: torch.dtype = torch.float32) -> WorkerKind:
    """`auto`: cuda when a GPU is visible, zentorch on AMD Zen with zentorch installed (for bf16, only
    where the CPU has AVX512_BF16, which zentorch's bf16 GEMMs require), else eager."""
    from engine.worker.cpu import zentorch_available

    if kind != "auto":
        return kind
    if torch.cuda.is_available():
        return "cuda"
    if is_amd_zen() and zentorch_available() and (dtype != torch.bfloat16 or has_native_bf16()):
        return "zentorch"
    return "eager"


def create_worker(kind: WorkerKind, model: nn.Module, layout: KVCacheLayout, dtype: torch.dtype,
                  activation_ranges: ActivationRanges | None = None, cuda_graphs: bool = True,
                  batch_invariant: bool = False) -> Worker:
    """`activation_ranges`: run the projections' larger calls with int8 activations (zentorch only).
    `cuda_graphs`: the cuda worker replays decode steps from CUDA graphs.
    `batch_invariant`: EngineConfig.batch_invariant (CPU workers)."""
    kind = resolve_worker_kind(kind, dtype)
    if batch_invariant and kind == "cuda":
        # cuBLAS picks its GEMM (and split-K) by the row count: nothing here makes a row's sums independent of it.
        raise ConfigError("--batch-invariant runs on the CPU workers only: the cuda worker's GEMMs depend on the batch")
    if batch_invariant and activation_ranges is not None:
        raise ConfigError("--batch-invariant computes exactly: it cannot run with --quantize-activations int8, "
                          "whose activation scales are per row")
    if activation_ranges is not None and kind != "zentorch":
        raise ConfigError(f"int8 activations run on the zentorch worker: the {kind} worker has none")
    if kind == "cuda":
        cache_dtype = layout.groups[0].spec.dtype
        if cache_dtype == torch.int8:
            # The torch paths would run, but nothing here has checked them on a GPU.
            raise ConfigError("the int8 KV cache runs on the CPU workers only")
        if cache_dtype != dtype:
            raise ConfigError("a KV cache in another dtype than the model's (--kv-cache-dtype float16) runs on the "
                              "CPU workers only")
        from engine.worker.cuda import CUDAWorker

        return CUDAWorker(model, layout, dtype, cuda_graphs=cuda_graphs)
    if kind == "zentorch":
        if dtype == torch.bfloat16 and not has_native_bf16():
            raise ConfigError("zentorch's bf16 GEMMs need a CPU with AVX512_BF16, and this one has none: "
                              "serve float32 (--dtype float32) or use the eager worker")
        from engine.worker.cpu import ZentorchWorker

        return ZentorchWorker(model, layout, dtype, activation_ranges, batch_invariant=batch_invariant)
    from engine.worker.cpu import CPUWorker

    return CPUWorker(model, layout, dtype, batch_invariant=batch_invariant)
