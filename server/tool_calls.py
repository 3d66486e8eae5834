"""Tool calling in OpenAI's shape: the tools put into the prompt, the model's calls parsed out of its text, and
`tool_choice` "required" or a named function constrained by a grammar, so the arguments always validate.

A format is how a model family writes its calls (vLLM's --tool-call-parser names): `hermes` (Qwen 2.5/3,
Hermes, and the generic format for templates that know no tools, as llama.cpp uses one), `llama3_json` and
`mistral`. Where the chat template takes no `tools` (the embedded SmolLM2's), the tools and the format are put
in a system message instead, and earlier calls and results are written back into the conversation as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.structured_output import DEFAULT_JSON_WHITESPACE, StructuredOutputSpec


# Calls one constrained output may hold: without a bound a small model can keep adding calls until max_tokens.
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str

    def body(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallFormat:
    """How one family of models writes a call. Subclasses set the markers and the call object's key for the
    arguments; `parse` finds calls, `grammar` constrains output to calls."""

    name = ""
    arguments_key = "arguments"
    start = ""  # text that opens a call (or the list of calls)
    end = ""  # text that closes one call ("" where the end of the output closes them)
    separator = "\n"  # between parallel calls

    def call_schema(self, tools: list[dict]) -> dict:
        """The JSON schema of one call object: any of the tools' names with its parameters."""
        variants = []
        for tool in tools:
            function = tool["function"]
            parameters = function.get("parameters") or {"type": "object", "properties": {}}
            variants.append({"type": "object", "properties": {"name": {"const": function["name"]},
                                                              self.arguments_key: parameters},
                             "required": ["name", self.arguments_key], "additionalProperties": False})
        schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
        # The same bounded whitespace as response_format's JSON (engine/structured_output.py).
        return {**schema, "x-guidance": {"whitespace_pattern": DEFAULT_JSON_WHITESPACE}}

    def grammar(self, tools: list[dict], parallel: bool) -> StructuredOutputSpec:
        """Output that is one call (or, `parallel`, one or more) of `tools`, in this format, as a Lark grammar."""
        call = f"{_lark_literal(self.start)} %json {json.dumps(self.call_schema(tools))} {_lark_literal(self.end)}"
        repeat = f" ({_lark_literal(self.separator)} call)~0..{MAX_PARALLEL_CALLS - 1}" if parallel else ""
        return StructuredOutputSpec("grammar", f"start: call{repeat}\ncall: {call}\n", param="tools")

    def instructions(self, tools: list[dict]) -> str:
        """A system message's text for a template that takes no tools."""
        listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        example = self.render_calls([ToolCall("function_name", '{"argument": "value"}', "")])
        return ("You can call functions. Their signatures:\n" + listed + "\n\nTo call a function, answer with "
                f"exactly:\n{example}\nwith the function's name and a JSON object of its arguments. Otherwise answer "
                "as usual.")

    def render_calls(self, calls: list[ToolCall]) -> str:
        """Calls as the model writes them (an assistant message's tool_calls, for the next prompt)."""
        objects = [json.dumps({"name": c.name, self.arguments_key: _json_or_text(c.arguments)}, ensure_ascii=False)
                   for c in calls]
        return self.separator.join(f"{self.start}{o}{self.end}" for o in objects)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output: calls are the well-formed call objects after a start marker; the
        text before the first is the content (None if empty). No call: the text is all content."""
        at = text.find(self.start) if self.start else _first_object(text)
        if at < 0:
            return text, []
        calls = [ToolCall(obj["name"], json.dumps(obj.get(self.arguments_key, {}), ensure_ascii=False), new_call_id())
                 for obj in _call_objects(text[at:], self.arguments_key)]
        if not calls:
            return text, []
        content = text[:at].strip()
        return content or None, calls


class HermesFormat(ToolCallFormat):
    name = "hermes"
    start, end = "<tool_call>\n", "\n</tool_call>"


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1-3.3's JSON calls: {"name": ..., "parameters": {...}}, several joined by "; "."""

    name = "llama3_json"
    arguments_key = "parameters"
    start, end, separator = "", "", "; "


class MistralFormat(ToolCallFormat):
    """Mistral's [TOOL_CALLS] followed by a JSON list of calls."""

    name = "mistral"
    start = "[TOOL_CALLS]"

    def grammar(self, tools: list[dict], parallel: bool) -> StructuredOutputSpec:
        items = {"type": "array", "items": self.call_schema(tools), "minItems": 1,
                 "maxItems": MAX_PARALLEL_CALLS if parallel else 1}
        return StructuredOutputSpec("grammar", f"start: {_lark_literal(self.start)} %json {json.dumps(items)}\n",
                                    param="tools")

    def render_calls(self, calls: list[ToolCall]) -> str:
        return self.start + json.dumps([{"name": c.name, "arguments": _json_or_text(c.arguments)} for c in calls],
                                       ensure_ascii=False)


FORMATS: dict[str, type[ToolCallFormat]] = {f.name: f for f in (HermesFormat, Llama3JsonFormat, MistralFormat)}


def default_format(architecture: str) -> str:
    """The family's own format where zenserve knows it, else the generic (hermes) one."""
    return "mistral" if architecture == "MistralForCausalLM" else "hermes"


def _lark_literal(text: str) -> str:
    return json.dumps(text) if text else '""'


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _first_object(text: str) -> int:
    match = re.search(r'\{\s*"name"\s*:', text)
    return match.start() if match else -1


def _call_objects(text: str, arguments_key: str) -> list[dict]:
    """Every JSON object with a string "name" in `text` (nested in a list or not), in order."""
    decoder = json.JSONDecoder()
    found: list[dict] = []
    i = 0
    while i < len(text):
        if text[i] not in "{[":
            i += 1
            continue
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        for obj in value if isinstance(value, list) else [value]:
            if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get(arguments_key, {}), dict):
                found.append(obj)
        i = end
    return found


def prepare_messages(messages: list[dict], tools: list[dict], fmt: ToolCallFormat, template_takes_tools: bool
                     ) -> list[dict]:
    """The conversation for a template: as it is where the template renders tools itself; else with the tools in
    a system message, assistant calls written as the model writes them, and tool results as user turns."""
    if template_takes_tools:
        return messages
    out: list[dict] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = [ToolCall(c["function"]["name"], c["function"].get("arguments", "{}"), c.get("id", ""))
                     for c in m["tool_calls"]]
            text = m.get("content") or ""
            out.append({"role": "assistant", "content": (text + "\n" if text else "") + fmt.render_calls(calls)})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append(m)
    if tools:
        instructions = fmt.instructions(tools)
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + instructions}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out
