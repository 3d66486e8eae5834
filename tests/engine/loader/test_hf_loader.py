"""HF directory loading: config.json → ModelArchConfig, sharded safetensors → named tensors."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.config import ModelArchConfig, RopeScaling
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loader.hf_loader import iter_hf_weights, read_hf_arch

transformers = pytest.importorskip("transformers")

_TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024, rms_norm_eps=1e-6,
)


def _save_tiny(tmp_path: Path, model_type: str, **overrides) -> tuple[Path, torch.nn.Module]:
    config = transformers.AutoConfig.for_model(model_type, **(_TINY | overrides))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at 1 and biases at 0: randomize so mix-ups show
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model_dir = tmp_path / model_type
    # 40 KB shards: the 64 KB embedding gets its own shard, layers spread over several more.
    model.save_pretrained(model_dir, safe_serialization=True, max_shard_size="40KB")
    return model_dir, model


def _expected_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict, less lm_head.weight when it is the embedding itself."""
    state = model.state_dict()
    if model.lm_head.weight is model.model.embed_tokens.weight:
        del state["lm_head.weight"]
    return state


def _tiny_arch(architecture: str, **changes) -> ModelArchConfig:
    """The ModelArchConfig of _TINY, with `changes`."""
    base = ModelArchConfig(
        architecture=architecture, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=1024, tie_word_embeddings=False,
    )
    return replace(base, **changes)


def _write_config(model_dir: Path, **config) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(_TINY | config))
    return model_dir


def test_llama_sharded_checkpoint(tmp_path):
    model_dir, model = _save_tiny(tmp_path, "llama")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really sharded
    assert read_hf_arch(model_dir) == _tiny_arch("LlamaForCausalLM")
    weights = dict(iter_hf_weights(model_dir, torch.float32))
    expected = _expected_weights(model)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_qwen2_tied_checkpoint_has_no_lm_head(tmp_path):
    model_dir, model = _save_tiny(tmp_path, "qwen2", tie_word_embeddings=True, rope_theta=1e6)
    assert read_hf_arch(model_dir) == _tiny_arch(
        "Qwen2ForCausalLM", tie_word_embeddings=True, attention_bias=True, rope_theta=1e6
    )
    weights = dict(iter_hf_weights(model_dir, torch.float32))
    assert "lm_head.weight" not in weights
    assert "model.layers.0.self_attn.q_proj.bias" in weights
    expected = _expected_weights(model)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_qwen3_checkpoint_has_qk_norm_and_config_head_dim(tmp_path):
    model_dir, model = _save_tiny(tmp_path, "qwen3", head_dim=32)
    assert read_hf_arch(model_dir) == _tiny_arch("Qwen3ForCausalLM", qk_norm=True, head_dim=32)
    weights = dict(iter_hf_weights(model_dir, torch.bfloat16))
    assert weights["model.layers.1.self_attn.k_norm.weight"].shape == (32,)
    expected = _expected_weights(model)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.bfloat16
        assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name


def test_only_files_listed_in_the_index_are_read(tmp_path):
    model_dir, model = _save_tiny(tmp_path, "llama")
    save_file({"stale.weight": torch.zeros(2)}, model_dir / "consolidated.safetensors")
    names = {name for name, _ in iter_hf_weights(model_dir, torch.float32)}
    assert "stale.weight" not in names and names == _expected_weights(model).keys()


def test_unsharded_directory_without_index(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    save_file({"model.norm.weight": torch.arange(4.0)}, model_dir / "model.safetensors")
    assert [(n, t.tolist()) for n, t in iter_hf_weights(model_dir, torch.float32)] == [
        ("model.norm.weight", [0.0, 1.0, 2.0, 3.0])
    ]


def test_rotary_inv_freq_buffers_are_dropped(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    save_file(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8), "model.norm.weight": torch.ones(4)},
        model_dir / "model.safetensors",
    )
    assert [n for n, _ in iter_hf_weights(model_dir, torch.float32)] == ["model.norm.weight"]


def test_no_safetensors_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="safetensors"):
        list(iter_hf_weights(tmp_path, torch.float32))


def test_corrupt_safetensors_is_a_load_error_naming_the_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        list(iter_hf_weights(tmp_path, torch.float32))


def test_index_naming_a_missing_shard_is_a_load_error(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ModelLoadError, match="gone.safetensors"):
        list(iter_hf_weights(tmp_path, torch.float32))


# --- config.json variants, no weights needed ---


def test_mistral_sliding_window(tmp_path):
    arch = read_hf_arch(_write_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=4096))
    assert arch.architecture == "MistralForCausalLM" and arch.sliding_window == 4096


def test_qwen2_sliding_window_only_when_enabled(tmp_path):
    base = dict(architectures=["Qwen2ForCausalLM"], sliding_window=4096, max_window_layers=0)
    assert read_hf_arch(_write_config(tmp_path / "off", **base, use_sliding_window=False)).sliding_window is None
    assert read_hf_arch(_write_config(tmp_path / "on", **base, use_sliding_window=True)).sliding_window == 4096
    # transformers ≥ 5 states it per layer
    on_v5 = _write_config(tmp_path / "v5", **base, use_sliding_window=True, layer_types=["full_attention"] * 2)
    assert read_hf_arch(on_v5).sliding_window is None


def test_qwen2_sliding_window_on_some_layers_is_unsupported(tmp_path):
    model_dir = _write_config(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=4096,
                              use_sliding_window=True, max_window_layers=1)
    with pytest.raises(UnsupportedModelError, match="some layers"):
        read_hf_arch(model_dir)


def test_llama_never_has_a_sliding_window(tmp_path):
    model_dir = _write_config(tmp_path, architectures=["LlamaForCausalLM"], sliding_window=16)
    assert read_hf_arch(model_dir).sliding_window is None


def test_legacy_rope_theta_and_rope_scaling(tmp_path):
    model_dir = _write_config(tmp_path, architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                              rope_scaling={"type": "linear", "factor": 2.0})
    arch = read_hf_arch(model_dir)
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)


def test_transformers_v5_rope_parameters_llama3(tmp_path):
    config = transformers.LlamaConfig(**_TINY, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512, "rope_theta": 500000.0,
    })
    config.save_pretrained(tmp_path)
    arch = read_hf_arch(tmp_path)
    assert arch.architecture == "LlamaForCausalLM"  # from model_type: config-only saves have no architectures
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=512
    )


def test_unknown_architecture_is_unsupported(tmp_path):
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        read_hf_arch(_write_config(tmp_path, architectures=["GPT2LMHeadModel"]))


def test_llama_with_attention_bias_is_unsupported(tmp_path):
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        read_hf_arch(_write_config(tmp_path, architectures=["LlamaForCausalLM"], attention_bias=True))


def test_missing_or_broken_config_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        read_hf_arch(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ModelLoadError, match="config.json"):
        read_hf_arch(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        read_hf_arch(tmp_path)
