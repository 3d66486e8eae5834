"""Fixtures for the engine tests."""

from __future__ import annotations

import pytest

import engine.kernels as kernels


@pytest.fixture(scope="session")
def cpu_kernels() -> None:
    """zenserve's CPU kernels, built (or loaded from the build cache): this machine has g++ and ninja,
    so a failed build is a failure here, not a silent fall back to torch ops."""
    assert kernels.load_paged_decode_attention() is not None, "the CPU kernels did not build (see the log)"
