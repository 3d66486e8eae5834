"""The offloading connector: the engine's side of the KV tiers.

At admission it looks up the prompt's chunks past the engine's own prefix hit and, on a hit,
loads them into fresh engine blocks while the request waits (WAITING_FOR_KV). After each step
it stores newly completed chunks. Block ids in flight are fenced by holding a reference on
them in the block pool, so they are never reused before their copy finished.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
import logging
import time
from dataclasses import dataclass, field

import torch

from engine.block_pool import BlockPool, KVCacheBlock
from engine.kv_events import KVCacheEvent
from engine.offload.events_tracker import OffloadingEventsTracker
from engine.offload.group import GroupOffloadConfig
from engine.offload.progress import TransferProgress
from engine.offload.transfer import KVCaches, KVHostBuffer, TransferThread
from engine.request import Request, RequestId
from kvtier.base import MEDIUM_CPU, LookupResult, OffloadingManager, OffloadKey, ReqContext, make_offload_key

log = logging.getLogger(__name__)


@dataclass
class OffloadStats:
    """Running totals; metrics read them, nothing is computed twice."""

    lookups: int = 0
    lookup_hit_chunks: int = 0
    queried_tokens: int = 0  # external prefix cache: tokens asked of the tiers
    hit_tokens: int = 0  # ... and tokens they supplied
    loads: int = 0
    load_failures: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    stores: int = 0
    stored_bytes: int = 0
    store_seconds: float = 0.0
    store_rejections: int = 0  # prepare_store found no room
    deferrals: int = 0
    deferral_seconds: float = 0.0
    deadline_expired: int = 0  # deferred past lookup_deadline_s: recomputed instead


@dataclass
class _RequestOffloadState:
    ctx: ReqContext
    max_offload_tokens: int | None
    next_stored_chunk: int = 0
    deferred_since: float | None = None
    waiting_on: OffloadKey | None = None  # deferred: the last chunk its lookup found pending
    gave_up_lookup: bool = False
    hit_keys: tuple[OffloadKey, ...] = ()  # from the last lookup, consumed by start_load
    hit_start_chunk: int = 0


@dataclass
class _Job:
    request_id: RequestId
    keys: tuple[OffloadKey, ...]
    blocks: list[KVCacheBlock]  # fenced: one extra reference each until the copy finished
    num_tokens: int = 0  # loads: tokens that become computed
    ctx: ReqContext = field(default_factory=lambda: ReqContext(""))


class OffloadingConnector:
    def __init__(
        self,
        manager: OffloadingManager,
        host: KVHostBuffer,
        group: GroupOffloadConfig,
        pool: BlockPool,
        kv_caches: KVCaches,
        *,
        offload_prompt_only: bool = True,
        lookup_deadline_s: float = 10.0,
        events: OffloadingEventsTracker | None = None,
        executor: ThreadPoolExecutor | None = None,
    ):
        self.manager = manager
        self.host = host
        self.group = group
        self.pool = pool
        self.kv_caches = kv_caches
        self.offload_prompt_only = offload_prompt_only
        self.lookup_deadline_s = lookup_deadline_s
        self.events = events or OffloadingEventsTracker(False)
        self.progress = TransferProgress()  # copies and tier reads finishing wake a waiting engine
        self.transfer = TransferThread(executor, on_done=self.progress.notify)
        manager.set_progress_listener(self.progress.notify)
        self.stats = OffloadStats()
        self._states: dict[RequestId, _RequestOffloadState] = {}
        self._jobs: dict[int, _Job] = {}
        self._job_ids = itertools.count()

    # ---- per request -------------------------------------------------------------------------
    def _state(self, request: Request) -> _RequestOffloadState:
        st = self._states.get(request.request_id)
        if st is None:
            st = self._states[request.request_id] = _RequestOffloadState(
                ReqContext(request.request_id), request.max_offload_tokens
            )
        return st

    def _key(self, request: Request, chunk_idx: int) -> OffloadKey:
        hpc = self.group.hashes_per_chunk
        return make_offload_key(request.block_hashes[(chunk_idx + 1) * hpc - 1], self.group.group_idx)

    def request_finished(self, request: Request) -> None:
        """No more lookups or stores for it; its in-flight copies still complete."""
        self._states.pop(request.request_id, None)

    # ---- admission: lookup and load -----------------------------------------------------------
    def lookup(self, request: Request, num_engine_hit_tokens: int) -> int | None:
        """Tokens past the engine's hit that the tier can supply (whole chunks, never the last
        token); 0 for none; None to defer the request to a later step."""
        st = self._state(request)
        if st.gave_up_lookup:
            return 0
        tpc = self.group.tokens_per_chunk
        start_chunk = num_engine_hit_tokens // tpc
        end_chunk = (request.num_tokens - 1) // tpc
        if end_chunk <= start_chunk or len(request.block_hashes) < end_chunk * self.group.hashes_per_chunk:
            return 0
        if st.waiting_on is not None and self.manager.still_pending(st.waiting_on):
            # NOTE: a rescan would defer again: skip it. Rescanning every chunk of a long prompt at
            # every poll kept the engine thread (and the GIL) busy while the tier's threads read.
            num_hits = None
        else:
            keys = [self._key(request, c) for c in range(start_chunk, end_chunk)]
            if start_chunk and st.deferred_since is None:
                # Chunks the engine cache already holds are reused too: keep them fresh in the tier.
                self.manager.touch([self._key(request, c) for c in range(start_chunk)], st.ctx)
            num_hits, st.waiting_on = self._maximal_prefix_lookup(
                keys, st.ctx, request, start_chunk, record=st.max_offload_tokens != 0
            )
        now = time.monotonic()
        if num_hits is None:
            if st.deferred_since is None:
                st.deferred_since = now
                self.stats.deferrals += 1
            elif now - st.deferred_since > self.lookup_deadline_s:
                # NOTE: an unbounded HIT_PENDING wedges a server; give up and recompute.
                log.warning("request %s: offload lookup deferred for %.1f s; recomputing", request.request_id,
                            now - st.deferred_since)
                self.stats.deadline_expired += 1
                st.gave_up_lookup = True
                return 0
            return None
        if st.deferred_since is not None:
            self.stats.deferral_seconds += now - st.deferred_since
            st.deferred_since = None
        self.stats.lookups += 1
        self.stats.queried_tokens += request.num_tokens - num_engine_hit_tokens
        if num_hits == 0:
            return 0
        self.stats.lookup_hit_chunks += num_hits
        st.hit_keys = tuple(keys[:num_hits])
        st.hit_start_chunk = start_chunk
        num_tokens = (start_chunk + num_hits) * tpc - num_engine_hit_tokens
        self.stats.hit_tokens += num_tokens
        return num_tokens

    def _maximal_prefix_lookup(
        self, keys: list[OffloadKey], ctx: ReqContext, request: Request, start_chunk_idx: int, record: bool = True
    ) -> tuple[int | None, OffloadKey | None]:
        """(consecutive HITs from the start, None) or, if anything deferred, (None, the last key
        that did). A MISS stops the scan; HIT_PENDING and RETRY defer but the scan goes on, so
        every pending promotion starts."""
        num_hits = 0
        pending = None
        for i, key in enumerate(keys):
            result = self.manager.lookup(key, ctx)
            if result is LookupResult.MISS:
                break
            if result is LookupResult.HIT:
                if record:
                    self.events.record_lookup(request, self.group, start_chunk_idx + i, key)
                if pending is None:
                    num_hits += 1
            else:  # HIT_PENDING or RETRY
                pending = key
        return (None, pending) if pending is not None else (num_hits, None)

    def start_load(self, request: Request, num_engine_hit_tokens: int, num_tokens: int) -> None:
        """Copy the hit chunks into the request's freshly allocated blocks on the transfer thread."""
        st = self._state(request)
        keys = st.hit_keys
        slot_ids = self.manager.prepare_load(keys, st.ctx)
        self.manager.touch(keys, st.ctx)
        bs = self.group.block_size
        first, end = num_engine_hit_tokens, num_engine_hit_tokens + num_tokens
        block_ids = request.block_ids
        engine_slots = torch.tensor(
            [block_ids[p // bs] * bs + p % bs for p in range(first, end)], dtype=torch.int64
        )
        blocks = [self.pool.blocks[b] for b in block_ids[first // bs : -(-end // bs)]]
        self.pool.touch(blocks)
        skip = first - st.hit_start_chunk * self.group.tokens_per_chunk
        job_id = next(self._job_ids)
        self._jobs[job_id] = _Job(request.request_id, keys, blocks, num_tokens, st.ctx)
        self.transfer.submit(job_id, "load", self.host.load, self.kv_caches, list(slot_ids), skip, engine_slots)
        st.next_stored_chunk = max(st.next_stored_chunk, end // self.group.tokens_per_chunk)

    # ---- stores -------------------------------------------------------------------------------
    def build_stores(self, request: Request) -> None:
        """Offload the chunks this step completed (prompt only by default; per-request cap)."""
        st = self._state(request)
        if st.max_offload_tokens == 0:
            return
        limit = request.num_computed_tokens
        if self.offload_prompt_only:
            limit = min(limit, request.num_prompt_tokens)
        if st.max_offload_tokens is not None:
            limit = min(limit, st.max_offload_tokens)
        tpc = self.group.tokens_per_chunk
        end_chunk = min(limit // tpc, len(request.block_hashes) // self.group.hashes_per_chunk)
        if end_chunk <= st.next_stored_chunk:
            return
        chunk_of = {self._key(request, c): c for c in range(st.next_stored_chunk, end_chunk)}
        st.next_stored_chunk = end_chunk
        out = self.manager.prepare_store(list(chunk_of), st.ctx)
        if out is None:
            self.stats.store_rejections += 1
            return
        if not out.keys_to_store:
            return
        bpc, bs = self.group.blocks_per_chunk, self.group.block_size
        blocks: list[KVCacheBlock] = []
        for key in out.keys_to_store:
            c = chunk_of[key]
            self.events.record_store(request, self.group, c, key)
            blocks.extend(self.pool.blocks[b] for b in request.block_ids[c * bpc : (c + 1) * bpc])
        engine_slots = torch.tensor(
            [b.block_id * bs + t for b in blocks for t in range(bs)], dtype=torch.int64
        )
        self.pool.touch(blocks)
        job_id = next(self._job_ids)
        self._jobs[job_id] = _Job(request.request_id, out.keys_to_store, blocks, ctx=st.ctx)
        self.transfer.submit(job_id, "store", self.host.store, self.kv_caches, engine_slots, list(out.slot_ids))

    # ---- completion -----------------------------------------------------------------------------
    def take_finished_loads(self) -> list[tuple[RequestId, bool, int]]:
        """Process finished copies: (request id, success, tokens loaded) for each load."""
        loads = []
        for result in self.transfer.take_finished():
            job = self._jobs.pop(result.job_id)
            self.pool.free(job.blocks)
            if result.kind == "load":
                self.manager.complete_load(job.keys, job.ctx)
                self.stats.loads += 1
                self.stats.loaded_bytes += result.num_bytes
                self.stats.load_seconds += result.seconds
                if not result.success:
                    self.stats.load_failures += 1
                    log.warning("KV load for %s failed; recomputing", job.request_id)
                loads.append((job.request_id, result.success, job.num_tokens))
            else:
                self.manager.complete_store(job.keys, job.ctx, result.success)
                if result.success:
                    self.stats.stores += 1
                    self.stats.stored_bytes += result.num_bytes
                    self.stats.store_seconds += result.seconds
        return loads

    def on_schedule_end(self) -> None:
        self.manager.on_schedule_end()

    def has_pending_work(self) -> bool:
        return self.transfer.num_in_flight > 0 or self.manager.has_pending_work()

    def take_events(self) -> list[KVCacheEvent]:
        return self.events.take_events(self.manager.take_events())

    def snapshot_events(self) -> list[KVCacheEvent]:
        """A stored event for every readable chunk of the CPU tier (for late subscribers)."""
        return [self.events.describe(key, MEDIUM_CPU) for key in self.manager.keys()]

    def flush(self) -> None:
        """Wait for every copy in flight (reset and shutdown only); the scheduler then takes
        the results with take_finished_loads as in any step."""
        self.transfer.wait_all()

    def reset(self) -> None:
        self.manager.reset_cache()
        self.events.reset()

    def shutdown(self) -> None:
        self.transfer.shutdown()
        self.manager.shutdown()

    async def shutdown_async(self) -> None:
        """shutdown() on the event loop the manager's tiers use (it awaits their tasks)."""
        self.transfer.shutdown()
        await self.manager.shutdown_async()
