"""`LLM(model).generate(prompts, params)`: the offline helper for scripts and tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import InvalidRequestError
from engine.model_loader import LoadedModel
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from engine.worker.base import TokenLogprobs


@dataclass
class Sample:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    samples: list[Sample]
    num_cached_tokens: int = 0


class LLM:
    def __init__(
        self,
        model: str | None = None,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
    ):
        config = config or EngineConfig()
        if model is not None:
            config = replace(config, model=replace(config.model, model=model))
        self.engine = EngineCore(config, loaded)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion in one continuous batch; results in prompt order.
        Bad input raises InvalidRequestError before any prompt runs (none is left queued)."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, Sequence) or not prompts:
            raise InvalidRequestError("prompts must be a string, token ids, or a non-empty list of them")
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        encoded = [self._token_ids(prompt) for prompt in prompts]
        results: dict[str, GenerationResult] = {}
        try:
            for ids, p in zip(encoded, params_list, strict=True):
                rid = f"llm-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(rid, ids, p)
                results[rid] = GenerationResult(rid, ids, [Sample(i) for i in range(p.n)])
        except BaseException:
            for rid in results:  # the prompts queued before the bad one must not run later
                self.engine.abort(rid)
            raise
        while self.engine.has_unfinished():
            for out in self.engine.step():
                _accumulate(results[out.request_id], out)
        return list(results.values())

    def _token_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> GenerationResult:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.generate([ids], params)[0]


def _accumulate(result: GenerationResult, out: RequestOutput) -> None:
    sample = result.samples[out.index]
    sample.text += out.text
    sample.token_ids.extend(out.new_token_ids)
    if out.logprobs is not None:
        sample.logprobs = (sample.logprobs or []) + out.logprobs
    if out.finished:
        sample.finish_reason = out.finish_reason
        sample.stop_reason = out.stop_reason
        result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
