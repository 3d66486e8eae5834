"""`zenserve serve` as a subprocess on a free loopback port, driven by the official openai client."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    cmd = [
        sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--kv-cache-memory", "256M", "--max-num-seqs", "64",
        "--served-model-name", "smollm2",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while _get(base + "/health")[0] != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not become healthy:\n{proc.stdout.read()}")
        time.sleep(0.5)
    yield base
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert rc == 0, log
    assert "zenserve ready on http://127.0.0.1" in log and "model=smollm2" in log
    # A float32 model's default cache on the CPU workers: float16, the dtype named where it starts.
    assert re.search(r"dtype=float32 kv_cache=\d+ MiB float16 \(\d+ tokens\)", log), log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "List three colours."}]


def test_non_streaming_chat(client):
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 10


def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 10
    plain = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=10, temperature=0)
    assert text == plain.choices[0].message.content


def test_n2_stop_and_seed(client):
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, n=2, temperature=1.0, seed=11)
    assert len(r.choices) == 2
    again = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, n=2, temperature=1.0, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    greedy = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=20, temperature=0)
    text = greedy.choices[0].message.content
    stop = text[4:8]
    s = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=20, temperature=0, stop=[stop])
    assert s.choices[0].finish_reason == "stop" and stop not in s.choices[0].message.content


def test_structured_outputs_and_tool_calls_through_the_client(client):
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Invent a city."}], max_tokens=120, temperature=1.0, seed=2,
        stream=True, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Weather in Rome?"}], max_tokens=100, temperature=0,
        tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), tools[0]["function"]["parameters"])
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})


def test_bad_request_is_a_400_the_client_understands(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages=[], max_tokens=4)


def test_64_concurrent_streams_complete_and_8_cut_streams_leave_nothing_running(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)

        async def full(i):
            stream = await aclient.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": f"Count to {i}."}],
                max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True},
            )
            n = 0
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    n += 1
            return n

        async def cut(i):
            stream = await aclient.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": f"Write a long essay number {i}."}],
                max_tokens=500, temperature=0, stream=True, extra_body={"ignore_eos": True},
            )
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
            await stream.close()

        counts = await asyncio.gather(*(full(i) for i in range(64)))
        await asyncio.gather(*(cut(i) for i in range(8)))
        await aclient.close()
        return counts

    counts = asyncio.run(main())
    assert len(counts) == 64 and all(c > 0 for c in counts)
    running = waiting = None
    for _ in range(100):
        _, metrics = _get(server + "/metrics")
        running = _gauge(metrics, "zenserve:num_requests_running")
        waiting = _gauge(metrics, "zenserve:num_requests_waiting")
        if running == 0 and waiting == 0:
            break
        time.sleep(0.1)
    assert (running, waiting) == (0, 0)
    assert _get(server + "/health")[0] == 200


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")
