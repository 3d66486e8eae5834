"""The prefix-cache hash chain: hash[i] = H(parent, tokens of block i, extra keys).

Pure functions of plain inputs, so routers (and tests) can recompute every hash.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import NewType

import orjson

BlockHash = NewType("BlockHash", bytes)

# NOTE: a fixed seed (as vLLM's sha256 default) so independent processes agree on hashes,
# which shared filesystem / object-store tiers and routers depend on.
NONE_HASH_SEED = b"vllm-none-hash"
NONE_HASH = BlockHash(hashlib.sha256(NONE_HASH_SEED).digest())


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """SHA-256 over a canonical serialization of (parent, token ids, extra keys).

    Canonical: parent digest, token count, tokens as little-endian uint32, then the extra keys
    as JSON (orjson sorts nothing it isn't given; callers pass tuples in a fixed order).
    """
    h = hashlib.sha256()
    h.update(parent if parent is not None else NONE_HASH)
    tokens = array("I", token_ids)  # 4 bytes on every platform CPython supports
    if sys.byteorder == "big":
        tokens.byteswap()
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(tokens.tobytes())
    if extra_keys:
        h.update(orjson.dumps(extra_keys))
    return BlockHash(h.digest())


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    existing: Sequence[BlockHash] = (),
    extra_keys: tuple | None = None,
    first_block_salt: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` not yet in `existing` (chained onto its last).
    `first_block_salt` (a request's cache_salt) joins block 0's extra keys, after the others: every
    later hash chains on it, so only requests with the same salt share any prefix."""
    new: list[BlockHash] = []
    parent = existing[-1] if existing else None
    for start in range(len(existing) * block_size, len(token_ids) - block_size + 1, block_size):
        keys = salted_extra_keys(extra_keys, first_block_salt) if start == 0 else extra_keys
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], keys)
        new.append(parent)
    return new


def salted_extra_keys(extra_keys: tuple | None, cache_salt: str | None) -> tuple | None:
    """Block 0's extra keys with the request's cache_salt last (vLLM's order)."""
    if cache_salt is None:
        return extra_keys
    return (*(extra_keys or ()), cache_salt)


def block_hash_to_int(block_hash: bytes) -> int:
    """The 64-bit int routers expect in KV events: the digest read big-endian, low 64 bits
    (vLLM's int-hash form)."""
    return int.from_bytes(block_hash[-8:], "big")
