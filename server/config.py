"""The server's own settings (the engine's live in engine.config)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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
    warm_up: bool = True  # run throwaway steps (compiles, kernel set-up) before answering as ready
    # vLLM's --enable-auto-tool-choice: tool_choice "auto" served (and the default where tools are sent)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # the format of tool calls (server/tool_calls.py); None: the model family's
    # Image URLs in chat requests (multimodal models), see media.MediaConnector.
    allowed_local_media_path: str | None = None  # file: URLs may read under this directory; None: refused
    allowed_media_domains: tuple[str, ...] | None = None  # None: any public host
    allow_private_media_addresses: bool = False  # also fetch from loopback/private hosts (local testing only)
    media_io_kwargs: Mapping[str, Mapping[str, Any]] | None = None  # e.g. {"image": {"image_mode": None}}
    media_decode_processes: int | None = None  # image decode processes; None: usable cores - 1 (1-4); 0: threads
