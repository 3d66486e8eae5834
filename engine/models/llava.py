"""LLaVA: a CLIP or SigLIP vision tower, a two-layer projector, and a Llama-family text model.

Image features (hidden states of the tower's `feature_layers`, CLS dropped by the "default" strategy,
projected to the text width) replace the embeddings of the image's placeholder tokens; everything else
is the text model's forward pass, paged KV cache included.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.config import ModelArchConfig
from engine.loader.weights_mapper import WeightsMapper
from engine.models.clip import VisionTransformer, activation
from engine.models.llama import LlamaForCausalLM
from engine.multimodal.encoder_cache import EncoderCache

# Checkpoints name the parts three ways: transformers >= 5 saves (and < 4.52 saved) `language_model.model.*`,
# `language_model.lm_head.*`, `vision_tower[.vision_model].*`, `multi_modal_projector.*`; 4.52-4.57 saved
# `model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.*`.
LLAVA_WEIGHTS_MAPPER = (
    WeightsMapper(orig_to_new_prefix={
        "model.language_model.": "language_model.model.",
        "model.vision_tower.": "vision_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "lm_head.": "language_model.lm_head.",
    })
    | WeightsMapper(orig_to_new_prefix={"vision_tower.vision_model.": "vision_tower."})
    # Not used for features: the tower's post-layernorm and SigLIP's pooling head.
    | WeightsMapper(orig_to_new_regex=[
        (r"^vision_tower\.(post_layernorm|head)\.", None),
        (r"\.rotary_emb\.inv_freq$", None),
    ])
)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, hidden_size: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden_size, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, arch: ModelArchConfig, max_positions: int):
        super().__init__()
        mm = arch.multimodal
        if mm is None:
            raise ValueError("LlavaForConditionalGeneration needs arch.multimodal")
        self.mm_config = mm
        self.vision_tower = VisionTransformer(mm.vision)
        self.multi_modal_projector = LlavaMultiModalProjector(
            mm.vision.hidden_size * len(mm.feature_layers), arch.hidden_size, mm.projector_hidden_act, mm.projector_bias
        )
        self.language_model = LlamaForCausalLM(arch, max_positions)
        self.encoder_cache = EncoderCache()

    @property
    def model(self) -> nn.Module:
        """The text decoder (`.layers`, `.embed_tokens`), where workers look for it on Llama models."""
        return self.language_model.model

    def reset_rope(self) -> None:
        self.language_model.reset_rope()

    def fuse_projections(self) -> None:
        self.language_model.fuse_projections()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, num_image_tokens, hidden]: the features that replace the placeholders."""
        states = self.vision_tower(pixel_values, self.mm_config.feature_layers)
        if self.mm_config.feature_strategy == "default":
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, float32)
