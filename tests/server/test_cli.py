"""`zenserve serve` flags reach the configs they name."""

from __future__ import annotations

import pytest

from server.cli import build_parser, configs_from_args


def configs(*argv: str):
    return configs_from_args(build_parser().parse_args(["serve", *argv]))


def test_model_flags_reach_the_model_config():
    _, engine = configs("--dtype", "float32", "--small-batch-kernels", "off", "--max-model-len", "512")
    assert engine.model.dtype == "float32"
    assert engine.model.small_batch_kernels == "off"
    assert engine.model.max_model_len == 512
    _, engine = configs()
    assert engine.model.small_batch_kernels == "auto"
    assert engine.model.quantize_activations == "off"
    _, engine = configs("--quantize-activations", "int8")
    assert engine.model.quantize_activations == "int8"


def test_the_kv_cache_dtype_flag_reaches_the_cache_config():
    assert configs()[1].cache.kv_cache_dtype == "auto"
    assert configs("--kv-cache-dtype", "int8")[1].cache.kv_cache_dtype == "int8"
    assert configs("--kv-cache-dtype", "float16")[1].cache.kv_cache_dtype == "float16"
    assert configs("--kv-cache-dtype", "fp8")[1].cache.kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        configs("--kv-cache-dtype", "fp8_e5m2")


def test_an_unknown_small_batch_kernels_value_is_refused():
    with pytest.raises(SystemExit):
        configs("--small-batch-kernels", "int3")


def test_scheduling_and_warm_up_flags():
    server, engine = configs()
    assert server.warm_up is True
    assert engine.scheduler.max_prefill_tokens_while_decoding == 1024
    server, engine = configs("--no-warm-up", "--max-prefill-tokens-while-decoding", "0")
    assert server.warm_up is False
    assert engine.scheduler.max_prefill_tokens_while_decoding == 0


def test_a_negative_prefill_cap_is_refused():
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        configs("--max-prefill-tokens-while-decoding", "-1")


def test_media_decode_processes_flag_reaches_the_connector():
    from server.state import make_media_connector

    server, _ = configs()
    assert server.media_decode_processes is None
    server, _ = configs("--media-decode-processes", "0")
    assert server.media_decode_processes == 0
    assert make_media_connector(server)._decode_pool is None  # decoding stays on threads
    server, _ = configs("--media-decode-processes", "3")
    pool = make_media_connector(server)._decode_pool
    assert pool is None or pool.num_workers == 3  # None where processes are unsupported
    with pytest.raises(SystemExit):
        configs("--media-decode-processes", "-1")


@pytest.mark.parametrize("argv", [("--port", "70000"), ("--port", "0"), ("--port", "-5"), ("--max-waiting", "0")])
def test_out_of_range_flags_are_refused_by_the_parser(argv):
    with pytest.raises(SystemExit):
        configs(*argv)


def test_a_max_model_len_below_one_is_refused():
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="max_model_len"):
        configs("--max-model-len", "0")


def test_the_batch_invariant_flag_reaches_the_engine_config_and_the_cuda_worker_refuses_it():
    assert configs()[1].batch_invariant is False
    assert configs("--batch-invariant")[1].batch_invariant is True
    import torch

    from engine.errors import ConfigError
    from engine.worker import create_worker

    # Refused before any model or layout is looked at: cuBLAS's kernels depend on the row count.
    with pytest.raises(ConfigError, match="CPU workers only"):
        create_worker("cuda", None, None, torch.bfloat16, batch_invariant=True)
