"""Wakes an engine that waits on background KV work (a copy, a batch of tier reads) when some of
it finishes, instead of letting it sleep out a fixed poll interval.

Why: with a 1 ms poll a promotion that landed just after a poll waited up to 1 ms more to be seen,
a tenth of an FS-tier hit's ~9 ms of reads. The poll interval stays the longest wait (deadlines
and other bookkeeping are checked on each poll), so a missed notification costs no more than before.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class TransferProgress:
    """`notify()` from any thread; one engine waits with `wait` (a thread) or `wait_async` (a loop)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def notify(self) -> None:
        self._event.set()
        with self._lock:
            waiters = list(self._async_waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(event.set)

    def wait(self, timeout_s: float) -> bool:
        """Block until notified (True; also if notified since the last wait) or `timeout_s`."""
        notified = self._event.wait(timeout_s)
        self._event.clear()
        return notified

    async def wait_async(self, timeout_s: float) -> bool:
        """`wait` for a coroutine: the loop keeps running meanwhile."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._async_waiters.append(waiter)
        try:
            if not self._event.is_set():  # NOTE: after registering, so no notify is lost in between
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter[1].wait(), timeout_s)
        finally:
            with self._lock:
                self._async_waiters.remove(waiter)
        notified = self._event.is_set()
        self._event.clear()
        return notified
