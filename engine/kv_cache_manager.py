"""The scheduler's only door to the block pool: prefix hits, slot allocation, freeing."""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_hash import BlockHash, hash_full_blocks
from engine.block_pool import BlockPool, KVCacheBlock
from engine.multimodal.prefix_keys import hash_full_blocks_with_images, request_block_extra_keys
from engine.request import Request


@dataclass(frozen=True)
class PrefixHit:
    blocks: tuple[KVCacheBlock, ...]
    num_tokens: int


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_caching: bool = True, compute_hashes: bool = False,
                 publish_generated: bool = False):
        """`publish_generated`: blocks holding generated tokens join the prefix cache too. Their K/V came from
        decode steps, whose paths (packed weights, decode attention) sum in another order than a prompt's, so
        a later prompt that hit them would compute other tokens than one that did not: only where every step
        runs the prompt's paths (EngineConfig.batch_invariant) are they published."""
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Offloading keys chunks by block hash even when the engine's own prefix cache is off.
        self.compute_hashes = compute_hashes or enable_caching
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many leading blocks are published
        self.publish_generated = publish_generated
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's hash chain over any tokens that completed a block."""
        if not self.compute_hashes:
            return
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            if request.mm_items:  # blocks over an image also key on the image's content
                new = hash_full_blocks_with_images(
                    request.all_token_ids, self.block_size, request.block_hashes, request.mm_items,
                    request.cache_salt,
                )
            else:
                new = hash_full_blocks(
                    request.all_token_ids, self.block_size, request.block_hashes, first_block_salt=request.cache_salt
                )
            request.block_hashes.extend(new)

    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """Longest run of cached blocks from the start, never covering the last token."""
        if not self.enable_caching:
            return PrefixHit((), 0)
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += len(hit) * self.block_size
        return PrefixHit(tuple(hit), len(hit) * self.block_size)

    def num_blocks_needed(self, request: Request, num_new_tokens: int, hit: PrefixHit | None) -> int:
        have = len(self._blocks.get(request.request_id, ())) + (len(hit.blocks) if hit else 0)
        total_tokens = request.num_computed_tokens + (hit.num_tokens if hit else 0) + num_new_tokens
        return max(0, -(-total_tokens // self.block_size) - have)

    def has_blocks(self, request: Request) -> bool:
        return bool(self._blocks.get(request.request_id))

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None, publish: bool = True
    ) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens (after any prefix hit); None if the pool is short.

        Returns the ids of newly allocated (non-hit) blocks, which the zeroing rule applies to.
        Hit blocks idle in the free queue count against availability, since touching them
        takes them out of it. publish=False: the new blocks are filled by a KV load that is still
        in flight, so they join the prefix cache only when the request is next scheduled.
        """
        num_new_blocks = self.num_blocks_needed(request, num_new_tokens, hit)
        hit_blocks = hit.blocks if hit else ()
        if num_new_blocks == 0 and not hit_blocks and request.request_id in self._blocks:
            # Most decode steps: the last block has room, the block list stands as it is.
            if publish:
                self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
            return []
        num_idle_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_idle_hits > self.pool.num_free_blocks:
            return None
        blocks = self._blocks.setdefault(request.request_id, [])
        if hit_blocks:
            self.pool.touch(hit_blocks)
            blocks.extend(hit_blocks)
            self._num_cached_blocks[request.request_id] = len(hit_blocks)
        new_blocks = self.pool.allocate(num_new_blocks)
        blocks.extend(new_blocks)
        request.block_ids = [b.block_id for b in blocks]
        if publish:
            self._cache_full_blocks(request, request.num_computed_tokens + (hit.num_tokens if hit else 0) + num_new_tokens)
        return [b.block_id for b in new_blocks]

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        """Publish blocks that this step fills (their KV is written before anyone can hit them,
        since hits are only used by later steps)."""
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        blocks = self._blocks[request.request_id]
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens_after_step // self.block_size, len(request.block_hashes))
        if not self.publish_generated:
            end = min(end, request.num_prompt_tokens // self.block_size)
        if end <= start:
            return
        parent: BlockHash | None = request.block_hashes[start - 1] if start else None
        bs = self.block_size
        extra_keys = None
        if request.mm_items or request.cache_salt is not None:
            extra_keys = [request_block_extra_keys(request.mm_items, request.cache_salt, i * bs, (i + 1) * bs)
                          for i in range(start, end)]
        self.pool.cache_full_blocks(
            blocks[start:end],
            request.block_hashes[start:end],
            request.all_token_ids[start * bs : end * bs],
            bs,
            parent,
            extra_keys,
        )
        self._num_cached_blocks[request.request_id] = end

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (deepest evicted first)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))
        request.block_ids = []

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
