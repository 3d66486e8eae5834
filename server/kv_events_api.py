"""GET /v1/kv_events (websocket) and POST /reset_prefix_cache."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import WSMsgType, web

from server.errors import ApiError, bad_request, not_found
from server.state import WEBSOCKET_CLOSED, get_state

routes = web.RouteTableDef()


@routes.get("/v1/kv_events")
async def kv_events(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    publisher = state.kv_events
    if publisher is None:
        raise not_found("KV events are off: start the server with --kv-events")
    engine = state.require_engine()
    since = _int_param(request, "since")
    snapshot = request.query.get("snapshot", "0") in ("1", "true")
    if request.query.get("format", "json") != "json":
        raise bad_request("only format=json is supported", param="format")
    # The snapshot is taken and the subscriber registered with no await in between.
    sub = publisher.subscribe(since, engine.core.snapshot_kv_events() if snapshot else None)
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=64 * 1024)
    try:
        await ws.prepare(request)
    except BaseException:
        publisher.unsubscribe(sub)
        raise
    reader = asyncio.create_task(_drain_client(ws))
    getter: asyncio.Task | None = None
    try:
        while not reader.done():
            getter = asyncio.create_task(sub.next_message())
            done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                break
            await ws.send_str(getter.result().decode())
    except (ConnectionResetError, RuntimeError):
        pass  # the client went away mid-send
    except asyncio.CancelledError:
        # The client closed the socket and aiohttp cancelled this handler: the stream's normal end.
        request[WEBSOCKET_CLOSED] = True
        raise
    finally:
        publisher.unsubscribe(sub)
        for task in (getter, reader):  # neither may outlive the handler (a pending task is an error)
            if task is not None:
                task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*(t for t in (getter, reader) if t is not None), return_exceptions=True)
        await ws.close()
    return ws


async def _drain_client(ws: web.WebSocketResponse) -> None:
    """Clients have nothing to say: text frames are ignored, binary frames close the socket."""
    async for msg in ws:
        if msg.type == WSMsgType.BINARY:
            await ws.close(code=1003, message=b"binary frames are not accepted")
            return
        if msg.type == WSMsgType.ERROR:
            return


def _int_param(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"'{name}' must be an integer", param=name) from None
    if value < 0:
        raise bad_request(f"'{name}' must not be negative", param=name)
    return value


@routes.post("/reset_prefix_cache")
async def reset_prefix_cache(request: web.Request) -> web.Response:
    engine = get_state(request).require_engine()
    if not engine.reset_prefix_cache():
        raise ApiError(409, "the prefix cache is in use by running requests; try again when idle", "ConflictError")
    return web.json_response({"reset": True})
