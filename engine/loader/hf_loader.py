"""Read a Hugging Face model directory: config.json → ModelArchConfig, *.safetensors → named tensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.config import ModelArchConfig, RopeScaling
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loader.weights_mapper import WeightsMapper
from engine.multimodal.hf_config import is_llava_config, read_llava_config

# config.json "model_type" → architecture, for configs saved without an "architectures" list.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Checkpoint names already are the HF names models use; only drop buffers older exports saved.
HF_WEIGHTS_MAPPER = WeightsMapper(orig_to_new_regex=[(r"\.rotary_emb\.inv_freq$", None)])

_INDEX_FILE = "model.safetensors.index.json"


def read_hf_arch(model_dir: str | Path) -> ModelArchConfig:
    config = _read_config(Path(model_dir))
    if is_llava_config(config):
        text_config = config.get("text_config")
        if not isinstance(text_config, dict):
            raise ModelLoadError(f"{model_dir}/config.json has no text_config object")
        text_arch = _text_arch(text_config, model_dir)
        return replace(
            text_arch,
            architecture="LlavaForConditionalGeneration",
            multimodal=read_llava_config(config, Path(model_dir)),
        )
    return _text_arch(config, model_dir)


def _text_arch(config: dict[str, Any], model_dir: str | Path) -> ModelArchConfig:
    architecture = _architecture(config)

    def get(key: str, default: Any = None) -> Any:
        value = config.get(key, default)
        if value is None and default is None:
            raise ModelLoadError(f"{model_dir}/config.json has no {key!r}")
        return value

    if architecture in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM") and config.get("attention_bias"):
        # NOTE: in these classes attention_bias also puts a bias on o_proj, which ModelArchConfig cannot say.
        raise UnsupportedModelError(f"{architecture} with attention_bias=true is not supported")
    if config.get("mlp_bias"):
        raise UnsupportedModelError(f"{architecture} with mlp_bias=true is not supported")
    hidden_size = get("hidden_size")
    num_heads = get("num_attention_heads")
    num_layers = get("num_hidden_layers")
    # transformers ≥ 5 writes rope_parameters (rope_theta inside); older configs rope_theta + rope_scaling.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return ModelArchConfig(
        architecture=architecture,
        vocab_size=get("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or hidden_size // num_heads,
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0),
        max_position_embeddings=get("max_position_embeddings"),
        # transformers' defaults for all four classes; real checkpoints state it.
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=_rope_scaling(rope),
        attention_bias=architecture == "Qwen2ForCausalLM",  # Qwen2 always biases q/k/v; no config flag
        qk_norm=architecture == "Qwen3ForCausalLM",
        sliding_window=_sliding_window(config, architecture, num_layers),
    )


def iter_hf_weights(
    model_dir: str | Path, dtype: torch.dtype, mapper: WeightsMapper | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (model name, tensor in `dtype`) from the directory's safetensors files, file by file.
    `mapper`: the architecture's renaming (None: HF_WEIGHTS_MAPPER)."""
    mapper = mapper or HF_WEIGHTS_MAPPER
    for path in _safetensors_files(Path(model_dir)):
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    name = mapper.map_name(key)
                    if name is not None:
                        yield name, f.get_tensor(key).to(dtype)
        except (OSError, SafetensorError) as e:
            raise ModelLoadError(f"{path}: cannot read safetensors ({e})") from e


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read config ({e})") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return config


def _architecture(config: dict[str, Any]) -> str:
    architectures = config.get("architectures") or []
    if architectures:
        architecture = architectures[0]
        if architecture in _MODEL_TYPES.values():
            return architecture
    else:
        architecture = _MODEL_TYPES.get(config.get("model_type", ""))
        if architecture is not None:
            return architecture
        architecture = f"model_type {config.get('model_type')!r}"
    raise UnsupportedModelError(
        f"architecture {architecture} is not supported (supported: {', '.join(_MODEL_TYPES.values())})"
    )


def _rope_scaling(rope: dict[str, Any]) -> RopeScaling:
    rope_type = rope.get("rope_type") or rope.get("type") or "default"  # "type": pre-4.45 configs
    if rope_type == "default":
        return RopeScaling()
    defaults = RopeScaling()
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rope.get("factor", defaults.factor)),
        low_freq_factor=float(rope.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(rope.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=rope.get("original_max_position_embeddings"),
    )


def _sliding_window(config: dict[str, Any], architecture: str, num_layers: int) -> int | None:
    window = config.get("sliding_window")
    if architecture == "MistralForCausalLM" or window is None:
        return window
    if architecture == "LlamaForCausalLM":
        return None
    # Qwen2/Qwen3: the window applies only with use_sliding_window, and only to the layers listed as
    # sliding in layer_types (transformers ≥ 5) or from max_window_layers on (older configs).
    if not config.get("use_sliding_window"):
        return None
    layer_types = config.get("layer_types") or [
        "sliding_attention" if i >= config.get("max_window_layers", 0) else "full_attention" for i in range(num_layers)
    ]
    if all(t == "full_attention" for t in layer_types):
        return None
    if all(t == "sliding_attention" for t in layer_types):
        return window
    raise UnsupportedModelError(f"{architecture} with sliding window on only some layers is not supported")


def _safetensors_files(model_dir: Path) -> list[Path]:
    index_path = model_dir / _INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index_path}: cannot read index ({e})") from e
        # NOTE: only the files the index names; a directory may also hold stale or consolidated copies.
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index_path} names missing files: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files")
    return files
