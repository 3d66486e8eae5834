"""Run the server on uvloop until SIGINT/SIGTERM, then shut down gracefully."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

import uvloop
from aiohttp import web

from engine.config import EngineConfig
from server.app import STARTUP_CONFIG_ERRORS, create_app
from server.config import ServerConfig
from server.state import STATE

log = logging.getLogger("zenserve")


def serve(server_config: ServerConfig, engine_config: EngineConfig) -> int:
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return uvloop.run(_serve(server_config, engine_config))


async def _serve(server_config: ServerConfig, engine_config: EngineConfig) -> int:
    # The port first: a bad or busy one is a one-line error before the model starts loading.
    try:
        sock = _listening_socket(server_config.host, server_config.port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", server_config.host, server_config.port, e.strerror or e)
        return 2
    app = create_app(server_config, engine_config)
    # Cancel a handler when its client disconnects: that aborts its request in the engine.
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=server_config.shutdown_grace_s, access_log=None
    )
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    state = app[STATE]
    rc = 0
    ready_logged = False
    try:
        while not stop.is_set():
            if state.load_error is not None:
                err = state.load_error
                log.error("cannot serve: %s", err)
                rc = 2 if isinstance(err, STARTUP_CONFIG_ERRORS) else 1
                break
            if state.engine is not None and not ready_logged:
                ready_logged = True
                engine = state.engine
                log.info(
                    "zenserve ready on http://%s:%d model=%s worker=%s dtype=%s kv_cache=%.0f MiB %s (%d tokens)",
                    server_config.host, server_config.port, state.model_name, engine.core.worker.name,
                    str(engine.core.loaded.dtype).removeprefix("torch."), engine.core.worker.kv_cache_bytes / 2**20,
                    str(engine.core.layout.groups[0].spec.dtype).removeprefix("torch."),
                    engine.core.layout.num_blocks * engine.core.layout.block_size,
                )
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.2 if not ready_logged else 5.0)
            except TimeoutError:
                pass
        if stop.is_set():
            log.info("shutting down: finishing in-flight requests for up to %.0f s", server_config.shutdown_grace_s)
    finally:
        # Stops accepting, waits for handlers up to shutdown_timeout, then cancels the rest.
        await runner.cleanup()
    return rc


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), as aiohttp's TCPSite would bind it (address reuse on)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock
