"""Serving benchmark for any OpenAI-compatible server: streaming chat requests, bounded.

    zenserve bench serve --base-url http://127.0.0.1:8000 --model smollm2 \\
        --prompt-tokens 158 --max-tokens 128 --concurrency 1 --num-requests 8 --json out.json

Prompts are synthetic with an exact token length under the embedded SmolLM2 tokenizer (the
model every peer serves here); `--shared-prefix-tokens K` makes every prompt start with the
same K tokens. Load is a fixed concurrency or a Poisson arrival rate (`--request-rate`).
Each request opens its own connection (llama-server drops kept-alive streaming connections).
Reports request throughput, output tok/s, TTFT and inter-token latency percentiles,
end-to-end latency and failures, and each request's send time, TTFT and latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson


@dataclass
class RequestResult:
    ok: bool
    sent_at: float = 0.0  # perf_counter when the request was sent
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival time of each content chunk
    output_tokens: int = 0
    error: str = ""


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float | None]:
    """Linear-interpolated percentiles; None (JSON null, not NaN, which JSON lacks) with no values."""
    if not values:
        return {f"p{p}": None for p in ps}
    ordered = sorted(values)
    out = {}
    for p in ps:
        k = (len(ordered) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
        out[f"p{p}"] = ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
    return out


def make_prompts(num: int, prompt_tokens: int, shared_prefix_tokens: int, seed: int) -> list[str]:
    """Texts of exactly `prompt_tokens` tokens (SmolLM2 tokenizer), the first K shared."""
    from engine.embedded_model import embedded_model_path
    from engine.loader.gguf_loader import open_gguf
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(open_gguf(embedded_model_path()))
    rng = random.Random(seed)
    words = ["river", "stone", "light", "cloud", "market", "garden", "copper", "violin", "harbor", "lantern",
             "meadow", "engine", "puzzle", "orbit", "canyon", "ember", "willow", "signal", "marble", "tide"]

    def text_of(n: int, salt: str) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            ids += tok.encode(f" {salt} " + " ".join(rng.choice(words) for _ in range(n)), add_special_tokens=False)
        return ids[:n]

    prefix = text_of(shared_prefix_tokens, "shared") if shared_prefix_tokens else []
    prompts = []
    for i in range(num):
        ids = prefix + text_of(prompt_tokens - len(prefix), f"q{i}")
        prompts.append(tok.decode(ids, skip_special_tokens=False))
    return prompts


async def one_request(base_url: str, model: str, prompt: str, max_tokens: int, api_key: str | None,
                      ignore_eos: bool, timeout_s: float, extra: dict | None = None) -> RequestResult:
    """`extra`: more request fields (a response_format)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    if ignore_eos:
        body["ignore_eos"] = True
        body["repeat_penalty"] = 1.0  # llama-cpp-python applies 1.1 by default even at temperature 0
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    started = time.perf_counter()
    result = RequestResult(ok=False, sent_at=started)
    try:
        connector = aiohttp.TCPConnector(force_close=True)  # a fresh connection per request
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.post(base_url.rstrip("/") + "/v1/chat/completions", json=body, headers=headers) as resp:
                if resp.status != 200:
                    result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return result
                usage_tokens = None
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    chunk = orjson.loads(payload)
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                    for choice in chunk.get("choices") or []:
                        if (choice.get("delta") or {}).get("content"):
                            now = time.perf_counter()
                            if not result.token_times:
                                result.ttft_s = now - started
                            result.token_times.append(now)
                result.output_tokens = usage_tokens if usage_tokens is not None else len(result.token_times)
                result.ok = bool(result.token_times)
                if not result.ok:
                    result.error = "no content streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.e2e_s = time.perf_counter() - started
    return result


async def reset_prefix_cache(base_url: str, api_key: str | None) -> str | None:
    """POST /reset_prefix_cache (zenserve, vLLM): None when done, else why not."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.post(base_url.rstrip("/") + "/reset_prefix_cache", headers=headers) as resp:
                return None if resp.status == 200 else f"HTTP {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"{type(e).__name__}: {e}"


async def run(args: argparse.Namespace) -> dict:
    prompts = make_prompts(args.num_requests, args.prompt_tokens, args.shared_prefix_tokens, args.seed)
    if args.reset_prefix_cache:
        # NOTE: the same --seed gives the same prompts: a second run against the same server
        # would otherwise hit the prefix cache for whole prompts and report a TTFT of one decode.
        why = await reset_prefix_cache(args.base_url, args.api_key)
        if why is not None:
            print(f"warning: could not reset the server's prefix cache ({why}); use a new --seed per run",
                  file=sys.stderr)
    extra = None
    if args.json_schema is not None:
        schema = json.loads(Path(args.json_schema).read_text())
        extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}}
    results: list[RequestResult] = []
    sem = asyncio.Semaphore(args.concurrency)
    rng = random.Random(args.seed)
    deadline = time.perf_counter() + args.max_duration

    async def run_one(prompt: str):
        async with sem:
            if time.perf_counter() > deadline:
                results.append(RequestResult(ok=False, sent_at=time.perf_counter(), error="benchmark time limit"))
                return
            results.append(await one_request(args.base_url, args.model, prompt, args.max_tokens, args.api_key,
                                             not args.no_ignore_eos, args.request_timeout, extra))

    started = time.perf_counter()
    if args.sequential:
        for p in prompts:
            await run_one(p)
    else:
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(run_one(p)))
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started
    ok = [r for r in results if r.ok]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("api_key", "func")},
        "duration_s": elapsed,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "request_throughput": len(ok) / elapsed,
        "output_tok_s": out_tokens / elapsed,
        "ttft_ms": _milliseconds(percentiles([r.ttft_s for r in ok])),
        "ttft_ms_first": ok[0].ttft_s * 1000 if ok else None,
        "ttft_ms_rest_median": statistics.median([r.ttft_s * 1000 for r in ok[1:]]) if len(ok) > 1 else None,
        "itl_ms": _milliseconds(percentiles(itl)),
        "tpot_ms_median": statistics.median([(r.e2e_s - r.ttft_s) / max(1, r.output_tokens - 1) * 1000 for r in ok]) if ok else None,
        "e2e_s": percentiles([r.e2e_s for r in ok]),
        # One record per request in the order they were sent, so that a tail (a TTFT p90) can be
        # traced to when its requests arrived.
        "requests": [_request_record(r, started) for r in sorted(results, key=lambda r: r.sent_at)],
    }


def _request_record(r: RequestResult, run_started: float) -> dict:
    record = {"sent_s": r.sent_at - run_started, "ok": r.ok, "output_tokens": r.output_tokens}
    if r.ok:
        record |= {"ttft_ms": r.ttft_s * 1000, "e2e_s": r.e2e_s}
    else:
        record["error"] = r.error
    return record


def _milliseconds(seconds: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if v is None else v * 1000 for k, v in seconds.items()}


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more")
        return value

    return parse


def _seconds(allow_zero: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError("must be 0 or more" if allow_zero else "must be more than 0")
        return value

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--prompt-tokens", type=_count(1), default=158)
    p.add_argument("--shared-prefix-tokens", type=_count(0), default=0)
    p.add_argument("--max-tokens", type=_count(1), default=128)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="every request's output under this JSON schema (response_format json_schema)")
    p.add_argument("--num-requests", type=_count(1), default=8)
    p.add_argument("--concurrency", type=_count(1), default=1)
    p.add_argument("--request-rate", type=_seconds(allow_zero=True), default=0.0,
                   help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--sequential", action="store_true", help="one request after another")
    p.add_argument("--max-duration", type=_seconds(allow_zero=False), default=600.0,
                   help="stop starting requests after this many seconds")
    p.add_argument("--request-timeout", type=_seconds(allow_zero=False), default=600.0)
    p.add_argument("--seed", type=int, default=0, help="prompt generator seed: use a new one per run against one server, "
                   "or --reset-prefix-cache, else the prompts hit the cache of the previous run")
    p.add_argument("--reset-prefix-cache", action="store_true", help="POST /reset_prefix_cache first (zenserve, vLLM)")
    p.add_argument("--json", default=None, help="write the report here")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    return run_and_report(args)


def run_and_report(args: argparse.Namespace) -> int:
    if args.shared_prefix_tokens > args.prompt_tokens:
        print("bench serve: --shared-prefix-tokens may not exceed --prompt-tokens", file=sys.stderr)
        return 2
    if args.json and not Path(args.json).resolve().parent.is_dir():  # before the run, not after it
        print(f"bench serve: cannot write {args.json}: its directory does not exist", file=sys.stderr)
        return 2
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=2, allow_nan=False)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
