"""TransferProgress: an engine waiting on KV copies or tier reads wakes when one finishes."""

from __future__ import annotations

import asyncio
import threading
import time

from engine.offload.progress import TransferProgress


def notify_later(progress: TransferProgress, delay_s: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), progress.notify()))
    thread.start()
    return thread


def test_a_waiting_thread_wakes_on_notify_not_at_its_timeout():
    progress = TransferProgress()
    thread = notify_later(progress, 0.05)
    started = time.monotonic()
    assert progress.wait(10.0)
    assert time.monotonic() - started < 5.0
    thread.join()


def test_wait_times_out_without_a_notify_and_a_notify_before_the_wait_is_not_lost():
    progress = TransferProgress()
    started = time.monotonic()
    assert not progress.wait(0.02)
    assert time.monotonic() - started >= 0.02
    progress.notify()
    assert progress.wait(10.0)  # at once: it came before the wait
    assert not progress.wait(0.01)  # consumed


async def test_a_waiting_coroutine_wakes_on_a_notify_from_another_thread_and_the_loop_keeps_running():
    progress = TransferProgress()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    thread = notify_later(progress, 0.05)
    started = time.monotonic()
    assert await progress.wait_async(10.0)
    assert time.monotonic() - started < 5.0 and ticks > 1
    assert not await progress.wait_async(0.01)
    task.cancel()
    thread.join()


def test_a_finished_copy_notifies_once_its_result_can_be_taken():
    from engine.offload.transfer import TransferThread

    progress = TransferProgress()
    transfer = TransferThread(on_done=progress.notify)
    go = threading.Event()
    transfer.submit(7, "load", lambda: go.wait(10) and 1234)
    assert not progress.wait(0.02) and transfer.take_finished() == []
    go.set()
    assert progress.wait(10.0)
    (result,) = transfer.take_finished()  # the notify came after the result was set
    assert (result.job_id, result.success, result.num_bytes) == (7, True, 1234)
    transfer.shutdown()
