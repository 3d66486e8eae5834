"""The aiohttp application: middlewares (errors, auth), routes, and the engine's lifetime."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import InvalidRequestError, QueueFullError, ZenserveError
from kvtier.secondary_tier import TierStartupError
from server import kv_events_api, misc_api, openai_api
from server.config import ServerConfig
from server.errors import ApiError, bad_request, internal_error, not_found, overloaded, unauthorized
from server.kv_event_stream import KVEventPublisher
from server.metrics import ServerMetrics
from server.state import CLIENT_CLOSED, STATE, WEBSOCKET_CLOSED, ServerState, make_media_connector

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Open to probes and scrapers even when an API key is set.
_OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})
# nginx's "client closed request": the status the HTTP metrics give a response its client left.
CLIENT_CLOSED_STATUS = 499
# Websocket clients may pass the key as ?api_key= instead of a header.
_QUERY_KEY_PATHS = frozenset({"/v1/kv_events"})


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Map every failure to the OpenAI error shape; nothing a client sends becomes a 500."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPNotFound:
        return not_found(f"no route for {request.method} {request.path}").response()
    except web.HTTPMethodNotAllowed:
        return ApiError(405, f"{request.method} is not allowed on {request.path}", "MethodNotAllowed").response()
    except web.HTTPException as e:
        return ApiError(e.status, e.reason, type(e).__name__).response()
    except QueueFullError as e:
        return overloaded(str(e)).response()
    except InvalidRequestError as e:
        return bad_request(str(e), param=getattr(e, "param", None)).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except ZenserveError as e:
        log.error("engine error on %s: %s", request.path, e)
        return overloaded(str(e)).response()
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return internal_error().response()


@web.middleware
async def http_metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Counts and times every request by route template (not raw path: bounded label values)."""
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = CLIENT_CLOSED_STATUS if request.get(CLIENT_CLOSED) else response.status
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        # The client went away (a cancelled handler, or a failed write); a websocket's close is its end.
        status = 101 if request.get(WEBSOCKET_CLOSED) else CLIENT_CLOSED_STATUS
        raise
    finally:
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        request.app[STATE].metrics.record_http(request.method, name, status, time.perf_counter() - started)


def auth_middleware(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and request.path not in _OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if request.path in _QUERY_KEY_PATHS and "api_key" in request.query:
                given = f"Bearer {request.query['api_key']}".encode()  # browsers can't set ws headers
            if not hmac.compare_digest(given, expected):  # constant time
                return unauthorized().response()
        return await handler(request)

    return check


def create_app(
    server_config: ServerConfig,
    engine_config: EngineConfig | None = None,
    engine: AsyncEngine | None = None,
) -> web.Application:
    """With `engine`, serve it (tests); otherwise load one from `engine_config` in the background,
    answering 503 until it is ready."""
    app = web.Application(
        middlewares=[http_metrics_middleware, error_middleware, auth_middleware(server_config.api_key)],
        client_max_size=server_config.max_body_bytes,
    )
    name = server_config.served_model_name or (engine.core.loaded.name if engine else "zenserve")
    state = ServerState(server_config, name, ServerMetrics(name), media=make_media_connector(server_config))
    if server_config.kv_events:
        state.kv_events = KVEventPublisher()
    app[STATE] = state
    app.add_routes(openai_api.routes)
    app.add_routes(misc_api.routes)
    app.add_routes(kv_events_api.routes)
    app.cleanup_ctx.append(_engine_lifetime(engine_config, engine))
    return app


def _engine_lifetime(engine_config: EngineConfig | None, given: AsyncEngine | None):
    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        state = app[STATE]
        loader: asyncio.Task | None = None
        if given is not None:
            _attach(state, given)
        else:
            assert engine_config is not None
            loader = asyncio.create_task(_load(state, engine_config, state.config.warm_up), name="zenserve-model-load")
        yield
        if loader is not None and not loader.done():
            loader.cancel()
            await asyncio.gather(loader, return_exceptions=True)
        if state.engine is not None and given is None:
            await state.engine.shutdown()
        if state.media is not None:
            await state.media.close()

    return lifetime


# A load that fails for one of these is a configuration the user can fix: one line says why (`serve`
# exits 2). Anything else is a bug, logged with its traceback (exit 1).
STARTUP_CONFIG_ERRORS = (ZenserveError, ValueError, TierStartupError)


async def _load(state: ServerState, config: EngineConfig, warm_up: bool) -> None:
    """Load and attach the engine; a failure is left in state.load_error (503s say so, and
    `serve` stops), not raised: nothing awaits this task until shutdown."""
    try:
        engine = await AsyncEngine.create(config, warm_up=warm_up)
    except STARTUP_CONFIG_ERRORS as e:
        state.load_error = e
        return
    except Exception as e:
        log.exception("model failed to load")
        state.load_error = e
        return
    _attach(state, engine)
    if warm_up and engine.core.loaded.arch.multimodal is not None and state.media is not None:
        await state.media.warm_up()  # the image decode processes, before the first image arrives


def _attach(state: ServerState, engine: AsyncEngine) -> None:
    if state.config.served_model_name is None:
        state.model_name = engine.core.loaded.name
        state.metrics.set_model_name(state.model_name)
    state.metrics.bind_engine(engine)
    if state.kv_events is not None:
        engine.on_kv_events = state.kv_events.publish
    state.engine = engine
