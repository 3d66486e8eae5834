"""Linear-layer kernels at small row counts: which one a decode step should run.

    python ops/bench_kernels.py [--threads 2] [--rows 1 4 8 16 64] [--json out.json]

For each of SmolLM2-135M's projection shapes (fused qkv, o, fused gate/up, down, lm_head) it
times dense float32, dense bf16, torch's int4 weight-only kernel (group 32, what Q4_0/Q4_1 map
onto), torch's int8 weight-only kernel (per-row scales) and fbgemm's dynamic int8 linear (int8
activations too). Each figure is the best of --repeat calls, in microseconds; all kernels of a
shape run interleaved in one process, so compare within a row, not across runs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

SHAPES = {  # name: (out_features N, in_features K)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
GROUP = 32


def best_us(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def kernels_for(n: int, k: int, rows: int) -> dict[str, Callable[[], object]]:
    w = torch.randn(n, k) * 0.05
    x = torch.randn(rows, k)
    wb, xb = w.to(torch.bfloat16), x.to(torch.bfloat16)
    groups = w.reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 15
    q4 = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
    scales_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], -1).to(torch.bfloat16).contiguous()
    row_scale = w.abs().amax(1) / 127
    q8 = (w / row_scale[:, None]).round().to(torch.int8)
    dynamic = torch.ao.nn.quantized.dynamic.Linear(k, n, bias_=False)
    dynamic.set_weight_bias(
        torch.quantize_per_channel(w, row_scale, torch.zeros(n, dtype=torch.long), 0, torch.qint8), None
    )
    return {
        "fp32": lambda: torch.nn.functional.linear(x, w),
        "bf16": lambda: torch.nn.functional.linear(xb, wb),
        "int4pack": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed4, GROUP, scales_zeros),
        "int8pack": lambda: torch.ops.aten._weight_int8pack_mm(xb, q8, row_scale.to(torch.bfloat16)),
        "dynamic_int8": lambda: dynamic(x),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16, 64])
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    results = []
    print(f"{'shape':>8} {'rows':>4} " + " ".join(f"{k:>12}" for k in kernels_for(64, 64, 1)))
    for rows in args.rows:
        for name, (n, k) in SHAPES.items():
            timings = {kernel: round(best_us(fn, args.repeat), 1) for kernel, fn in kernels_for(n, k, rows).items()}
            results.append({"shape": name, "n": n, "k": k, "rows": rows, "us": timings})
            print(f"{name:>8} {rows:>4} " + " ".join(f"{v:>12.1f}" for v in timings.values()), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"threads": args.threads, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
