"""The worker's image step: encode the images a step's chunks reach and put their features in place
of the placeholder embeddings. Runs on the worker thread, inside `execute`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.multimodal.inputs import MultiModalItem
    from engine.scheduler import ScheduledSequence


def build_inputs_embeds(
    model: torch.nn.Module, seqs: Sequence[ScheduledSequence], input_ids: torch.Tensor
) -> torch.Tensor | None:
    """Input embeddings for a step whose chunks (in row order) cover image placeholders; None otherwise.

    A chunk may start or end inside an image (chunked prefill, a prefix hit mid-image): it takes the slice of
    the image's features that its positions cover.
    """
    if not any(seq.mm_items for seq in seqs):
        return None
    cache = model.encoder_cache
    features: dict[str, torch.Tensor] = {}
    to_encode: dict[str, MultiModalItem] = {}  # by mm_hash: an image twice in a step encodes once
    for seq in seqs:
        for item in seq.mm_items:
            if item.mm_hash in features or item.mm_hash in to_encode:
                continue
            cached = cache.get(item.mm_hash)
            if cached is None:
                to_encode[item.mm_hash] = item
            else:
                features[item.mm_hash] = cached
    if to_encode:
        device = input_ids.device
        pixels = torch.stack([item.pixel_values for item in to_encode.values()]).to(device)
        for mm_hash, image_features in zip(to_encode, model.embed_images(pixels), strict=True):
            features[mm_hash] = image_features
            cache.put(mm_hash, image_features)

    embeds = model.embed_input_ids(input_ids)  # [T, hidden]
    consumed: set[str] = set()
    pending: set[str] = set()  # another chunk of this step stops inside the image: keep it
    row = 0
    for seq in seqs:
        start, end = seq.start_position, seq.context_len
        for item in seq.mm_items:
            lo, hi = max(item.offset, start), min(item.end, end)
            embeds[row + lo - start : row + hi - start] = features[item.mm_hash][lo - item.offset : hi - item.offset]
            (consumed if hi == item.end else pending).add(item.mm_hash)
        row += seq.num_tokens
    for mm_hash in consumed - pending:
        cache.drop(mm_hash)
    return embeds
