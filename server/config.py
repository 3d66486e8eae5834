"""The server's own settings (the engine's live in engine.config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    health_deadline_s: float = 30.0  # work waiting and no step completed for this long: unhealthy
    shutdown_grace_s: float = 10.0  # in-flight requests may finish for this long on SIGTERM
    log_level: str = "info"
    kv_events: bool = False  # serve /v1/kv_events
