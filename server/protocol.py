"""Typed OpenAI/vLLM request bodies, parsed and validated from untrusted JSON.

Every problem raises ApiError(400) naming the field; unknown fields are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.request import SamplingParams
from engine.structured_output import StructuredOutputSpec
from server.errors import bad_request

_MISSING = object()


class JsonObject:
    """Typed accessors over one JSON object; `bool` is never accepted as a number."""

    def __init__(self, body: Any):
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        self.body = body

    def get(self, name: str, kinds: tuple[type, ...], default: Any = None, *, nullable: bool = True) -> Any:
        value = self.body.get(name, _MISSING)
        if value is _MISSING or (value is None and nullable):
            return default
        if isinstance(value, bool) and bool not in kinds:
            raise bad_request(f"'{name}' must be of type {_kind_names(kinds)}", param=name)
        if not isinstance(value, kinds):
            raise bad_request(f"'{name}' must be of type {_kind_names(kinds)}", param=name)
        return value

    def number(self, name: str, default: float | None = None) -> float | None:
        value = self.get(name, (int, float), default)
        return None if value is None else float(value)

    def integer(self, name: str, default: int | None = None) -> int | None:
        return self.get(name, (int,), default)

    def boolean(self, name: str, default: bool = False) -> bool:
        return self.get(name, (bool,), default)


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {int: "integer", float: "number", bool: "boolean", str: "string", list: "array", dict: "object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


@dataclass(frozen=True)
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """What chat and completion requests share: sampling, streaming, the output cap."""

    model: str | None
    max_tokens: int | None  # None: up to the context limit
    stream: bool
    stream_options: StreamOptions
    logprobs: int | None  # alternatives per position; None: no logprobs
    echo: bool
    sampling: dict[str, Any]  # SamplingParams fields other than max_tokens and logprobs
    kv_transfer_params: dict[str, Any] | None  # offloading controls (max_offload_tokens)
    cache_salt: str | None  # only requests with the same salt share cached prefixes (tenants)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **self.sampling)
        except InvalidRequestError as e:
            raise bad_request(str(e)) from e


@dataclass(frozen=True)
class ToolChoice:
    """What the request lets the model do with its tools: "none", "auto", "required", or call `function`."""

    mode: str
    function: str | None = None


@dataclass(frozen=True)
class ChatRequest(GenerationRequest):
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message's turn left open, for the model to continue
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = ToolChoice("default")  # "default": the server's (none, or auto where enabled)
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class CompletionRequest(GenerationRequest):
    prompts: list[str | list[int]]


def _common(f: JsonObject, *, default_max_tokens: int | None, chat: bool) -> dict[str, Any]:
    stream = f.boolean("stream")
    raw_options = f.get("stream_options", (dict,))
    if raw_options is not None and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    opts = JsonObject(raw_options or {})
    stream_options = StreamOptions(opts.boolean("include_usage"), opts.boolean("continuous_usage_stats"))

    max_tokens = f.integer("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = f.integer("max_tokens", default_max_tokens)
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")

    if chat:
        wants_logprobs = f.boolean("logprobs")
        top = f.integer("top_logprobs", 0)
        if top and not wants_logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
        logprobs = top if wants_logprobs else None
    else:
        logprobs = f.integer("logprobs")
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise bad_request("logprobs alternatives must be between 0 and 20", param="top_logprobs" if chat else "logprobs")

    stop = f.get("stop", (str, list), ())
    if isinstance(stop, str):
        stop = (stop,)
    if not all(isinstance(s, str) for s in stop):
        raise bad_request("'stop' must be a string or a list of strings", param="stop")
    stop_token_ids = f.get("stop_token_ids", (list,), ())
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids):
        raise bad_request("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    seed = f.integer("seed")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise bad_request("'seed' must fit in 64 bits", param="seed")

    sampling: dict[str, Any] = {
        "n": f.integer("n", 1),
        "temperature": f.number("temperature", 1.0),
        "top_p": f.number("top_p", 1.0),
        "top_k": f.integer("top_k", 0),
        "min_p": f.number("min_p", 0.0),
        "seed": seed,
        "presence_penalty": f.number("presence_penalty", 0.0),
        "frequency_penalty": f.number("frequency_penalty", 0.0),
        "repetition_penalty": f.number("repetition_penalty", 1.0),
        "stop": tuple(stop),
        "stop_token_ids": tuple(stop_token_ids),
        "ignore_eos": f.boolean("ignore_eos"),
        "min_tokens": f.integer("min_tokens", 0),
        "skip_special_tokens": f.boolean("skip_special_tokens", True),
        "include_stop_str_in_output": f.boolean("include_stop_str_in_output"),
    }
    if not 1 <= sampling["n"] <= 16:
        raise bad_request("'n' must be between 1 and 16", param="n")
    sampling["logit_bias"] = _logit_bias(f)
    sampling["structured_output"] = _structured_output(f)
    if f.integer("priority", 0) != 0:  # vLLM's answer under its default first-come-first-served policy
        raise bad_request("priority scheduling is not enabled: zenserve serves requests in arrival order", param="priority")
    f.get("user", (str,))  # accepted and ignored, but it must be a string
    return dict(
        model=f.get("model", (str,)),
        max_tokens=max_tokens,
        stream=stream,
        stream_options=stream_options,
        logprobs=logprobs,
        echo=f.boolean("echo"),
        sampling=sampling,
        kv_transfer_params=f.get("kv_transfer_params", (dict,)),
        cache_salt=_cache_salt(f),
    )


def _cache_salt(f: JsonObject) -> str | None:
    salt = f.get("cache_salt", (str,))
    if salt is not None and not salt:
        raise bad_request("'cache_salt' must be a non-empty string", param="cache_salt")
    return salt


def _logit_bias(f: JsonObject) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}; the ids' range is checked by the engine, which knows the vocab."""
    raw = f.get("logit_bias", (dict,)) or {}
    pairs = []
    for key, bias in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise bad_request(f"logit_bias keys must be token ids as strings, got {key!r}", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {bias!r}", param="logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


# vLLM's older structured-output fields, each one kind of constraint.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# The fields of vLLM's `structured_outputs` object that name a constraint, and its options.
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _structured_output(f: JsonObject) -> StructuredOutputSpec | None:
    """The request's output constraint: OpenAI's response_format, vLLM's structured_outputs object or its older
    guided_* fields (at most one constraint in all), or None."""
    found: list[StructuredOutputSpec] = []
    response_format = f.get("response_format", (dict,))
    if response_format is not None:
        found += _response_format(response_format)
    structured = f.get("structured_outputs", (dict,))
    if structured is not None:
        found.append(_structured_outputs(JsonObject(structured), param="structured_outputs"))
    options = dict(whitespace_pattern=f.get("guided_whitespace_pattern", (str,)))
    for name, kind in _GUIDED_FIELDS.items():
        value = f.body.get(name)
        if value is not None:
            found.append(_spec(kind, value, name, options))
    if len(found) > 1:
        raise bad_request("give one output constraint: response_format, structured_outputs or a guided_* field",
                          param=found[1].param)
    return found[0] if found else None


def _response_format(response_format: dict) -> list[StructuredOutputSpec]:
    kind = response_format.get("type")
    if not isinstance(kind, str):
        raise bad_request("'response_format' must be an object with a string 'type'", param="response_format")
    if kind == "text":
        return []
    if kind == "json_object":
        return [StructuredOutputSpec("json_object", "", param="response_format")]
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise bad_request("response_format 'json_schema' needs an object 'json_schema' with a 'schema'",
                              param="response_format")
        return [_spec("json", schema, "response_format", {})]
    raise bad_request(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                      param="response_format")


def _structured_outputs(f: JsonObject, param: str) -> StructuredOutputSpec:
    named = [k for k in _STRUCTURED_KINDS if f.body.get(k) not in (None, False)]
    if len(named) != 1:
        raise bad_request(f"'{param}' must name exactly one of {', '.join(_STRUCTURED_KINDS)}", param=param)
    options = dict(
        whitespace_pattern=f.get("whitespace_pattern", (str,)),
        disable_any_whitespace=f.boolean("disable_any_whitespace"),
        disable_additional_properties=f.boolean("disable_additional_properties"),
    )
    if named[0] == "json_object":
        return StructuredOutputSpec("json_object", "", param=param, **options)
    return _spec(named[0], f.body[named[0]], param, options)


def _spec(kind: str, value: Any, param: str, options: dict) -> StructuredOutputSpec:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad_request(f"the JSON schema in '{param}' is not valid JSON: {e}", param=param) from e
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"the JSON schema in '{param}' must be an object", param=param)
        return StructuredOutputSpec.json_schema(value, param=param, **options)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise bad_request(f"the choices in '{param}' must be a non-empty list of strings", param=param)
        return StructuredOutputSpec.choice(value, param=param, **options)
    if not isinstance(value, str) or not value:
        raise bad_request(f"the {kind} in '{param}' must be a non-empty string", param=param)
    return StructuredOutputSpec(kind, value, param=param, **options)  # type: ignore[arg-type]


def _check_tools(f: JsonObject) -> tuple[list[dict[str, Any]] | None, ToolChoice, bool]:
    """The request's tools, its tool_choice (default: "none", as vLLM's without --enable-auto-tool-choice; the API
    layer makes it "auto" where the server enables that) and parallel_tool_calls."""
    tools = f.get("tools", (list,))
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]):
            raise bad_request("each of 'tools' must be an object with a 'function' that has a 'name'", param="tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"the parameters of tool {function['name']!r} must be a JSON schema object", param="tools")
    raw = f.get("tool_choice", (str, dict))
    parallel = f.boolean("parallel_tool_calls", True)
    if raw is None:
        return tools or None, ToolChoice("default"), parallel
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or a named function", param="tool_choice")
        choice = ToolChoice(raw)
    else:
        function = raw.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if raw.get("type") != "function" or not isinstance(name, str):
            raise bad_request("a named 'tool_choice' must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                              param="tool_choice")
        if not any(t["function"]["name"] == name for t in tools or ()):
            raise bad_request(f"tool_choice names {name!r}, which is not among 'tools'", param="tool_choice")
        choice = ToolChoice("function", name)
    if choice.mode != "none" and not tools:
        raise bad_request(f"tool_choice {raw if isinstance(raw, str) else 'function'!r} needs 'tools'", param="tool_choice")
    return tools or None, choice, parallel


def parse_chat_request(body: Any) -> ChatRequest:
    f = JsonObject(body)
    messages = f.get("messages", (list,))
    if not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(f"messages[{i}].content must be a string or a list of parts", param="messages")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise bad_request(f"messages[{i}].content parts must be objects with a 'type'", param="messages")
    kwargs = f.get("chat_template_kwargs", (dict,))
    reserved = {"messages", "add_generation_prompt", "continue_final_message", "tools", "image_placeholder"} & set(kwargs or ())
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(sorted(reserved))}: use the request fields",
            param="chat_template_kwargs",
        )
    tools, tool_choice, parallel_tool_calls = _check_tools(f)
    return ChatRequest(
        **_common(f, default_max_tokens=None, chat=True),
        messages=messages,
        add_generation_prompt=f.boolean("add_generation_prompt", True),
        continue_final_message=f.boolean("continue_final_message"),
        chat_template_kwargs=kwargs,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
    )


def parse_completion_request(body: Any) -> CompletionRequest:
    f = JsonObject(body)
    prompt = f.get("prompt", (str, list))
    if prompt is None or prompt == "" or prompt == []:
        raise bad_request("'prompt' must be a non-empty string, list of strings or token ids", param="prompt")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise bad_request("'prompt' must be a string, a list of strings, or token id lists", param="prompt")
    if f.get("suffix", (str,)):
        raise bad_request("'suffix' is not supported", param="suffix")
    return CompletionRequest(**_common(f, default_max_tokens=16, chat=False), prompts=prompts)


def flatten_text_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Refuse image parts (text-only model); leave the rest for the chat template."""
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                kind = part.get("type")
                if kind in ("image_url", "image", "input_image", "image_embeds"):
                    raise bad_request("this model accepts text only: image content parts are not supported", param="messages")
                if kind not in ("text", "input_text"):
                    raise bad_request(f"content part type {kind!r} is not supported", param="messages")
                if not isinstance(part.get("text"), str):
                    raise bad_request("text content parts need a string 'text'", param="messages")
    return messages


