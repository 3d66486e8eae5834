"""Chat with images over HTTP against a small random LLaVA: data, file and http URLs, the prefix cache
across requests, and a 400 (OpenAI error shape) for every bad image, URL or part."""

from __future__ import annotations

import base64
import io

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from PIL import Image

from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core import EngineCore
from engine.model_loader import load_model
from engine.multimodal.inputs import MultiModalPrompt, expand_image_placeholders, process_image
from media import encode_image_url
from server.app import create_app
from server.config import ServerConfig
from tests.engine.test_llava_parity import BLOCK, IMAGE_TOKEN, build_tiny_llava, hf_greedy, make_image

transformers = pytest.importorskip("transformers")

# A LLaVA-style template: it loops over the parts and writes the placeholder for each image part.
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>\n{% elif p['type'] == 'text' %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "What is shown in this picture?"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava"), "clip-llama", chat_template=PARTS_TEMPLATE)


@pytest.fixture(scope="module")
def loaded(tiny):
    return load_model(ModelConfig(model=str(tiny.path), dtype="float32"))


@pytest.fixture
async def make_vlm_client(loaded):
    started: list[tuple[TestClient, AsyncEngine]] = []

    async def make(**server) -> TestClient:
        config = EngineConfig(
            model=ModelConfig(dtype="float32"),
            cache=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=2 * 1024 * 1024),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8),  # images span several steps
            worker="eager",
        )
        engine = AsyncEngine(EngineCore(config, loaded))
        engine.start()
        client = TestClient(TestServer(create_app(ServerConfig(**server), engine=engine), host="127.0.0.1"))
        await client.start_server()
        started.append((client, engine))
        return client

    yield make
    for client, engine in started:
        await client.close()
        await engine.shutdown()


def image_message(*urls: str, text: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def body(messages: list[dict], **extra) -> dict:
    return {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra}


def expected_prompt(loaded, images: list[Image.Image]) -> MultiModalPrompt:
    """The prompt the server should build for image_message(*images)."""
    messages = [{"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": QUESTION}]}]
    text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, image_placeholder=IMAGE_TOKEN)
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    mm = loaded.arch.multimodal
    return expand_image_placeholders(ids, [process_image(im, mm) for im in images], mm)


def expected_completion(tiny, loaded, images: list[Image.Image]) -> tuple[str, int]:
    """transformers' greedy continuation of the same chat, and the prompt's length in tokens."""
    prompt = expected_prompt(loaded, images)
    return loaded.tokenizer.decode(hf_greedy(tiny, prompt, images, 4)), len(prompt.token_ids)


async def assert_400(resp, match: str) -> dict:
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert error["type"] == "BadRequestError" and error["code"] in (400, "context_length_exceeded")
    assert match in error["message"], error["message"]
    return error


async def test_chat_with_a_data_url_image_matches_transformers(make_vlm_client, tiny, loaded):
    client = await make_vlm_client()
    image = make_image(1)
    resp = await client.post("/v1/chat/completions", json=body(image_message(encode_image_url(image))))
    assert resp.status == 200, await resp.text()
    data = await resp.json()
    text, prompt_len = expected_completion(tiny, loaded, [image])
    assert data["choices"][0]["message"]["content"] == text
    assert data["usage"]["prompt_tokens"] == prompt_len  # the image counts as its 16 placeholder tokens
    assert data["usage"]["completion_tokens"] == 4


async def test_n_samples_share_the_image(make_vlm_client, tiny, loaded):
    client = await make_vlm_client()
    image = make_image(8)
    resp = await client.post("/v1/chat/completions", json=body(image_message(encode_image_url(image)), n=2))
    assert resp.status == 200, await resp.text()
    expected = expected_completion(tiny, loaded, [image])[0]
    assert [c["message"]["content"] for c in (await resp.json())["choices"]] == [expected, expected]


async def test_same_image_is_cached_and_another_is_not(make_vlm_client, loaded):
    client = await make_vlm_client()
    first, other = make_image(1), make_image(2)

    async def usage(image: Image.Image) -> dict:
        resp = await client.post("/v1/chat/completions", json=body(image_message(encode_image_url(image))))
        assert resp.status == 200, await resp.text()
        return (await resp.json())["usage"]

    cold = await usage(first)
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    n = cold["prompt_tokens"]
    # Other bytes (another PNG encoding), the same pixels: the same image. All of the prompt but the block
    # holding its last token is cached, the image's blocks included.
    png = io.BytesIO()
    first.save(png, format="PNG", compress_level=9)
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    resp = await client.post("/v1/chat/completions", json=body(image_message(url)))
    warm = (await resp.json())["usage"]
    (item,) = expected_prompt(loaded, [first]).items
    assert warm["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BLOCK * BLOCK >= item.end
    # Another image, the same tokens: only the blocks before the image.
    miss = await usage(other)
    assert miss["prompt_tokens_details"]["cached_tokens"] == item.offset // BLOCK * BLOCK


async def test_streaming_chat_with_an_image(make_vlm_client, tiny, loaded):
    client = await make_vlm_client()
    image = make_image(3, (40, 60))
    resp = await client.post("/v1/chat/completions", json=body(image_message(encode_image_url(image)), stream=True))
    assert resp.status == 200
    raw = await resp.text()
    chunks = [orjson.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected_completion(tiny, loaded, [image])[0]


async def test_file_and_http_urls(make_vlm_client, tiny, loaded, tmp_path):
    image = make_image(4)
    image.save(tmp_path / "cat.png")
    expected = expected_completion(tiny, loaded, [image])[0]

    async def serve_png(request: web.Request) -> web.Response:
        return web.Response(body=(tmp_path / "cat.png").read_bytes(), content_type="image/png")

    media_app = web.Application()
    media_app.router.add_get("/cat.png", serve_png)
    media_server = TestServer(media_app, host="127.0.0.1")
    await media_server.start_server()
    try:
        client = await make_vlm_client(allowed_local_media_path=str(tmp_path), allow_private_media_addresses=True)
        for url in (f"file://{tmp_path / 'cat.png'}", str(media_server.make_url("/cat.png"))):
            resp = await client.post("/v1/chat/completions", json=body(image_message(url)))
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["choices"][0]["message"]["content"] == expected
    finally:
        await media_server.close()


async def test_two_images_in_one_message(make_vlm_client, tiny, loaded):
    client = await make_vlm_client()
    images = [make_image(5), make_image(6, (64, 32))]
    resp = await client.post("/v1/chat/completions", json=body(image_message(*map(encode_image_url, images))))
    assert resp.status == 200, await resp.text()
    text, prompt_len = expected_completion(tiny, loaded, images)
    data = await resp.json()
    assert data["choices"][0]["message"]["content"] == text
    assert data["usage"]["prompt_tokens"] == prompt_len


@pytest.mark.parametrize(
    "url, match",
    [
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not a readable image"),  # valid base64, not an image
        ("data:image/png;base64,!!!", "not valid base64"),
        ("data:text/plain;base64,aGVsbG8=", "image/*"),
        ("ftp://example.com/cat.png", "http(s), data or file"),
        ("file:///etc/passwd", "file: URLs are disabled"),
        ("http://127.0.0.1:9/cat.png", "loopback address"),  # SSRF: refused before any connection
        ("http://169.254.169.254/latest/meta-data", "metadata address"),
    ],
)
async def test_bad_images_and_urls_are_400(make_vlm_client, url, match):
    client = await make_vlm_client()
    resp = await client.post("/v1/chat/completions", json=body(image_message(url)))
    error = await assert_400(resp, match)
    assert error["param"] == "messages"


async def test_truncated_image_is_400(make_vlm_client):
    client = await make_vlm_client()
    png = io.BytesIO()
    make_image(7, (64, 64)).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()[:-200]).decode()
    await assert_400(await client.post("/v1/chat/completions", json=body(image_message(url))), "truncated or corrupt")


@pytest.mark.parametrize(
    "content, match",
    [
        ([{"type": "image_url"}], "string 'url'"),
        ([{"type": "image_url", "image_url": {"url": 5}}], "string 'url'"),
        ([{"type": "input_audio", "input_audio": {}}], "'input_audio' is not supported"),
        ([{"type": "text", "text": f"two {IMAGE_TOKEN} placeholders"}], "1 image placeholders for 0 images"),
    ],
)
async def test_bad_parts_are_400(make_vlm_client, content, match):
    client = await make_vlm_client()
    await assert_400(await client.post("/v1/chat/completions", json=body([{"role": "user", "content": content}])), match)


async def test_literal_placeholder_beside_an_image_is_400(make_vlm_client):
    client = await make_vlm_client()
    messages = image_message(encode_image_url(make_image(1)), text=f"and {IMAGE_TOKEN} too")
    await assert_400(await client.post("/v1/chat/completions", json=body(messages)), "2 image placeholders for 1 images")


async def test_too_many_images_for_the_context_is_400_before_fetching(make_vlm_client):
    client = await make_vlm_client()
    # 20 images x 16 tokens overflow the 256-token context; the unreachable URLs are never fetched.
    messages = image_message(*[f"http://example.invalid/{i}.png" for i in range(20)])
    error = await assert_400(await client.post("/v1/chat/completions", json=body(messages)), "maximum context length")
    assert error["code"] == "context_length_exceeded"


async def test_completion_prompt_with_a_bare_placeholder_is_400(make_vlm_client):
    client = await make_vlm_client()
    resp = await client.post("/v1/completions", json={"prompt": f"look: {IMAGE_TOKEN}", "max_tokens": 2})
    await assert_400(resp, "placeholder tokens")


async def test_text_only_chat_still_works(make_vlm_client):
    client = await make_vlm_client()
    resp = await client.post("/v1/chat/completions", json=body([{"role": "user", "content": QUESTION}]))
    assert resp.status == 200, await resp.text()


async def test_text_only_model_refuses_image_parts(make_client):
    client = await make_client()
    resp = await client.post("/v1/chat/completions", json=body(image_message(encode_image_url(make_image(1)))))
    await assert_400(resp, "accepts text only")
