"""The connector's start gate: a burst of http fetches starts a few per event-loop turn, never all in one."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from media.connector import _STARTS_PER_TURN, _StartGate


@pytest.fixture
async def turns() -> AsyncIterator[list[int]]:
    """turns[0]: how many turns the test's (asyncio) loop has begun; counted by its own _run_once."""
    loop = asyncio.get_running_loop()
    counter = [0]
    run_once = loop._run_once  # noqa: SLF001

    def counted() -> None:
        counter[0] += 1
        run_once()

    loop._run_once = counted  # noqa: SLF001
    yield counter
    del loop._run_once  # noqa: SLF001


async def test_gate_lets_at_most_per_turn_callers_through_per_turn_in_order(turns):
    gate = _StartGate(per_turn=3)
    passed: list[tuple[int, int]] = []

    async def caller(index: int) -> None:
        await gate.wait()
        passed.append((index, turns[0]))

    await asyncio.gather(*(caller(i) for i in range(10)))
    assert [index for index, _ in passed] == list(range(10))  # first come, first through
    per_turn = Counter(turn for _, turn in passed)
    assert max(per_turn.values()) == 3
    assert len(per_turn) == 4  # 3 + 3 + 3 + 1


async def test_gate_skips_cancelled_waiters_and_goes_idle(turns):
    gate = _StartGate(per_turn=1)
    passed: list[int] = []

    async def caller(index: int) -> None:
        await gate.wait()
        passed.append(index)

    tasks = [asyncio.create_task(caller(i)) for i in range(5)]
    await asyncio.sleep(0)  # all five are at the gate: 0 passed, 1-4 wait
    tasks[2].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert passed == [0, 1, 3, 4]
    for _ in range(3):
        await asyncio.sleep(0)
    assert not gate._turn_scheduled and not gate._waiting  # noqa: SLF001 - no callbacks left behind


async def test_a_burst_of_http_fetches_starts_a_few_per_turn(image_server, make_connector, rgb_image, turns):
    connector = make_connector(allow_private_addresses=True)
    started: list[int] = []
    download = connector._download  # noqa: SLF001

    async def recorded(session, url):
        started.append(turns[0])
        return await download(session, url)

    connector._download = recorded  # noqa: SLF001
    images = await asyncio.gather(*(connector.fetch_image_async(image_server.url("/rgb.png")) for _ in range(12)))
    assert {image.tobytes() for image in images} == {rgb_image.tobytes()}
    assert len(started) == 12
    assert max(Counter(started).values()) <= _STARTS_PER_TURN
