"""Typed application state, reached through an aiohttp AppKey (no module globals)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from engine.async_engine import AsyncEngine
from media import MediaConnector
from server.config import ServerConfig
from server.errors import overloaded
from server.kv_event_stream import KVEventPublisher
from server.metrics import ServerMetrics


@dataclass
class ServerState:
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics
    engine: AsyncEngine | None = None  # None while the model loads
    load_error: BaseException | None = None
    kv_events: KVEventPublisher | None = None  # None: --kv-events is off
    media: MediaConnector | None = None  # fetches chat image URLs; set by create_app
    started_at: float = field(default_factory=time.time)

    def require_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise overloaded("the model is still loading" if self.load_error is None else "the model failed to load")
        return self.engine


STATE = web.AppKey("zenserve_state", ServerState)
# Set on a request whose client went away mid-response: the HTTP metrics count it as status 499.
CLIENT_CLOSED = web.RequestKey("zenserve_client_closed", bool)
# Set on a websocket request whose client closed it: the HTTP metrics count it as 101, its status.
WEBSOCKET_CLOSED = web.RequestKey("zenserve_websocket_closed", bool)


def make_media_connector(config: ServerConfig) -> MediaConnector:
    """The connector the server config describes; a bad option raises ValueError (a MediaOptionError)."""
    return MediaConnector(
        media_io_kwargs=config.media_io_kwargs,
        allowed_local_media_path=config.allowed_local_media_path,
        allowed_media_domains=config.allowed_media_domains,
        allow_private_addresses=config.allow_private_media_addresses,
        decode_processes=config.media_decode_processes,
    )


def get_state(request: web.Request) -> ServerState:
    return request.app[STATE]
