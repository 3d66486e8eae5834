"""Media path: images decoded per second and the event loop's worst stall while 32 image
requests arrive at once (fetched over HTTP from a loopback server, decoded on threads).

    python -m ops.bench_media [--images 32] [--size 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import time

from aiohttp import web
from PIL import Image

from media import MediaConnector


def _jpeg(size: int, seed: int) -> bytes:
    img = Image.effect_mandelbrot((size, size), (-2 + seed * 0.01, -1.5, 1, 1.5), 100).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


async def main_async(args) -> dict:
    bodies = [_jpeg(args.size, i) for i in range(args.images)]
    app = web.Application()

    async def image(request: web.Request) -> web.Response:
        return web.Response(body=bodies[int(request.match_info["i"])], content_type="image/jpeg")

    app.router.add_get("/img/{i}.jpg", image)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the bound ephemeral port
    worst = 0.0
    done = asyncio.Event()

    async def probe():
        nonlocal worst
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0)
            worst = max(worst, time.perf_counter() - t)
            await asyncio.sleep(0.001)

    async with MediaConnector(allow_private_addresses=True) as connector:
        await connector.fetch_image_async(f"http://127.0.0.1:{port}/img/0.jpg")  # warm the threads
        prober = asyncio.create_task(probe())
        started = time.perf_counter()
        images = await asyncio.gather(
            *(connector.fetch_image_async(f"http://127.0.0.1:{port}/img/{i}.jpg") for i in range(args.images))
        )
        elapsed = time.perf_counter() - started
        done.set()
        await prober
    await runner.cleanup()
    return {
        "images": len(images),
        "size": f"{args.size}x{args.size}",
        "jpeg_kib_each": round(sum(map(len, bodies)) / len(bodies) / 1024, 1),
        "images_per_s": round(len(images) / elapsed, 1),
        "worst_loop_stall_ms": round(worst * 1000, 2),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    report = asyncio.run(main_async(args))
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
