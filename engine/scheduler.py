"""A loop-driven step scheduler in the style of vLLM v1.

Each step: running requests first (decodes and unfinished prefill chunks, in admission
order), then waiting ones, within a token budget (max_num_batched_tokens) and max_num_seqs;
while any request decodes, prefill chunks share a smaller budget
(max_prefill_tokens_while_decoding), so a burst of prompts cannot stall the decodes for long.
When blocks run out, the lowest-priority newest running request is preempted by recompute:
its blocks are freed (they stay cached, so resumption usually hits) and it rejoins the front
of the waiting queue with its output so far, which it continues unchanged.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_events import KVCacheEvent
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.multimodal.inputs import MultiModalItem
from engine.offload.connector import OffloadingConnector
from engine.request import Request, RequestId, RequestStatus


@dataclass(frozen=True)
class ScheduledSequence:
    """One request's slice of a step: `token_ids` at positions start_position.. ."""

    request_id: RequestId
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[int, ...]
    needs_sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    mm_items: tuple[MultiModalItem, ...] = ()  # images whose placeholders this chunk covers (in part)
    # One generated token (past the prompt): the worker's decode paths may serve it. A prompt position never
    # takes them, even alone (a full prefix-cache hit's last token, a one-token chunk): it is computed the
    # same way however its prompt was split between the cache and the steps.
    is_decode: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the cache once this chunk is written."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    sequences: tuple[ScheduledSequence, ...]
    block_ids_to_zero: tuple[int, ...]
    preempted_request_ids: tuple[RequestId, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences


@dataclass(frozen=True)
class FinishedRequest:
    request_id: RequestId
    status: RequestStatus


def _is_decoding(request: Request) -> bool:
    """Past its prompt (and any recompute after preemption): one new token per step."""
    return request.num_tokens - request.num_computed_tokens == 1 and request.num_output_tokens > 0


def check_stop(request: Request, last_token_id: int) -> RequestStatus | None:
    """Pure stop decision after a token was appended (stop strings are the detokenizer's)."""
    params = request.sampling_params
    past_min = request.num_output_tokens >= params.min_tokens
    if past_min and not params.ignore_eos and last_token_id in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if past_min and last_token_id in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= request.max_total_len:
        return RequestStatus.FINISHED_LENGTH
    return None


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        zero_new_blocks: bool = False,
        connector: OffloadingConnector | None = None,
    ):
        self.config = config
        self.kv = kv
        self.zero_new_blocks = zero_new_blocks
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[RequestId, Request] = {}  # WAITING_FOR_KV: offloaded KV on its way
        self.requests: dict[RequestId, Request] = {}
        self.num_preemptions = 0  # since start, for metrics and tests

    # ---- admission and removal ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: RequestId, status: RequestStatus) -> bool:
        """Finish (or abort) a request at any moment; its blocks are freed now."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_KV:
            del self.loading[request.request_id]  # its load's blocks stay fenced until it lands
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        if self.connector is not None:
            self.connector.request_finished(request)
        return True

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.connector is not None:
            self._finish_loads()
        budget = self.config.max_num_batched_tokens
        # Prefill tokens this step may take: capped while decodes run, so that they keep a
        # steady pace (see SchedulerConfig.max_prefill_tokens_while_decoding).
        prefill_budget = budget
        cap = self.config.max_prefill_tokens_while_decoding
        if cap and any(_is_decoding(r) for r in self.running):
            prefill_budget = cap
        scheduled: list[tuple[Request, int]] = []
        prefilling: set[RequestId] = set()  # scheduled running requests whose chunk is prefill
        to_zero: list[int] = []
        preempted: list[RequestId] = []

        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            decoding = _is_decoding(request)
            if not decoding and prefill_budget <= 0:
                continue  # a partial prefill waits; decodes after it still run
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not decoding:
                num_new = min(num_new, prefill_budget)
            while True:
                new_block_ids = self.kv.allocate_slots(request, num_new)
                if new_block_ids is not None:
                    break
                victim = self._pick_victim()
                self._preempt(victim)
                preempted.append(victim.request_id)
                for i, (done, n) in enumerate(scheduled):
                    if done is victim:  # a higher-priority request needs its blocks
                        del scheduled[i]
                        budget += n
                        if victim.request_id in prefilling:
                            prefill_budget += n
                        break
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            to_zero.extend(new_block_ids)
            scheduled.append((request, num_new))
            budget -= num_new
            if not decoding:
                prefill_budget -= num_new
                prefilling.add(request.request_id)

        # NOTE: no admission in a step that preempted: the pool is already short.
        deferred: list[Request] = []
        budget = min(budget, prefill_budget)  # everything admitted from here on is prefill
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.popleft()
            if self.kv.has_blocks(request):
                # Its prefix arrived from an offload tier; compute the rest.
                hit = None
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            else:
                hit = self.kv.find_prefix_hit(request)
                if self.connector is not None:
                    external = self.connector.lookup(request, hit.num_tokens)
                    if external is None:
                        deferred.append(request)  # a tier is still fetching: ask again next step
                        continue
                    if external > 0:
                        if not self._start_load(request, hit, external):
                            self.waiting.appendleft(request)
                            break
                        continue
                num_new = min(request.num_tokens - hit.num_tokens, budget)
            new_block_ids = self.kv.allocate_slots(request, num_new, hit)
            if new_block_ids is None:
                self.waiting.appendleft(request)
                break
            if hit is not None:
                request.num_computed_tokens = hit.num_tokens
                if request.num_preemptions == 0:
                    request.num_cached_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            to_zero.extend(new_block_ids)
            scheduled.append((request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        if self.connector is not None:
            self.connector.on_schedule_end()

        sequences = tuple(self._make_scheduled(r, n) for r, n in scheduled)
        return SchedulerOutput(
            sequences,
            tuple(to_zero) if self.zero_new_blocks else (),
            tuple(preempted),
        )

    def _start_load(self, request: Request, hit, num_external: int) -> bool:
        """Allocate blocks for the hit plus the external tokens and start the load."""
        if self.kv.allocate_slots(request, num_external, hit, publish=False) is None:
            return False
        request.num_computed_tokens = hit.num_tokens
        request.status = RequestStatus.WAITING_FOR_KV
        self.loading[request.request_id] = request
        self.connector.start_load(request, hit.num_tokens, num_external)
        return True

    def finish_loads_now(self) -> None:
        """Apply loads that finished (after a flush) without waiting for the next step."""
        if self.connector is not None:
            self._finish_loads()

    def _finish_loads(self) -> None:
        """Loaded requests rejoin the front of the queue; a failed load just recomputes."""
        for request_id, success, num_tokens in self.connector.take_finished_loads():
            request = self.loading.pop(request_id, None)
            if request is None:
                continue  # finished or aborted while loading
            if success:
                request.num_computed_tokens += num_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def _make_scheduled(self, request: Request, num_new: int) -> ScheduledSequence:
        start = request.num_computed_tokens
        tokens = request.token_ids_between(start, start + num_new)
        return ScheduledSequence(
            request.request_id,
            tuple(tokens),
            start,
            tuple(request.block_ids),
            needs_sample=start + num_new == request.num_tokens,
            mm_items=tuple(i for i in request.mm_items if i.overlaps(start, start + num_new)),
            is_decode=num_new == 1 and start >= request.num_prompt_tokens,
        )

    def _pick_victim(self) -> Request:
        """Lowest priority first (largest value), then the newest."""
        return max(self.running, key=lambda r: (r.priority, r.arrival_seq))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(
        self, output: SchedulerOutput, sampled_token_ids: Sequence[int | None]
    ) -> list[FinishedRequest]:
        """Advance counters, append sampled tokens, finish what stopped.

        `sampled_token_ids[i]` belongs to output.sequences[i] (None where nothing was sampled).
        Requests finished or aborted while the step ran are skipped.
        """
        finished: list[FinishedRequest] = []
        for seq, token_id in zip(output.sequences, sampled_token_ids, strict=True):
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += seq.num_tokens
            if self.connector is not None:
                self.connector.build_stores(request)
            if token_id is None:
                continue
            request.append_output_token(token_id)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            self.kv.update_block_hashes(request)
            status = check_stop(request, token_id)
            if status is not None:
                self.finish_request(request.request_id, status)
                finished.append(FinishedRequest(request.request_id, status))
        return finished

    def take_kv_events(self) -> list[KVCacheEvent]:
        events = self.kv.pool.take_events()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        return events

    def has_pending_transfers(self) -> bool:
        return self.connector is not None and self.connector.has_pending_work()
