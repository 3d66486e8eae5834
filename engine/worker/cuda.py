"""The CUDA worker: the same torch path on a GPU; the KV cache lives in device memory, and decode-only
steps replay CUDA graphs (engine/worker/decode_graphs.py) unless `cuda_graphs` is off."""

from __future__ import annotations

import torch
from torch import nn

from engine.kv_cache_spec import KVCacheLayout
from engine.models.pinned_attributes import unpin_attributes
from engine.worker.decode_graphs import DecodeGraphs
from engine.worker.torch_worker import TorchWorker


class CUDAWorker(TorchWorker):
    name = "cuda"

    def __init__(self, model: nn.Module, layout: KVCacheLayout, dtype: torch.dtype, device_index: int = 0,
                 cuda_graphs: bool = True):
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda worker needs a CUDA GPU; none is visible")
        device = torch.device("cuda", device_index)
        unpin_attributes(model)  # a CPU worker may have pinned it: .to() replaces the buffers
        super().__init__(model.to(device), layout, dtype, device, scratch_blocks=1 if cuda_graphs else 0)
        if cuda_graphs:
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches_with_scratch, layout.block_size,
                                              layout.num_blocks, self.sliding_window or 0, device)

    def execute(self, batch):
        out = super().execute(batch)
        torch.cuda.synchronize(self.device)
        return out
