"""The synchronous engine core: one step = schedule -> worker -> update -> outputs.

The async engine drives it from an asyncio task with the worker call on an executor thread;
the offline `LLM` helper drives it in a plain loop. Only one thread ever calls its methods.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.block_pool import BlockPool
from engine.kv_events import KVCacheEvent
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError, QueueFullError
from engine.heap import release_free_heap
from engine.kv_cache_manager import KVCacheManager
from engine.kv_cache_spec import make_kv_cache_layout
from engine.kv_quant import kv_cache_torch_dtype
from engine.model_loader import LoadedModel, load_model
from engine.multimodal.inputs import MultiModalItem, check_multimodal_prompt
from engine.outputs import RequestOutput, RequestTimings
from engine.request import Request, RequestId, RequestStatus, SamplingParams
from engine.sampling import SamplingRow, make_generator
from engine.scheduler import Scheduler, SchedulerOutput
from engine.stop_strings import StopStringMatcher
from engine.worker import StepBatch, Worker, WorkerOutput, create_worker, resolve_worker_kind

if TYPE_CHECKING:
    from engine.structured_output import GrammarCompiler, GrammarMatcher

log = logging.getLogger(__name__)

# The longest an idle step waits for KV copies or tier reads before looking again.
TRANSFER_POLL_S = 0.001


@dataclass
class _SampleState:
    """Per-sample output processing state (one per child of an n > 1 request)."""

    request: Request
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher | None
    generator: object | None
    pending: RequestOutput | None = None
    grammar: GrammarMatcher | None = None  # the sample's place in its structured-output grammar


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        tier_loop: asyncio.AbstractEventLoop | None = None,
        compute_executor: ThreadPoolExecutor | None = None,
    ):
        """`tier_loop`: the event loop secondary offload tiers do their I/O on (the async engine
        passes the server's); None: a private loop on a daemon thread (offline use).
        `compute_executor`: the one thread that runs forward passes, which KV copies then share."""
        self.config = config
        on_gpu = resolve_worker_kind(config.worker) == "cuda"  # cuda or not does not depend on the dtype
        self.loaded = loaded or load_model(config.model, "cuda" if on_gpu else "cpu")
        arch = self.loaded.arch
        cache = config.cache
        cpu_worker = not on_gpu
        kv_dtype = kv_cache_torch_dtype(cache.kv_cache_dtype, self.loaded.dtype, cpu_worker)
        self.layout = make_kv_cache_layout(arch, cache.block_size, kv_dtype, cache.kv_cache_memory_bytes)
        capacity = self.layout.num_blocks * cache.block_size
        if self.layout.num_blocks < 1:
            raise InvalidRequestError(
                f"kv cache memory {cache.kv_cache_memory_bytes} bytes holds no block of this model"
            )
        self.max_model_len = min(self.loaded.max_model_len, capacity)
        if self.max_model_len < self.loaded.max_model_len:
            log.warning(
                "KV cache holds %d tokens: max_model_len lowered from %d", capacity, self.loaded.max_model_len
            )
        self.pool = BlockPool(self.layout.num_blocks, cache.enable_prefix_caching, config.enable_kv_events)
        self.kv = KVCacheManager(
            self.pool, cache.block_size, cache.enable_prefix_caching, compute_hashes=config.offload is not None,
            publish_generated=config.batch_invariant,
        )
        self.worker: Worker = create_worker(
            config.worker, self.loaded.model, self.layout, self.loaded.dtype, self.loaded.activation_ranges,
            config.cuda_graphs, config.batch_invariant,
        )
        release_free_heap()  # the dense weights a worker replaced with its own layouts' copies
        self.connector = None
        if config.offload is not None:
            from engine.offload.factory import build_connector

            self.connector = build_connector(
                config.offload, self.layout, self.pool, self.worker.kv_caches, config.enable_kv_events,
                model_id=f"{self.loaded.source.name}:{arch.architecture}", loop=tier_loop,
                executor=compute_executor,
            )
        self.scheduler = Scheduler(
            config.scheduler, self.kv, zero_new_blocks=self.layout.needs_zeroing, connector=self.connector
        )
        self.tokenizer = self.loaded.tokenizer
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self._states: dict[RequestId, _SampleState] = {}
        self._warming_up = False  # warm-up's own requests pass max_waiting (it may be below their count)
        self._held_children: dict[RequestId, list[_SampleState]] = {}  # n > 1: wait for the prompt
        self._arrival = itertools.count()

    # ---- requests -------------------------------------------------------------------------
    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, mm_items: Sequence[MultiModalItem] = ()
    ) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.loaded.arch.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens including at least one generated token"
            )
        check_multimodal_prompt(prompt_token_ids, mm_items, self.loaded.arch.multimodal)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request (its n samples). Raises InvalidRequestError for bad input.
        `mm_items`: its images (see engine.multimodal.inputs.expand_image_placeholders).
        `cache_salt`: the prompt's prefix is shared only with requests of the same salt (tenants)."""
        self.validate(prompt_token_ids, params, mm_items)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string")
        max_offload_tokens = _max_offload_tokens(kv_transfer_params)
        if any(RequestId(f"{request_id}/{i}") in self._states for i in range(params.n)):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if self.scheduler.num_waiting >= self.config.scheduler.max_waiting and not self._warming_up:
            raise QueueFullError(
                f"the server is busy: {self.scheduler.num_waiting} requests are already waiting"
            )
        # Compiled here if the async engine has not already (off the loop): the cache answers then.
        grammar = self.grammars.compile(params.structured_output) if params.structured_output is not None else None
        samples = [self._make_sample(request_id, i, prompt_token_ids, params) for i in range(params.n)]
        for s in samples:
            if grammar is not None:
                s.grammar = self.grammars.matcher(grammar)
            s.request.max_offload_tokens = max_offload_tokens
            s.request.mm_items = tuple(mm_items)
            s.request.cache_salt = cache_salt
        for s in samples:
            self._states[s.request.request_id] = s
        self.scheduler.add_request(samples[0].request)
        if len(samples) > 1:
            # The other samples join once the first has written the prompt's KV, so that they
            # take the prompt's blocks from the prefix cache instead of recomputing them.
            self._held_children[samples[0].request.request_id] = samples[1:]

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler over this model's tokenizer (llguidance, imported on first use)."""
        if self._grammars is None:
            from engine.structured_output import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.tokenizer.eos_token_ids,
                                             self.loaded.arch.vocab_size)
        return self._grammars

    def _make_sample(self, request_id: str, index: int, prompt: list[int], params: SamplingParams) -> _SampleState:
        rid = RequestId(f"{request_id}/{index}")
        request = Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            arrival_seq=next(self._arrival),
            max_total_len=self.max_model_len,
        )
        seed = None if params.seed is None else params.seed + index
        return _SampleState(
            request=request,
            parent_id=request_id,
            index=index,
            detokenizer=IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens),
            stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None,
            generator=None if seed is None else make_generator(seed),
        )

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Abort every sample of a request; its blocks are free at once."""
        outputs = []
        for rid in [r for r, s in self._states.items() if s.parent_id == request_id]:
            state = self._states[rid]
            self._held_children.pop(rid, None)
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            state.request.status = RequestStatus.FINISHED_ABORTED
            outputs.append(self._output(state, [], "", None, "abort"))
            del self._states[rid]
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._states)

    def has_pending_transfers(self) -> bool:
        """KV copies still in flight (their completion is processed by a later step)."""
        return self.scheduler.has_pending_transfers()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + sum(len(v) for v in self._held_children.values())

    # ---- one step -------------------------------------------------------------------------
    def prepare_step(self) -> StepBatch | None:
        out = self.scheduler.schedule()
        if out.is_empty:
            return None
        rows = tuple(self._sampling_row(s.request_id) if s.needs_sample else None for s in out.sequences)
        return StepBatch(out, rows)

    def _sampling_row(self, request_id: RequestId) -> SamplingRow:
        state = self._states[request_id]
        req = state.request
        params = req.sampling_params
        # Token history only crosses to the worker when a penalty or min_tokens reads it.
        needs_history = params.has_penalties or params.min_tokens > 0
        return SamplingRow(
            params=params,
            prompt_token_ids=tuple(req.prompt_token_ids) if params.repetition_penalty != 1.0 else (),
            output_token_ids=tuple(req.output_token_ids) if needs_history else (),
            eos_token_ids=req.eos_token_ids,
            generator=state.generator,
            grammar=state.grammar,
        )

    def complete_step(self, batch: StepBatch, result: WorkerOutput) -> list[RequestOutput]:
        sched_out: SchedulerOutput = batch.scheduler_output
        finished = {f.request_id: f.status for f in self.scheduler.update(sched_out, result.sampled_token_ids)}
        outputs: list[RequestOutput] = []
        for seq, token_id, logprobs in zip(sched_out.sequences, result.sampled_token_ids, result.logprobs):
            state = self._states.get(seq.request_id)
            if state is None:
                continue  # aborted while the step ran
            self._release_children(seq.request_id)
            if token_id is None:
                continue
            status = finished.get(seq.request_id)
            out = self._process_token(state, token_id, logprobs, status)
            if out is not None:
                outputs.append(out)
        return outputs

    def step(self) -> list[RequestOutput]:
        """Synchronous step (offline use and tests)."""
        batch = self.prepare_step()
        if batch is None:
            if self.has_pending_transfers():
                # NOTE: only KV copies or tier reads are running: wait for one to finish instead
                # of spinning, which would starve their threads of the GIL (a 10x slower load).
                self.wait_for_transfers()
            return []
        return self.complete_step(batch, self.worker.execute(batch))

    def wait_for_transfers(self, timeout_s: float = TRANSFER_POLL_S) -> None:
        """Sleep until a KV copy or tier read finishes (a step may then make progress), or at
        most `timeout_s`: promotion deadlines are checked on each poll."""
        if self.connector is None:
            time.sleep(timeout_s)
        else:
            self.connector.progress.wait(timeout_s)

    async def wait_for_transfers_async(self, timeout_s: float = TRANSFER_POLL_S) -> None:
        """`wait_for_transfers` on the event loop, which keeps running meanwhile."""
        if self.connector is None:
            await asyncio.sleep(timeout_s)
        else:
            await self.connector.progress.wait_async(timeout_s)

    def _release_children(self, request_id: RequestId) -> None:
        children = self._held_children.get(request_id)
        if children is None:
            return
        first = self._states[request_id].request
        if first.num_computed_tokens >= first.num_prompt_tokens or first.is_finished:
            del self._held_children[request_id]
            for child in children:
                self.scheduler.add_request(child.request)

    def _process_token(self, state, token_id, logprobs, status) -> RequestOutput | None:
        request = state.request
        if state.grammar is not None:
            state.grammar.accept(token_id)
        finish_reason = status.finish_reason if status else None
        stop_reason: int | str | None = None
        if status == RequestStatus.FINISHED_STOPPED:
            # A stop token is not part of the text; a user stop id is reported as stop_reason.
            text = ""
            if token_id not in request.eos_token_ids:
                stop_reason = token_id
        else:
            text = state.detokenizer.step([token_id])
        if finish_reason is not None:
            text += state.detokenizer.flush()
        if state.stop_matcher is not None:
            match = state.stop_matcher.feed(text)
            text = match.text_to_emit
            if match.stopped:
                if status is None:
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                finish_reason, stop_reason = "stop", match.stop_str
            elif finish_reason is not None:
                text += state.stop_matcher.flush()
        out = self._output(state, [token_id], text, [logprobs] if logprobs else None, finish_reason)
        out.stop_reason = stop_reason
        if finish_reason is not None:
            self._states.pop(request.request_id, None)
            self._held_children.pop(request.request_id, None)
        return out

    def _output(self, state, token_ids, text, logprobs, finish_reason) -> RequestOutput:
        r = state.request
        timings = None
        if finish_reason is not None:
            now = time.monotonic()
            scheduled = r.first_scheduled_time or now
            first_token = r.first_token_time or now
            timings = RequestTimings(scheduled - r.arrival_time, first_token - scheduled, now - first_token)
        return RequestOutput(
            request_id=state.parent_id,
            index=state.index,
            new_token_ids=list(token_ids),
            text=text,
            logprobs=logprobs,
            finish_reason=finish_reason,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens,
            num_cached_tokens=r.num_cached_tokens,
            timings=timings,
        )

    # ---- start-up -------------------------------------------------------------------------
    def warm_up(self, max_decode_batch: int = 8) -> int:
        """Run throwaway steps before serving, so that the first requests do not pay for compiled
        graphs and lazily built kernels (measured: the first W1 request's TTFT was 2.5 s against
        0.19 s for the next ones). Covers a fresh prefill, prefills over a cached prefix, a step
        mixing decodes with a prefill, and pure decode batches of every size from
        `max_decode_batch` down to 1 (the linear kernels switch on the row count).

        Leaves no trace: blocks freed, prefix cache and KV events cleared, counters reset, and
        the offload tiers never consulted. Call it before the first request. Returns the steps run."""
        if self._states:
            raise RuntimeError("warm_up() must run before any request is added")
        words = self.tokenizer.encode(" zenserve warm-up" * 64, add_special_tokens=False)
        # A prefix of whole blocks, leaving room in the context for the suffixes and outputs.
        bs = self.config.cache.block_size
        prefix_len = min(3 * bs, (self.max_model_len - 2 * max_decode_batch - 8) // bs * bs, len(words) - 8)
        if prefix_len < bs:
            log.info("warm-up skipped: a %d-token context is too short for it", self.max_model_len)
            return 0
        prefix = words[:prefix_len]
        connector, self.scheduler.connector = self.scheduler.connector, None
        self._warming_up = True
        try:
            first = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            self.add_request("warmup-0", prefix, first)
            steps = self._warm_up_until_idle()
            # Prefix hits with 3-token suffixes (chunks over a cached context); sample i then
            # decodes until step i + 3, so the decode batch shrinks through every size.
            for i in range(max_decode_batch):
                params = SamplingParams(
                    temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=i + 3, ignore_eos=True
                )
                self.add_request(f"warmup-{i + 1}", prefix + words[i : i + 3], params)
            late = (f"warmup-{max_decode_batch + 1}", words[: prefix_len + 5], SamplingParams(temperature=0.0, max_tokens=1))
            steps += self._warm_up_until_idle(late, join_after=2)
        finally:
            self._warming_up = False
            self.scheduler.connector = connector
            for rid in {s.parent_id for s in self._states.values()}:
                self.abort(rid)
        self.kv.reset_prefix_cache()
        self.take_kv_events()
        self.kv.num_queried_tokens = self.kv.num_hit_tokens = 0
        self.scheduler.num_preemptions = 0
        prepared = self.worker.prepare_decode_steps(self.config.scheduler.max_num_seqs, self.max_model_len)
        if prepared:
            log.info("warm-up: %d decode step graphs captured", prepared)
        release_free_heap()  # the warm-up batches' activations
        return steps

    def _warm_up_until_idle(self, late: tuple | None = None, join_after: int = 0) -> int:
        """Step until idle; `late` (add_request's arguments) joins after `join_after` steps."""
        steps = 0
        while self.has_unfinished():
            if late is not None and steps == join_after:
                self.add_request(*late)
                late = None
            self.step()
            steps += 1
        return steps

    # ---- cache control --------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Clear the engine cache (only while no block is in use) and the offload tiers.

        In-flight KV copies are flushed first, so no copy targets a forgotten block."""
        if self.connector is not None:
            self.connector.flush()
            self.scheduler.finish_loads_now()
        if not self.kv.reset_prefix_cache():
            return False
        if self.connector is not None:
            self.connector.reset()
        return True

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()

    async def shutdown_async(self) -> None:
        """shutdown() for a caller on the event loop that the offload tiers use."""
        if self.connector is not None:
            await self.connector.shutdown_async()

    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.scheduler.take_kv_events()

    def snapshot_kv_events(self) -> list[KVCacheEvent]:
        """What every tier holds now, as stored events in chain order (late subscribers)."""
        events: list[KVCacheEvent] = list(self.pool.snapshot_events(self.layout.block_size))
        if self.connector is not None:
            events.extend(self.connector.snapshot_events())
        return events


def _max_offload_tokens(kv_transfer_params: dict | None) -> int | None:
    """kv_transfer_params.max_offload_tokens: a non-negative int; anything else is ignored."""
    if not kv_transfer_params:
        return None
    value = kv_transfer_params.get("max_offload_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        log.warning("ignoring kv_transfer_params.max_offload_tokens=%r (not a non-negative int)", value)
        return None
    return value
