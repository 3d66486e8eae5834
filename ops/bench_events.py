"""KV-event stream cost: events per second delivered to 8 subscribers while serving 32
concurrent streams, and the server's output tok/s with events on vs off (same run).

    python -m ops.bench_events [--requests 64] [--concurrency 32] [--subscribers 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace

import aiohttp
from aiohttp import web

from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core import EngineCore
from engine.model_loader import load_model
from ops.bench_serve import make_prompts, one_request
from server.app import create_app
from server.config import ServerConfig


async def serve_once(loaded, config: EngineConfig, events: bool, prompts, args) -> dict:
    engine = AsyncEngine(EngineCore(replace(config, enable_kv_events=events), loaded))
    engine.start()
    app = create_app(ServerConfig(kv_events=events), engine=engine)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the bound ephemeral port
    base = f"http://127.0.0.1:{port}"
    received = [0] * args.subscribers
    session = aiohttp.ClientSession()
    stop = asyncio.Event()

    async def subscribe(i: int) -> None:
        async with session.ws_connect(base + "/v1/kv_events") as ws:
            while not stop.is_set():
                try:
                    msg = await ws.receive(timeout=0.5)
                except TimeoutError:
                    continue
                if msg.type != aiohttp.WSMsgType.TEXT:
                    return
                received[i] += len(json.loads(msg.data).get("events", []))

    subs = [asyncio.create_task(subscribe(i)) for i in range(args.subscribers)] if events else []
    await asyncio.sleep(0.2)
    sem = asyncio.Semaphore(args.concurrency)

    async def run(p):
        async with sem:
            return await one_request(base, engine.core.loaded.name, p, args.max_tokens, None, True, 600)

    started = time.perf_counter()
    results = await asyncio.gather(*(run(p) for p in prompts))
    elapsed = time.perf_counter() - started
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*subs, return_exceptions=True)
    await session.close()
    await runner.cleanup()
    await engine.shutdown()
    tokens = sum(r.output_tokens for r in results if r.ok)
    return {
        "events": events,
        "output_tok_s": round(tokens / elapsed, 1),
        "failed": sum(not r.ok for r in results),
        "events_per_s_per_subscriber": round(sum(received) / max(1, len(received)) / elapsed, 1) if events else None,
        "events_per_subscriber": sum(received) // max(1, len(received)),
    }


async def main_async(args) -> dict:
    loaded = load_model(ModelConfig(dtype=args.dtype))
    config = EngineConfig(
        model=ModelConfig(dtype=args.dtype),
        cache=CacheConfig(kv_cache_memory_bytes=512 * 2**20),
        scheduler=SchedulerConfig(max_num_seqs=args.concurrency, max_num_batched_tokens=4096),
        worker=args.worker,
    )
    runs = []
    for i, events in enumerate([False, True, False, True]):  # interleaved: machine noise hits both
        prompts = make_prompts(args.requests, args.prompt_tokens, 0, seed=100 + i)
        runs.append(await serve_once(loaded, config, events, prompts, args))
        print(json.dumps(runs[-1]), flush=True)
    off = [r["output_tok_s"] for r in runs if not r["events"]]
    on = [r["output_tok_s"] for r in runs if r["events"]]
    return {"runs": runs, "throughput_cost_pct": round(100 * (1 - sum(on) / sum(off)), 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--subscribers", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--worker", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    report = asyncio.run(main_async(args))
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
