import pytest

from engine.block_hash import hash_block_tokens
from engine.block_pool import BlockPool
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def _h(i: int):
    return hash_block_tokens(None, [i])


def test_allocate_pops_from_the_head_and_sets_one_reference():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert pool.num_free_blocks == 2
    with pytest.raises(ValueError):
        pool.allocate(3)


def test_freed_uncached_blocks_are_reused_first_and_cached_ones_last():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache_full_blocks([a], [_h(0)], [0], 1, None)
    pool.free([c, b, a])  # a request frees tail first
    # c and b are unhashed: to the head (b pushed last, so first); a cached: to the tail.
    assert pool.free_block_ids() == [b.block_id, c.block_id, a.block_id]


def test_eviction_is_least_recently_freed_and_deepest_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    hashes = [_h(i) for i in range(3)]
    pool.cache_full_blocks(blocks, hashes, [0, 1, 2], 1, None)
    pool.free(list(reversed(blocks)))
    assert pool.free_block_ids() == [2, 1, 0]
    pool.take_events()
    (evicted,) = pool.allocate(1)
    assert evicted.block_id == 2 and evicted.block_hash is None
    assert pool.get_cached_block(hashes[2]) is None
    assert pool.take_events() == [BlockRemoved((hashes[2],))]


def test_touch_takes_idle_hit_blocks_out_of_the_free_queue():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_full_blocks([a], [_h(0)], [0], 1, None)
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free([a])
    assert pool.num_free_blocks == 1  # still referenced once
    pool.free([a])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.free([a])


def test_cache_full_blocks_emits_stored_events_with_parent_and_tokens():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    pool.cache_full_blocks(blocks, [h0, h1], [1, 2, 3, 4], 2, None)
    assert pool.take_events() == [BlockStored((h0, h1), None, (1, 2, 3, 4), 2)]
    assert pool.cached_blocks() == {h0: blocks[0].block_id, h1: blocks[1].block_id}


def test_a_duplicate_hash_stays_unpublished_and_events_name_the_right_parent():
    pool = BlockPool(4)
    first = pool.allocate(1)
    h0 = hash_block_tokens(None, [1])
    h1 = hash_block_tokens(h0, [2])
    pool.cache_full_blocks(first, [h0], [1], 1, None)
    pool.take_events()
    second = pool.allocate(2)  # another request computed the same first block
    pool.cache_full_blocks(second, [h0, h1], [1, 2], 1, None)
    assert second[0].block_hash is None
    assert pool.get_cached_block(h0) is first[0]
    assert pool.take_events() == [BlockStored((h1,), h0, (2,), 1)]


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_full_blocks([a], [_h(0)], [0], 1, None)
    assert pool.reset_prefix_cache() is False
    pool.free([a])
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and a.block_hash is None
    assert pool.take_events() == [AllBlocksCleared()]


def test_caching_disabled_publishes_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_full_blocks([a], [_h(0)], [0], 1, None)
    assert pool.num_cached_blocks == 0 and pool.take_events() == []


def test_snapshot_lists_cached_blocks_parents_first_with_their_tokens():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    h2 = hash_block_tokens(h1, [5, 6])
    pool.cache_full_blocks(blocks, [h0, h1, h2], [1, 2, 3, 4, 5, 6], 2, None)
    branch = pool.allocate(1)
    hb = hash_block_tokens(h0, [9, 9])
    pool.cache_full_blocks(branch, [hb], [9, 9], 2, h0)
    snap = pool.snapshot_events(2)
    order = [e.block_hashes[0] for e in snap]
    assert order[0] == h0 and order.index(h1) < order.index(h2) and set(order) == {h0, h1, h2, hb}
    by_hash = {e.block_hashes[0]: e for e in snap}
    assert by_hash[h2].parent_block_hash == h1 and by_hash[h2].token_ids == (5, 6)
    assert by_hash[hb].parent_block_hash == h0 and by_hash[hb].token_ids == (9, 9)
    pool.free([blocks[2]])
    pool.allocate(3)  # evicts h2 among others: it leaves the snapshot
    assert h2 not in {e.block_hashes[0] for e in pool.snapshot_events(2)}


def test_extra_keys_reach_the_stored_event_and_the_snapshot_per_block():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    h0 = hash_block_tokens(None, [1, 2], ("salt",))
    h1 = hash_block_tokens(h0, [3, 4])
    pool.cache_full_blocks(blocks, [h0, h1], [1, 2, 3, 4], 2, None, [("salt",), None])
    (event,) = pool.take_events()
    assert event.extra_keys == (("salt",), None)
    snap = {e.block_hashes[0]: e.extra_keys for e in pool.snapshot_events(2)}
    assert snap == {h0: (("salt",),), h1: None}
    pool.free(blocks)
    assert pool.reset_prefix_cache() and all(b.extra_keys is None for b in pool.blocks)
