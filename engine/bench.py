"""Offline engine benchmark: prompt and decode throughput at several batch sizes.

    python -m engine.bench [--workers eager zentorch] [--batch-sizes 1 8 32] [--dtype auto]

Prompt tok/s: a batch of fresh prompts prefilled together (max_tokens=1).
Decode tok/s: output tokens per second of the decode phase only (after every prefill).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.kv_quant import KV_CACHE_DTYPES
from engine.core import EngineCore
from engine.model_loader import load_model
from engine.request import SamplingParams


def _prompts(vocab: int, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def run_case(core: EngineCore, batch: int, prompt_len: int, decode_len: int, seed: int) -> dict:
    vocab = core.loaded.arch.vocab_size
    # Prefill: fresh prompts (no prefix-cache hits), one token out.
    prompts = _prompts(vocab, batch, prompt_len, seed)
    for i, p in enumerate(prompts):
        core.add_request(f"p{seed}-{i}", p, SamplingParams(temperature=0.0, max_tokens=1))
    t0 = time.perf_counter()
    while core.has_unfinished():
        core.step()
    prefill_s = time.perf_counter() - t0
    # Decode: prefill separately, then time only the decode steps.
    prompts = _prompts(vocab, batch, prompt_len, seed + 1)
    params = SamplingParams(temperature=0.0, max_tokens=decode_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"d{seed}-{i}", p, params)
    produced = 0
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        produced += sum(len(o.new_token_ids) for o in core.step())
    t0 = time.perf_counter()
    decoded = 0
    while core.has_unfinished():
        decoded += sum(len(o.new_token_ids) for o in core.step())
    decode_s = time.perf_counter() - t0
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "prompt_tok_s": round(batch * prompt_len / prefill_s, 1),
        "decode_tok_s": round(decoded / decode_s, 1),
        "decode_ms_per_step": round(1000 * decode_s / max(1, decoded / batch), 2),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--workers", nargs="+", default=["eager", "zentorch"],
                    help="eager, zentorch, cuda; zentorch-int8: zentorch with int8 activations; cuda-eager: "
                         "cuda without CUDA graphs")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    results = []
    for name in args.workers:
        worker, _, variant = name.partition("-")
        model_config = ModelConfig(model=args.model, dtype=args.dtype, quantize_activations="int8" if variant == "int8" else "off")
        # Each worker gets its own copy: zentorch replaces layers in place, cuda moves the model.
        model = load_model(model_config, "cuda" if worker == "cuda" else "cpu")
        config = EngineConfig(
            model=model_config,
            cache=CacheConfig(kv_cache_memory_bytes=1024**3, kv_cache_dtype=args.kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=4096),
            worker=worker,
            cuda_graphs=variant != "eager",
        )
        try:
            core = EngineCore(config, model)
        except Exception as e:  # noqa: BLE001 - report and go on with the other workers
            print(f"{name}: unavailable ({e})")
            continue
        run_case(core, 2, 16, 4, seed=999)  # warm-up (and zentorch's compilation)
        for b in args.batch_sizes:
            if worker == "cuda":  # an untimed run of the same shape captures the decode steps' graphs
                run_case(core, b, args.prompt_len, args.decode_len, seed=1000 + b)
            r = {"worker": name, "dtype": str(model.dtype).removeprefix("torch."), **run_case(core, b, args.prompt_len, args.decode_len, seed=b)}
            results.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
