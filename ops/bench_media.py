"""Media path: images decoded per second and the event loop's worst stall while a burst of image requests
arrives at once. Each request fetches an image (over HTTP from an aiohttp server on loopback, in a process of its
own as a remote host would be, or from a base64 data: URL), then decodes and hashes it the way the chat endpoint
does (fetch_hashed_image_async: in the connector's decode processes, or on its threads with
--decode-processes 0).

    python -m ops.bench_media [--images 32] [--size 1024] [--source http|data] [--pattern mandelbrot|noise]
                              [--rounds 5] [--loop uvloop|asyncio] [--decode-processes N]

The stall probe is a task that sleeps --probe-interval-ms and records how late it wakes: everything that keeps
the loop thread from running it (callbacks on the loop, waiting for the GIL, waiting for a CPU) shows up as
lateness. On Linux each wake-up's window (the sleep and the lateness) is split with the loop thread's
schedstat into:
- loop_cpu: the loop thread ran (callbacks, or the interpreter's own work such as GC);
- runqueue: it was runnable but had no CPU (other processes, or this one's threads);
- blocked: the rest of the lateness, asleep although its timer was due: waiting for the GIL.
worst_own_stall_ms is the largest lateness minus its run-queue wait. After each burst the same probe runs on the
idle loop for as long as the burst took: idle_worst_stall_ms is the machine's noise floor. With --loop asyncio,
longest_turn_cpu_ms is the most loop-thread CPU one loop turn took (independent of the machine's load).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass

from aiohttp import web
from PIL import Image

from media import MediaConnector


def _jpeg(size: int, seed: int, pattern: str = "mandelbrot") -> bytes:
    """A JPEG of size x size: a fractal (~66 KiB at 1024) or noise (~0.9 MB at 1024, ~3.8 MB at 2048)."""
    if pattern == "noise":
        img = Image.frombytes("RGB", (size, size), random.Random(seed).randbytes(size * size * 3))
    else:
        img = Image.effect_mandelbrot((size, size), (-2 + seed * 0.01, -1.5, 1, 1.5), 100).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


class _SchedStat:
    """CPU and run-queue seconds of the calling thread so far (Linux /proc schedstat); None elsewhere."""

    def __init__(self) -> None:
        self._path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        try:
            self.read()
            self.available = True
        except OSError:
            self.available = False

    def read(self) -> tuple[float, float]:
        with open(self._path) as f:
            cpu_ns, runqueue_ns, _ = f.read().split()
        return int(cpu_ns) / 1e9, int(runqueue_ns) / 1e9


@dataclass
class Stall:
    late_s: float
    loop_cpu_s: float | None = None
    runqueue_s: float | None = None

    @property
    def blocked_s(self) -> float | None:
        """Late, yet neither running nor runnable: waiting on a lock (the GIL)."""
        if self.loop_cpu_s is None or self.runqueue_s is None:
            return None
        return max(0.0, self.late_s - self.loop_cpu_s - self.runqueue_s)

    @property
    def own_s(self) -> float:
        """Late minus the loop thread's wait for a CPU: the loop's own work and its waits for the GIL. On a loaded
        machine this still holds contention: a thread holding the GIL may itself be waiting for a CPU."""
        return max(0.0, self.late_s - (self.runqueue_s or 0.0))

    def as_dict(self) -> dict:
        ms = lambda s: None if s is None else round(s * 1000, 2)  # noqa: E731
        return {"late_ms": ms(self.late_s), "loop_cpu_ms": ms(self.loop_cpu_s), "runqueue_ms": ms(self.runqueue_s),
                "blocked_ms": ms(self.blocked_s)}


class LoopProbe:
    """Sleeps `interval` over and over on the running loop and records how late each wake-up is."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.stalls: list[Stall] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> LoopProbe:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)  # the probe is running before the measured work starts
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    async def _run(self) -> None:
        sched = _SchedStat()  # the loop thread's, since this task runs on it
        while True:
            before = sched.read() if sched.available else None
            started = time.perf_counter()
            await asyncio.sleep(self.interval)
            late = max(0.0, time.perf_counter() - started - self.interval)
            if before is None:
                self.stalls.append(Stall(late))
                continue
            cpu, runqueue = (b - a for a, b in zip(before, sched.read(), strict=True))
            self.stalls.append(Stall(late, cpu, runqueue))

    def worst(self) -> Stall:
        return max(self.stalls, key=lambda s: s.late_s, default=Stall(0.0))

    def worst_own(self) -> Stall:
        return max(self.stalls, key=lambda s: s.own_s, default=Stall(0.0))


class TurnTimer:
    """The longest turn of an asyncio (not uvloop) event loop, in loop-thread CPU seconds: how long the loop's
    own callbacks kept it from everything else, whatever the machine's load (waits for a CPU or the GIL are
    not CPU time). Hooks the loop's private _run_once; uvloop has no such hook."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.longest = 0.0
        self._loop = loop
        self._run_once = getattr(loop, "_run_once", None)

    def __enter__(self) -> TurnTimer:
        if self._run_once is not None:
            run_once = self._run_once

            def timed_run_once() -> None:
                started = time.thread_time()
                run_once()
                self.longest = max(self.longest, time.thread_time() - started)

            self._loop._run_once = timed_run_once  # noqa: SLF001
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._run_once is not None:
            del self._loop._run_once  # noqa: SLF001 - back to the class's method


async def _serve(bodies: list[bytes], port_out: multiprocessing.connection.Connection) -> None:
    app = web.Application()

    async def image(request: web.Request) -> web.Response:
        return web.Response(body=bodies[int(request.match_info["i"])], content_type="image/jpeg")

    app.router.add_get("/img/{i}.jpg", image)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port_out.send(site._server.sockets[0].getsockname()[1])  # noqa: SLF001 - the bound ephemeral port
    await asyncio.Event().wait()  # until terminated


def _image_server_process(bodies: list[bytes], port_out: multiprocessing.connection.Connection) -> None:
    # NOTE: a remote host spends none of our CPUs; on a small machine the stand-in would take a core from the
    # loop mid-burst. At nice 19 it runs when our side leaves a core idle.
    os.nice(19)
    asyncio.run(_serve(bodies, port_out))


def _start_image_server(bodies: list[bytes]) -> tuple[multiprocessing.process.BaseProcess, int]:
    """The image host, in a process of its own: a remote host's serving work does not run on our loop."""
    context = multiprocessing.get_context("spawn")
    port_in, port_out = context.Pipe(duplex=False)
    server = context.Process(target=_image_server_process, args=(bodies, port_out), daemon=True)
    server.start()
    if not port_in.poll(60):
        server.kill()
        raise RuntimeError("the image server did not start")
    return server, port_in.recv()


async def _one_round(urls: list[str], interval: float, decode_processes: int | None) -> dict:
    loop = asyncio.get_running_loop()
    # A fresh connector per round: new connections and a new session, as for images from hosts not yet seen.
    async with MediaConnector(allow_private_addresses=True, decode_processes=decode_processes) as connector:
        await connector.warm_up()  # the decode processes are ready, as after a server's start
        await connector.fetch_image_async(urls[0])  # warm the decode threads and the session

        async def request(url: str) -> str:
            hashed = await connector.fetch_hashed_image_async(url)  # as the chat endpoint fetches and hashes
            return hashed.mm_hash

        with TurnTimer(loop) as turns:
            async with LoopProbe(interval) as probe:
                started = time.perf_counter()
                hashes = await asyncio.gather(*(request(url) for url in urls))
                elapsed = time.perf_counter() - started
        del hashes
        async with LoopProbe(interval) as idle:  # the same probe with nothing to do: the noise floor
            await asyncio.sleep(elapsed)
    return {
        "images_per_s": round(len(urls) / elapsed, 1),
        "worst_stall": probe.worst().as_dict(),
        "worst_own_stall_ms": round(probe.worst_own().own_s * 1000, 2),
        "longest_turn_cpu_ms": round(turns.longest * 1000, 2) if turns.longest else None,
        "idle_worst_stall_ms": round(idle.worst().late_s * 1000, 2),
        "probes": len(probe.stalls),
    }


async def main_async(args) -> dict:
    bodies = [_jpeg(args.size, i, args.pattern) for i in range(args.images)]
    server = None
    if args.source == "http":
        server, port = _start_image_server(bodies)
        urls = [f"http://127.0.0.1:{port}/img/{i}.jpg" for i in range(args.images)]
    else:
        urls = ["data:image/jpeg;base64," + base64.b64encode(body).decode() for body in bodies]
    rounds = []
    try:
        for _ in range(args.rounds):
            rounds.append(await _one_round(urls, args.probe_interval_ms / 1000, args.decode_processes))
    finally:
        if server is not None:
            server.terminate()
            server.join(10)

    def spread(values: list[float]) -> dict:
        return {"min": min(values), "median": round(statistics.median(values), 2), "max": max(values)}

    return {
        "images": args.images,
        "size": f"{args.size}x{args.size}",
        "source": args.source,
        "loop": args.loop,
        "pattern": args.pattern,
        "decode_processes": args.decode_processes,
        "jpeg_kib_each": round(sum(map(len, bodies)) / len(bodies) / 1024, 1),
        "images_per_s": spread([r["images_per_s"] for r in rounds]),
        "worst_loop_stall_ms": spread([r["worst_stall"]["late_ms"] for r in rounds]),
        "worst_own_stall_ms": spread([r["worst_own_stall_ms"] for r in rounds]),
        "longest_turn_cpu_ms": spread([r["longest_turn_cpu_ms"] for r in rounds]) if args.loop == "asyncio" else None,
        "idle_worst_stall_ms": spread([r["idle_worst_stall_ms"] for r in rounds]),
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=32, help="requests in the burst")
    ap.add_argument("--size", type=int, default=1024, help="image width and height")
    ap.add_argument("--source", choices=("http", "data"), default="http")
    ap.add_argument("--pattern", choices=("mandelbrot", "noise"), default="mandelbrot", help="noise: large JPEGs")
    ap.add_argument("--rounds", type=int, default=5, help="bursts, each with a fresh connector")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="uvloop: as zenserve serve")
    ap.add_argument("--probe-interval-ms", type=float, default=1.0)
    ap.add_argument("--decode-processes", type=int, default=None, help="the connector's (default: its own); 0: threads")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.loop == "uvloop":
        import uvloop

        report = uvloop.run(main_async(args))
    else:
        report = asyncio.run(main_async(args))
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
