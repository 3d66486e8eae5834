"""Structured outputs and tool calls over HTTP: every constrained output parses and validates, sampled at
temperature 1 under several seeds; bad constraints get a 400 naming their field; unconstrained requests in the
same batch are untouched."""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import pytest

from tests.server.conftest import engine_of

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 16},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "height_m": {"type": "number", "minimum": 1.2, "maximum": 2.2},
        "role": {"enum": ["pilot", "chef", "poet"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "height_m", "role", "address", "skills"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Invent a person and describe them."}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 20},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer"}, "b": {"type": "integer"}},
                                          "required": ["a", "b"], "additionalProperties": False}}},
]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


async def chat(client, **body) -> dict:
    resp = await client.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_json_schema_outputs_validate_under_sampling(client):
    for seed in (1, 2, 3):
        out = await chat(client, temperature=1.0, seed=seed, n=2, max_tokens=300,
                         response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                                 "strict": True}})
        for choice in out["choices"]:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    # The same schema every time: compiled once.
    assert engine_of(client).core.grammars.num_compiles == 1


async def test_vllm_fields_constrain_the_output(client):
    out = await chat(client, temperature=1.0, seed=5, max_tokens=40, structured_outputs={"regex": r"[A-Z]{2}-\d{3}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out["choices"][0]["message"]["content"])
    for body in ({"guided_choice": ["red", "green", "blue"]}, {"structured_outputs": {"choice": ["red", "green", "blue"]}}):
        out = await chat(client, temperature=1.0, seed=6, max_tokens=10, **body)
        assert out["choices"][0]["message"]["content"] in ("red", "green", "blue")
        assert out["choices"][0]["finish_reason"] == "stop"
    grammar = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[1-9]/'
    out = await chat(client, temperature=1.0, seed=7, max_tokens=10, structured_outputs={"grammar": grammar})
    assert re.fullmatch(r"yes|no|maybe [1-9]", out["choices"][0]["message"]["content"])
    out = await chat(client, temperature=1.0, seed=8, max_tokens=200, response_format={"type": "json_object"})
    assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict)
    compact = {"json": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
               "disable_any_whitespace": True, "disable_additional_properties": True}
    out = await chat(client, temperature=1.0, seed=9, max_tokens=30, structured_outputs=compact)
    assert re.fullmatch(r'\{"x":-?\d+\}', out["choices"][0]["message"]["content"])
    # Completions too, streamed.
    resp = await client.post("/v1/completions", json={"prompt": "The colour of the sky:", "max_tokens": 10, "stream": True,
                                                      "guided_choice": ["blue", "grey"], "temperature": 1.0})
    text = "".join([json.loads(line[6:])["choices"][0]["text"] async for line in _data_lines(resp)])
    assert text in ("blue", "grey")


async def _data_lines(resp):
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield line


async def test_a_constrained_request_cut_by_max_tokens_ends_with_length(client):
    out = await chat(client, temperature=0.0, max_tokens=5, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON}})
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 5


async def test_free_requests_beside_constrained_ones_are_untouched(client):
    free = {"messages": [{"role": "user", "content": "Name three rivers."}], "temperature": 0.0, "max_tokens": 24}
    alone = await (await client.post("/v1/chat/completions", json=free)).json()
    constrained = [chat(client, temperature=1.0, seed=s, max_tokens=300, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}) for s in (11, 12)]
    mixed = await asyncio.gather(client.post("/v1/chat/completions", json=free), *constrained)
    assert (await mixed[0].json())["choices"][0]["message"] == alone["choices"][0]["message"]
    for out in mixed[1:]:
        jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), PERSON)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}}, "response_format",
         "strin"),
        ({"guided_regex": "a(b"}, "guided_regex", "regex"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs", "grammar"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choices"),
        ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json", "one output"),
        ({"guided_regex": "a" * 300_000}, "guided_regex", "bytes"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}], "tool_choice": "required"}, "tools",
         "parameters"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "cannot be combined"),
    ],
)
async def test_bad_constraints_get_a_400_naming_the_field_and_the_server_serves_on(client, extra, param, message):
    resp = await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra})
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param and message in error["message"], error
    assert (await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})).status == 200


async def test_a_large_grammar_compiles_off_the_event_loop(client):
    """A schema of 1,500 properties takes a while to compile: /health answers meanwhile."""
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 8, "pattern": f"^{i}[a-z]+$"}
                                             for i in range(1500)}, "required": ["field_0"]}
    request = asyncio.create_task(client.post("/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 3, "response_format": {"type": "json_schema", "json_schema": {"schema": big}}}))
    worst = 0.0
    while not request.done():
        started = time.perf_counter()
        assert (await client.get("/health")).status in (200, 503)
        worst = max(worst, time.perf_counter() - started)
        await asyncio.sleep(0.01)
    assert (await request).status == 200
    assert worst < 0.5, worst


async def test_named_and_required_tool_calls_validate(client):
    weather_args = TOOLS[0]["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in (1, 2):
        out = await chat(client, messages=WEATHER, tools=TOOLS, tool_choice=named, temperature=1.0, seed=seed, max_tokens=150)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), weather_args)
    out = await chat(client, messages=[{"role": "user", "content": "Add 2 and 3, and tell me the weather in Oslo."}],
                     tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, max_tokens=400)
    calls = out["choices"][0]["message"]["tool_calls"]
    assert out["choices"][0]["finish_reason"] == "tool_calls" and calls
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), by_name[call["function"]["name"]])
    # One call only where parallel calls are off.
    out = await chat(client, messages=WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                     temperature=1.0, seed=4, max_tokens=150)
    assert len(out["choices"][0]["message"]["tool_calls"]) == 1


async def test_streamed_tool_calls_come_in_openais_incremental_shape(client):
    resp = await client.post("/v1/chat/completions", json={
        "messages": WEATHER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 150, "temperature": 0.0, "stream": True})
    events = [json.loads(line[6:]) async for line in _data_lines(resp)]
    deltas = [e["choices"][0] for e in events]
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", ())]
    assert calls and calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads("".join(c["function"].get("arguments", "") for c in calls)),
                        TOOLS[0]["function"]["parameters"])
    assert deltas[-1]["finish_reason"] == "tool_calls"


async def test_auto_tool_choice_parses_the_models_calls_and_renders_results_back(make_client):
    client = await make_client(server={"enable_auto_tool_choice": True})
    # The model decides; a reply that writes a call in the generic format is parsed into tool_calls.
    out = await chat(client, messages=WEATHER, tools=TOOLS, temperature=0.0, max_tokens=60)
    message = out["choices"][0]["message"]
    if message.get("tool_calls"):
        assert out["choices"][0]["finish_reason"] == "tool_calls"
    else:
        assert out["choices"][0]["finish_reason"] in ("stop", "length") and message["content"]
    # A conversation carrying a call and its result renders into the next prompt and is served.
    history = WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    out = await chat(client, messages=history, tools=TOOLS, tool_choice="none", temperature=0.0, max_tokens=20)
    assert out["choices"][0]["message"]["content"]
