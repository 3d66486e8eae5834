"""The event loop the secondary tiers' coroutines run on, and the tasks running there.

Either a loop the owner passes (the server's, in the async engine) or, without one (the offline
`LLM`, scripts, tests), a private loop on a daemon thread. Work is submitted from any thread as a
coroutine *factory*, so that a coroutine object only ever exists on the loop (none is left
un-awaited when work is cancelled before it started).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
CoroutineFactory = Callable[[], Coroutine[Any, Any, T]]


class TierLoop:
    """- submit(factory): start a tracked task (any thread; never blocks).
    - run_sync(factory, timeout_s): run to completion and return its result (a thread that is not
      the loop's; raises RuntimeError on the loop's thread, where waiting would deadlock).
    - close_async(): on the loop: cancel every task and await them. close(): the same from any
      other thread, then stop the private loop; on the loop's own thread it can only cancel.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._thread: threading.Thread | None = None
        if loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=_run_forever, args=(loop,), name="zenserve-kvtier-io", daemon=True)
            self._thread.start()
        self.loop = loop
        self._tasks: set[asyncio.Task] = set()  # touched on the loop only
        self._closed = False

    @property
    def owns_loop(self) -> bool:
        return self._thread is not None

    def is_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def submit(self, factory: CoroutineFactory) -> None:
        if self._closed:
            return
        if self.is_loop_thread():
            self._start(factory)
            return
        try:
            self.loop.call_soon_threadsafe(self._start, factory)
        except RuntimeError:  # the loop is closed: the owner is shutting down
            log.debug("tier loop closed; dropping submitted work")

    def _start(self, factory: CoroutineFactory) -> None:
        if self._closed:
            return
        task = self.loop.create_task(factory())
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("kvtier task failed", exc_info=task.exception())

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    def run_sync(self, factory: CoroutineFactory[T], timeout_s: float | None = None) -> T:
        if self.is_loop_thread():
            raise RuntimeError("run_sync on the tier loop's own thread would deadlock; await the coroutine instead")

        async def run() -> T:
            return await factory()

        future = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"tier operation did not finish within {timeout_s} s") from None

    async def close_async(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        if self.is_loop_thread():
            # NOTE: cannot await here; the owner should have called close_async().
            self._closed = True
            for task in list(self._tasks):
                task.cancel()
            return
        if not self.loop.is_closed() and self.loop.is_running():
            try:
                self.run_sync(self.close_async, timeout_s=10.0)
            except TimeoutError:
                log.warning("kvtier tasks did not stop within 10 s")
        self._closed = True
        if self._thread is not None:
            try:
                self.run_sync(self.loop.shutdown_default_executor, timeout_s=10.0)
            except TimeoutError:
                log.warning("kvtier I/O threads did not stop within 10 s")
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10.0)
            if not self._thread.is_alive():
                self.loop.close()
            self._thread = None


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()
