"""Fetch images from http(s), data and file URLs without blocking the event loop or trusting the URL.

| URL                       | read with                                   | refused when                               |
|---------------------------|---------------------------------------------|--------------------------------------------|
| http://, https://         | the connector's one aiohttp session:        | host outside the allowlist, private        |
|                           | streamed, byte cap, manual redirects,       | address (on any hop), too many redirects,  |
|                           | connect and total timeouts                  | too many bytes, too slow                   |
| data:image/...;base64,... | base64 decode in a decode process           | not image/*, not base64, too many bytes    |
| file:///path              | a read in a decode process (path checked    | no allowed directory, resolved path outside|
|                           | here first)                                 |                                            |

Decoding and hashing run in the connector's decode processes (media.decode_pool), handed to them by its
threads, which also read files; the loop only moves bytes, and never copies or joins a body (a 20 MB copy is
milliseconds of loop time). With decode_processes=0 the threads decode; they share the GIL with the loop,
so what they run while holding it is kept short too (see media.image.yield_gil). http fetches that
arrive together start a few per loop turn (_StartGate), so a burst does not become one long turn.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from PIL import Image
from yarl import URL

from media.decode_pool import DecodeProcessPool
from media.decode_pool import supported as decode_processes_supported
from media.egress import EgressPolicy, VettingResolver
from media.errors import (
    MediaFetchError,
    MediaOptionError,
    MediaTimeoutError,
    MediaTooLargeError,
    MediaURLError,
)
from media.hashing import HashedImage, media_hash
from media.image import ImageMediaIO
from media.limits import MediaLimits
from media.local_file import resolve_allowed_root, resolve_file_url

T = TypeVar("T")

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK_SIZE = 64 * 1024
# http fetches that may start in one loop turn. Starting one (request set-up, connecting) is ~0.15 ms of loop
# time, and its later steps as much again: 32 started at once made a ~5 ms turn. With 4 per turn the longest turn
# of a 32-image burst is ~2 ms (ops/bench_media.py), and the 32nd fetch starts ~8 turns later.
_STARTS_PER_TURN = 4
_MAX_DATA_URL_HEADER = 256  # "data:<media type>[;param]*;base64," never needs more
_REQUEST_HEADERS = {"Accept": "image/*", "Accept-Encoding": "identity", "User-Agent": "zenserve-media"}
# media_io_kwargs keys each modality accepts (the keyword arguments of its MediaIO class).
_MEDIA_IO_KEYS: Mapping[str, frozenset[str]] = {"image": frozenset({"image_mode", "rgba_background_color"})}


def _validate_media_io_kwargs(media_io_kwargs: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    validated: dict[str, dict[str, Any]] = {}
    for modality, kwargs in (media_io_kwargs or {}).items():
        accepted = _MEDIA_IO_KEYS.get(modality)
        if accepted is None:
            raise MediaOptionError(f"media_io_kwargs: unsupported modality {modality!r} (supported: image)")
        if not isinstance(kwargs, Mapping):
            raise MediaOptionError(f"media_io_kwargs[{modality!r}] must be an object of keyword arguments")
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise MediaOptionError(
                f"media_io_kwargs[{modality!r}]: unknown option(s) {', '.join(map(repr, unknown))} "
                f"(accepted: {', '.join(sorted(accepted))})"
            )
        validated[modality] = dict(kwargs)
    return validated


def default_decode_processes() -> int:
    """One decode process per usable core but one, at most 4, at least 1: the spare core is the event loop's,
    so a burst of images does not leave the loop waiting for a CPU (BENCHMARKS.md, media)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores - 1))


def _url_scheme(url: str) -> str:
    head, colon, _ = url[:16].partition(":")
    return head.lower() if colon else ""


def _data_url_payload_start(url: str) -> int:
    """Where the base64 payload of an image data URL (RFC 2397) starts, after checking its header.

    An index, not the payload: slicing it off would copy the whole URL (tens of ms for 25 MB, holding the GIL)."""
    comma = url.find(",", 0, _MAX_DATA_URL_HEADER)
    if comma < 0:
        raise MediaURLError("data URL must look like data:image/<type>;base64,<data>")
    media_type, *params = url[len("data:") : comma].split(";")
    media_type = media_type.strip().lower()
    if not media_type.startswith("image/"):
        raise MediaURLError(f"data URL media type must be image/*, got {media_type or 'none'!r}")
    if "base64" not in (p.strip().lower() for p in params):
        raise MediaURLError("only base64 data URLs are supported")
    return comma + 1


def _load_data_url(image_io: ImageMediaIO, url: str) -> Image.Image:
    return image_io.load_base64(url, start=_data_url_payload_start(url))


def _redirect_target(current: URL, response: aiohttp.ClientResponse) -> URL:
    location = response.headers.get("Location")
    if not location:
        raise MediaFetchError(f"media host {current.host!r} sent a redirect without a Location")
    try:
        return current.join(URL(location))
    except (ValueError, TypeError):
        raise MediaFetchError(f"media host {current.host!r} sent a malformed redirect") from None


async def _read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> list[bytes]:
    """The response body as received, in chunks, aborted (connection dropped) as soon as it exceeds max_bytes.

    NOTE: chunks, not one buffer: growing a bytearray reallocates and copies it on the loop (a few ms each time
    for a large body); the decoder reads the chunks in place on its thread (ImageMediaIO.load_chunks)."""
    too_large = MediaTooLargeError(f"media download is over the limit of {max_bytes} bytes")
    if response.content_length is not None and response.content_length > max_bytes:
        response.close()
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(_CHUNK_SIZE):
        chunks.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            # NOTE: close, not release: releasing would drain the rest of a body that may never end.
            response.close()
            raise too_large
    return chunks


class _StartGate:
    """Lets at most `per_turn` callers through per event-loop turn; later ones wait for later turns, in order.

    Not a concurrency limit: a caller that got through holds nothing. It spreads the loop time a burst of
    fetches costs to start over several turns, so the loop still runs other callbacks (other requests, timers)
    every ~1 ms instead of once after the whole burst.
    """

    def __init__(self, per_turn: int) -> None:
        self._per_turn = per_turn
        self._passed = 0  # callers let through since the last turn boundary
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._turn_scheduled = False

    async def wait(self) -> None:
        if not self._waiting and self._passed < self._per_turn:
            self._passed += 1
            self._schedule_turn()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        self._schedule_turn()
        await waiter  # NOTE: a cancelled waiter is done, so _next_turn skips it

    def _schedule_turn(self) -> None:
        # call_soon from inside a turn runs in the next turn: the loop runs only the callbacks that were ready
        # when the turn began (asyncio and uvloop alike).
        if not self._turn_scheduled:
            self._turn_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._turn_scheduled = False
        self._passed = 0
        while self._waiting and self._passed < self._per_turn:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)  # its task resumes in the next turn, counted against this one
                self._passed += 1
        if self._waiting or self._passed:
            self._schedule_turn()


def _run_blocking(make_coroutine: Callable[[], Any]) -> Any:
    """Run a coroutine to completion from synchronous code, whether or not this thread runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coroutine())
    # NOTE: called from inside a running loop (a notebook, a sync helper in async code): a loop cannot be
    # nested, so the coroutine gets its own loop on a helper thread. The caller blocks either way.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="media-sync-fetch") as pool:
        return pool.submit(lambda: asyncio.run(make_coroutine())).result()


class MediaConnector:
    """Loads images from URLs under the server's media policy.

    media_io_kwargs: per-modality options, e.g. {"image": {"image_mode": None, "rgba_background_color": [0, 0, 0]}};
        an image_mode given here overrides the image_mode argument of every fetch.
    allowed_local_media_path: the directory file: URLs may read from; None disables file: URLs.
    allowed_media_domains: None allows any host; otherwise only these hostnames (".example.com" for its
        subdomains); checked on every redirect hop.
    allow_private_addresses: also fetch from loopback, private, link-local, ... addresses (local testing only).
    trusted_hosts: hostname -> addresses, answered without DNS and exempt from the private-address check
        (see EgressPolicy); for an internal mirror, and for tests that need a "public" host on loopback.
    num_decode_threads: size of the connector's thread pool (file-URL checks, handing images to and from the
        decode processes, the preprocessing that follows a fetch); None: min(4, CPU count).
    decode_processes: worker processes that decode images (media.decode_pool); None: one per usable core but
        one, at most 4 (at least 1); 0: decode on the threads instead (also where processes are unsupported).

    The http session and the decode pool belong to the connector: `await close()` (or `async with`) frees them.
    """

    def __init__(
        self,
        media_io_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        allowed_local_media_path: str | os.PathLike[str] | None = None,
        allowed_media_domains: Sequence[str] | None = None,
        allow_private_addresses: bool = False,
        limits: MediaLimits = MediaLimits(),
        *,
        trusted_hosts: Mapping[str, str | Sequence[str]] | None = None,
        num_decode_threads: int | None = None,
        decode_processes: int | None = None,
    ) -> None:
        self.limits = limits
        self._media_io_kwargs = _validate_media_io_kwargs(media_io_kwargs)
        self._image_ios: dict[str | None, ImageMediaIO] = {}
        self.image_io()  # NOTE: built once so a bad option fails at start-up, not on the first request
        self._allowed_root: Path | None = (
            None if allowed_local_media_path is None else resolve_allowed_root(allowed_local_media_path)
        )
        self.egress = EgressPolicy(
            allowed_domains=allowed_media_domains,
            allow_private_addresses=allow_private_addresses,
            trusted_hosts=trusted_hosts,
        )
        if num_decode_threads is None:
            num_decode_threads = min(4, os.cpu_count() or 1)
        self._executor = ThreadPoolExecutor(max_workers=num_decode_threads, thread_name_prefix="media-decode")
        if decode_processes is None:
            decode_processes = default_decode_processes()
        # NOTE: workers start on first use (or warm_up): building a connector only to check options starts none.
        self._decode_pool: DecodeProcessPool | None = (
            DecodeProcessPool(decode_processes, decode_timeout=limits.decode_timeout)
            if decode_processes > 0 and decode_processes_supported()
            else None
        )
        self._start_gate = _StartGate(_STARTS_PER_TURN)
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def image_io(self, image_mode: str | None = "RGB") -> ImageMediaIO:
        """The image loader for one fetch: the call's image_mode, overridden by media_io_kwargs["image"]."""
        # NOTE: built once per mode (it is immutable): building one validates it, loop time on every fetch.
        cacheable = image_mode is None or isinstance(image_mode, str)
        image_io = self._image_ios.get(image_mode) if cacheable else None
        if image_io is None:
            kwargs = {"image_mode": image_mode} | self._media_io_kwargs.get("image", {})
            image_io = ImageMediaIO(**kwargs, limits=self.limits)
            if cacheable:
                self._image_ios[image_mode] = image_io
        return image_io

    # -- fetching -------------------------------------------------------------------------------------------

    async def fetch_image_async(self, url: str, *, image_mode: str | None = "RGB") -> Image.Image:
        """Load an image from an http(s), data or file URL; converted to image_mode (None: kept as decoded)."""
        return (await self._fetch(url, image_mode, want_hash=False)).image

    async def fetch_hashed_image_async(self, url: str, *, image_mode: str | None = "RGB") -> HashedImage:
        """`fetch_image_async` plus the image's media_hash, computed where it was decoded (a decode process):
        what a prefix-cache key needs, without hashing megabytes of pixels in the server's process."""
        return await self._fetch(url, image_mode, want_hash=True)

    async def _fetch(self, url: str, image_mode: str | None, *, want_hash: bool) -> HashedImage:
        self._check_open()
        image_io = self.image_io(image_mode)
        scheme = _url_scheme(url) if isinstance(url, str) else ""
        if scheme in ("http", "https"):
            session = self._shared_session()
            await self._start_gate.wait()
            chunks = await self._download(session, url)
            return await self._run_on_decode_thread(self._decode, want_hash, image_io.load_chunks, chunks)
        if scheme == "data":
            # NOTE: the whole URL goes to the thread (and on to the decode process, which base64-decodes it):
            # even slicing off a 25 MB payload is a copy.
            return await self._run_on_decode_thread(self._decode, want_hash, _load_data_url, image_io, url)
        if scheme == "file":
            return await self._run_on_decode_thread(self._decode_file_url, want_hash, image_io, url)
        raise MediaURLError("media URL must be an http(s), data or file URL")

    def fetch_image(self, url: str, *, image_mode: str | None = "RGB") -> Image.Image:
        """Blocking `fetch_image_async` for scripts: same checks, decoded on the calling thread.

        http(s) URLs use a session of their own for the call; never call this from a server's event loop.
        """
        self._check_open()
        image_io = self.image_io(image_mode)
        scheme = _url_scheme(url) if isinstance(url, str) else ""
        if scheme in ("http", "https"):
            return image_io.load_chunks(_run_blocking(lambda: self._download_with_own_session(url)))
        if scheme == "data":
            return _load_data_url(image_io, url)
        if scheme == "file":
            return image_io.load_file(resolve_file_url(url, self._allowed_root))
        raise MediaURLError("media URL must be an http(s), data or file URL")

    async def warm_up(self) -> None:
        """Start the decode processes and wait until each is ready, so the first images do not wait for them."""
        self._check_open()
        if self._decode_pool is not None:
            await self._run_on_decode_thread(self._decode_pool.ping)

    async def close(self) -> None:
        """Close the http session and stop the decode pools (running decodes finish on their own)."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._decode_pool is not None:
            await asyncio.to_thread(self._decode_pool.close)  # NOTE: waits for idle workers to exit

    async def __aenter__(self) -> MediaConnector:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- internals ------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MediaConnector is closed")

    async def run_on_media_thread(self, func: Callable[..., T], *args: Any) -> T:
        """Run image work that follows a fetch (hashing, preprocessing) on the connector's decode pool,
        so that all media work shares one bounded set of threads."""
        self._check_open()
        return await self._run_on_decode_thread(func, *args)

    async def _run_on_decode_thread(self, func: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, func, *args)

    def _decode(self, want_hash: bool, load: Callable[..., Image.Image], *args: Any) -> HashedImage:
        """load(*args) (and its hash) in a decode process if the connector has them, else right here. On a
        decode thread."""
        if self._decode_pool is not None:
            return self._decode_pool.decode(load, *args, want_hash=want_hash)
        image = load(*args)
        return HashedImage(image, media_hash(image) if want_hash else None)

    def _decode_file_url(self, want_hash: bool, image_io: ImageMediaIO, url: str) -> HashedImage:
        # NOTE: the path is checked here, in the process that holds the policy; the worker only reads it.
        return self._decode(want_hash, image_io.load_file, resolve_file_url(url, self._allowed_root))

    def _new_session(self) -> aiohttp.ClientSession:
        """A session whose every connection goes through the egress policy.

        use_dns_cache=False: each new connection asks VettingResolver, so each is vetted (pooled keep-alive
        connections were vetted when opened). trust_env=False: a proxy from the environment would dial on our
        behalf and bypass the address check. DummyCookieJar: one user's cookies never ride on another's fetch.
        auto_decompress=False (with Accept-Encoding: identity): the byte cap counts what is decoded.
        """
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(resolver=VettingResolver(self.egress), use_dns_cache=False),
            timeout=aiohttp.ClientTimeout(
                total=None, connect=self.limits.connect_timeout, sock_connect=self.limits.connect_timeout
            ),
            headers=_REQUEST_HEADERS,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            trust_env=False,
        )

    def _shared_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None:
            self._session, self._session_loop = self._new_session(), loop
        elif self._session_loop is not loop:
            raise RuntimeError("MediaConnector is bound to the event loop that first used it")
        return self._session

    async def _download_with_own_session(self, url: str) -> list[bytes]:
        async with self._new_session() as session:
            return await self._download(session, url)

    async def _download(self, session: aiohttp.ClientSession, url: str) -> list[bytes]:
        """The body at `url`, following at most max_redirects redirects, each checked like the first URL."""
        try:
            current = URL(url)
        except (ValueError, TypeError):
            raise MediaURLError("media URL is malformed") from None
        limits = self.limits
        try:
            async with asyncio.timeout(limits.total_timeout):
                for _ in range(limits.max_redirects + 1):
                    self.egress.check_url(current)
                    async with session.get(current, allow_redirects=False) as response:
                        if response.status in _REDIRECT_STATUSES:
                            current = _redirect_target(current, response)
                            continue
                        if not 200 <= response.status < 300:
                            raise MediaFetchError(f"media host {current.host!r} answered HTTP {response.status}")
                        return await _read_capped(response, limits.max_bytes)
                raise MediaFetchError(f"media URL redirected more than {limits.max_redirects} times")
        except TimeoutError:  # asyncio.timeout, and aiohttp's connect timeouts (they subclass it)
            raise MediaTimeoutError(f"fetching media from {current.host!r} took longer than allowed") from None
        except aiohttp.ClientConnectorError:
            raise MediaFetchError(f"cannot connect to media host {current.host!r}") from None
        except aiohttp.ClientError as exc:
            raise MediaFetchError(f"fetching media from {current.host!r} failed ({type(exc).__name__})") from None
