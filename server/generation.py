"""Running one API request's prompts through the engine: merged outputs, usage, metrics."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError, QueueFullError
from engine.multimodal.inputs import MultiModalItem
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from server.metrics import ServerMetrics


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class GenerationRun:
    """One API request: several prompts (completions), each with n samples.

    Choice index = prompt index * n + sample index, as OpenAI numbers them.
    """

    engine: AsyncEngine
    metrics: ServerMetrics
    prompts: list[list[int]]
    params: SamplingParams
    kv_transfer_params: dict | None = None
    mm_items: tuple[MultiModalItem, ...] = ()  # images of the (single) prompt
    cache_salt: str | None = None  # isolates the prompts' prefix cache (a tenant's)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    usage: Usage = field(default_factory=Usage)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: dict[int, float] = field(default_factory=dict)  # per choice, for inter-token latency
    generated: dict[int, int] = field(default_factory=dict)  # tokens per choice so far
    finished: set[int] = field(default_factory=set)  # choices whose end was counted

    def __post_init__(self) -> None:
        self.usage.prompt_tokens = sum(len(p) for p in self.prompts)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) as they come; aborts everything if the consumer stops, and then
        counts each unfinished choice as aborted."""
        rejected = False
        try:
            async for item in self._outputs():
                self._account(*item)
                yield item
        except (InvalidRequestError, QueueFullError):
            rejected = True  # never admitted: neither finished nor aborted
            raise
        finally:
            if not rejected:
                self._account_aborts()

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        n = self.params.n
        if len(self.prompts) == 1:
            async for out in self.engine.generate(
                self.prompts[0], self.params, f"{self.request_id}-0", self.kv_transfer_params, self.mm_items,
                self.cache_salt,
            ):
                yield out.index, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue(maxsize=64)

        async def pump(p: int, ids: list[int]) -> None:
            try:
                async for out in self.engine.generate(
                    ids, self.params, f"{self.request_id}-{p}", self.kv_transfer_params, cache_salt=self.cache_salt
                ):
                    await queue.put((p * n + out.index, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                await queue.put(e)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(p, ids)) for p, ids in enumerate(self.prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _account(self, choice: int, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.new_token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
            previous = self.last_token_at.get(choice)
            if previous is not None:
                self.metrics.record_token_gap(now - previous, len(out.new_token_ids))
            self.last_token_at[choice] = now
        self.usage.completion_tokens += len(out.new_token_ids)
        self.generated[choice] = self.generated.get(choice, 0) + len(out.new_token_ids)
        if out.finished:
            self.finished.add(choice)
            if out.index == 0:  # the prompt counts once in usage: so do its cached tokens
                self.usage.cached_tokens += out.num_cached_tokens
            self.metrics.record_finished(
                out.finish_reason or "abort",
                out.num_prompt_tokens if out.index == 0 else 0,
                out.num_output_tokens,
                self._ttft() if out.index == 0 else None,
                now - self.started,
                out.timings,
            )

    def _account_aborts(self) -> None:
        """The choices the consumer left unfinished (a client that went away): aborted."""
        n = self.params.n
        now = time.perf_counter()
        for choice in range(len(self.prompts) * n):
            if choice in self.finished:
                continue
            self.finished.add(choice)
            first_sample = choice % n == 0
            self.metrics.record_finished(
                "abort",
                len(self.prompts[choice // n]) if first_sample else 0,
                self.generated.get(choice, 0),
                self._ttft() if first_sample else None,
                now - self.started,
                None,
            )

    def _ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started
