"""Prefix-cache hashes of blocks that hold image placeholders.

Placeholder tokens are the same for every image, so the image's content hash (and where the image starts
relative to the block) joins the block's extra keys: the same image reuses the cache, another never does.
Blocks before the first image hash exactly as text blocks do.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_hash import BlockHash, hash_block_tokens, salted_extra_keys
from engine.multimodal.inputs import MultiModalItem


def block_extra_keys(items: Sequence[MultiModalItem], start: int, end: int) -> tuple | None:
    """(mm_hash, item offset - block start) of each image overlapping tokens [start, end)."""
    keys = tuple((item.mm_hash, item.offset - start) for item in items if item.overlaps(start, end))
    return keys or None


def request_block_extra_keys(
    items: Sequence[MultiModalItem], cache_salt: str | None, start: int, end: int
) -> tuple | None:
    """Everything besides its tokens that keys the block of tokens [start, end) of a request: its
    images' keys, then the cache_salt on block 0 (what KV events report as the block's extra_keys)."""
    keys = block_extra_keys(items, start, end) if items else None
    return salted_extra_keys(keys, cache_salt) if start == 0 else keys


def hash_full_blocks_with_images(
    token_ids: Sequence[int],
    block_size: int,
    existing: Sequence[BlockHash],
    items: Sequence[MultiModalItem],
    first_block_salt: str | None = None,
) -> list[BlockHash]:
    """`hash_full_blocks` with each block's image keys (and the salt on block 0): the keys
    `request_block_extra_keys` gives, so KV events report exactly what was hashed."""
    new: list[BlockHash] = []
    parent = existing[-1] if existing else None
    for start in range(len(existing) * block_size, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        keys = request_block_extra_keys(items, first_block_salt, start, end)
        parent = hash_block_tokens(parent, token_ids[start:end], keys)
        new.append(parent)
    return new
