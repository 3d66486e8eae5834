"""`zenserve serve` that cannot start says why in one line and exits 2, without a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(*argv: str, port: int | None = None) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port or _free_port()),
           "--no-warm-up", *argv]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    return done.returncode, done.stdout


def test_a_busy_port_is_one_line_before_any_model_loads():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rc, log = _serve(port=port)
    assert rc == 2, log
    assert f"cannot listen on 127.0.0.1:{port}" in log
    assert "Traceback" not in log and "loading" not in log.lower()


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (("/nonexistent/model.gguf",), "does not exist"),
        (("--max-model-len", "100000"), "longer than the model's context"),
        (("--kv-cache-memory", "100K"), "holds no block"),
    ],
)
def test_a_model_that_cannot_load_is_one_line(argv, reason):
    rc, log = _serve(*argv)
    assert rc == 2, log
    assert "cannot serve:" in log and reason in log
    assert "Traceback" not in log and "never retrieved" not in log, log
