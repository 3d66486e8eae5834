"""Two `zenserve serve` processes sharing one S3 bucket (a real SeaweedFS): a prefix the first
computed is served to the second from the bucket, with identical output."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import openai

from tests.e2e.test_openai_client import _free_port, _get

MESSAGES = [{"role": "user", "content": "Here are my notes: " + " ".join(f"river-{i}" for i in range(150)) + ". Summarise."}]


def _start(s3_server, extra_env=None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    offload = {
        "cpu_bytes_to_use": "64M",
        "secondary_tiers": [{
            "type": "obj", "endpoint": s3_server.endpoint, "bucket": s3_server.bucket, "prefix": "shared-e2e",
            "capacity_bytes": "1G", "access_key": s3_server.access_key, "secret_key": s3_server.secret_key,
            "demote_on": "store",
        }],
    }
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--worker", "eager", "--kv-cache-memory", "128M",
           "--served-model-name", "smollm2", "--kv-offloading-config", json.dumps(offload)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while _get(base + "/health")[0] != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server did not start:\n{proc.stdout.read()}")
        time.sleep(0.5)
    return proc, base


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.stdout.read()


def _chat(base: str):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})


def test_a_second_process_serves_the_prefix_the_first_computed_from_the_bucket(s3_server):
    first, base1 = _start(s3_server)
    try:
        r1 = _chat(base1)
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        time.sleep(2.0)  # let the store-time demotion reach the bucket
    finally:
        _stop(first)
    second, base2 = _start(s3_server)
    try:
        # A fresh process: its engine cache and CPU tier are empty, so cached tokens can only
        # have come from the bucket (the request waits while they are promoted).
        r2 = _chat(base2)
        assert r2.usage.prompt_tokens_details.cached_tokens == 16 * ((r2.usage.prompt_tokens - 1) // 16)
        assert r2.choices[0].message.content == r1.choices[0].message.content
    finally:
        _stop(second)
