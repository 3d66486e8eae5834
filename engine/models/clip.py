"""The vision towers of LLaVA-style models: CLIP and SigLIP ViTs, with Hugging Face parameter names
(`embeddings.*`, `pre_layrnorm.*`, `encoder.layers.{i}.*`) so checkpoints load without renaming.

Only what feature extraction needs: no post-layernorm or pooling head (LLaVA reads hidden states).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModelError
from engine.multimodal.config import VisionTowerConfig


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# transformers' ACT2FN names for what vision towers and projectors use.
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
}


def activation(name: str):
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise UnsupportedModelError(f"activation {name!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    return fn


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionTowerConfig):
        super().__init__()
        dim = cfg.hidden_size
        # CLIP's patch conv has no bias and a learned CLS token goes first; SigLIP's conv has a bias, no CLS.
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, dim, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=not cfg.has_class_token
        )
        if cfg.has_class_token:
            self.class_embedding = nn.Parameter(torch.zeros(dim))
        # Given its weight, as LlamaModel's embedding: no normal_() init on the meta device.
        self.position_embedding = nn.Embedding(cfg.num_positions, dim, _weight=torch.empty(cfg.num_positions, dim))
        self.has_class_token = cfg.has_class_token

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, H, W] -> [N, P, D]
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        if self.has_class_token:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionTowerConfig):
        super().__init__()
        dim = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = dim // self.num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, D], full (not causal) attention
        n, p, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, p, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(n, p, d))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionTowerConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionTowerConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionTowerConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class VisionTransformer(nn.Module):
    """CLIPVisionModel / SiglipVisionModel up to the encoder's hidden states."""

    def __init__(self, cfg: VisionTowerConfig):
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg)
        if cfg.kind == "clip":
            self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)  # (sic: HF's name)
        self.encoder = VisionEncoder(cfg)

    def forward(self, pixel_values: torch.Tensor, feature_layers: tuple[int, ...]) -> list[torch.Tensor]:
        """The hidden states at `feature_layers` (0: the embeddings, i: layer i's output), in that order.

        Layers past the deepest one asked for are not run."""
        x = self.embeddings(pixel_values.to(self.embeddings.patch_embedding.weight.dtype))
        if hasattr(self, "pre_layrnorm"):
            x = self.pre_layrnorm(x)
        states = {0: x} if 0 in feature_layers else {}
        for i, layer in enumerate(self.encoder.layers[: max(feature_layers)], start=1):
            x = layer(x)
            if i in feature_layers:
                states[i] = x
        return [states[i] for i in feature_layers]
