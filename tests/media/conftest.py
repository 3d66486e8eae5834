"""Media fixtures: small test images, a local aiohttp image server on 127.0.0.1, and a connect tripwire.

Nothing here ever connects anywhere but 127.0.0.1: the server binds there, and `connect_log` fails any test whose
code tries to dial another address.
"""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from io import BytesIO

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from PIL import Image

from media import MediaConnector


def encode(image: Image.Image, format: str = "PNG", **options) -> bytes:
    buffer = BytesIO()
    image.save(buffer, format=format, **options)
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height but carries no pixel data: a bomb's header without the bomb."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def rgba_with_one_opaque_pixel(size: tuple[int, int], at: tuple[int, int]) -> Image.Image:
    """Fully transparent black, except one opaque black pixel (the seed tests' image)."""
    image = Image.new("RGBA", size, (0, 0, 0, 0))
    image.putpixel(at, (0, 0, 0, 255))
    return image


@pytest.fixture(scope="session")
def rgb_image() -> Image.Image:
    pixels = np.arange(6 * 8 * 3, dtype=np.uint8).reshape(6, 8, 3)  # 8 wide, 6 high, every pixel distinct
    return Image.fromarray(pixels, "RGB")


@pytest.fixture(scope="session")
def big_jpeg() -> bytes:
    """~20 MB of noise at 6000x6000: decoding takes ~0.3 s, long enough to stall a loop visibly."""
    pixels = np.random.default_rng(0).integers(0, 256, (6000, 6000, 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels, "RGB"), "JPEG", quality=75)


HITS = web.AppKey("hits", list)
STATE = web.AppKey("state", dict)
STOP = web.AppKey("stop", asyncio.Event)


@dataclass
class ImageServer:
    """The running test server: its base URL, the paths it was asked for, and what streaming handlers saw."""

    server: TestServer
    hits: list[str]
    state: dict = field(default_factory=dict)

    @property
    def port(self) -> int:
        return self.server.port

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


def _build_app(rgb_png: bytes, rgba_png: bytes, jpeg: bytes, big_jpeg: bytes) -> web.Application:
    app = web.Application()
    app[HITS] = []
    app[STATE] = {"endless_bytes_sent": 0, "endless_finished": False}
    app[STOP] = asyncio.Event()

    @web.middleware
    async def record(request: web.Request, handler):
        request.app[HITS].append(request.path)
        return await handler(request)

    app.middlewares.append(record)

    def static(body: bytes, content_type: str) -> Callable:
        async def handler(request: web.Request) -> web.Response:
            return web.Response(body=body, content_type=content_type)

        return handler

    async def endless(request: web.Request) -> web.StreamResponse:
        """Chunked, no Content-Length, never ends: only a client-side byte cap stops it."""
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        await response.prepare(request)
        chunk = b"\0" * 65536
        try:
            while not request.app[STOP].is_set():
                await response.write(chunk)
                request.app[STATE]["endless_bytes_sent"] += len(chunk)
                await asyncio.sleep(0)
        except (ConnectionError, RuntimeError):
            pass
        finally:  # a write error or, with handler cancellation, a CancelledError: either way the client left
            request.app[STATE]["endless_finished"] = True
        return response

    async def declared_huge(request: web.Request) -> web.StreamResponse:
        """Declares a gigabyte, then sends nothing: only a Content-Length check fails fast."""
        response = web.StreamResponse(headers={"Content-Type": "image/png", "Content-Length": str(10**9)})
        await response.prepare(request)
        await request.app[STOP].wait()
        return response

    async def slow(request: web.Request) -> web.StreamResponse:
        """A byte every 50 ms, forever: each read succeeds, only a total timeout stops it."""
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        await response.prepare(request)
        try:
            while not request.app[STOP].is_set():
                await response.write(b"\0")
                await asyncio.sleep(0.05)
        except (ConnectionError, RuntimeError):
            pass
        return response

    async def big(request: web.Request) -> web.StreamResponse:
        """The big JPEG in 256 KiB writes, as bytes arrive from a remote host (one 25 MB write would itself
        hold this loop, which the connector under test shares)."""
        response = web.StreamResponse(headers={"Content-Type": "image/jpeg"})
        response.content_length = len(big_jpeg)
        await response.prepare(request)
        for start in range(0, len(big_jpeg), 256 * 1024):
            await response.write(big_jpeg[start : start + 256 * 1024])
        await response.write_eof()
        return response

    async def redirect_chain(request: web.Request) -> web.Response:
        remaining = int(request.match_info["remaining"])
        if remaining == 0:
            return web.Response(body=rgb_png, content_type="image/png")
        raise web.HTTPFound(f"/redirect/{remaining - 1}")

    async def redirect_to(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["target"])

    async def status(request: web.Request) -> web.Response:
        return web.Response(status=int(request.match_info["code"]), text="no image here")

    app.router.add_get("/rgb.png", static(rgb_png, "image/png"))
    app.router.add_get("/rgba.png", static(rgba_png, "image/png"))
    app.router.add_get("/image.jpg", static(jpeg, "image/jpeg"))
    app.router.add_get("/big/{i}.jpg", big)
    app.router.add_get("/truncated.png", static(rgb_png[: len(rgb_png) // 2], "image/png"))
    app.router.add_get("/bomb.png", static(png_header_only(8000, 8000), "image/png"))
    app.router.add_get("/text", static(b"hello, not an image", "text/plain"))
    app.router.add_get("/endless", endless)
    app.router.add_get("/declared-huge", declared_huge)
    app.router.add_get("/slow", slow)
    app.router.add_get("/redirect/{remaining}", redirect_chain)
    app.router.add_get("/redirect-to", redirect_to)
    app.router.add_get("/status/{code}", status)
    return app


@pytest.fixture
async def image_server(rgb_image: Image.Image, big_jpeg: bytes) -> AsyncIterator[ImageServer]:
    rgba = rgba_with_one_opaque_pixel((4, 4), (2, 2))
    app = _build_app(encode(rgb_image), encode(rgba), encode(rgb_image, "JPEG", quality=95), big_jpeg)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield ImageServer(server, app[HITS], app[STATE])
    app[STOP].set()  # let the never-ending handlers return so shutdown does not wait on them
    await server.close()


@pytest.fixture
async def connect_log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every address this test's loop dials; dialling anything but 127.0.0.1 fails the test at once."""
    loop = asyncio.get_running_loop()
    original = loop.sock_connect
    dialled: list[str] = []

    async def guarded(sock, address):
        dialled.append(address[0])
        if address[0] != "127.0.0.1":
            raise AssertionError(f"the media connector tried to connect to {address!r}")
        return await original(sock, address)

    monkeypatch.setattr(loop, "sock_connect", guarded)
    return dialled


@pytest.fixture
async def make_connector() -> AsyncIterator[Callable[..., MediaConnector]]:
    """Build connectors for one test; all are closed after it."""
    connectors: list[MediaConnector] = []

    def make(**kwargs) -> MediaConnector:
        connector = MediaConnector(**kwargs)
        connectors.append(connector)
        return connector

    yield make
    for connector in connectors:
        await connector.close()
