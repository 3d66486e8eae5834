"""ops/bench_media.py: its stall probe sees every stall, and the benchmark runs end to end."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from ops import bench_media
from ops.bench_media import LoopProbe, TurnTimer


def _burn_cpu(seconds: float) -> None:
    """Hold the calling thread busy for `seconds` of its own CPU time (however long that takes on a busy box)."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


async def test_probe_sees_a_stall_that_starts_while_it_sleeps():
    """A probe that timed only `await asyncio.sleep(0)` missed stalls that began during its sleep; lateness of a
    timed sleep cannot miss one."""
    async with LoopProbe(interval=0.001) as probe:
        await asyncio.sleep(0.01)
        time.sleep(0.06)  # noqa: ASYNC251 - the stall under test
        await asyncio.sleep(0.01)
    assert probe.worst().late_s >= 0.05


async def test_probe_attributes_a_busy_loop_to_loop_cpu():
    async with LoopProbe(interval=0.001) as probe:
        await asyncio.sleep(0.005)
        _burn_cpu(0.03)
        await asyncio.sleep(0.005)
    worst = probe.worst()
    if worst.loop_cpu_s is None:
        pytest.skip("no per-thread schedstat here")
    assert worst.loop_cpu_s >= 0.025
    assert worst.late_s >= 0.025


async def test_turn_timer_measures_the_longest_turn_and_unhooks():
    loop = asyncio.get_running_loop()
    with TurnTimer(loop) as turns:
        loop.call_soon(_burn_cpu, 0.02)
        await asyncio.sleep(0.01)
    assert turns.longest >= 0.02
    assert "_run_once" not in vars(loop)


@pytest.mark.parametrize("source", ["data", "http"])
def test_bench_runs_end_to_end(tmp_path, source):
    out = tmp_path / "report.json"
    bench_media.main(["--images", "3", "--size", "64", "--rounds", "2", "--source", source, "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["source"] == source and len(report["rounds"]) == 2
    assert report["images_per_s"]["min"] > 0
    assert report["worst_loop_stall_ms"]["max"] >= report["worst_loop_stall_ms"]["min"] >= 0
