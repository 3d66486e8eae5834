"""The `zenserve` command line: `zenserve serve [MODEL] ...` and `zenserve bench ...`."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.kv_quant import KV_CACHE_DTYPES
from server.config import ServerConfig
from server.tool_calls import FORMATS

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_bytes(text: str) -> int:
    """'512M', '2G', '1.5GiB', '1048576' -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M or 2G)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise argparse.ArgumentTypeError("the size must be positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zenserve",
        description="zenserve: an OpenAI-compatible LLM server for AMD Zen CPUs and GPUs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API", description="Serve a model over the OpenAI-compatible HTTP API.")
    serve.add_argument("model", nargs="?", default=None, help="a .gguf file or a Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port to bind, 1-65535 (default: 8000)")
    serve.add_argument("--api-key", default=os.environ.get("ZENSERVE_API_KEY"), help="require 'Authorization: Bearer KEY' on /v1 routes (env ZENSERVE_API_KEY)")
    serve.add_argument("--served-model-name", default=None, help="the model id clients send and /v1/models lists")
    serve.add_argument("--max-model-len", type=int, default=None, help="context length cap in tokens (default: the model's)")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one batch (default: 64)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step (default: 2048)")
    serve.add_argument("--max-prefill-tokens-while-decoding", type=int, default=1024, metavar="N", help="prefill tokens per step while requests decode, so decodes keep pace during bursts of prompts (0: only the step budget; default: 1024)")
    serve.add_argument("--no-warm-up", action="store_true", help="serve at once, without running throwaway steps that compile and warm the kernels first")
    serve.add_argument("--max-waiting", type=_positive_int, default=1024, help="waiting requests before new ones get 503 (default: 1024)")
    serve.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("1G"), help="KV cache size in bytes, K/M/G suffixes allowed (default: 1G)")
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    serve.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="auto (default): float16 for a float32 model on the CPU workers, as llama.cpp's f16 cache (twice the tokens, decode attention reads half the bytes; next-token KL from float32 ~1e-6), else the model's dtype; model: the model's dtype; float16: a float32 model's rows in float16; int8: rows stored as int8 with a scale each, about twice the tokens of float16/bf16; not exact. float16 and int8: CPU workers. fp8 (fp8_e4m3): a bf16 model's rows as float8 e4m3fn, twice bf16's tokens; not exact (next-token KL ~0.01-0.025); CPU workers with AVX-512")
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="compute dtype (default: auto)")
    serve.add_argument("--small-batch-kernels", choices=["auto", "off"], default="auto", help="auto: 4/8-bit GGUF weights also keep an int4/int8 copy that bf16 decode batches of a few rows run on (default: auto)")
    serve.add_argument("--quantize-activations", choices=["off", "int8"], default="off", help="int8: prefill and batched decode run the projections as int8 GEMMs, activations quantized per token (SmoothQuant-calibrated at load; zentorch worker: a bf16 model's on AVX512-VNNI, a float32 model's at 7 bits on oneDNN, its down projection float32). Faster, not exact (default: off)")
    serve.add_argument("--compact-weights", action="store_true", help="the model's 4/8-bit GGUF weights keep no dense copy: each larger call writes its weight out from the 4-bit groups (a float32 model on zenserve's group kernels: 620 MB less for SmolLM2-135M, prefill about 1.1-1.2x slower on a Zen 3; a bf16 model on a CPU with AMX: 310 MB less, a 158-token prefill about 1.2x slower on a Xeon). Elsewhere dense copies are kept")
    serve.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    serve.add_argument("--enable-auto-tool-choice", action="store_true", help="serve tool_choice 'auto' (and make it the default where a request sends tools), its calls parsed out of the output (as vLLM's flag)")
    serve.add_argument("--tool-call-parser", choices=sorted(FORMATS), default=None, help="how the model writes tool calls (as vLLM's flag; default: the model family's, else hermes, which is also the generic format for templates without tools)")
    serve.add_argument("--batch-invariant", action="store_true", help="greedy output independent of the other requests in a batch and of preemption (as vLLM's VLLM_BATCH_INVARIANT): every row runs the prompt's paths (dense weights, prefill attention), so decodes are slower; CPU workers only. Without it, output is already independent of prefix-cache hits and chunking")
    serve.add_argument("--worker", choices=["auto", "eager", "zentorch", "cuda"], default=os.environ.get("ZENSERVE_WORKER", "auto"), help="forward-pass worker (default: auto, env ZENSERVE_WORKER)")
    serve.add_argument("--enforce-eager", action="store_true", help="cuda worker: run decode steps eagerly instead of replaying CUDA graphs (as vLLM's --enforce-eager)")
    serve.add_argument("--kv-offloading-config", default=None, metavar="JSON", help="KV offloading tiers as JSON, or @FILE holding it: {\"cpu_bytes_to_use\": \"4G\", ...} (see README)")
    serve.add_argument("--kv-events", action="store_true", help="publish KV cache events on the /v1/kv_events websocket")
    serve.add_argument("--max-body-bytes", type=parse_bytes, default=parse_bytes("8M"), help="largest request body (default: 8M)")
    serve.add_argument("--allowed-local-media-path", default=None, metavar="DIR", help="image file:// URLs may read under DIR (default: file URLs refused)")
    serve.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="DOMAIN", help="fetch image URLs only from these hosts ('.example.com': its subdomains; default: any public host)")
    serve.add_argument("--allow-private-media-addresses", action="store_true", help="also fetch image URLs from loopback and private addresses (local testing only)")
    serve.add_argument("--media-decode-processes", type=_non_negative_int, default=None, metavar="N", help="worker processes that decode images (default: one per core but one, 1-4; 0: decode on threads in the server process)")
    serve.add_argument("--media-io-kwargs", type=_json_object, default=None, metavar="JSON", help="per-modality media options, e.g. '{\"image\": {\"image_mode\": null}}'")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    bench = sub.add_parser("bench", help="benchmarks: `serve` drives a server, `offline` the engine")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="KIND")
    from ops import bench_serve

    bench_serve.add_arguments(bench_sub.add_parser("serve", help="drive an OpenAI-compatible server with streaming chat"))
    bench_sub.add_parser("offline", help="engine throughput without HTTP (python -m engine.bench; extra args pass through)",
                         add_help=False)
    return parser


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError("a port is 1-65535")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _offloading_config(value: str | None):
    if value is None:
        return None
    from kvtier.config import parse_offloading_config

    text = value
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"--kv-offloading-config: cannot read {value[1:]}: {e}") from e
    return parse_offloading_config(text)


def configs_from_args(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    server = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        log_level=args.log_level,
        kv_events=args.kv_events,
        warm_up=not args.no_warm_up,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(args.allowed_media_domains) if args.allowed_media_domains else None,
        allow_private_media_addresses=args.allow_private_media_addresses,
        media_io_kwargs=args.media_io_kwargs,
        media_decode_processes=args.media_decode_processes,
    )
    from server.state import make_media_connector

    make_media_connector(server)  # refuse bad media options now, not when the app starts (ValueError)
    engine = EngineConfig(
        model=ModelConfig(
            model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
            served_model_name=args.served_model_name, small_batch_kernels=args.small_batch_kernels,
            quantize_activations=args.quantize_activations, compact_weights=args.compact_weights,
        ),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory, enable_prefix_caching=not args.no_prefix_caching,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, max_waiting=args.max_waiting,
                                  max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding),
        worker=args.worker,
        cuda_graphs=not args.enforce_eager,
        batch_invariant=args.batch_invariant,
        enable_kv_events=args.kv_events,
        offload=_offloading_config(args.kv_offloading_config),
    )
    return server, engine


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        if args.bench_command == "offline":
            from engine import bench as engine_bench

            engine_bench.main(extra)
            return 0
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        from ops import bench_serve

        return bench_serve.run_and_report(args)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "serve":
        from engine.errors import ZenserveError
        from server.serve import serve

        try:
            server_config, engine_config = configs_from_args(args)
        except (ZenserveError, ValueError) as e:
            parser.error(str(e))
        return serve(server_config, engine_config)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
