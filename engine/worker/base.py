"""The worker contract: an immutable batch in, sampled tokens and logprobs out.

A worker runs on its own executor thread; nothing but these values crosses the boundary.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from engine.sampling import SamplingRow
from engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepBatch:
    scheduler_output: SchedulerOutput
    sampling_rows: tuple[SamplingRow | None, ...]  # aligned with the sequences; None: no sample


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class WorkerOutput:
    sampled_token_ids: tuple[int | None, ...]  # aligned with the sequences
    logprobs: tuple[TokenLogprobs | None, ...]


class Worker(abc.ABC):
    """Owns the model weights and the KV cache tensors of one device.

    - `execute(batch)`: zeroes `block_ids_to_zero`, writes the step's K/V into the cache, runs
      the forward pass and samples one token for each sequence with a sampling row.
    - `kv_cache_bytes`: the size of the KV cache it allocated.
    Called from one thread at a time; it holds no engine state.
    """

    name: str

    @abc.abstractmethod
    def execute(self, batch: StepBatch) -> WorkerOutput: ...

    @property
    @abc.abstractmethod
    def kv_cache_bytes(self) -> int: ...

    def prepare_decode_steps(self, max_batch: int, max_context: int) -> int:
        """Before serving: build what decode steps of up to `max_batch` sequences and `max_context`
        positions would otherwise build on first use (the cuda worker's graphs). Returns how many."""
        return 0
