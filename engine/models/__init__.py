"""Model architectures by Hugging Face architecture name."""

from __future__ import annotations

from torch import nn

from engine.config import ModelArchConfig
from engine.errors import UnsupportedModelError
from engine.loader.weights_mapper import WeightsMapper
from engine.models.llama import LlamaForCausalLM
from engine.models.llava import LLAVA_WEIGHTS_MAPPER, LlavaForConditionalGeneration

# Mistral and Qwen2/3 are Llama with flags (sliding window, qkv bias, q/k norm) in ModelArchConfig.
_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
}


def create_model(arch: ModelArchConfig, max_positions: int) -> nn.Module:
    cls = _ARCHITECTURES.get(arch.architecture)
    if cls is None:
        raise UnsupportedModelError(
            f"architecture {arch.architecture!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    return cls(arch, max_positions)


def hf_weights_mapper(arch: ModelArchConfig) -> WeightsMapper | None:
    """The safetensors name mapper of an architecture whose checkpoints nest their parts; None: the default."""
    return LLAVA_WEIGHTS_MAPPER if arch.architecture == "LlavaForConditionalGeneration" else None
