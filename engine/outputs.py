"""What a request yields to its caller after each step."""

from __future__ import annotations

from dataclasses import dataclass

from engine.worker.base import TokenLogprobs


@dataclass(frozen=True)
class RequestTimings:
    """Phases of a finished request, in seconds (vLLM's queue/prefill/decode split)."""

    queue_s: float  # arrival -> first scheduled
    prefill_s: float  # first scheduled -> first token
    decode_s: float  # first token -> finished


@dataclass
class RequestOutput:
    """A delta: the tokens and text produced since the previous output of this request.

    `index` tells the samples of an n > 1 request apart. Deltas of a lagging consumer are merged.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None  # "stop", "length", "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    timings: RequestTimings | None = None  # set on the final output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, newer: RequestOutput) -> None:
        self.new_token_ids.extend(newer.new_token_ids)
        self.text += newer.text
        if newer.logprobs is not None:
            self.logprobs = (self.logprobs or []) + newer.logprobs
        self.finish_reason = newer.finish_reason
        self.stop_reason = newer.stop_reason
        self.num_output_tokens = newer.num_output_tokens
        self.num_cached_tokens = newer.num_cached_tokens
        self.timings = newer.timings
