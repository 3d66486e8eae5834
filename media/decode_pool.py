"""Image decoding in worker processes, each with a shared memory slot for the pixels.

Why processes: a decode thread shares the GIL with the event loop, and the Python it runs between Pillow's
GIL-free calls (and the loop's wait to get the GIL back) stalled the loop 5-10 ms per burst of images
(BENCHMARKS.md, media). A worker process decodes with a GIL of its own; the parent only sends the encoded
bytes and copies the pixels out of the slot (Image.frombytes, which releases the GIL while it copies).

Each worker also isolates the decoders: a crash or a hang in one (a hostile file) kills that worker, not the
server. The request gets a 400 and a fresh worker takes the dead one's place.

Callers are decode threads: `decode` blocks. A worker serves one request at a time; the thread that sent it
copies the pixels out before the worker goes back to the idle queue, so a slot is never written while read.
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from PIL import Image

from media.decode_worker import READY, DecodedImage, SharedSlot, send_request
from media.errors import MediaDecodeError
from media.hashing import HashedImage

# The slot each worker starts with; a larger image grows it, and the slot shrinks back afterwards so one huge
# image does not pin its size in memory for good. 16 MiB holds a 2048x2048 RGBA image.
DEFAULT_SLOT_BYTES = 16 * 1024 * 1024
_IDLE_POLL_S = 0.1  # how often a thread waiting for a worker checks whether the pool closed
# How long a new worker may take to start (Python and Pillow's imports: 0.6 s on a Zen 3 core, more on a
# loaded machine). Counted apart from the decode timeout, which a replacement's start would otherwise eat.
_START_TIMEOUT_S = 60.0
# glibc hands each decoded image (a few MB) its own mmap and unmaps it when freed, so every decode page-faulted
# all its memory in afresh: 10.9 ms per 1024x1024 JPEG in a worker, 4.0 ms with these (images up to 32 MiB
# reuse the heap, and up to 64 MiB of it stays mapped between decodes).
_WORKER_MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=67108864"
_WORKER_MAIN = "import sys; from media.decode_worker import main; main(sys.argv[1:])"
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)  # the directory that holds the media package


def supported() -> bool:
    """Worker processes need memfd_create (Linux)."""
    return hasattr(os, "memfd_create")


class _WorkerLost(Exception):
    """The worker died, hung past the timeout, or its pipe broke."""


class _Worker:
    def __init__(self, slot_bytes: int) -> None:
        parent_sock, child_sock = socket.socketpair()
        slot_fd = os.memfd_create("zenserve-decode-slot")
        try:
            os.ftruncate(slot_fd, slot_bytes)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
            env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), _WORKER_MALLOC_TUNABLES]))
            self.process = subprocess.Popen(
                # NOTE: -c, not -m: under -m the worker's classes would pickle as __main__.DecodedImage.
                [sys.executable, "-c", _WORKER_MAIN, str(child_sock.fileno()), str(slot_fd)],
                pass_fds=(child_sock.fileno(), slot_fd),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            parent_sock.close()
            os.close(slot_fd)
            raise
        finally:
            child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.slot = SharedSlot(slot_fd)
        self.slot_bytes = slot_bytes
        self.ready = False  # the worker's READY message received

    def call(
        self, func: Callable[..., Image.Image], args: tuple, timeout: float, want_hash: bool = False
    ) -> HashedImage:
        try:
            if not self.ready:
                if not self.conn.poll(_START_TIMEOUT_S) or self.conn.recv() != READY:
                    raise _WorkerLost
                self.ready = True
            send_request(self.conn, func, args, want_hash)
            if not self.conn.poll(timeout):
                raise _WorkerLost
            status, payload = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise _WorkerLost from exc
        if status == "error":
            raise payload
        return HashedImage(self._copy_out(payload), payload.mm_hash)

    def _copy_out(self, decoded: DecodedImage) -> Image.Image:
        if decoded.nbytes == 0:
            image = Image.new(decoded.mode, decoded.size)
        else:
            with memoryview(self.slot.view()) as whole, whole[: decoded.nbytes] as pixels:
                image = Image.frombytes(decoded.mode, decoded.size, pixels)
        if decoded.palette is not None:
            raw_mode, palette = decoded.palette
            image.putpalette(palette, raw_mode)
        image.info.update(decoded.info)
        image.format = decoded.format  # as Pillow reports it for an image that was not converted
        if os.fstat(self.slot.fd).st_size > self.slot_bytes:
            os.ftruncate(self.slot.fd, self.slot_bytes)  # both sides remap on their next use
        return image

    def stop(self, wait_s: float = 1.0) -> None:
        """EOF ends the worker; one that does not end in wait_s is killed."""
        self.conn.close()
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.slot.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()
        self.slot.close()


class DecodeProcessPool:
    """`num_workers` decode processes, started on first use (or by `start`).

    decode_timeout: seconds one decode may take; a worker past it is killed and replaced, and the image gets
        a MediaDecodeError (images are pixel-capped, so an honest decode takes well under a second).
    """

    def __init__(
        self, num_workers: int, *, decode_timeout: float = 30.0, slot_bytes: int = DEFAULT_SLOT_BYTES
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.num_workers = num_workers
        self._decode_timeout = decode_timeout
        self._slot_bytes = slot_bytes
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._started = 0
        self._closed = False

    def start(self) -> None:
        """Start the workers that are not running yet (blocking: call it on a thread)."""
        with self._lock:
            while self._started < self.num_workers and not self._closed:
                self._idle.put(_Worker(self._slot_bytes))
                self._started += 1

    def ping(self) -> None:
        """Start every worker and wait until each has answered once (its imports done)."""
        workers = [self._take() for _ in range(self.num_workers)]
        for worker in workers:  # NOTE: each is given back (or replaced) by _call
            self._call(worker, Image.new, ("L", (1, 1)), want_hash=False)

    def decode(self, func: Callable[..., Image.Image], *args: Any, want_hash: bool = False) -> HashedImage:
        """func(*args) in a worker process, the image it returns rebuilt here (with its media_hash if
        want_hash). Blocking: call it on a thread.

        func and args must pickle (module-level functions, ImageMediaIO methods, bytes, str, paths). Raises what
        func raised (a MediaError), or MediaDecodeError if the worker crashed or hung on this image."""
        return self._call(self._take(), func, args, want_hash=want_hash)

    def close(self) -> None:
        """Stop the idle workers now; busy ones stop when their decode finishes. Blocking."""
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().stop()
            except queue.Empty:
                return

    def _call(self, worker: _Worker, func: Callable[..., Image.Image], args: tuple, *, want_hash: bool) -> HashedImage:
        """One request on a worker this thread took; the worker goes back to the idle queue, or is replaced."""
        lost = False
        try:
            return worker.call(func, args, self._decode_timeout, want_hash)
        except _WorkerLost:
            lost = True
            worker.kill()
            with self._lock:
                self._started -= 1  # the next _take starts a replacement
            raise MediaDecodeError(
                f"the image decoder failed on this image (it crashed or ran over {self._decode_timeout:g} s)"
            ) from None
        finally:
            if not lost:
                self._give_back(worker)

    def _take(self) -> _Worker:
        while True:
            if self._closed:
                raise RuntimeError("the decode pool is closed")
            self.start()  # first use, or a worker lost since
            try:
                return self._idle.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                continue

    def _give_back(self, worker: _Worker) -> None:
        if self._closed:
            worker.stop()
        else:
            self._idle.put(worker)
