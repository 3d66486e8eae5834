"""Each tool-call format: its grammar accepts exactly the calls it writes, and its parser reads them back."""

from __future__ import annotations

import json

import pytest
from gguf import GGUFReader

from engine.embedded_model import embedded_model_path
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer
from server.tool_calls import FORMATS, MAX_PARALLEL_CALLS, ToolCall, prepare_messages

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]
CALLS = [ToolCall("get_weather", '{"city": "Paris"}', ""), ToolCall("add", '{"a": 1, "b": 2}', "")]


@pytest.fixture(scope="module")
def compiler() -> tuple[Tokenizer, GrammarCompiler]:
    tokenizer = Tokenizer.from_gguf(GGUFReader(str(embedded_model_path())))
    return tokenizer, GrammarCompiler(tokenizer.to_json(), tokenizer.eos_token_ids, 49152)


def accepts(compiler, spec, text: str) -> bool:
    tokenizer, grammars = compiler
    matcher = grammars.matcher(grammars.compile(spec))._matcher
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_format_parses_what_it_writes_and_its_grammar_takes_exactly_that(compiler, name):
    fmt = FORMATS[name]()
    text = fmt.render_calls(CALLS)
    content, calls = fmt.parse("Let me check. " + text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(c.name, json.loads(c.arguments)) for c in CALLS]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert accepts(compiler, fmt.grammar(TOOLS, parallel=True), text)
    assert not accepts(compiler, fmt.grammar(TOOLS, parallel=False), text)  # two calls where one is allowed
    assert accepts(compiler, fmt.grammar(TOOLS, parallel=False), fmt.render_calls(CALLS[:1]))
    # Arguments that break the function's schema, or an unknown function, are outside the grammar.
    assert not accepts(compiler, fmt.grammar(TOOLS, parallel=True), fmt.render_calls([ToolCall("add", '{"a": "x", "b": 2}', "")]))
    assert not accepts(compiler, fmt.grammar(TOOLS, parallel=True), fmt.render_calls([ToolCall("nope", "{}", "")]))
    assert not accepts(compiler, fmt.grammar(TOOLS, parallel=True), fmt.render_calls(CALLS[:1] * (MAX_PARALLEL_CALLS + 1)))
    assert fmt.parse("No call here.") == ("No call here.", [])


def test_a_template_without_tools_gets_them_in_a_system_message_and_the_history_as_text():
    fmt = FORMATS["hermes"]()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    out = prepare_messages(messages, TOOLS, fmt, template_takes_tools=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and "get_weather" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": fmt.render_calls([ToolCall("get_weather", '{"city": "Paris"}', "")])}
    assert out[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}
    assert prepare_messages(messages, TOOLS, fmt, template_takes_tools=True) is messages
