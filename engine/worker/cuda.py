"""The CUDA worker: the same torch path on a GPU; the KV cache lives in device memory."""

from __future__ import annotations

import torch
from torch import nn

from engine.kv_cache_spec import KVCacheLayout
from engine.models.pinned_attributes import unpin_attributes
from engine.worker.torch_worker import TorchWorker


class CUDAWorker(TorchWorker):
    name = "cuda"

    def __init__(self, model: nn.Module, layout: KVCacheLayout, dtype: torch.dtype, device_index: int = 0):
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda worker needs a CUDA GPU; none is visible")
        device = torch.device("cuda", device_index)
        unpin_attributes(model)  # a CPU worker may have pinned it: .to() replaces the buffers
        super().__init__(model.to(device), layout, dtype, device)

    def execute(self, batch):
        out = super().execute(batch)
        torch.cuda.synchronize(self.device)
        return out
