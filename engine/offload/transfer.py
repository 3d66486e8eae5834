"""The offload tier's host buffer and the thread that copies KV between it and the engine cache.

Copies never run on the event loop: each job goes to one transfer thread and its result is
picked up, without blocking, at the start of a later engine step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from engine.kv_quant import as_bytes

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V as [num_slots, KVH, D]


class KVHostBuffer:
    """num_chunks fixed slots: [slot, layer, K|V, tokens_per_chunk, KVH, D] in the KV dtype, D the cache's
    row size (the head size; int8 rows add their scale's 4 bytes)."""

    def __init__(self, num_slots: int, num_layers: int, tokens_per_chunk: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype):
        pin = torch.cuda.is_available()  # pinned pages only matter for DMA to a GPU
        self.tokens_per_chunk = tokens_per_chunk
        self.data = torch.empty(
            (num_slots, num_layers, 2, tokens_per_chunk, num_kv_heads, head_dim), dtype=dtype, pin_memory=pin
        )
        # NOTE: made once: a view per call (tensor -> numpy -> memoryview) costs more than copying
        # a small chunk.
        self._bytes = memoryview(self.data.view(-1).view(torch.uint8).numpy()).cast("B")
        self._bytes_per_chunk = self.data[0].numel() * self.data.element_size()

    @property
    def bytes_per_chunk(self) -> int:
        return self._bytes_per_chunk

    def slot_view(self, slot_id: int) -> memoryview:
        """The slot's bytes, writable, without a copy: uint8 [layer * 2 * tokens * KVH * D * itemsize]."""
        size = self.bytes_per_chunk
        return self._bytes[slot_id * size : (slot_id + 1) * size]

    def store(self, kv_caches: KVCaches, engine_slots: torch.Tensor, slot_ids: list[int]) -> int:
        """engine_slots: [n * tokens_per_chunk] cache rows, chunk after chunk -> host slots."""
        n, tpc = len(slot_ids), self.tokens_per_chunk
        slots = torch.tensor(slot_ids)
        data = as_bytes(self.data)  # float8 rows copied as their bytes: torch indexes no float8 on the CPU
        for layer, (k, v) in enumerate(kv_caches):
            k, v = as_bytes(k), as_bytes(v)
            data[slots, layer, 0] = k[engine_slots].view(n, tpc, *k.shape[1:]).to("cpu")
            data[slots, layer, 1] = v[engine_slots].view(n, tpc, *v.shape[1:]).to("cpu")
        return n * self.bytes_per_chunk

    def load(self, kv_caches: KVCaches, slot_ids: list[int], skip_tokens: int, engine_slots: torch.Tensor) -> int:
        """Host slots -> cache rows, skipping the first `skip_tokens` (already in the engine)."""
        slots = torch.tensor(slot_ids)
        data = as_bytes(self.data)
        for layer, (k, v) in enumerate(kv_caches):
            k, v = as_bytes(k), as_bytes(v)
            src_k = data[slots, layer, 0].flatten(0, 1)[skip_tokens:]  # [tokens, KVH, D]
            src_v = data[slots, layer, 1].flatten(0, 1)[skip_tokens:]
            k.index_copy_(0, engine_slots, src_k.to(k.device))
            v.index_copy_(0, engine_slots, src_v.to(v.device))
        return len(slot_ids) * self.bytes_per_chunk


class HostSlotBytes:
    """kvtier's `SlotBytes` over a KVHostBuffer: the secondary tiers read and write whole slots."""

    def __init__(self, host: KVHostBuffer):
        self.host = host

    def read(self, slot_id: int) -> bytes:
        return bytes(self.host.slot_view(slot_id))

    def view(self, slot_id: int) -> memoryview:
        return self.host.slot_view(slot_id)


@dataclass(frozen=True)
class TransferResult:
    job_id: int
    kind: Literal["load", "store"]
    success: bool
    num_bytes: int
    seconds: float


class TransferThread:
    """Runs copies on its own thread, or on `executor` when given (the engine's compute thread:
    torch is much slower here once two threads each drive their own OpenMP team)."""

    def __init__(self, executor: ThreadPoolExecutor | None = None, on_done: Callable[[], None] | None = None) -> None:
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="zenserve-kv-transfer")
        self._jobs: dict[int, tuple[Literal["load", "store"], Future]] = {}
        self._on_done = on_done  # called once a job's result is ready to take (any thread)

    def submit(self, job_id: int, kind: Literal["load", "store"], fn, *args) -> None:
        def timed():
            started = time.perf_counter()
            num_bytes = fn(*args)
            return num_bytes, time.perf_counter() - started

        future = self._executor.submit(timed)
        self._jobs[job_id] = (kind, future)
        if self._on_done is not None:
            on_done = self._on_done
            future.add_done_callback(lambda _: on_done())

    def take_finished(self) -> list[TransferResult]:
        done = []
        for job_id, (kind, fut) in list(self._jobs.items()):
            if fut.done():
                del self._jobs[job_id]
                err = fut.exception()
                num_bytes, seconds = (0, 0.0) if err is not None else fut.result()
                done.append(TransferResult(job_id, kind, err is None, num_bytes, seconds))
        return done

    def wait_all(self) -> None:
        """Block until every job finished (reset and shutdown only, never on the hot path);
        the results are then picked up by take_finished as usual."""
        for _, fut in list(self._jobs.values()):
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - reported through take_finished
                pass

    @property
    def num_in_flight(self) -> int:
        return len(self._jobs)

    def shutdown(self) -> None:
        if self._owns_executor:
            self._executor.shutdown(wait=True)
        else:
            self.wait_all()
