"""Prometheus metrics of one server, in its own registry (no process-wide globals).

Request-level series are observed by the server as responses finish; engine-level series
(cache usage, prefix-cache and offload counters, preemptions, tiers) are read from the
engine's own counters at scrape time by a collector, so nothing is counted twice.
Names are vLLM's with the `zenserve:` prefix, with vLLM's buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.async_engine import AsyncEngine, StepRecord
from engine.outputs import RequestTimings

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A decode step of a small model takes milliseconds on a CPU; a long prefill chunk, a second or more.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.5, 5.0)
STEP_GAP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025,
                    0.05, 0.1, 0.25, 1.0)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
FINISH_REASONS = ("stop", "length", "abort")
# Tier statistics that are levels, not running totals; and vLLM's names for the totals.
_TIER_GAUGES = frozenset({"healthy", "used_bytes", "capacity_bytes", "num_chunks", "active_promotions",
                          "pending_demotion_bytes", "num_used_slots", "num_slots"})
_TIER_STAT_NAMES = {"bytes_read": "read_bytes", "read_seconds": "read_time",
                    "bytes_written": "write_bytes", "write_seconds": "write_time"}


def one_two_five_buckets(maximum: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 buckets: 1, 2, 5, 10, 20, 50, ... up to `maximum`."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > maximum:
                return tuple(out)
            out.append(value)
        exponent += 1


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int = 8192):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name", "engine"]
        self.request_success = Counter("zenserve:request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("zenserve:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("zenserve:generation_tokens", "Tokens generated.", labels, registry=r)
        self.request_prompt_tokens = Histogram("zenserve:request_prompt_tokens", "Prompt tokens per request.",
                                               labels, buckets=one_two_five_buckets(max_model_len), registry=r)
        self.request_generation_tokens = Histogram("zenserve:request_generation_tokens", "Generated tokens per request.",
                                                   labels, buckets=one_two_five_buckets(max_model_len), registry=r)
        self.time_to_first_token = Histogram("zenserve:time_to_first_token_seconds", "Time to the first token.",
                                             labels, buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("zenserve:inter_token_latency_seconds", "Time between output tokens.",
                                             labels, buckets=ITL_BUCKETS, registry=r)
        self.e2e_latency = Histogram("zenserve:e2e_request_latency_seconds", "End-to-end request latency.",
                                     labels, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("zenserve:request_queue_time_seconds", "Time waiting before first scheduled.",
                                    labels, buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("zenserve:request_prefill_time_seconds", "First scheduled to first token.",
                                      labels, buckets=LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("zenserve:request_decode_time_seconds", "First token to finish.",
                                     labels, buckets=LATENCY_BUCKETS, registry=r)
        # Per engine step: vLLM's tokens per iteration, and (zenserve's own) where a step's time goes.
        self.iteration_tokens = Histogram("zenserve:iteration_tokens_total", "Tokens computed per engine step.",
                                          labels, buckets=ITERATION_TOKEN_BUCKETS, registry=r)
        self.step_duration = Histogram("zenserve:engine_step_duration_seconds",
                                       "Each engine step's forward pass and sampling, on the worker thread.",
                                       labels, buckets=STEP_BUCKETS, registry=r)
        self.step_gap = Histogram("zenserve:engine_step_gap_seconds",
                                  "The worker's wait between two steps with work pending: outputs handed out, "
                                  "scheduling, the hand-over to the worker thread.",
                                  labels, buckets=STEP_GAP_BUCKETS, registry=r)
        self.http_requests = Counter("zenserve:http_requests", "HTTP requests by route and status.",
                                     ["method", "route", "status"], registry=r)
        self.http_latency = Histogram("zenserve:http_request_duration_seconds", "HTTP handler latency by route.",
                                      ["method", "route"], buckets=HTTP_BUCKETS, registry=r)
        self._precreate_finish_reasons()
        self._engine_collector: EngineCollector | None = None

    def _precreate_finish_reasons(self) -> None:
        for reason in FINISH_REASONS:  # pre-created at 0, as vLLM does
            self.request_success.labels(*self._labels(), reason)

    def set_model_name(self, model_name: str) -> None:
        """Name the series after the loaded model (known once it loads), dropping the placeholder's
        pre-created zeros: nothing is served before the model is attached, so they never counted."""
        for reason in FINISH_REASONS:
            self.request_success.remove(*self._labels(), reason)
        self.model_name = model_name
        self._precreate_finish_reasons()

    def _labels(self) -> tuple[str, str]:
        return self.model_name, "0"

    def bind_engine(self, engine: AsyncEngine) -> None:
        self._engine_collector = EngineCollector(engine, self._labels)
        self.registry.register(self._engine_collector)
        engine.on_step = self.record_step

    def record_step(self, step: StepRecord) -> None:
        labels = self._labels()
        self.iteration_tokens.labels(*labels).observe(step.num_tokens)
        self.step_duration.labels(*labels).observe(step.forward_s)
        if step.gap_s is not None:
            self.step_gap.labels(*labels).observe(step.gap_s)

    def record_token_gap(self, seconds: float, num_tokens: int) -> None:
        per_token = seconds / num_tokens
        for _ in range(num_tokens):
            self.inter_token_latency.labels(*self._labels()).observe(per_token)

    def record_finished(self, reason: str, num_prompt: int, num_generated: int, ttft_s: float | None,
                        e2e_s: float, timings: RequestTimings | None) -> None:
        labels = self._labels()
        self.request_success.labels(*labels, reason).inc()
        self.prompt_tokens.labels(*labels).inc(num_prompt)
        self.generation_tokens.labels(*labels).inc(num_generated)
        self.request_prompt_tokens.labels(*labels).observe(num_prompt)
        self.request_generation_tokens.labels(*labels).observe(num_generated)
        if ttft_s is not None:
            self.time_to_first_token.labels(*labels).observe(ttft_s)
        self.e2e_latency.labels(*labels).observe(e2e_s)
        if timings is not None:
            self.queue_time.labels(*labels).observe(timings.queue_s)
            self.prefill_time.labels(*labels).observe(timings.prefill_s)
            self.decode_time.labels(*labels).observe(timings.decode_s)

    def record_http(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_latency.labels(method, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Reads the engine's live counters at scrape time."""

    def __init__(self, engine: AsyncEngine, labels: Callable[[], tuple[str, str]]):
        self.engine = engine
        self.labels = labels

    def collect(self) -> Iterator:
        core = self.engine.core
        names = ["model_name", "engine"]
        values = list(self.labels())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("zenserve:num_requests_running", "Requests in the running batch.", core.num_running)
        yield gauge("zenserve:num_requests_waiting", "Requests waiting to be scheduled.", core.num_waiting)
        yield gauge("zenserve:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", core.pool.usage)
        yield counter("zenserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      core.kv.num_queried_tokens)
        yield counter("zenserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.", core.kv.num_hit_tokens)
        yield counter("zenserve:num_preemptions", "Requests preempted for lack of KV blocks.",
                      core.scheduler.num_preemptions)
        connector = core.connector
        if connector is None:
            return
        st = connector.stats
        yield counter("zenserve:external_prefix_cache_queries", "Tokens asked of the offload tiers.", st.queried_tokens)
        yield counter("zenserve:external_prefix_cache_hits", "Tokens the offload tiers supplied.", st.hit_tokens)
        yield counter("zenserve:kv_offload_load_bytes", "Bytes loaded from the offload tier.", st.loaded_bytes)
        yield counter("zenserve:kv_offload_store_bytes", "Bytes stored to the offload tier.", st.stored_bytes)
        yield counter("zenserve:kv_offload_load_time", "Seconds spent loading.", st.load_seconds)
        yield counter("zenserve:kv_offload_store_time", "Seconds spent storing.", st.store_seconds)
        yield counter("zenserve:kv_offload_loads", "Load jobs finished.", st.loads)
        yield counter("zenserve:kv_offload_load_failures", "Load jobs that failed (recomputed).", st.load_failures)
        yield counter("zenserve:kv_offload_allocation_failure", "Stores refused for lack of room.", st.store_rejections)
        yield counter("zenserve:kv_offload_lookup_async_delay_seconds", "Seconds requests waited on deferred lookups.",
                      st.deferral_seconds)
        yield counter("zenserve:kv_offload_lookup_deadline_expired", "Deferred lookups given up (recomputed).",
                      st.deadline_expired)
        tier_names = ["model_name", "engine", "tier"]
        families = {
            "queries": CounterMetricFamily("zenserve:kv_offload_tiering_chunk_queries", "Chunk lookups per tier.", labels=tier_names),
            "hits": CounterMetricFamily("zenserve:kv_offload_tiering_chunk_hits", "Chunk hits per tier.", labels=tier_names),
            "stored": CounterMetricFamily("zenserve:kv_offload_tiering_stored_chunks", "Chunks stored per tier.", labels=tier_names),
            "evicted": CounterMetricFamily("zenserve:kv_offload_tiering_evicted_chunks", "Chunks evicted per tier.", labels=tier_names),
        }
        extras: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for tier, ts in connector.manager.stats().items():
            row = values + [tier]
            families["queries"].add_metric(row, ts.lookups)
            families["hits"].add_metric(row, ts.hits)
            families["stored"].add_metric(row, ts.stored_chunks)
            families["evicted"].add_metric(row, ts.evicted_chunks)
            for key, value in ts.extra.items():
                name = _TIER_STAT_NAMES.get(key, key)
                fam = extras.get(name)
                if fam is None:
                    kind = GaugeMetricFamily if key in _TIER_GAUGES else CounterMetricFamily
                    fam = extras[name] = kind(f"zenserve:kv_offload_tiering_{name}", f"Tier statistic {name}.",
                                              labels=tier_names)
                fam.add_metric(row, float(value))
        yield from families.values()
        yield from extras.values()
