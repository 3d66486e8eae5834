"""The one SSE writer: `data: {json}\\n\\n` events, then `data: [DONE]`."""

from __future__ import annotations

import orjson
from aiohttp import web


class SSEWriter:
    def __init__(self, request: web.Request):
        self._request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )

    async def start(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, payload: dict) -> None:
        await self.response.write(b"data: " + orjson.dumps(payload) + b"\n\n")

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
