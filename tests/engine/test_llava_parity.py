"""LLaVA parity with transformers on small random-weight checkpoints this module builds and saves:
pixel values, logits (whole prompt and chunked prefill split inside the image), greedy decoding, and
prefix caching keyed by the image's content."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engine.attention import build_attention_metadata
from engine.block_hash import hash_full_blocks
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core import EngineCore
from engine.errors import InvalidRequestError
from engine.kv_cache_spec import make_kv_cache_layout
from engine.model_loader import LoadedModel, load_model
from engine.multimodal.inputs import (
    MultiModalItem,
    MultiModalPrompt,
    expand_image_placeholders,
    process_image,
)
from engine.multimodal.prefix_keys import hash_full_blocks_with_images
from engine.multimodal.worker_inputs import build_inputs_embeds
from engine.request import RequestId, SamplingParams
from engine.scheduler import ScheduledSequence
from engine.worker.cpu import CPUWorker, zentorch_available

transformers = pytest.importorskip("transformers")

IMAGE_TOKEN = "<image>"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "What is shown in this picture? Describe the image in one sentence.",
    "You are a careful assistant who looks closely at images.",
    "The quick brown fox jumps over the lazy dog.",
]
BLOCK = 4  # small blocks: several lie before the image, several over it


@dataclass(frozen=True)
class TinyLlava:
    path: Path
    hf: Any  # transformers LlavaForConditionalGeneration, float32, eval
    image_processor: Any  # the transformers image processor saved beside it


def build_tiny_llava(path: Path, kind: str = "clip-llama", chat_template: str = CHATML) -> TinyLlava:
    """A random LLaVA saved as transformers saves it, with a byte-level BPE tokenizer trained on the spot.

    clip-llama: CLIP tower (32 px, 8 px patches, 3 layers, feature layer -2, CLS dropped: 16 image tokens),
    Llama text model. siglip-qwen2: SigLIP tower (all 16 patches of the last layer), tied Qwen2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", IMAGE_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": chat_template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    image_token_id = tok.token_to_id(IMAGE_TOKEN)

    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    vision = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, image_size=32, patch_size=8)
    if kind == "clip-llama":
        config = transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(**vision, num_hidden_layers=3),
            text_config=transformers.LlamaConfig(**text, tie_word_embeddings=False),
            image_token_id=image_token_id, vision_feature_layer=-2, vision_feature_select_strategy="default",
        )
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    elif kind == "siglip-qwen2":
        config = transformers.LlavaConfig(
            vision_config=transformers.SiglipVisionConfig(**vision, num_hidden_layers=2),
            text_config=transformers.Qwen2Config(**text, tie_word_embeddings=True),
            image_token_id=image_token_id, vision_feature_layer=-1, vision_feature_select_strategy="full",
            tie_word_embeddings=True,
        )
        processor = transformers.SiglipImageProcessor(size={"height": 32, "width": 32})
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    hf = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias") or "class_embedding" in name:
                p.normal_(0.5, 0.2)  # random, not 0/1, so that loading each of them matters
            elif p.dim() >= 2:
                # Unit-gain weights (the default 0.02 makes the image all but invisible at later tokens:
                # two different images moved the last logits by 3e-4, under what a parity check can see).
                p.normal_(0.0, p[0].numel() ** -0.5)
    hf.save_pretrained(path)
    processor.save_pretrained(path)
    return TinyLlava(path, hf, processor)


def make_image(seed: int, size: tuple[int, int] = (45, 37), mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, size=(size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def chat_prompt(loaded: LoadedModel, images: list[Image.Image], question: str = "What is shown in this picture?"):
    """Render with the model's template, tokenize, expand the placeholders: what the server does."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    messages = [{"role": "system", "content": "You are a careful assistant."}, {"role": "user", "content": content}]
    text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, image_placeholder=IMAGE_TOKEN)
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    mm = loaded.arch.multimodal
    return text, expand_image_placeholders(ids, [process_image(im, mm) for im in images], mm)


def hf_pixels(tiny: TinyLlava, image: Image.Image) -> torch.Tensor:
    return tiny.image_processor(images=image, return_tensors="pt").pixel_values[0]


def hf_logits(tiny: TinyLlava, prompt: MultiModalPrompt, images: list[Image.Image]) -> torch.Tensor:
    pixel_values = torch.stack([hf_pixels(tiny, im) for im in images])
    with torch.inference_mode():
        return tiny.hf(input_ids=torch.tensor([prompt.token_ids]), pixel_values=pixel_values).logits[0]


def zen_logits(loaded: LoadedModel, prompt: MultiModalPrompt, chunks: list[int]) -> torch.Tensor:
    """All-position logits through the worker's path (paged KV, image embeddings), one chunk per step."""
    assert sum(chunks) == len(prompt.token_ids)
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 4 * 1024 * 1024)
    worker = CPUWorker(loaded.model, layout, loaded.dtype)
    block_ids = tuple(range(-(-len(prompt.token_ids) // 16)))
    rows, start = [], 0
    for n in chunks:
        seq = ScheduledSequence(
            RequestId("r/0"), tuple(prompt.token_ids[start : start + n]), start, block_ids,
            needs_sample=start + n == len(prompt.token_ids),
            mm_items=tuple(i for i in prompt.items if i.overlaps(start, start + n)),
        )
        meta, positions = build_attention_metadata([], [(list(block_ids), start, n)], 16, None, torch.device("cpu"))
        with torch.inference_mode():
            input_ids = torch.tensor(seq.token_ids)
            embeds = build_inputs_embeds(loaded.model, [seq], input_ids)
            hidden = loaded.model(input_ids, positions, worker.kv_caches, meta, inputs_embeds=embeds)
            rows.append(loaded.model.compute_logits(hidden))
        start += n
    return torch.cat(rows)


@pytest.fixture(scope="module", params=["clip-llama", "siglip-qwen2"])
def tiny(request, tmp_path_factory) -> TinyLlava:
    return build_tiny_llava(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def loaded(tiny) -> LoadedModel:
    return load_model(ModelConfig(model=str(tiny.path), dtype="float32"))


def make_core(loaded: LoadedModel, max_num_batched_tokens: int = 256, worker: str = "eager") -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=2 * 1024 * 1024, kv_cache_dtype="model"),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens),
        worker=worker,
    )
    return EngineCore(config, loaded)


PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)


def run(core: EngineCore, rid: str, prompt: MultiModalPrompt, params: SamplingParams = PARAMS):
    """Run one request to the end; (token ids, logprobs of each token, num_cached_tokens)."""
    core.add_request(rid, prompt.token_ids, params, mm_items=prompt.items)
    tokens, logprobs, cached = [], [], 0
    while core.has_unfinished():
        for out in core.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            logprobs += out.logprobs or []
            cached = out.num_cached_tokens
    return tokens, logprobs, cached


def assert_first_logprobs_match(logprobs, ref_last_logits: torch.Tensor) -> None:
    ref = torch.log_softmax(ref_last_logits.float(), -1)
    first = logprobs[0]
    assert first.token_id == int(ref.argmax())
    for token_id, lp in first.top:
        assert abs(lp - float(ref[token_id])) < 1e-4, (token_id, lp, float(ref[token_id]))


# ---- preprocessing and prompt expansion ---------------------------------------------------------------------


def test_pixel_values_equal_transformers_processor(tiny, loaded):
    palette = Image.fromarray(np.arange(40 * 40, dtype=np.uint8).reshape(40, 40) % 7, "P")
    palette.putpalette([(i * 37) % 256 for i in range(256 * 3)])
    palette.info["transparency"] = 3
    images = [
        make_image(1),  # non-square: resize (bicubic), then crop
        make_image(2, (30, 50), "RGBA"),  # alpha composited onto white
        make_image(3, (64, 64), "L"),
        palette,
        make_image(4, (32, 32)),  # already the tower's size
        make_image(5, (400, 9)),  # extreme aspect ratio
    ]
    for image in images:
        mine = process_image(image, loaded.arch.multimodal).pixel_values
        ref = hf_pixels(tiny, image)
        assert mine.dtype == torch.float32 and mine.shape == ref.shape
        assert torch.equal(mine, ref), (image.mode, image.size, (mine - ref).abs().max())


def test_placeholders_expand_like_the_llava_processor(tiny, loaded):
    image = make_image(1)
    text, prompt = chat_prompt(loaded, [image])
    mm = loaded.arch.multimodal
    assert mm.num_image_tokens == 16  # (32 / 8)^2 patches; CLIP's CLS is dropped by "default"
    (item,) = prompt.items
    assert prompt.token_ids[item.offset : item.end] == [mm.image_token_id] * 16
    assert prompt.token_ids.count(mm.image_token_id) == 16
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny.path / "tokenizer.json"))
    vision = tiny.hf.config.vision_config
    processor = transformers.LlavaProcessor(
        image_processor=tiny.image_processor, tokenizer=hf_tok, patch_size=vision.patch_size,
        vision_feature_select_strategy=tiny.hf.config.vision_feature_select_strategy,
        num_additional_image_tokens=1 if vision.model_type == "clip_vision_model" else 0, image_token=IMAGE_TOKEN,
    )
    ref = processor(text=text, images=[image], return_tensors="pt")
    assert ref["input_ids"][0].tolist() == prompt.token_ids
    assert torch.equal(ref["pixel_values"][0], item.pixel_values)


def test_placeholder_count_must_match_images(loaded):
    mm = loaded.arch.multimodal
    image = process_image(make_image(1), mm)
    with pytest.raises(InvalidRequestError, match="1 image placeholders for 2 images"):
        expand_image_placeholders([5, mm.image_token_id, 6], [image, image], mm)
    core = make_core(loaded)
    ok = expand_image_placeholders([5, mm.image_token_id, 6], [image], mm)
    with pytest.raises(InvalidRequestError, match="placeholder tokens"):  # image tokens but no image
        core.add_request("bare", [5, mm.image_token_id, 6], PARAMS)
    with pytest.raises(InvalidRequestError, match="placeholder"):  # an item off its placeholders
        shifted = MultiModalItem(ok.items[0].mm_hash, 0, 16, ok.items[0].pixel_values)
        core.add_request("shifted", ok.token_ids, PARAMS, mm_items=[shifted])


# ---- logits --------------------------------------------------------------------------------------------------


def test_logits_match_transformers_with_one_image(tiny, loaded):
    image = make_image(1)
    _, prompt = chat_prompt(loaded, [image])
    ref = hf_logits(tiny, prompt, [image])
    mine = zen_logits(loaded, prompt, [len(prompt.token_ids)])
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (mine - ref).abs().max()


def test_chunked_prefill_splitting_the_image_matches(tiny, loaded):
    image = make_image(1)
    _, prompt = chat_prompt(loaded, [image])
    (item,) = prompt.items
    # The first chunk ends 5 tokens into the image, the second 5 tokens before its end.
    chunks = [item.offset + 5, item.length - 10, 5 + 3]
    chunks.append(len(prompt.token_ids) - sum(chunks))
    ref = hf_logits(tiny, prompt, [image])
    cache = loaded.model.encoder_cache
    encoded = cache.num_encoded
    mine = zen_logits(loaded, prompt, chunks)
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (mine - ref).abs().max()
    assert cache.num_encoded == encoded + 1  # encoded once, at the first chunk; later chunks read the cache
    assert item.mm_hash not in cache  # dropped once a chunk reached the image's end


def test_two_images_match_transformers(tiny, loaded):
    images = [make_image(1), make_image(7, (50, 60))]
    _, prompt = chat_prompt(loaded, images)
    assert [i.offset for i in prompt.items][1] == prompt.items[0].end + 1  # "<image>\n<image>"
    ref = hf_logits(tiny, prompt, images)
    mine = zen_logits(loaded, prompt, [len(prompt.token_ids)])
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (mine - ref).abs().max()


# ---- the engine: greedy decoding, chunking and the prefix cache ----------------------------------------------


def hf_greedy(tiny: TinyLlava, prompt: MultiModalPrompt, images: list[Image.Image], num_tokens: int) -> list[int]:
    pixel_values = torch.stack([hf_pixels(tiny, im) for im in images])
    ids = list(prompt.token_ids)
    with torch.inference_mode():
        for _ in range(num_tokens):  # no KV cache: a full forward per token (the model is tiny)
            logits = tiny.hf(input_ids=torch.tensor([ids]), pixel_values=pixel_values).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt.token_ids) :]


@pytest.mark.parametrize("budget", [256, 7])  # 7 tokens a step: the image spreads over three steps
def test_engine_greedy_matches_transformers(tiny, loaded, budget):
    image = make_image(1)
    _, prompt = chat_prompt(loaded, [image])
    tokens, logprobs, _ = run(make_core(loaded, budget), "g", prompt)
    assert tokens == hf_greedy(tiny, prompt, [image], 4)
    assert_first_logprobs_match(logprobs, hf_logits(tiny, prompt, [image])[-1])


@pytest.mark.skipif(not zentorch_available(), reason="zentorch is not installed")
def test_the_zentorch_worker_serves_a_llava_model(tiny):
    # The worker replaces the text model's projections and lm_head: a copy of its own.
    loaded = load_model(ModelConfig(model=str(tiny.path), dtype="float32"))
    image = make_image(1)
    _, prompt = chat_prompt(loaded, [image])
    core = make_core(loaded, worker="zentorch")
    assert core.worker.name == "zentorch"
    tokens, logprobs, _ = run(core, "z", prompt)
    assert tokens == hf_greedy(tiny, prompt, [image], 4)
    assert_first_logprobs_match(logprobs, hf_logits(tiny, prompt, [image])[-1])


def test_same_image_hits_the_prefix_cache_and_another_does_not(tiny, loaded):
    core = make_core(loaded)
    cat, dog = make_image(1), make_image(2)  # same size, different pixels
    _, first = chat_prompt(loaded, [cat])
    _, again = chat_prompt(loaded, [cat])
    _, other = chat_prompt(loaded, [dog])
    assert first.token_ids == again.token_ids == other.token_ids
    (item,) = first.items
    n = len(first.token_ids)
    cache = loaded.model.encoder_cache

    run(core, "first", first)
    encoded = cache.num_encoded
    _, again_lp, again_cached = run(core, "again", again)
    # Every full block but the one holding the last prompt token: the image's blocks included.
    assert again_cached == (n - 1) // BLOCK * BLOCK >= item.end
    assert cache.num_encoded == encoded  # all of the image came from the cache: the tower did not run

    _, other_lp, other_cached = run(core, "other", other)
    assert other_cached == item.offset // BLOCK * BLOCK  # only the blocks before the image
    assert cache.num_encoded == encoded + 1
    assert_first_logprobs_match(again_lp, hf_logits(tiny, first, [cat])[-1])
    assert_first_logprobs_match(other_lp, hf_logits(tiny, other, [dog])[-1])


def test_prefix_hit_that_ends_inside_the_image(tiny, loaded):
    """An aborted request published the blocks of its first chunk, which ends mid-image: the next request
    starts computing inside the image and takes the rest of the image's features."""
    image = make_image(3, (40, 40))
    _, prompt = chat_prompt(loaded, [image])
    (item,) = prompt.items
    first_chunk = item.offset + 8
    core = make_core(loaded, max_num_batched_tokens=first_chunk)
    core.add_request("aborted", prompt.token_ids, PARAMS, mm_items=prompt.items)
    assert core.step() == []  # one prefill chunk, nothing sampled yet
    core.abort("aborted")
    hit = first_chunk // BLOCK * BLOCK
    assert item.offset < hit < item.end
    cache = loaded.model.encoder_cache
    cache.clear()  # the aborted request's features are gone too: the tower runs again, for a slice
    encoded = cache.num_encoded

    tokens, logprobs, cached = run(core, "resumed", prompt)
    assert cached == hit
    assert cache.num_encoded == encoded + 1
    assert tokens == hf_greedy(tiny, prompt, [image], 4)
    assert_first_logprobs_match(logprobs, hf_logits(tiny, prompt, [image])[-1])


# ---- block hashes ----------------------------------------------------------------------------------------------


def _item(mm_hash: str, offset: int, length: int) -> MultiModalItem:
    return MultiModalItem(mm_hash, offset, length, torch.zeros(3, 2, 2))


def test_image_keys_change_only_the_blocks_over_the_image():
    tokens = list(range(10)) + [99] * 8 + list(range(10))  # 28 tokens: 7 blocks of 4, the image at 10..18
    text_only = hash_full_blocks(tokens, 4)
    a = hash_full_blocks_with_images(tokens, 4, [], [_item("a", 10, 8)])
    b = hash_full_blocks_with_images(tokens, 4, [], [_item("b", 10, 8)])
    assert a[:2] == b[:2] == text_only[:2]  # blocks 0-1 end before the image
    assert all(x != y for x, y in zip(a[2:], b[2:]))  # block 2 holds the image's start; the chain carries it on
    assert a == hash_full_blocks_with_images(tokens, 4, [], [_item("a", 10, 8)])  # deterministic
    # The same image at another position inside a block is another key.
    shifted = [5] + tokens[:-1]
    assert hash_full_blocks_with_images(shifted, 4, [], [_item("a", 11, 8)])[2] != a[2]
    # Extending a chain continues it exactly.
    assert hash_full_blocks_with_images(tokens, 4, a[:3], [_item("a", 10, 8)]) == a[3:]


def test_preempted_request_recomputes_its_image(tiny, loaded):
    """Two requests whose prompts fit together but whose outputs do not: the newer is preempted (blocks
    freed, prefix cache off so nothing survives) and recomputed from scratch, image included."""
    images = [make_image(11), make_image(12)]
    prompts = [chat_prompt(loaded, [im])[1] for im in images]
    num_blocks = 2 * -(-len(prompts[0].token_ids) // BLOCK) + 1  # both prompts, and one block to grow
    block_bytes = make_kv_cache_layout(loaded.arch, BLOCK, loaded.dtype, 1 << 20).groups[0].spec.page_size_bytes
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(
            block_size=BLOCK, enable_prefix_caching=False, kv_cache_dtype="model",
            kv_cache_memory_bytes=num_blocks * block_bytes * loaded.arch.num_hidden_layers,
        ),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        worker="eager",
    )
    core = EngineCore(config, loaded)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt.token_ids, params, mm_items=prompt.items)
    tokens: dict[str, list[int]] = {"r0": [], "r1": []}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    assert core.scheduler.num_preemptions > 0
    for i, (prompt, image) in enumerate(zip(prompts, images)):
        assert tokens[f"r{i}"] == hf_greedy(tiny, prompt, [image], 8)


def _rename_checkpoint(src: Path, dst: Path, rename) -> None:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({rename(k): v for k, v in load_file(f).items()}, dst / f.name)
        else:
            (dst / f.name).write_bytes(f.read_bytes())


@pytest.mark.parametrize(
    "layout",
    [
        # transformers 4.52-4.57: everything under model., lm_head at the top
        lambda k: ("lm_head." + k.removeprefix("language_model.lm_head.")) if k.startswith("language_model.lm_head.")
        else "model." + k.replace("language_model.model.", "language_model.", 1),
        # transformers < 4.52 (llava-hf checkpoints): the tower nested in vision_model
        lambda k: k.replace("vision_tower.", "vision_tower.vision_model.", 1),
    ],
    ids=["model-prefixed", "vision_model-nested"],
)
def test_other_checkpoint_layouts_load_the_same(tiny, loaded, layout, tmp_path):
    _rename_checkpoint(tiny.path, tmp_path / "renamed", layout)
    other = load_model(ModelConfig(model=str(tmp_path / "renamed"), dtype="float32"))
    mine, theirs = dict(loaded.model.state_dict()), dict(other.model.state_dict())
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_config_problems_are_load_errors(tiny, tmp_path):
    from engine.errors import ModelLoadError, UnsupportedModelError
    from engine.loader.hf_loader import read_hf_arch

    config = json.loads((tiny.path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="preprocessor_config.json: missing"):
        read_hf_arch(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text((tiny.path / "preprocessor_config.json").read_text())
    assert read_hf_arch(tmp_path).multimodal.num_image_tokens == 16
    bad_tower = config | {"vision_config": config["vision_config"] | {"model_type": "pixtral"}}
    (tmp_path / "config.json").write_text(json.dumps(bad_tower))
    with pytest.raises(UnsupportedModelError, match="vision tower 'pixtral'"):
        read_hf_arch(tmp_path)
    bad_size = config | {"vision_config": config["vision_config"] | {"image_size": 64}}
    (tmp_path / "config.json").write_text(json.dumps(bad_size))
    with pytest.raises(UnsupportedModelError, match="the vision tower takes 64x64"):
        read_hf_arch(tmp_path)
