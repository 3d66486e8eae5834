"""Time to first token of a long prompt: recompute vs engine-cache hit vs CPU-tier hit, and
(with --fs / --s3) vs a filesystem-tier or S3-tier hit.

    python -m ops.bench_offload [--prompt-tokens 2000] [--dtype auto] [--repeats 3] [--fs DIR] [--s3]

Also reports the CPU tier's load bandwidth against a plain memcpy of the same bytes, and each
secondary tier's read bandwidth against a plain read of the same objects from the same medium in
the same run, right after each hit (files read back whole, one after the other; S3 GETs with a
plain client). The tier's bandwidth is the bytes it read for the hit over the wall time its
promotions were pending: from the lookup that started the first one until the engine saw the
last one land in the CPU tier (scheduler polling included; the tier's `promotion_seconds`).
--s3 starts a local SeaweedFS (the test suite's fixture; run from the repository root).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace

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
    ap.add_argument("--fs", default=None, metavar="DIR", help="also measure a filesystem tier in DIR")
    ap.add_argument("--s3", action="store_true", help="also measure an S3 tier (a local SeaweedFS)")
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
    report_tiers = {}
    cpu_hit_s = statistics.median(results["cpu_tier_hit"])
    for kind in (["fs"] if args.fs else []) + (["s3"] if args.s3 else []):
        report_tiers[kind] = secondary_tier_case(kind, args, loaded, config, rng, cpu_hit_s)
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
        "secondary_tiers": report_tiers,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    core.shutdown()


def secondary_tier_case(kind: str, args, loaded, config: EngineConfig, rng: random.Random, cpu_hit_s: float) -> dict:
    """Recompute, then the same prompt after the engine cache and the CPU tier were cleared:
    it must come back from the secondary tier (promotion, then load)."""
    import pathlib
    import shutil
    import tempfile

    server = None
    workdir = None
    if kind == "fs":
        # NOTE: a fresh directory: chunks a previous run left under --fs would make "recompute" a hit
        workdir = tempfile.mkdtemp(prefix="bench-fs-", dir=args.fs)
        tier = {"type": "fs", "path": workdir, "capacity_bytes": "4G", "demote_on": "store"}
    else:
        from tests.s3_server import start_s3_server

        server = start_s3_server(pathlib.Path(tempfile.mkdtemp(prefix="bench-s3-")))
        tier = {"type": "obj", "endpoint": server.endpoint, "bucket": server.bucket, "prefix": "bench",
                "capacity_bytes": "4G", "access_key": server.access_key, "secret_key": server.secret_key,
                "demote_on": "store"}
    offload = parse_offloading_config({"cpu_bytes_to_use": "1G", "secondary_tiers": [tier]})
    core = EngineCore(replace(config, offload=offload), loaded)
    manager = core.connector.manager
    (tier_obj,) = manager.tiers
    cold, hits, hit_bytes, promotion_s, raw_bw = [], [], [], [], []
    try:
        for r in range(args.repeats + 1):
            prompt = [rng.randrange(200, loaded.arch.vocab_size) for _ in range(args.prompt_tokens)]
            t_cold = ttft(core, prompt, f"{kind}-cold{r}")
            while core.has_pending_transfers() or manager.pending_demotion_bytes:
                core.step()
                time.sleep(0.005)
            core.scheduler.finish_loads_now()
            assert core.reset_prefix_cache()  # engine cache and CPU tier; the secondary keeps it
            before = tier_obj.stats().extra
            t_hit = ttft(core, prompt, f"{kind}-hit{r}")
            after = tier_obj.stats().extra
            promoted = [key for key in manager.keys() if tier_obj.contains(key)]
            assert after["promotions"] - before["promotions"] == len(promoted) > 0, "the hit was not promoted"
            raw = _raw_read_bandwidth(tier_obj, promoted, server)  # the same objects, right after the hit
            if r:
                cold.append(t_cold)
                hits.append(t_hit)
                hit_bytes.append(after["bytes_read"] - before["bytes_read"])
                promotion_s.append(after["promotion_seconds"] - before["promotion_seconds"])
                raw_bw.append(raw)
    finally:
        core.shutdown()
        if server is not None:
            server.stop()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    tier_bw = [b / s / 1e9 for b, s in zip(hit_bytes, promotion_s)]
    return {
        "ttft_ms_recompute": round(statistics.median(cold) * 1000, 1),
        "ttft_ms_tier_hit": round(statistics.median(hits) * 1000, 1),
        "tier_hit_vs_recompute": round(statistics.median(hits) / statistics.median(cold), 3),
        "ttft_ms_beyond_cpu_hit": round((statistics.median(hits) - cpu_hit_s) * 1000, 1),
        "bytes_per_hit": int(statistics.median(hit_bytes)),
        "promotion_ms": [round(s * 1000, 1) for s in promotion_s],
        "tier_read_gb_s": [round(bw, 3) for bw in tier_bw],
        "raw_read_gb_s": [round(bw, 3) for bw in raw_bw],
        "tier_vs_raw": round(statistics.median(t / r for t, r in zip(tier_bw, raw_bw)), 3),
    }


def _raw_read_bandwidth(tier, keys, server) -> float:
    """A plain read of the same objects from the same medium: each file read whole (open, read,
    close), or each object with a plain GET, one after the other."""
    total = 0
    if server is None:
        paths = [tier.path_of(key) for key in keys]
        started = time.perf_counter()
        for path in paths:
            with open(path, "rb") as f:
                total += len(f.read())
    else:
        client = server.client()
        names = [tier.object_key(key) for key in keys]
        started = time.perf_counter()
        for name in names:
            total += len(client.get_object(Bucket=server.bucket, Key=name)["Body"].read())
    return total / (time.perf_counter() - started) / 1e9


if __name__ == "__main__":
    main()
