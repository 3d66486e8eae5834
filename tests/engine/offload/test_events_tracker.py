"""Self-describing offload events (the seed's test_events scenarios, on zenserve's API)."""

from __future__ import annotations

import pytest

from engine.block_hash import BlockHash
from engine.kv_events import BlockRemoved, BlockStored
from engine.offload.events_tracker import OffloadingEventsTracker
from engine.offload.group import GroupOffloadConfig
from engine.request import Request, RequestId, SamplingParams
from kvtier.base import MEDIUM_CPU, MEDIUM_FS, MEDIUM_OBJ, Locality, OffloadingEvent, make_offload_key


def _hash(i: int) -> BlockHash:
    return BlockHash(f"hash-{i}".encode().ljust(32, b"."))


def _request(num_hashes: int, token_count: int, req_id: str = "req") -> Request:
    req = Request(RequestId(req_id), list(range(1, token_count + 1)), SamplingParams(), frozenset({2}), 0, 1000)
    req.block_hashes = [_hash(i) for i in range(num_hashes)]
    return req


def _group(group_idx: int = 0, block_size: int = 4, blocks_per_chunk: int = 1, window_chunks: int | None = None):
    return GroupOffloadConfig(
        group_idx, block_size, blocks_per_chunk,
        kv_cache_spec_kind="full_attention" if window_chunks is None else "sliding_window",
        sliding_window_size_in_chunks=window_chunks,
    )


def _keys(req: Request, group: GroupOffloadConfig, num_chunks: int):
    hpc = group.hashes_per_chunk
    return [make_offload_key(req.block_hashes[(c + 1) * hpc - 1], group.group_idx) for c in range(num_chunks)]


def _record_stores(tracker, req, group, num_chunks):
    keys = _keys(req, group, num_chunks)
    for c, key in enumerate(keys):
        tracker.record_store(req, group, c, key)
    return keys


def _record_lookups(tracker, req, group, num_chunks):
    keys = _keys(req, group, num_chunks)
    for c, key in enumerate(keys):
        tracker.record_lookup(req, group, c, key)
    return keys


def stored(keys, medium=MEDIUM_CPU, **kw):
    return OffloadingEvent(tuple(keys), medium, removed=False, **kw)


def removed(keys, medium=MEDIUM_CPU, **kw):
    return OffloadingEvent(tuple(keys), medium, removed=True, **kw)


def test_stores_publish_routable_block_stored_events_with_parent_chain():
    tracker = OffloadingEventsTracker(True)
    req = _request(3, 12)
    keys = _record_stores(tracker, req, _group(), 3)
    events = tracker.take_events([stored(keys, locality=Locality.LOCAL)])
    assert [e.block_hashes for e in events] == [(_hash(0),), (_hash(1),), (_hash(2),)]
    assert [e.parent_block_hash for e in events] == [None, _hash(0), _hash(1)]
    assert [e.token_ids for e in events] == [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]
    assert all(e.block_size == 4 and e.medium == MEDIUM_CPU and e.locality == "LOCAL" for e in events)
    assert len(tracker._pending_event_metadata) == 3  # read, not consumed


def test_promotion_hit_emits_a_full_cpu_stored_event():
    tracker = OffloadingEventsTracker(True)
    req = _request(1, 4)
    (key,) = _record_lookups(tracker, req, _group(), 1)
    (event,) = tracker.take_events([stored([key])])
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (_hash(0),) and event.parent_block_hash is None
    assert event.token_ids == (1, 2, 3, 4) and event.block_size == 4
    assert event.lora_id is None and event.lora_name is None and event.extra_keys is None
    assert event.group_idx == 0 and event.kv_cache_spec_kind == "full_attention"
    assert event.kv_cache_spec_sliding_window is None


def test_chunks_of_several_blocks_store_and_remove_every_constituent_hash():
    tracker = OffloadingEventsTracker(True)
    group = _group(blocks_per_chunk=2)
    req = _request(4, 16)
    keys = _record_lookups(tracker, req, group, 2)
    events = tracker.take_events([stored(keys)])
    assert [e.block_hashes for e in events] == [(_hash(0), _hash(1)), (_hash(2), _hash(3))]
    assert [e.parent_block_hash for e in events] == [None, _hash(1)]
    assert events[1].token_ids == tuple(range(9, 17)) and events[1].block_size == 4
    (gone,) = tracker.take_events([removed(keys)])
    assert isinstance(gone, BlockRemoved)
    assert gone.block_hashes == (_hash(0), _hash(1), _hash(2), _hash(3))
    assert not tracker._pending_event_metadata  # a CPU removal consumes the metadata


def test_opt_out_keeps_placeholders_and_no_state():
    tracker = OffloadingEventsTracker(False)
    req = _request(3, 12)
    keys = _record_stores(tracker, req, _group(), 3)
    _record_lookups(tracker, req, _group(), 3)
    assert not tracker._pending_event_metadata
    events = tracker.take_events([stored(keys), removed(keys)])
    assert [e.block_size for e in events[:3]] == [0, 0, 0]
    assert all(e.token_ids == () and e.parent_block_hash is None for e in events[:3])
    assert events[3].block_hashes == (_hash(0), _hash(1), _hash(2))


@pytest.mark.parametrize("window_chunks", [1, 2], ids=["ssm", "sliding-window"])
def test_non_full_attention_groups_keep_placeholders(window_chunks):
    tracker = OffloadingEventsTracker(True)
    group = _group(window_chunks=window_chunks)
    req = _request(3, 12)
    keys = _record_stores(tracker, req, group, 3)
    _record_lookups(tracker, req, group, 3)
    assert not tracker._pending_event_metadata
    assert tracker.take_events([stored(keys[:1])])[0].block_size == 0


def test_pending_cpu_removal_consumes_hit_backfill_until_the_next_hit():
    tracker = OffloadingEventsTracker(True)
    group = _group(blocks_per_chunk=2)
    req = _request(2, 8)
    (key,) = _record_stores(tracker, req, group, 1)
    confirmed = tracker._pending_event_metadata[key]
    other = _request(2, 8, req_id="new-request")
    tracker.record_lookup(other, group, 0, key)
    assert tracker._pending_event_metadata[key] is confirmed
    (gone,) = tracker.take_events([removed([key])])
    assert gone.block_hashes == (_hash(0), _hash(1))
    (again,) = tracker.take_events([stored([key])])  # re-promotion nobody saw as a HIT
    assert again.block_size == 0 and again.token_ids == ()
    tracker.record_lookup(other, group, 0, key)  # a later HIT heals the removal
    (gone,) = tracker.take_events([removed([key])])
    assert gone.block_hashes == (_hash(0), _hash(1))


@pytest.mark.parametrize("medium", [MEDIUM_FS, MEDIUM_OBJ])
def test_secondary_stored_event_does_not_change_cpu_metadata(medium):
    tracker = OffloadingEventsTracker(True)
    req = _request(1, 4)
    (key,) = _record_lookups(tracker, req, _group(), 1)
    before = {k: (m.block_hashes, set(m.residencies)) for k, m in tracker._pending_event_metadata.items()}
    (event,) = tracker.take_events([stored([key], medium)])
    assert event.token_ids == (1, 2, 3, 4) and event.medium == medium
    after = {k: (m.block_hashes, set(m.residencies)) for k, m in tracker._pending_event_metadata.items()}
    assert after == before


def test_secondary_residency_keeps_metadata_until_its_removal():
    tracker = OffloadingEventsTracker(True)
    req = _request(1, 4)
    (key,) = _record_stores(tracker, req, _group(), 1)
    tracker.take_events([stored([key], MEDIUM_FS, ownership="0:fs", removal_expected=True)])
    tracker.take_events([removed([key])])  # CPU copy gone; the FS copy still needs describing
    (gone,) = tracker.take_events([removed([key], MEDIUM_FS, ownership="0:fs")])
    assert gone.block_hashes == (_hash(0),) and gone.ownership == "0:fs"
    assert not tracker._pending_event_metadata


def test_removed_hashes_are_grouped_by_kv_group():
    tracker = OffloadingEventsTracker(True)
    g0, g1 = _group(0, blocks_per_chunk=2), _group(1, blocks_per_chunk=2)
    req = _request(4, 16)
    k0 = _record_stores(tracker, req, g0, 2)
    k1 = _record_stores(tracker, req, g1, 1)
    events = tracker.take_events([removed([k0[0], k1[0], k0[1]])])
    assert {e.group_idx: e.block_hashes for e in events} == {
        0: (_hash(0), _hash(1), _hash(2), _hash(3)),
        1: (_hash(0), _hash(1)),
    }


def test_removal_of_an_unknown_key_names_its_hash():
    tracker = OffloadingEventsTracker(True)
    key = make_offload_key(_hash(9), 0)
    (gone,) = tracker.take_events([removed([key])])
    assert gone.block_hashes == (_hash(9),)


def test_reset_clears_the_side_table():
    tracker = OffloadingEventsTracker(True)
    _record_lookups(tracker, _request(3, 12), _group(), 3)
    assert tracker._pending_event_metadata
    tracker.reset()
    assert not tracker._pending_event_metadata
