"""The asyncio engine: a step-loop task that owns the core; forward passes on one executor thread.

`generate()` is an async iterator of deltas for one request. Cancelling it (a client that
disconnects) aborts the request, and its blocks are free before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import EngineDeadError, InvalidRequestError
from engine.kv_events import KVCacheEvent
from engine.model_loader import LoadedModel
from engine.multimodal.inputs import MultiModalItem
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from engine.worker import StepBatch, WorkerOutput

if TYPE_CHECKING:
    from engine.structured_output import StructuredOutputSpec

log = logging.getLogger(__name__)

# Prompts longer than this are tokenized on a thread so the loop never stalls on them.
_INLINE_TOKENIZE_CHARS = 4096
# A structured-output constraint still compiling after this is refused (llguidance's work limits bound it too).
GRAMMAR_COMPILE_TIMEOUT_S = 10.0

# A step's output, with when its execute started and ended on the worker thread.
_TimedOutput = tuple[WorkerOutput, float, float]


@dataclass(frozen=True)
class StepRecord:
    """One engine step, as the step loop saw it (AsyncEngine.on_step)."""

    num_tokens: int  # tokens the forward pass computed: prompt chunks and one per decode
    forward_s: float  # the worker's execute, on its thread: forward pass, sampling
    # From the previous step's end to this one's start on the worker thread, when this step followed it with
    # work pending throughout (outputs handed out, scheduling, the hand-over to the worker); None after the
    # engine idled or waited on KV transfers in between.
    gap_s: float | None


class _OutputSlot:
    """One bounded slot per request: deltas merge (one pending item per sample) while the
    consumer lags, so a slow client never grows memory."""

    def __init__(self) -> None:
        self._pending: dict[int, RequestOutput] = {}
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        prior = self._pending.get(out.index)
        if prior is None:
            self._pending[out.index] = out
        else:
            prior.merge(out)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> list[RequestOutput]:
        await self._ready.wait()
        self._ready.clear()
        if self._error is not None and not self._pending:
            raise self._error
        outs = list(self._pending.values())
        self._pending.clear()
        return outs


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        on_kv_events: Callable[[list[KVCacheEvent]], None] | None = None,
        executor: ThreadPoolExecutor | None = None,
    ):
        self.core = core
        # Called on the loop thread with each step's events (only when the engine records them).
        self.on_kv_events = on_kv_events
        # Called on the loop thread after each step (the server's step metrics).
        self.on_step: Callable[[StepRecord], None] | None = None
        self.tokenizer = core.tokenizer
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="zenserve-worker")
        self._slots: dict[str, _OutputSlot] = {}
        self._remaining: dict[str, int] = {}  # samples not yet finished, per request
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self.last_step_completed = time.monotonic()
        self.num_steps = 0

    @classmethod
    async def create(cls, config: EngineConfig, loaded: LoadedModel | None = None, warm_up: bool = True) -> AsyncEngine:
        """Load the model on a thread (it takes seconds), warm it up, then start the step loop."""
        loop = asyncio.get_running_loop()
        # NOTE: every torch op (loading, forward passes, KV copies) runs on this one thread. On
        # these CPUs a second thread driving its own OpenMP team slows both by ~1.8x (measured:
        # 35 vs 64 ms per decode step), even after it has gone idle.
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zenserve-worker")
        # Offload tiers do their I/O on this loop; the core is built on the worker thread meanwhile.
        core = await loop.run_in_executor(executor, EngineCore, config, loaded, loop, executor)
        if warm_up:
            started = time.monotonic()
            steps = await loop.run_in_executor(executor, core.warm_up)
            log.info("warm-up: %d steps in %.1f s", steps, time.monotonic() - started)
        engine = cls(core, executor=executor)
        engine.start()
        return engine

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="zenserve-step-loop")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for rid in list(self._slots):
            self.abort(rid)
        self._executor.shutdown(wait=True)
        await self.core.shutdown_async()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self._dead is None

    def is_making_progress(self, deadline_s: float) -> bool:
        """False when work is waiting and no step completed within `deadline_s` (a wedged loop)."""
        if not self.is_running:
            return False
        busy = self.core.has_unfinished()
        return not busy or time.monotonic() - self.last_step_completed < deadline_s

    # ---- requests -------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        kv_transfer_params: dict | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield deltas until every sample of the request finished. Bad input raises
        InvalidRequestError before anything is yielded. `mm_items`: the prompt's images;
        `cache_salt`: see EngineCore.add_request."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._dead!r}")
        request_id = request_id or uuid.uuid4().hex
        if isinstance(prompt, str):
            token_ids = await self.encode(prompt)
        else:
            token_ids = list(prompt)
        if request_id in self._slots:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.structured_output is not None:
            await self.compile_grammar(params.structured_output)
        self.core.add_request(request_id, token_ids, params, kv_transfer_params, mm_items, cache_salt)
        slot = self._slots[request_id] = _OutputSlot()
        self._remaining[request_id] = params.n
        self._wake.set()
        finished = False
        try:
            while not finished:
                for out in await slot.get():
                    if out.finished:
                        self._remaining[request_id] -= 1
                    finished = self._remaining[request_id] == 0
                    yield out
        finally:
            if not finished:
                self.abort(request_id)  # cancelled or closed early: free the blocks now
            self._slots.pop(request_id, None)
            self._remaining.pop(request_id, None)

    async def compile_grammar(self, spec: StructuredOutputSpec) -> None:
        """Compile a structured-output constraint on a thread (cached by the core's compiler, so add_request then
        finds it), within GRAMMAR_COMPILE_TIMEOUT_S: a grammar past it is refused, and the loop never waits on one."""
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(None, self.core.grammars.compile, spec), GRAMMAR_COMPILE_TIMEOUT_S)
        except TimeoutError:
            from engine.structured_output import StructuredOutputError

            raise StructuredOutputError(f"the constraint did not compile within {GRAMMAR_COMPILE_TIMEOUT_S:g} s",
                                        spec.param) from None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize inline when short, on a thread when long (the loop must not stall)."""
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(
            None, self.tokenizer.encode, text, add_special_tokens
        )

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def abort(self, request_id: str) -> None:
        """Abort at any moment; a consumer still iterating sees finish_reason "abort"."""
        outputs = self.core.abort(request_id)
        slot = self._slots.get(request_id)
        if slot is not None:
            for out in outputs:
                slot.put(out)

    # ---- the step loop --------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        running: tuple[StepBatch, asyncio.Future[_TimedOutput]] | None = None
        previous_end: float | None = None  # the last step's end on the worker thread, while work stayed pending
        try:
            while True:
                if running is None:
                    if not self.core.has_unfinished() and not self.core.has_pending_transfers():
                        previous_end = None
                        self._wake.clear()
                        await self._wake.wait()
                        continue
                    running = self._start_step(loop)
                    if running is None:
                        # Only KV copies or tier reads in flight, or held n>1 samples: poll again
                        # once one of them finishes, or shortly.
                        previous_end = None
                        await self.core.wait_for_transfers_async()
                        continue
                batch, forward = running
                running = None
                try:
                    result, started, ended = await forward
                except Exception as e:  # noqa: BLE001 - fail this batch's requests, keep serving
                    log.exception("forward pass failed; aborting the %d requests in the batch", len(batch.scheduler_output.sequences))
                    self._fail_batch(batch, e)
                    previous_end = None
                    continue
                outputs = self.core.complete_step(batch, result)
                self.last_step_completed = time.monotonic()
                self.num_steps += 1
                if self.on_step is not None:
                    gap = None if previous_end is None else started - previous_end
                    self.on_step(StepRecord(batch.scheduler_output.num_batched_tokens, ended - started, gap))
                previous_end = ended
                self._publish_kv_events()
                # The next step is handed to the worker before this one's outputs go out. The worker
                # thread starts it once the loop lets go of the GIL, after the handlers' SSE encoding and
                # writes: 400-520 us at 16 streams on 2 cores. Yielding the GIL at once overlapped that
                # work with the step's own threads instead, for no clear gain (BENCHMARKS.md, "a
                # fifteenth time"); engine_step_gap_seconds shows the wait.
                if self.core.has_unfinished():
                    running = self._start_step(loop)
                for out in outputs:
                    slot = self._slots.get(out.request_id)
                    if slot is not None:
                        slot.put(out)
                await asyncio.sleep(0)  # let handlers write what this step produced
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._dead = e
            log.exception("engine loop died")
            for slot in self._slots.values():
                slot.fail(EngineDeadError(f"the engine loop stopped: {e!r}"))
            raise

    def _start_step(self, loop: asyncio.AbstractEventLoop) -> tuple[StepBatch, asyncio.Future[_TimedOutput]] | None:
        """Schedule a step and start its forward pass on the worker thread; None when nothing
        can run now."""
        batch = self.core.prepare_step()
        # Publish what scheduling recorded before awaiting the worker: a subscriber that joins
        # meanwhile gets a snapshot that already includes it, never it twice.
        self._publish_kv_events()
        if batch is None:
            return None
        return batch, loop.run_in_executor(self._executor, self._execute_timed, batch)

    def _execute_timed(self, batch: StepBatch) -> _TimedOutput:
        """The worker's execute, with when it started and ended (perf_counter, on the worker thread)."""
        started = time.perf_counter()
        result = self.core.worker.execute(batch)
        return result, started, time.perf_counter()

    def _publish_kv_events(self) -> None:
        if self.on_kv_events is None:
            return
        events = self.core.take_kv_events()
        if events:
            self.on_kv_events(events)

    def reset_prefix_cache(self) -> bool:
        """Clear the cache between steps (the loop thread runs this) and publish the result."""
        ok = self.core.reset_prefix_cache()
        self._publish_kv_events()
        return ok

    def _fail_batch(self, batch, error: Exception) -> None:
        parents = {s.request_id.rsplit("/", 1)[0] for s in batch.scheduler_output.sequences}
        for rid in parents:
            self.core.abort(rid)
            slot = self._slots.get(rid)
            if slot is not None:
                slot.fail(EngineDeadError(f"forward pass failed: {error}"))
