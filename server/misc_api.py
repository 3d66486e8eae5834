"""Operational routes: health, version, metrics, tokenize and detokenize."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import orjson
from aiohttp import web

from engine.errors import InvalidRequestError
from server.errors import bad_request
from server.openai_api import check_model, read_json
from server.protocol import JsonObject, flatten_text_content, parse_chat_request
from server.state import get_state

routes = web.RouteTableDef()


@routes.get("/health")
@routes.get("/ping")  # SageMaker-style probes, GET or POST: the same answer as /health
@routes.post("/ping")
async def health(request: web.Request) -> web.Response:
    """200 only when the model is loaded and the loop makes progress (not merely alive)."""
    state = get_state(request)
    engine = state.engine
    if engine is None:
        return web.json_response({"status": "loading"}, status=503)
    if not engine.is_making_progress(state.config.health_deadline_s):
        return web.json_response({"status": "engine not making progress"}, status=503)
    return web.Response(status=200)


@routes.get("/version")
async def get_version(request: web.Request) -> web.Response:
    try:
        v = version("zenserve")
    except PackageNotFoundError:  # running from a source tree
        v = "0.0.0+source"
    return web.json_response({"version": v})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    body = get_state(request).metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    state = get_state(request)
    engine = state.require_engine()
    f = JsonObject(await read_json(request))
    check_model(state, f.get("model", (str,)))
    messages = f.get("messages", (list,))
    if messages is not None:
        chat = parse_chat_request({"messages": messages})
        try:
            text = engine.tokenizer.apply_chat_template(
                flatten_text_content(chat.messages),
                add_generation_prompt=f.boolean("add_generation_prompt", True),
                continue_final_message=f.boolean("continue_final_message"),
            )
        except InvalidRequestError as e:
            raise bad_request(str(e), param="messages") from e
        ids = await engine.encode(text, add_special_tokens=f.boolean("add_special_tokens", False))
    else:
        prompt = f.get("prompt", (str,))
        if prompt is None:
            raise bad_request("either 'prompt' or 'messages' is required", param="prompt")
        ids = await engine.encode(prompt, add_special_tokens=f.boolean("add_special_tokens", True))
    body = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}
    if f.boolean("return_token_strs"):
        body["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
    return web.Response(body=orjson.dumps(body), content_type="application/json")


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    state = get_state(request)
    engine = state.require_engine()
    f = JsonObject(await read_json(request))
    check_model(state, f.get("model", (str,)))
    tokens = f.get("tokens", (list,))
    vocab = engine.core.loaded.arch.vocab_size
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
        raise bad_request(f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
    return web.json_response({"prompt": engine.tokenizer.decode(tokens)})
