"""Prometheus metrics of one server, in its own registry (no process-wide globals)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.request_success = Counter(
            "zenserve:request_success", "Finished requests by finish reason.", labels + ["finished_reason"], registry=r
        )
        self.prompt_tokens = Counter("zenserve:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("zenserve:generation_tokens", "Tokens generated.", labels, registry=r)
        self.time_to_first_token = Histogram(
            "zenserve:time_to_first_token_seconds", "Time to the first token.", labels, buckets=_TTFT_BUCKETS, registry=r
        )
        self.e2e_latency = Histogram(
            "zenserve:e2e_request_latency_seconds", "End-to-end request latency.", labels, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.num_running = Gauge("zenserve:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.num_waiting = Gauge("zenserve:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)

    def bind_engine(self, num_running: Callable[[], float], num_waiting: Callable[[], float]) -> None:
        """Gauges read the engine's live counts at scrape time."""
        self.num_running.labels(self.model_name).set_function(num_running)
        self.num_waiting.labels(self.model_name).set_function(num_waiting)

    def record_finished(self, reason: str, num_prompt: int, num_generated: int, ttft_s: float | None, e2e_s: float) -> None:
        m = self.model_name
        self.request_success.labels(m, reason).inc()
        self.prompt_tokens.labels(m).inc(num_prompt)
        self.generation_tokens.labels(m).inc(num_generated)
        if ttft_s is not None:
            self.time_to_first_token.labels(m).observe(ttft_s)
        self.e2e_latency.labels(m).observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
