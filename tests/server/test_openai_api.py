"""Every endpoint and error through aiohttp's test client on loopback."""

from __future__ import annotations

import asyncio
import gzip
import time
import zlib

import brotli
import orjson
import pytest
from backports import zstd

from tests.server.conftest import engine_of, start_stream_then_leave

CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0}


async def sse_events(resp) -> list:
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: ")
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


async def test_models_lists_the_served_model_with_its_context(client):
    resp = await client.get("/v1/models")
    body = await resp.json()
    assert resp.status == 200
    (card,) = body["data"]
    assert card["id"] == "SmolLM2-135M-Instruct.Q4_1" and card["object"] == "model"
    assert card["max_model_len"] == engine_of(client).max_model_len


async def test_health_version_and_metrics(client):
    assert (await client.get("/health")).status == 200
    assert "version" in await (await client.get("/version")).json()
    await client.post("/v1/chat/completions", json=CHAT)
    text = await (await client.get("/metrics")).text()
    assert 'finished_reason="length"' in text and "zenserve:request_success_total" in text
    assert "zenserve:generation_tokens_total" in text and "zenserve:num_requests_running" in text


async def test_chat_completion_shape_and_usage(client):
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    again = await (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]


async def test_chat_stream_sends_role_then_content_then_finish_usage_and_done(client):
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = [c["choices"][0] for c in chunks[1:-1]]
    assert content[-1]["finish_reason"] == "length"
    assert all(c["finish_reason"] is None for c in content[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    streamed = "".join(c["delta"].get("content", "") for c in content)
    plain = await (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert streamed == plain["choices"][0]["message"]["content"]


async def test_chat_n2_logprobs_and_stop(client):
    body = {**CHAT, "n": 2, "temperature": 1.0, "seed": 3, "logprobs": True, "top_logprobs": 2}
    data = await (await client.post("/v1/chat/completions", json=body)).json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    lp = data["choices"][0]["logprobs"]["content"]
    assert len(lp) == 8 and len(lp[0]["top_logprobs"]) == 2 and isinstance(lp[0]["bytes"], list)
    greedy = await (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 20})).json()
    text = greedy["choices"][0]["message"]["content"]
    stop = text[3:6]
    stopped = await (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 20, "stop": stop})).json()
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["message"]["content"] == text[: text.index(stop)]


async def test_completions_with_text_token_ids_and_several_prompts(client):
    resp = await client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 1})
    body = await resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and len(lp["token_logprobs"]) == 4 and len(lp["text_offset"]) == 4
    ids = await (await client.post("/tokenize", json={"prompt": "The capital of France is"})).json()
    by_ids = await (await client.post("/v1/completions", json={"prompt": ids["tokens"], "max_tokens": 4, "temperature": 0})).json()
    assert by_ids["choices"][0]["text"] == body["choices"][0]["text"]
    many = await (await client.post("/v1/completions", json={"prompt": ["One", "Two"], "n": 2, "max_tokens": 3, "temperature": 0})).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    assert many["usage"]["completion_tokens"] == 12


async def test_completion_stream(client):
    resp = await client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 5, "stream": True})
    events = await sse_events(resp)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "text_completion" for e in events[:-1])


async def test_tokenize_and_detokenize(client):
    tok = await (await client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})).json()
    assert tok["count"] == len(tok["tokens"]) and tok["token_strs"] and tok["max_model_len"] > 0
    chat = await (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})).json()
    assert chat["tokens"][0] == 1  # <|im_start|>
    detok = await (await client.post("/detokenize", json={"tokens": tok["tokens"]})).json()
    assert detok["prompt"] == "Hello world"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"max_tokens": 4}', "messages"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"content": "x"}]}', "role"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": true}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}', "top_p"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}', "stream"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}', "logprobs"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}', "maximum context length"),
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}', "text only"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stop": [1, 2]}', "stop"),
        (b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}}', "chat_template_kwargs"),
        (b'{"messages": [{"role": "user"}]}', "chat template"),
        (b'{"messages": [{"role": "user", "content": "x"}], "seed": 9223372036854775808}', "64 bits"),
    ],
)
async def test_bad_chat_requests_get_400_in_openai_shape(client, body, fragment):
    resp = await client.post("/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "BadRequestError"
    assert fragment in err["message"]


async def test_an_unknown_model_is_404_not_found(client):
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}),
        ("/v1/completions", {"prompt": "x", "model": "gpt-9"}),
    ]:
        resp = await client.post(path, json=body)
        assert resp.status == 404, path
        err = (await resp.json())["error"]
        assert err["type"] == "NotFoundError" and err["code"] == "model_not_found" and err["param"] == "model"
        assert "`gpt-9` does not exist" in err["message"]


async def test_a_body_that_does_not_inflate_gets_400(client):
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    resp = await client.post("/v1/chat/completions", data=b"not gzip", headers=headers)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["type"] == "BadRequestError" and "cannot be read" in err["message"]
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200  # still serving


def _compressed(encoding: str, data: bytes) -> bytes:
    if encoding == "gzip":
        return gzip.compress(data)
    if encoding == "deflate":
        return zlib.compress(data)
    if encoding == "br":
        return brotli.compress(data)
    return zstd.compress(data)


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
async def test_a_compressed_body_is_read_in_each_encoding_http_names(client, encoding):
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    resp = await client.post("/v1/chat/completions", data=_compressed(encoding, orjson.dumps(CHAT)), headers=headers)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["choices"][0]["message"]["content"]


@pytest.mark.parametrize("encoding", ["br", "zstd"])
async def test_a_body_that_does_not_decompress_gets_400_in_each_encoding(client, encoding):
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    resp = await client.post("/v1/chat/completions", data=b"not compressed", headers=headers)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["type"] == "BadRequestError" and "cannot be read" in err["message"]
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200  # still serving


@pytest.mark.parametrize("encoding", ["gzip", "br", "zstd"])
async def test_a_body_that_decompresses_past_the_limit_gets_413(make_client, encoding):
    client = await make_client(server={"max_body_bytes": 64 * 1024})
    bomb = {"messages": [{"role": "user", "content": "x" * 4 * 2**20}]}  # 4 MiB that compresses to a few KB
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    resp = await client.post("/v1/chat/completions", data=_compressed(encoding, orjson.dumps(bomb)), headers=headers)
    assert resp.status == 413 and (await resp.json())["error"]["type"] == "RequestTooLarge"
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200  # still serving


async def test_bad_completion_and_detokenize_requests_get_400(client):
    for path, body in [
        ("/v1/completions", {"prompt": ""}),
        ("/v1/completions", {"prompt": [1, "a"]}),
        ("/v1/completions", {"prompt": [10**9]}),
        ("/detokenize", {"tokens": [-1]}),
        ("/tokenize", {}),
    ]:
        resp = await client.post(path, json=body)
        assert resp.status == 400, (path, body, await resp.text())
    assert (await client.get("/health")).status == 200  # still serving


async def test_unknown_path_is_404_and_large_body_413(make_client):
    client = await make_client(server={"max_body_bytes": 1024})
    resp = await client.get("/v2/nothing")
    assert resp.status == 404 and (await resp.json())["error"]["code"] == 404
    big = {"messages": [{"role": "user", "content": "x" * 4096}]}
    resp = await client.post("/v1/chat/completions", json=big)
    assert resp.status == 413 and "error" in await resp.json()


async def test_api_key_is_required_on_v1_but_not_on_probes(make_client):
    client = await make_client(server={"api_key": "s3cret"})
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 401
    wrong = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"})
    assert wrong.status == 401 and (await wrong.json())["error"]["type"] == "AuthenticationError"
    ok = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer s3cret"})
    assert ok.status == 200
    assert (await client.get("/health")).status == 200
    assert (await client.get("/metrics")).status == 200


async def test_full_waiting_queue_gets_503(make_client):
    client = await make_client(scheduler={"max_waiting": 0})
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 503 and "busy" in (await resp.json())["error"]["message"]


async def test_before_the_model_loads_and_when_it_fails_503(tmp_path):
    from aiohttp.test_utils import TestClient, TestServer

    from engine.config import EngineConfig, ModelConfig
    from server.app import create_app
    from server.config import ServerConfig

    app = create_app(ServerConfig(), EngineConfig(model=ModelConfig(model=str(tmp_path / "missing.gguf"))))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        for _ in range(50):
            resp = await client.get("/health")
            assert resp.status == 503
            if "failed" in (await (await client.post("/v1/chat/completions", json=CHAT)).json())["error"]["message"]:
                break
            await asyncio.sleep(0.05)
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 503 and "failed to load" in (await resp.json())["error"]["message"]


async def test_a_client_that_disconnects_mid_stream_frees_its_request(client):
    engine = engine_of(client)
    free_before = engine.core.pool.num_free_blocks
    await start_stream_then_leave(client, {**CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True})
    for _ in range(200):
        if not engine.core.has_unfinished():
            break
        await asyncio.sleep(0.02)
    assert not engine.core.has_unfinished()
    assert engine.core.pool.num_free_blocks == free_before
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200


async def test_slow_steps_never_block_health_or_models(client):
    engine = engine_of(client)
    real_execute = engine.core.worker.execute

    def slow_execute(batch):
        time.sleep(1.0)  # a deliberately slow forward pass, on the worker thread
        return real_execute(batch)

    engine.core.worker.execute = slow_execute
    task = asyncio.create_task(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}))
    await asyncio.sleep(0.3)  # the first slow step is running now
    for path in ("/health", "/v1/models"):
        t = time.perf_counter()
        resp = await client.get(path)
        assert resp.status == 200
        assert time.perf_counter() - t < 0.2, path
    assert (await task).status == 200


async def test_health_is_503_when_work_waits_and_no_step_completes(make_client):
    client = await make_client(server={"health_deadline_s": 0.3})
    engine = engine_of(client)
    release = asyncio.Event()

    def wedged(batch):
        import time as _t

        while not release.is_set():
            _t.sleep(0.01)
        raise RuntimeError("wedged step released")

    engine.core.worker.execute = wedged
    task = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
    await asyncio.sleep(0.6)
    assert (await client.get("/health")).status == 503
    release.set()
    resp = await task
    assert resp.status in (200, 503)


async def test_a_step_that_fails_mid_stream_ends_the_stream_with_the_error(client):
    # The stream had begun when the step failed, so no status can be sent: the error is its last event,
    # then [DONE], and the connection closes (it used to stay open with nothing more to come).
    engine = engine_of(client)
    real_execute = engine.core.worker.execute
    calls = 0

    def fails_on_the_fourth_step(batch):
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("injected step failure")
        return real_execute(batch)

    engine.core.worker.execute = fails_on_the_fourth_step
    try:
        resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 20, "ignore_eos": True, "stream": True})
        assert resp.status == 200
        events = await asyncio.wait_for(sse_events(resp), timeout=30)
    finally:
        engine.core.worker.execute = real_execute
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 503 and "injected step failure" in error["message"]
    assert [e["choices"][0]["delta"].get("content") is not None for e in events[1:-2]] == [True] * 3
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200


# Every request field the server reads, each given values at the edges of what JSON can carry.
_EDGE_FIELDS = (
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "logprobs", "top_logprobs",
    "logit_bias", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "priority", "user", "model",
    "kv_transfer_params", "cache_salt", "echo", "stream_options",
)
_EDGE_VALUES = (
    2**63, 2**64 - 1, -(2**63), -1, 0, 1, 49_152, 1e308, -1e308, 5e-324, "", "x" * 2_000, [], [2**63], [-1],
    {}, {"49151": 100}, {"0": 1e308}, {str(2**63): 1}, True, None,
)


async def test_no_edge_value_in_any_field_reaches_a_5xx_or_a_neighbour(client):
    # Each field alone at each edge value, while a stream runs beside: every answer is a 200 or a 4xx in
    # OpenAI's shape, and the stream is not hurt. A top_k of 2**63 once failed the whole step.
    stream = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True})
    assert (await stream.content.readline()).startswith(b"data: ")
    served = 0
    for field in _EDGE_FIELDS:
        for value in _EDGE_VALUES:
            body = {**CHAT, "max_tokens": 2, "temperature": 0.8, field: value}  # sampled: every filter can run
            resp = await client.post("/v1/chat/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"})
            answer = await resp.json()
            assert resp.status == 200 or 400 <= resp.status < 500, (field, value, resp.status, answer)
            if resp.status == 200:
                served += 1
                assert answer["choices"] and answer["usage"]["completion_tokens"] >= 1, (field, value)
            else:
                assert set(answer["error"]) == {"message", "type", "param", "code"}, (field, value)
    assert served > len(_EDGE_FIELDS)  # most fields accept some of these values: the engine ran them
    events = await sse_events(stream)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_ci_runs_exactly_the_readme_test_command():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    assert "make test" in readme
    commands = [
        line.strip() for line in (root / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert commands[-1] == "make test"
    assert all(c.startswith(("set ", "cd ")) for c in commands[:-1])


async def test_logit_bias_changes_the_greedy_tokens(client):
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = await (await client.post("/v1/completions", json={**body, "logprobs": 0})).json()
    first = plain["choices"][0]["logprobs"]["tokens"][0]
    tokenizer = engine_of(client).tokenizer
    banned = tokenizer.encode(first, add_special_tokens=False)
    assert len(banned) == 1
    biased = await (await client.post("/v1/completions", json={**body, "logprobs": 0, "logit_bias": {str(banned[0]): -100}})).json()
    assert biased["choices"][0]["logprobs"]["tokens"][0] != first
    forced = await (await client.post("/v1/completions", json={**body, "logit_bias": {str(banned[0]): 100}})).json()
    assert forced["choices"][0]["text"] == first * 4


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": "x"}}, "logit_bias"),
        ({"logit_bias": {"5": 200}}, "logit_bias"),
        ({"logit_bias": {str(10**9): 1}}, None),  # outside the vocab: the engine's check
        ({"logit_bias": [1]}, "logit_bias"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": "x"}, "response_format"),
        ({"guided_json": 5}, "guided_json"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs"),
        ({"tools": "x"}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        # auto needs --enable-auto-tool-choice, as in vLLM (tests/server/test_structured_outputs.py serves it)
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"priority": 1}, "priority"),
        ({"priority": "high"}, "priority"),
    ],
)
async def test_what_zenserve_cannot_honour_is_refused_not_ignored(client, extra, param):
    resp = await client.post("/v1/chat/completions", json={**CHAT, **extra})
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["type"] == "BadRequestError" and err["param"] == param


async def test_text_format_and_tools_without_a_call_are_served(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for extra in ({"response_format": {"type": "text"}}, {"tools": tools}, {"tools": tools, "tool_choice": "none"}):
        resp = await client.post("/v1/chat/completions", json={**CHAT, **extra})
        assert resp.status == 200, (extra, await resp.text())


async def test_completion_echo_leads_each_choice_with_its_prompt(client):
    body = {"prompt": ["Roses are red,", "The sky is"], "max_tokens": 3, "temperature": 0, "n": 2}
    plain = await (await client.post("/v1/completions", json=body)).json()
    echoed = await (await client.post("/v1/completions", json={**body, "echo": True})).json()
    assert [c["index"] for c in echoed["choices"]] == [0, 1, 2, 3]
    for p, c, e in zip([0, 0, 1, 1], plain["choices"], echoed["choices"]):
        assert e["text"] == body["prompt"][p] + c["text"]
    assert echoed["usage"] == plain["usage"]
    # Streamed, the prompt leads each choice's first text chunk; token-id prompts echo decoded.
    ids = engine_of(client).tokenizer.encode("The sky is", add_special_tokens=False)
    resp = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True, "stream": True})
    texts = [e["choices"][0]["text"] for e in await sse_events(resp) if e != "[DONE]"]
    assert texts[0].startswith("The sky is") and "".join(texts) == "The sky is" + plain["choices"][2]["text"]
    resp = await client.post("/v1/completions", json={**body, "echo": True, "logprobs": 1})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "echo"


async def test_chat_echo_repeats_the_assistants_open_message(client):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"}]
    body = {"messages": messages, "max_tokens": 3, "temperature": 0, "add_generation_prompt": False}
    plain = await (await client.post("/v1/chat/completions", json=body)).json()
    echoed = await (await client.post("/v1/chat/completions", json={**body, "echo": True})).json()
    assert echoed["choices"][0]["message"]["content"] == "Blue" + plain["choices"][0]["message"]["content"]
    resp = await client.post("/v1/chat/completions", json={**body, "echo": True, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in await sse_events(resp) if e != "[DONE]"]
    assert deltas[0] == {"role": "assistant", "content": "Blue"}
    # A user message last: nothing to echo.
    user_last = {**CHAT, "echo": True}
    assert (await (await client.post("/v1/chat/completions", json=user_last)).json())["choices"][0]["message"]["content"] == (
        await (await client.post("/v1/chat/completions", json=CHAT)).json())["choices"][0]["message"]["content"]


async def test_continue_final_message_leaves_the_reply_open(client):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    tok = await (await client.post("/tokenize", json=body)).json()
    text = engine_of(client).tokenizer.decode(tok["tokens"], skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nMy favourite colour is")
    resp = await client.post("/v1/chat/completions", json={**body, "max_tokens": 4, "temperature": 0, "echo": True})
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"].startswith("My favourite colour is")
    both = {**body, "add_generation_prompt": True}
    resp = await client.post("/v1/chat/completions", json=both)
    assert resp.status == 400 and "cannot both" in (await resp.json())["error"]["message"]


async def test_cache_salt_shares_a_prefix_only_within_the_same_salt(client):
    prompt = "Lighthouses guide ships along dangerous coasts at night. " * 6

    async def cached(**extra) -> int:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached() == 0
    assert await cached() > 0  # unsalted requests share
    assert await cached(cache_salt="tenant-a") == 0  # a salt sees nothing of the unsalted prefix
    assert await cached(cache_salt="tenant-b") == 0  # nor another tenant's
    assert await cached(cache_salt="tenant-a") > 0  # but its own
    resp = await client.post("/v1/completions", json={"prompt": prompt, "cache_salt": ""})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "cache_salt"


async def test_ping_answers_like_health_to_get_and_post(client):
    assert (await client.get("/ping")).status == 200
    assert (await client.post("/ping")).status == 200
