"""The one pool of KV blocks: allocation, reference counts, the prefix-cache map, eviction.

Eviction order: a block whose last reference is dropped goes to the tail of the free queue if
it holds a cached (hashed) block, to the head otherwise; allocation pops from the head. So
unhashed blocks are reused first and cached blocks in least-recently-freed order. Requests free
their blocks tail first, so the deepest block of a sequence is evicted before its head.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.block_hash import BlockHash
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Kept while cached so a late subscriber can be told what the block holds (snapshot).
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    extra_keys: tuple | None = None  # what else keyed its hash (images, cache_salt), for events


def events_extra_keys(per_block: Sequence[tuple | None]) -> tuple[tuple | None, ...] | None:
    """A BlockStored's extra_keys: one entry per block, or None when no block has any."""
    return tuple(per_block) if any(k is not None for k in per_block) else None


class BlockPool:
    """Owns every block. Not thread-safe: only the engine's step loop calls it."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.record_events = record_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block; head = next to allocate. OrderedDict gives O(1) remove-from-middle.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self._events: list[KVCacheEvent] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def free_block_ids(self) -> list[int]:
        """In eviction order (head first); for tests and diagnostics."""
        return list(self._free)

    def cached_blocks(self) -> dict[BlockHash, int]:
        return {h: b.block_id for h, b in self._cached.items()}

    # ---- mutators ------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their cached hashes."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks, {len(self._free)} free")
        out: list[KVCacheBlock] = []
        evicted: list[BlockHash] = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash, block.parent_hash, block.token_ids, block.extra_keys = None, None, (), None
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.record_events:
            self._events.extend(BlockRemoved((h,)) for h in evicted)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling idle ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the order given (callers pass tail first)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        block_size: int,
        parent: BlockHash | None,
        extra_keys: Sequence[tuple | None] | None = None,
    ) -> None:
        """Publish newly full blocks under their hashes. `extra_keys`: per block, what besides its
        tokens went into its hash (None: nothing, for every block).

        A block whose hash another block already holds stays unhashed (it is freed like any
        other), so block tables never change under a running request.
        """
        if not self.enable_caching:
            return
        run: list[BlockHash] = []  # consecutive newly stored hashes -> one BlockStored event
        run_parent = parent
        run_start = 0
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            is_new = block.block_hash is None and block_hash not in self._cached
            if is_new:
                block.block_hash = block_hash
                block.parent_hash = block_hashes[i - 1] if i else parent
                block.token_ids = tuple(token_ids[i * block_size : (i + 1) * block_size])
                block.extra_keys = extra_keys[i] if extra_keys is not None else None
                self._cached[block_hash] = block
                if not run:
                    run_parent, run_start = (block_hashes[i - 1] if i else parent), i
                run.append(block_hash)
            if run and (not is_new or i == len(blocks) - 1):
                self._record_stored(run, run_parent, token_ids, block_size, run_start, extra_keys)
                run = []

    def _record_stored(
        self,
        hashes: list[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
        first_index: int,
        extra_keys: Sequence[tuple | None] | None,
    ) -> None:
        if self.record_events:
            tokens = token_ids[first_index * block_size : (first_index + len(hashes)) * block_size]
            keys = events_extra_keys(extra_keys[first_index : first_index + len(hashes)] if extra_keys else ())
            self._events.append(BlockStored(tuple(hashes), parent, tuple(tokens), block_size, extra_keys=keys))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash, block.parent_hash, block.token_ids, block.extra_keys = None, None, (), None
        self._cached.clear()
        if self.record_events:
            self._events.append(AllBlocksCleared())
        return True

    def snapshot_events(self, block_size: int) -> list[BlockStored]:
        """A BlockStored for every cached block, parents before children (chain order)."""
        children: dict[BlockHash | None, list[KVCacheBlock]] = {}
        for block in self._cached.values():
            parent = block.parent_hash if block.parent_hash in self._cached else None
            children.setdefault(parent, []).append(block)
        out: list[BlockStored] = []
        stack = list(reversed(children.get(None, [])))
        while stack:
            block = stack.pop()
            assert block.block_hash is not None
            out.append(BlockStored((block.block_hash,), block.parent_hash, block.token_ids, block_size,
                                   extra_keys=events_extra_keys((block.extra_keys,))))
            stack.extend(reversed(children.get(block.block_hash, [])))
        return out

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
