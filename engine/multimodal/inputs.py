"""A request's images: preprocessed pixels, their content hash, and where their placeholders sit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from engine.errors import InvalidRequestError
from engine.multimodal.config import MultiModalConfig
from engine.multimodal.image_processor import preprocess_image
from media.hashing import media_hash


@dataclass(frozen=True, eq=False)  # eq=False: identity, never an elementwise tensor comparison
class ProcessedImage:
    mm_hash: str  # hash of the decoded image: the prefix-cache and encoder-cache key
    pixel_values: torch.Tensor  # [3, H, W] float32


@dataclass(frozen=True, eq=False)
class MultiModalItem:
    """One image of a prompt: its features replace the placeholder tokens at [offset, offset + length)."""

    mm_hash: str
    offset: int
    length: int
    pixel_values: torch.Tensor  # [3, H, W] float32, on the CPU

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


@dataclass(frozen=True)
class MultiModalPrompt:
    token_ids: list[int]
    items: tuple[MultiModalItem, ...]


def process_image(image: Image.Image, config: MultiModalConfig, mm_hash: str | None = None) -> ProcessedImage:
    """Preprocess one decoded image, and hash it unless its media_hash is given. CPU-bound (NumPy, PIL): call
    it on a thread."""
    pixels = preprocess_image(image, config.image_processor)
    return ProcessedImage(mm_hash if mm_hash is not None else media_hash(image), torch.from_numpy(pixels))


def expand_image_placeholders(
    token_ids: Sequence[int], images: Sequence[ProcessedImage], config: MultiModalConfig
) -> MultiModalPrompt:
    """Each image token of the rendered prompt becomes num_image_tokens of them, in image order."""
    image_token, n = config.image_token_id, config.num_image_tokens
    found = sum(1 for t in token_ids if t == image_token)
    if found != len(images):
        raise InvalidRequestError(f"the prompt has {found} image placeholders for {len(images)} images")
    out: list[int] = []
    items: list[MultiModalItem] = []
    for t in token_ids:
        if t == image_token:
            image = images[len(items)]
            items.append(MultiModalItem(image.mm_hash, len(out), n, image.pixel_values))
            out.extend([image_token] * n)
        else:
            out.append(t)
    return MultiModalPrompt(out, tuple(items))


def check_multimodal_prompt(
    token_ids: Sequence[int], items: Sequence[MultiModalItem], config: MultiModalConfig | None
) -> None:
    """Every placeholder token belongs to exactly one image and every image fills its placeholders.

    A placeholder without an image would feed the model a token it was never trained to read."""
    if config is None:
        if items:
            raise InvalidRequestError("this model accepts text only: the request carries images")
        return
    image_token, size = config.image_token_id, config.vision.image_size
    covered = 0
    for i, item in enumerate(items):
        if item.length != config.num_image_tokens or item.offset < covered or item.end > len(token_ids):
            raise InvalidRequestError(f"image {i}: its placeholders do not fit the prompt")
        if any(t != image_token for t in token_ids[item.offset : item.end]):
            raise InvalidRequestError(f"image {i}: its placeholder range holds other tokens")
        if tuple(item.pixel_values.shape) != (config.vision.num_channels, size, size):
            raise InvalidRequestError(f"image {i}: pixel values must be [3, {size}, {size}]")
        covered = item.end
    found = sum(1 for t in token_ids if t == image_token)
    if found != len(items) * config.num_image_tokens:
        raise InvalidRequestError(
            f"the prompt has {found} image placeholder tokens; its {len(items)} image(s) fill "
            f"{len(items) * config.num_image_tokens}"
        )
