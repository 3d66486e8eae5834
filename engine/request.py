"""A request's sampling parameters and its mutable state inside the engine."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.multimodal.inputs import MultiModalItem
    from engine.structured_output import StructuredOutputSpec

RequestId = NewType("RequestId", str)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction (no I/O)."""

    n: int = 1
    max_tokens: int | None = 16  # None: until the context limit
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: sampled token plus top-k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # (token id, bias) pairs added to the logits before penalties and sampling (OpenAI's logit_bias:
    # -100 bans a token, +100 all but forces it); a dict is accepted and normalised
    logit_bias: tuple[tuple[int, float], ...] = ()
    # What the output must match (a JSON schema, regex, choice or grammar: engine/structured_output.py)
    structured_output: StructuredOutputSpec | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        _check_types(self)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))  # NOTE: normalising input, not config
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX:
            bad(f"seed must be a 64-bit integer, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            bad("stop strings must be non-empty")
        for token_id, bias in self.logit_bias:
            if not isinstance(token_id, int) or token_id < 0:
                bad(f"logit_bias keys must be token ids (non-negative integers), got {token_id!r}")
            if not (isinstance(bias, (int, float)) and math.isfinite(bias) and -100.0 <= bias <= 100.0):
                bad(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's and vLLM's range for a seed
_INTEGER_FIELDS = ("n", "min_tokens", "top_k")
_OPTIONAL_INTEGER_FIELDS = ("max_tokens", "seed", "logprobs")
_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _check_types(params: SamplingParams) -> None:
    """A typed error for a value of the wrong type (the library API has no JSON layer to catch it)."""
    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for name in _INTEGER_FIELDS:
        if not is_int(getattr(params, name)):
            raise InvalidRequestError(f"{name} must be an integer, got {getattr(params, name)!r}")
    for name in _OPTIONAL_INTEGER_FIELDS:
        value = getattr(params, name)
        if value is not None and not is_int(value):
            raise InvalidRequestError(f"{name} must be an integer or None, got {value!r}")
    for name in _NUMBER_FIELDS:
        value = getattr(params, name)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
            raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
    if not all(is_int(t) for t in params.stop_token_ids):
        raise InvalidRequestError("stop_token_ids must be integers")
    stops = (params.stop,) if isinstance(params.stop, str) else params.stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequestError("stop must be a string or a list of strings")


class RequestStatus(enum.IntEnum):
    """Order matters: everything above RUNNING is finished."""

    WAITING = 0
    WAITING_FOR_KV = 1  # loading offloaded KV before it may run
    PREEMPTED = 2
    RUNNING = 3
    FINISHED_STOPPED = 4  # EOS, stop token or stop string
    FINISHED_LENGTH = 5  # max_tokens or the context limit
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.RUNNING

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class Request:
    """One sequence being generated. The scheduler is its only mutator.

    `num_computed_tokens` counts tokens whose KV is in the cache; tokens past it are
    scheduled in later steps (chunked prefill) or were preempted away.
    """

    request_id: RequestId
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_seq: int  # admission order; larger = newer (preempted first)
    max_total_len: int  # prompt + output may not exceed this (the context limit)
    priority: int = 0  # lower value = more important
    max_offload_tokens: int | None = None  # kv_transfer_params: only the first N tokens may be offloaded
    mm_items: tuple[MultiModalItem, ...] = ()  # images, in prompt order; their placeholders are prompt tokens
    cache_salt: str | None = None  # joins the first block's hash: only requests with the same salt share a prefix
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first schedule
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Monotonic timestamps for metrics: admitted, first scheduled, first token.
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a decode step wants one token)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def token_id_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
