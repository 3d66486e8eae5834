"""Model architectures by Hugging Face architecture name."""

from __future__ import annotations

from torch import nn

from engine.config import ModelArchConfig
from engine.errors import UnsupportedModelError
from engine.models.llama import LlamaForCausalLM

# Mistral and Qwen2/3 are Llama with flags (sliding window, qkv bias, q/k norm) in ModelArchConfig.
_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def create_model(arch: ModelArchConfig, max_positions: int) -> nn.Module:
    cls = _ARCHITECTURES.get(arch.architecture)
    if cls is None:
        raise UnsupportedModelError(
            f"architecture {arch.architecture!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    return cls(arch, max_positions)
