"""Parity with Hugging Face transformers: the embedded GGUF and random-weight HF checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from engine.attention import build_attention_metadata
from engine.config import ModelConfig
from engine.kv_cache_spec import make_kv_cache_layout
from engine.model_loader import load_model
from engine.request import SamplingParams
from engine.worker.cpu import CPUWorker

transformers = pytest.importorskip("transformers")

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to five."}],
    [{"role": "user", "content": "Write a haiku about the sea. 🌊"}],
    [{"role": "user", "content": "def fib(n):\n    # complete this"}],
]


def prefill_logits(loaded, token_ids: list[int]) -> torch.Tensor:
    """All-position logits of one prefill through zenserve's paged attention path."""
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 16 * 1024 * 1024)
    worker = CPUWorker(loaded.model, layout, loaded.dtype)
    num_blocks = -(-len(token_ids) // 16)
    meta, positions = build_attention_metadata(
        [], [(list(range(num_blocks)), 0, len(token_ids))], 16, None, torch.device("cpu")
    )
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(token_ids), positions, worker.kv_caches, meta)
        return loaded.model.compute_logits(hidden)


@pytest.fixture(scope="module")
def hf_smollm(smollm_fp32):
    path = smollm_fp32.source
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def chat_ids(loaded, messages) -> list[int]:
    text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return loaded.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_embedded_gguf_logits_match_transformers(smollm_fp32, hf_smollm):
    for messages in CHATS:
        ids = chat_ids(smollm_fp32, messages)
        mine = prefill_logits(smollm_fp32, ids)
        with torch.inference_mode():
            ref = hf_smollm(torch.tensor([ids])).logits[0].float()
        assert torch.allclose(mine, ref, atol=2e-3, rtol=1e-4), (mine - ref).abs().max()


@pytest.mark.slow
def test_embedded_gguf_greedy_32_tokens_match_transformers(smollm_fp32, hf_smollm, make_llm):
    llm = make_llm()
    prompts = [chat_ids(smollm_fp32, m) for m in CHATS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = llm.generate(prompts, params)
    for ids, result in zip(prompts, results):
        assert result.samples[0].token_ids == hf_greedy(hf_smollm, ids, 32)


def hf_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """Plain greedy decoding with transformers' KV cache, EOS not special (like ignore_eos)."""
    out_ids: list[int] = []
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(num_tokens):
            token = int(out.logits[0, -1].argmax())
            out_ids.append(token)
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids


def _tiny_config(kind: str):
    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=kind != "llama",
    )
    if kind == "llama":
        return transformers.LlamaConfig(
            **common, rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.Qwen3Config(**common, head_dim=32)


@pytest.fixture(scope="module")
def hf_tokenizer_files(tmp_path_factory, smollm_fp32):
    """SmolLM2's tokenizer saved as HF files, reused by the tiny random checkpoints."""
    path = smollm_fp32.source
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    out = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_random_hf_checkpoints_match_transformers(kind, tmp_path, hf_tokenizer_files):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_tiny_config(kind)).eval()
    with torch.no_grad():  # random, not zero, biases and norms so their loading matters
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.5, 0.2)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="200KB")
    for f in hf_tokenizer_files.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert (tmp_path / "model.safetensors.index.json").exists()

    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32"))
    assert loaded.arch.architecture == hf.config.architectures[0]
    ids = [1, 504, 3458, 314, 253, 1345, 28, 2365, 30, 4, 17, 7000, 25, 99] * 6  # 84 tokens
    mine = prefill_logits(loaded, ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (mine - ref).abs().max()


@pytest.mark.slow
def test_bfloat16_tracks_float32_closely(smollm_fp32):
    bf16 = load_model(ModelConfig(dtype="bfloat16"))
    ids = chat_ids(smollm_fp32, CHATS[0])
    ref = prefill_logits(smollm_fp32, ids)
    mine = prefill_logits(bf16, ids)
    # bf16 keeps 8 bits of mantissa (logits near 30 move in steps of 0.125): the stated tolerance
    # is a mean error under 0.5, no logit off by more than 3, and the same top token almost everywhere.
    diff = (mine - ref).abs()
    assert diff.mean() < 0.5 and diff.max() < 3.0, (diff.mean(), diff.max())
    agree = (mine.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree > 0.9
