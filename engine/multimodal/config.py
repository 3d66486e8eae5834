"""What a LLaVA-style checkpoint states about its image path: tower, feature selection, projector,
preprocessing. Frozen and hashable, so it can sit inside ModelArchConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

VisionKind = Literal["clip", "siglip"]
FeatureStrategy = Literal["default", "full"]  # default: drop the first (CLS) token; full: keep all


@dataclass(frozen=True)
class VisionTowerConfig:
    kind: VisionKind
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def has_class_token(self) -> bool:
        return self.kind == "clip"  # SigLIP has neither a CLS token nor a pre-layernorm

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        return self.num_patches + int(self.has_class_token)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """CLIPImageProcessor / SiglipImageProcessor fields, with their class defaults filled in."""

    do_convert_rgb: bool
    do_resize: bool
    shortest_edge: int | None  # resize the shorter side to this (aspect kept) ...
    resize_height: int | None  # ... or to exactly height x width
    resize_width: int | None
    resample: int  # PIL.Image.Resampling value (3: bicubic)
    do_center_crop: bool
    crop_height: int | None
    crop_width: int | None
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every processed image, or None when it depends on the image."""
        if self.do_center_crop and self.crop_height and self.crop_width:
            return self.crop_height, self.crop_width
        if self.do_resize and self.resize_height and self.resize_width:
            return self.resize_height, self.resize_width
        return None


@dataclass(frozen=True)
class MultiModalConfig:
    image_token_id: int
    vision: VisionTowerConfig
    feature_layers: tuple[int, ...]  # indices into [embeddings, layer 1 out, ..., layer N out], non-negative
    feature_strategy: FeatureStrategy
    projector_hidden_act: str
    projector_bias: bool
    image_processor: ImageProcessorConfig

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (= features) one image takes in the prompt."""
        n = self.vision.num_positions
        return n - 1 if self.feature_strategy == "default" else n
