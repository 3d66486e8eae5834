"""Render a model's Jinja chat template the way transformers does, in a sandbox.

Templates come from model files, so they are untrusted code: they run in jinja2's
ImmutableSandboxedEnvironment with the same helpers HF provides (`raise_exception`,
`strftime_now`, a non-escaping `tojson`, loop controls, a no-op `{% generation %}` tag).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.meta
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidRequestError, ModelLoadError

ContentFormat = Literal["string", "openai"]

# Markers that close a turn in common template families. The first one a template
# writes is its end-of-turn token, which must stop generation like EOS does.
_END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|END_OF_TURN_TOKEN|>")

# What a template may raise while rendering a request's messages: all of it is the
# request not fitting the template (HTTP 400), e.g. a list where a string was expected.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError)


def _cut_after_final_message(text: str, final: Mapping[str, Any]) -> str:
    """`text` up to the end of the final message's text, wherever the template put it (its last
    occurrence), so that whatever the template writes after it (the end of the turn) is dropped."""
    content = final.get("content")
    if isinstance(content, list):  # its last text part
        content = next((p.get("text") for p in reversed(content) if isinstance(p, Mapping) and isinstance(p.get("text"), str)), None)
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequestError("continue_final_message needs a final message with text to continue")
    at = text.rfind(content.strip())
    if at < 0:
        raise InvalidRequestError("continue_final_message: the chat template does not write the final message's text as given")
    # Keep the message's own trailing whitespace where the template kept it too.
    kept = content.lstrip()
    end = at + (len(kept) if text.startswith(kept, at) else len(content.strip()))
    return text[:end]


class ChatTemplate:
    """One compiled chat template. Thread-safe: rendering shares no mutable state."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str | None] | None = None) -> None:
        """`special_tokens` (bos_token, eos_token, ...) are passed to every render, as HF does."""
        self.source = source
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        env = _make_environment()
        try:
            self._template = env.from_string(source)
            ast = env.parse(source)
            self.content_format: ContentFormat = _detect_content_format(ast)
            # Whether the template renders a request's `tools` itself (it reads the variable).
            self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(ast)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"chat template does not compile: {e} (line {e.lineno})") from e

    @property
    def end_of_turn_token(self) -> str | None:
        """The marker this template ends a turn with (e.g. '<|im_end|>'), if it uses a known one."""
        found = [(self.source.find(m), m) for m in _END_OF_TURN_MARKERS if m in self.source]
        return min(found)[1] if found else None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        image_placeholder: str | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages`. Any template failure is an InvalidRequestError.

        `continue_final_message`: the text ends right after the last message's text, its turn left
        open (no end-of-turn marker), so that the model continues it (a prefilled reply).

        `image_placeholder` (multimodal models only): `{"type": "image"}` parts are allowed; 'openai'
        templates render them themselves, 'string' ones get the placeholder, one line per image, before
        the message's text (as vLLM places them)."""
        prepared = [self._prepare_message(m, image_placeholder) for m in messages]
        context = {**self._special_tokens, **extra}
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true")
        try:
            text = self._template.render(
                messages=prepared, tools=tools, add_generation_prompt=add_generation_prompt, **context
            )
        except _RENDER_ERRORS as e:
            raise InvalidRequestError(f"chat template error: {e}") from e
        return _cut_after_final_message(text, messages[-1]) if continue_final_message and messages else text

    def _prepare_message(self, message: Mapping[str, Any], image_placeholder: str | None) -> dict[str, Any]:
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"a chat message must be an object, got {type(message).__name__}")
        # Like HF: drop null fields (OpenAI sends content=None beside tool_calls); many
        # templates test for a key's presence and would print "None".
        out = {k: v for k, v in message.items() if v is not None}
        content = out.get("content")
        if isinstance(content, list):
            _check_parts(content, allow_images=image_placeholder is not None)
            # NOTE: a string content stays a string even for 'openai' templates, as in HF:
            # their templates test `content is string`, and published ones are tested so.
            if self.content_format == "string":
                images = [image_placeholder for part in content if part.get("type") == "image"]
                texts = [str(part.get("text", "")) for part in content if part.get("type") == "text"]
                out["content"] = "\n".join([*images, *texts])
        return out


def _check_parts(parts: list[Any], *, allow_images: bool) -> None:
    allowed = ("text", "image") if allow_images else ("text",)
    for part in parts:
        if not isinstance(part, Mapping) or part.get("type") not in allowed:
            # Image parts need the model's image placeholder, which only a multimodal model defines;
            # callers turn image_url parts into {"type": "image"} once the image is accepted.
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequestError(f"content part of type {kind!r} is not supported by this model")


def _detect_content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    """'openai' if the template loops over a message's content (expects a list of parts).

    Only a loop directly over `x.content` / `x['content']` (maybe through filters, or via a
    variable set to it) counts; `x.content.split(...)` is string handling.
    """
    content_vars = {
        a.target.name
        for a in ast.find_all(jinja2.nodes.Assign)
        if isinstance(a.target, jinja2.nodes.Name) and _is_content(a.node)
    }
    for loop in ast.find_all(jinja2.nodes.For):
        node = loop.iter
        while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
            node = node.node
        if _is_content(node) or (isinstance(node, jinja2.nodes.Name) and node.name in content_vars):
            return "openai"
    return "string"


def _is_content(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return False


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    HF; for serving it renders its body unchanged (templates using it must still compile)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's override: jinja's own tojson HTML-escapes '<', '>' and '&', which changes prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
