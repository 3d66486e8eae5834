"""A real aiohttp server on 127.0.0.1 over the shared float32 model, and a client for it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine.async_engine import AsyncEngine
from engine.core import EngineCore
from server.app import create_app
from server.config import ServerConfig


@pytest.fixture
async def make_client(smollm_fp32, engine_config):
    """make_client(server={...ServerConfig}, scheduler={...}, ...) -> a started TestClient."""
    started: list[tuple[TestClient, AsyncEngine]] = []

    async def make(server: dict | None = None, engine: dict | None = None, **engine_sections) -> TestClient:
        """engine: top-level EngineConfig fields; engine_sections: fields of its sub-configs."""
        config = replace(engine_config, **(engine or {}))
        for section, values in engine_sections.items():
            config = replace(config, **{section: replace(getattr(config, section), **values)})
        engine = AsyncEngine(EngineCore(config, smollm_fp32))
        engine.start()
        app = create_app(ServerConfig(**(server or {})), engine=engine)
        client = TestClient(TestServer(app, host="127.0.0.1", handler_cancellation=True))
        await client.start_server()
        started.append((client, engine))
        return client

    yield make
    for client, engine in started:
        await client.close()
        await engine.shutdown()


@pytest.fixture
async def client(make_client):
    return await make_client()


def engine_of(client: TestClient) -> AsyncEngine:
    from server.state import STATE

    engine = client.app[STATE].engine
    assert engine is not None
    return engine


async def start_stream_then_leave(client: TestClient, body: dict, events: int = 3) -> None:
    """POST a streaming request, read `events` SSE lines, then close the connection (a client that
    goes away mid-stream)."""
    resp = await client.post("/v1/chat/completions", json=body)
    seen = 0
    async for raw in resp.content:
        seen += raw.startswith(b"data: ")
        if seen >= events:
            break
    resp.close()
