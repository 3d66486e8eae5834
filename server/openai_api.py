"""OpenAI-compatible routes: chat completions, completions, models."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import orjson
from aiohttp import web

from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError, QueueFullError, ZenserveError
from engine.multimodal.chat import split_image_parts
from engine.multimodal.config import MultiModalConfig
from engine.multimodal.inputs import (
    MultiModalItem,
    MultiModalPrompt,
    ProcessedImage,
    expand_image_placeholders,
    process_image,
)
from engine.outputs import RequestOutput
from engine.tokenizer import Tokenizer
from engine.worker.base import TokenLogprobs
from media import HashedImage
from server.errors import ApiError, bad_request, internal_error, not_found, overloaded
from server.generation import GenerationRun
from server.protocol import (
    ChatRequest,
    GenerationRequest,
    flatten_text_content,
    parse_chat_request,
    parse_completion_request,
)
from server.sse import SSEWriter
from server.tool_calls import FORMATS, ToolCallFormat, default_format, prepare_messages
from server.state import CLIENT_CLOSED, STATE, ServerState, get_state

log = logging.getLogger(__name__)
routes = web.RouteTableDef()


async def read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        limit = request.app[STATE].config.max_body_bytes
        raise ApiError(413, f"the request body is larger than {limit} bytes", "RequestTooLarge") from e
    except web.RequestPayloadError as e:  # e.g. a body sent as gzip that does not inflate
        # The rest of the body is unreadable: end it here, so that aiohttp does not read on into the
        # same error after the response (and log it as unhandled), and close the connection.
        request.content.feed_eof()
        error = bad_request(f"the request body cannot be read: {e}")
        error.close_connection = True
        raise error from e
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise not_found(f"The model `{model}` does not exist.", param="model", code="model_not_found")


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    room = max_model_len - prompt_len
    if room < 1 or (requested is not None and requested > room):
        asked = prompt_len + (requested or 1)
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{asked} tokens ({prompt_len} in the messages, {requested or 1} in the completion). "
            "Please reduce the length of the messages or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested if requested is not None else room


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    state = get_state(request)
    engine = state.require_engine()
    card = {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "zenserve",
        "root": str(engine.core.loaded.source),
        "parent": None,
        "max_model_len": engine.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]}, dumps=_dumps)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    engine = state.require_engine()
    req = parse_chat_request(await read_json(request))
    check_model(state, req.model)
    mm_config = engine.core.loaded.arch.multimodal
    tool_format, req = _plan_tools(state, engine, req)
    if mm_config is None:
        messages, image_urls, placeholder = flatten_text_content(req.messages), [], None
    else:
        messages, image_urls, placeholder = _split_images(engine, req.messages, mm_config)
    takes_tools = engine.tokenizer.chat_template_takes_tools
    if not takes_tools:
        # Earlier calls and results as text; the tools and their format in a system message where calls are asked for.
        fmt = tool_format or FORMATS[_tool_format_name(state, engine)]()
        messages = prepare_messages(messages, req.tools if tool_format is not None else [], fmt, takes_tools)
    try:
        text = engine.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=req.tools if takes_tools else None,
            image_placeholder=placeholder,
            **(req.chat_template_kwargs or {}),
        )
    except InvalidRequestError as e:
        raise bad_request(str(e), param="messages") from e
    prompt_ids = await engine.encode(text, add_special_tokens=False)
    # echo: the last message's content leads the reply when it is the assistant's own (vLLM's rule)
    last = req.messages[-1]
    echo = [_message_text(last)] if req.echo and last.get("role") == "assistant" else None
    if mm_config is None:
        return await _respond(request, state, req, [prompt_ids], "chat", echo=echo, tool_format=tool_format)
    prompt = await _with_images(state, engine, req, prompt_ids, image_urls, mm_config)
    return await _respond(request, state, req, [prompt.token_ids], "chat", prompt.items, echo=echo,
                          tool_format=tool_format)


def _tool_format_name(state: ServerState, engine: AsyncEngine) -> str:
    return state.config.tool_call_parser or default_format(engine.core.loaded.arch.architecture)


def _plan_tools(state: ServerState, engine: AsyncEngine, req: ChatRequest) -> tuple[ToolCallFormat | None, ChatRequest]:
    """The format tool calls are parsed in (None: the request's tools call nothing), and the request with the
    grammar that "required" and a named tool_choice put on its output."""
    choice = req.tool_choice
    mode = choice.mode
    if mode == "default":
        mode = "auto" if state.config.enable_auto_tool_choice and req.tools else "none"
    if mode == "none":
        return None, req
    if mode == "auto" and not state.config.enable_auto_tool_choice:
        raise bad_request('"auto" tool choice requires the server to run with --enable-auto-tool-choice',
                          param="tool_choice")
    fmt = FORMATS[_tool_format_name(state, engine)]()
    if mode == "auto":
        return fmt, req
    if req.sampling.get("structured_output") is not None:
        raise bad_request("a required or named tool_choice constrains the output already: it cannot be combined "
                          "with response_format or structured outputs", param="tool_choice")
    tools = req.tools or []
    if mode == "function":
        tools = [t for t in tools if t["function"]["name"] == choice.function]
    constraint = fmt.grammar(tools, parallel=req.parallel_tool_calls and mode == "required")
    return fmt, dataclasses.replace(req, sampling={**req.sampling, "structured_output": constraint})


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part.get("text"), str))
    return content if isinstance(content, str) else ""


def _split_images(
    engine: AsyncEngine, messages: list[dict], mm_config: MultiModalConfig
) -> tuple[list[dict], list[str], str]:
    """Messages for the template ({"type": "image"} parts), the image URLs, the placeholder text."""
    placeholder = engine.tokenizer.convert_ids_to_tokens([mm_config.image_token_id])[0]
    if placeholder is None:
        raise bad_request("this model's tokenizer has no image token", param="messages")
    try:
        split = split_image_parts(messages)
    except InvalidRequestError as e:
        raise bad_request(str(e), param="messages") from e
    return split.messages, split.image_urls, placeholder


async def _with_images(
    state: ServerState, engine: AsyncEngine, req: ChatRequest, prompt_ids: list[int], urls: list[str],
    mm_config: MultiModalConfig,
) -> MultiModalPrompt:
    """Fetch and hash (in the decode processes), preprocess (on a media thread), then expand the placeholders.

    Placeholder count and context length are checked first, so a hopeless request fetches nothing."""
    found = sum(1 for t in prompt_ids if t == mm_config.image_token_id)
    if found != len(urls):
        raise bad_request(f"the prompt has {found} image placeholders for {len(urls)} images", param="messages")
    expanded_len = len(prompt_ids) + len(urls) * (mm_config.num_image_tokens - 1)
    resolve_max_tokens(req.max_tokens, expanded_len, engine.max_model_len)
    if not urls:
        return MultiModalPrompt(prompt_ids, ())
    media = state.media
    assert media is not None

    async def fetch(index: int, url: str):
        try:
            return await media.fetch_hashed_image_async(url)
        except ValueError as e:  # every MediaError: the URL or the image is at fault
            raise bad_request(f"image {index}: {e}", param="messages") from None

    try:
        async with asyncio.TaskGroup() as group:  # the first failed fetch cancels the others
            fetches = [group.create_task(fetch(i, url)) for i, url in enumerate(urls)]
    except ExceptionGroup as eg:
        refused = eg.subgroup(ApiError)
        if refused is None:
            raise
        raise _first_leaf(refused) from None
    images = [f.result() for f in fetches]
    processed = await media.run_on_media_thread(_process_images, images, mm_config)
    try:
        return expand_image_placeholders(prompt_ids, processed, mm_config)
    except InvalidRequestError as e:
        raise bad_request(str(e), param="messages") from e


def _process_images(images: list[HashedImage], mm_config: MultiModalConfig) -> list[ProcessedImage]:
    return [process_image(hashed.image, mm_config, hashed.mm_hash) for hashed in images]


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    engine = state.require_engine()
    req = parse_completion_request(await read_json(request))
    check_model(state, req.model)
    if req.echo and req.logprobs is not None:
        raise bad_request("'echo' with 'logprobs' is not supported: zenserve returns no prompt logprobs", param="echo")
    prompts = [p if isinstance(p, list) else await engine.encode(p) for p in req.prompts]
    echo = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in req.prompts] if req.echo else None
    return await _respond(request, state, req, prompts, "completion", echo=echo)


async def _respond(
    request: web.Request, state: ServerState, req: GenerationRequest, prompts: list[list[int]], kind: str,
    mm_items: tuple[MultiModalItem, ...] = (), echo: list[str] | None = None, tool_format: ToolCallFormat | None = None,
) -> web.StreamResponse:
    """`echo`: per prompt, the text that leads each of its choices (the `echo` option), or None. `tool_format`:
    the chat choices' tool calls are parsed in it."""
    engine = state.require_engine()
    max_tokens = min(resolve_max_tokens(req.max_tokens, len(p), engine.max_model_len) for p in prompts)
    if any(not p for p in prompts):
        raise bad_request("the prompt is empty", param="prompt")
    params = req.sampling_params(max_tokens)
    run = GenerationRun(engine, state.metrics, prompts, params, req.kv_transfer_params, mm_items, req.cache_salt)
    response_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + run.request_id
    created = int(time.time())
    formatter = _ChatFormat(engine.tokenizer, tool_format) if kind == "chat" else _CompletionFormat(engine.tokenizer)
    # choice index -> its echoed text
    echoed = {p * params.n + i: text for p, text in enumerate(echo or ()) for i in range(params.n) if text}
    outputs = run.outputs()
    try:
        try:
            # Pull the first delta before answering, so bad input still gets a plain 400.
            first = await anext(outputs)
        except InvalidRequestError as e:
            raise bad_request(str(e), param=getattr(e, "param", None)) from e
        except QueueFullError as e:
            raise overloaded(str(e)) from e
        except StopAsyncIteration:
            first = None

        head = {"id": response_id, "created": created, "model": state.model_name}
        if req.stream:
            return await _stream(request, req, run, outputs, first, formatter, head, len(prompts) * params.n, echoed)
        choices: dict[int, dict] = {i: _new_choice(i, text) for i, text in echoed.items()}
        pending = [first] if first is not None else []
        for index, out in pending:
            _accumulate(choices, index, out)
        async for index, out in outputs:
            _accumulate(choices, index, out)
        body = {
            **head,
            "object": formatter.object_name,
            "choices": [formatter.finish_choice(choices[i]) for i in sorted(choices)],
            "usage": run.usage.body(),
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")
    finally:
        await outputs.aclose()  # a cancelled handler (the client went away) aborts what is unfinished now


async def _stream(request, req, run, outputs, first, formatter, head, num_choices, echoed) -> web.StreamResponse:
    sse = SSEWriter(request)
    await sse.start()
    chunk_head = {**head, "object": formatter.chunk_object_name}
    try:
        try:
            to_echo = dict(echoed)  # chat's go in the role deltas; completions' lead the first text
            if formatter.sends_role:
                for i in range(num_choices):
                    await sse.send({**chunk_head, "choices": [formatter.role_delta(i, to_echo.pop(i, ""))]})
            items = [first] if first is not None else []
            for index, out in items:
                await sse.send(_chunk(chunk_head, formatter, index, out, req, run, to_echo.pop(index, "")))
            async for index, out in outputs:
                await sse.send(_chunk(chunk_head, formatter, index, out, req, run, to_echo.pop(index, "")))
            if req.stream_options.include_usage:
                await sse.send({**chunk_head, "choices": [], "usage": run.usage.body()})
        except (InvalidRequestError, QueueFullError) as e:
            await sse.send(bad_request(str(e)).body())
        except ZenserveError as e:
            # The engine failed this request after its stream began (a failed step, a stopped loop): the
            # error goes out as the last event, then [DONE], so the client is not left waiting on an open stream.
            log.error("engine error mid-stream on %s: %s", request.path, e)
            await sse.send(overloaded(str(e)).body())
        except ConnectionResetError:
            raise  # the client went away: handled below, not an error of ours
        except Exception:
            log.exception("unexpected error mid-stream on %s", request.path)
            await sse.send(internal_error().body())
        await sse.done()
    except ConnectionResetError:
        # The client went away mid-stream: an ordinary end, not a server error (no traceback; the
        # HTTP metrics count it as 499, nginx's "client closed request").
        request[CLIENT_CLOSED] = True
    return sse.response


def _new_choice(index: int, text: str = "") -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}


def _accumulate(choices: dict[int, dict], index: int, out: RequestOutput) -> None:
    c = choices.setdefault(index, _new_choice(index))
    c["text"] += out.text
    if out.logprobs is not None:
        c["logprobs"] = (c["logprobs"] or []) + out.logprobs
    if out.finished:
        c["finish_reason"], c["stop_reason"] = out.finish_reason, out.stop_reason


def _chunk(chunk_head, formatter, index: int, out: RequestOutput, req, run, echo: str = "") -> dict:
    chunk = {**chunk_head, "choices": [formatter.delta_choice(index, out, echo)]}
    if req.stream_options.include_usage and req.stream_options.continuous_usage_stats:
        chunk["usage"] = run.usage.body()
    return chunk


class _ChatFormat:
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    sends_role = True

    def __init__(self, tokenizer: Tokenizer, tool_format: ToolCallFormat | None = None):
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        # Streamed choices whose text may hold tool calls: held until the choice ends, then parsed.
        self._held: dict[int, str] = {}

    def role_delta(self, index: int, echo: str = "") -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": echo}, "logprobs": None, "finish_reason": None}

    def delta_choice(self, index: int, out: RequestOutput, echo: str = "") -> dict:  # chat echoes in role_delta
        delta: dict[str, Any] = {"content": out.text} if out.text or not out.finished else {}
        finish_reason = out.finish_reason
        if self.tool_format is not None:
            # Tool calls are parsed from the whole text: it is sent when the choice ends, its calls in OpenAI's
            # incremental shape (index, id, name and the arguments once each).
            self._held[index] = self._held.get(index, "") + out.text
            delta = {}
            if out.finished:
                content, calls = self.tool_format.parse(self._held.pop(index))
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = [c.body(i) for i, c in enumerate(calls)]
                    finish_reason = _tool_calls_finish(finish_reason)
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(out.logprobs),
            "finish_reason": finish_reason,
        }
        if out.finished:
            choice["stop_reason"] = out.stop_reason
        return choice

    def finish_choice(self, c: dict) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": c["text"]}
        finish_reason = c["finish_reason"]
        if self.tool_format is not None:
            content, calls = self.tool_format.parse(c["text"])
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": [call.body() for call in calls]}
                finish_reason = _tool_calls_finish(finish_reason)
        return {
            "index": c["index"],
            "message": message,
            "logprobs": self._logprobs(c["logprobs"]),
            "finish_reason": finish_reason,
            "stop_reason": c["stop_reason"],
        }

    def _logprobs(self, lps: list[TokenLogprobs] | None) -> dict | None:
        if lps is None:
            return None
        return {
            "content": [
                {
                    **self._token(lp.token_id, lp.logprob),
                    "top_logprobs": [self._token(t, v) for t, v in lp.top],
                }
                for lp in lps
            ]
        }

    def _token(self, token_id: int, logprob: float) -> dict:
        raw = self.tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": max(logprob, -9999.0), "bytes": list(raw)}


def _tool_calls_finish(finish_reason: str | None) -> str | None:
    """OpenAI's finish_reason for a choice that called tools; one cut short by max_tokens stays "length"."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


class _CompletionFormat:
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    sends_role = False

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def delta_choice(self, index: int, out: RequestOutput, echo: str = "") -> dict:
        return {
            "index": index,
            "text": echo + out.text,
            "logprobs": self._logprobs(out.logprobs),
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason if out.finished else None,
        }

    def finish_choice(self, c: dict) -> dict:
        return {
            "index": c["index"],
            "text": c["text"],
            "logprobs": self._logprobs(c["logprobs"]),
            "finish_reason": c["finish_reason"],
            "stop_reason": c["stop_reason"],
        }

    def _logprobs(self, lps: list[TokenLogprobs] | None) -> dict | None:
        if lps is None:
            return None
        tokens = [self.tokenizer.token_bytes(lp.token_id).decode("utf-8", errors="replace") for lp in lps]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [
                {self.tokenizer.token_bytes(t).decode("utf-8", errors="replace"): v for t, v in lp.top} for lp in lps
            ],
            "text_offset": offsets,
        }


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


