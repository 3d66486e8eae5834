"""Rotary position embeddings with Hugging Face's rope_scaling variants."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engine.config import ModelArchConfig
from engine.errors import UnsupportedModelError


def rope_inv_freq(arch: ModelArchConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32) and the attention scaling factor for cos/sin."""
    dim = arch.head_dim
    # On the CPU whatever the default device: a model built on the meta device computes its tables here
    # and moves them (math on meta tensors runs decompositions that import torch._dynamo, +118 MB).
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = arch.rope_scaling
    kind = scaling.rope_type
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "llama3":
        original = scaling.original_max_position_embeddings or arch.max_position_embeddings
        low_wavelen = original / scaling.low_freq_factor
        high_wavelen = original / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (original / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported")


def rope_cos_sin(arch: ModelArchConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, head_dim] in float32, halves duplicated (rotate_half layout)."""
    inv_freq, attention_scaling = rope_inv_freq(arch)
    t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
    freqs = torch.outer(t, inv_freq)  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, 1, D] in x's dtype, or with a kernel (the worker's in-place rotation,
    engine/kernels) float32 [T, D] rows, which it rotates x by in place."""
    if kernel is not None:
        return kernel(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
