"""Time to first token of a long prompt: recompute vs CPU-tier hit vs engine-cache hit.

    python -m ops.bench_offload [--prompt-tokens 2000] [--dtype auto] [--repeats 3]

Also reports the CPU tier's load bandwidth against a plain memcpy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core import EngineCore
from engine.model_loader import load_model
from engine.request import SamplingParams
from kvtier.config import parse_offloading_config


def ttft(core: EngineCore, prompt: list[int], rid: str) -> float:
    """Seconds until the request's first token (steps run back to back)."""
    core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    started = time.perf_counter()
    while core.has_unfinished():
        core.step()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--worker", default="eager")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    loaded = load_model(ModelConfig(dtype=args.dtype))
    config = EngineConfig(
        model=ModelConfig(dtype=args.dtype),
        cache=CacheConfig(kv_cache_memory_bytes=512 * 2**20),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096),
        worker=args.worker,
        offload=parse_offloading_config({"cpu_bytes_to_use": "1G"}),
    )
    core = EngineCore(config, loaded)
    rng = random.Random(0)
    results = {"recompute": [], "cpu_tier_hit": [], "engine_cache_hit": []}
    for r in range(args.repeats + 1):  # the first round warms up
        prompt = [rng.randrange(200, loaded.arch.vocab_size) for _ in range(args.prompt_tokens)]
        cold = ttft(core, prompt, f"cold{r}")
        core.connector.flush()
        core.step()  # take the finished stores
        warm = ttft(core, prompt, f"warm{r}")
        core.connector.flush()
        core.scheduler.finish_loads_now()
        core.kv.reset_prefix_cache()  # engine cache only: the CPU tier keeps the chunks
        tier = ttft(core, prompt, f"tier{r}")
        if r:
            results["recompute"].append(cold)
            results["engine_cache_hit"].append(warm)
            results["cpu_tier_hit"].append(tier)
    stats = core.connector.stats
    load_bw = stats.loaded_bytes / stats.load_seconds / 1e9 if stats.load_seconds else float("nan")
    nbytes = core.connector.host.bytes_per_chunk * (args.prompt_tokens // 16)
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    memcpy_bw = nbytes * 10 / (time.perf_counter() - t) / 1e9
    report = {
        "prompt_tokens": args.prompt_tokens,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "ttft_ms": {k: round(statistics.median(v) * 1000, 1) for k, v in results.items()},
        "cpu_tier_hit_vs_recompute": round(statistics.median(results["cpu_tier_hit"]) / statistics.median(results["recompute"]), 3),
        "load_gb_s": round(load_bw, 2),
        "memcpy_gb_s": round(memcpy_bw, 2),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    core.shutdown()


if __name__ == "__main__":
    main()
