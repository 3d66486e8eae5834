"""The decode worker process: `main([SOCKET_FD, SLOT_FD])`, started by media.decode_pool.

It receives (function, arguments, want_hash) over a multiprocessing Connection on SOCKET_FD, calls the
function (a loader of media.image or media.connector, which returns a PIL image), writes the image's pixels
into the shared slot (a memfd the parent mapped too, SLOT_FD) and answers with a DecodedImage that describes them, or with the
MediaError the loader raised. The parent copies the pixels out before it sends the next request, so the slot
needs no lock. EOF on the socket ends the process.
"""

from __future__ import annotations

import mmap
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from PIL import Image

from media.errors import MediaDecodeError, MediaError
from media.hashing import media_hash

Buffer = bytes | bytearray | memoryview
_TEXT_SLICE = 1 << 20  # characters of a large str (a data URL) encoded per raw message


@dataclass(frozen=True)
class DecodedImage:
    """What the parent needs to rebuild the image from the slot's first `nbytes` bytes (Image.frombytes)."""

    mode: str
    size: tuple[int, int]
    nbytes: int
    palette: tuple[str, bytes] | None  # (raw mode, bytes) for palette images
    info: dict[str, Any]
    format: str | None
    mm_hash: str | None  # media_hash of the image, when asked for (computed here, off the parent's GIL)


class SharedSlot:
    """A memfd both processes map. Whoever needs more room grows the file; each side remaps when it finds the
    file's size changed (the parent also shrinks it back after an unusually large image)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map: mmap.mmap | None = None

    def view(self) -> mmap.mmap:
        size = os.fstat(self.fd).st_size
        if self._map is None or len(self._map) != size:
            if self._map is not None:
                self._map.close()  # NOTE: raises BufferError while a memoryview of it is alive: callers release
            self._map = mmap.mmap(self.fd, size)
        return self._map

    def ensure(self, nbytes: int) -> mmap.mmap:
        if os.fstat(self.fd).st_size < nbytes:
            os.ftruncate(self.fd, nbytes)
        return self.view()

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        os.close(self.fd)


def write_image(image: Image.Image, slot: SharedSlot, want_hash: bool = False) -> DecodedImage:
    raw = image.tobytes()
    view = slot.ensure(len(raw))
    view[: len(raw)] = raw
    palette = None
    if image.mode in ("P", "PA") and image.palette is not None:
        palette = (image.palette.mode, bytes(image.getpalette(image.palette.mode) or b""))
    mm_hash = media_hash(image) if want_hash else None
    return DecodedImage(image.mode, image.size, len(raw), palette, _plain_info(image.info), image.format, mm_hash)


_PLAIN = (str, bytes, int, float, bool, type(None))


def _plain_info(info: dict) -> dict[str, Any]:
    """The image's info entries that pickle for sure (plugin-specific objects stay behind)."""
    def plain(value: object) -> bool:
        return isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(plain(v) for v in value))

    return {key: value for key, value in info.items() if isinstance(key, str) and plain(value)}


@dataclass(frozen=True)
class BytesParts:
    """Stands in a request for a list of buffers that follow it as `count` raw messages (send_bytes)."""

    count: int


@dataclass(frozen=True)
class TextParts:
    """Stands in a request for an ASCII str that follows it in `count` raw messages."""

    count: int


def send_request(conn: Connection, func: Callable, args: tuple, want_hash: bool) -> None:
    """Send a request; large payloads go as raw messages after it, not inside its pickle.

    Pickling copies each payload into one buffer, a memcpy that holds the GIL (several ms for a 20 MB body, as
    long as the event loop then waits). send_bytes writes straight from the buffer with the GIL released, and
    a large str is encoded a slice at a time.
    """
    header: list[object] = []
    raw: list[Buffer] = []
    for arg in args:
        if isinstance(arg, list) and all(isinstance(part, (bytes, bytearray, memoryview)) for part in arg):
            header.append(BytesParts(len(arg)))
            raw.extend(arg)
        elif isinstance(arg, str) and len(arg) > _TEXT_SLICE:
            slices = [arg[i : i + _TEXT_SLICE] for i in range(0, len(arg), _TEXT_SLICE)]
            header.append(TextParts(len(slices)))
            raw.extend(_ascii_slices(slices))
        else:
            header.append(arg)
    conn.send((func, tuple(header), want_hash))
    for part in raw:
        conn.send_bytes(part)


def _ascii_slices(slices: list[str]) -> Iterator[bytes]:
    for piece in slices:
        # NOTE: non-ASCII text is no base64 anyway; "?" keeps the message count and fails the decode cleanly.
        yield piece.encode("ascii", errors="replace")


def receive_request(conn: Connection) -> tuple[Callable, tuple, bool]:
    func, header, want_hash = conn.recv()
    args: list[object] = []
    for arg in header:
        if isinstance(arg, BytesParts):
            args.append([conn.recv_bytes() for _ in range(arg.count)])
        elif isinstance(arg, TextParts):
            args.append(b"".join(conn.recv_bytes() for _ in range(arg.count)).decode("ascii"))
        else:
            args.append(arg)
    return func, tuple(args), want_hash


def serve(conn: Connection, slot: SharedSlot) -> None:
    while True:
        try:
            func, args, want_hash = receive_request(conn)
        except EOFError:
            return
        try:
            reply: tuple[str, object] = ("ok", write_image(func(*args), slot, want_hash))
        except MediaError as exc:
            reply = ("error", exc)
        except Exception as exc:  # NOTE: a loader bug, not the client's input; still never the server's crash
            reply = ("error", MediaDecodeError(f"image could not be decoded ({type(exc).__name__})"))
        conn.send(reply)


READY = ("ready", None)  # a worker's first message, once its imports are done


def main(argv: list[str]) -> None:
    # The parent ends a worker by closing its socket; a Ctrl-C meant for the server must not kill it first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    socket_fd, slot_fd = int(argv[0]), int(argv[1])
    conn = Connection(socket_fd)
    conn.send(READY)  # imports done: the parent's decode timeout starts from here
    serve(conn, SharedSlot(slot_fd))

