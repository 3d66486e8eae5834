import pytest

from kvtier import create_offloading_manager, parse_offloading_config
from kvtier.base import MEDIUM_CPU, LookupResult, OffloadingEvent, ReqContext, make_offload_key
from kvtier.cpu_tier import CPUOffloadingManager

CTX = ReqContext("req-0")
HIT, HIT_PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS


def _k(i: int):
    return make_offload_key(i.to_bytes(8, "big"), 0)


def _ks(*ids: int):
    return tuple(_k(i) for i in ids)


def _store(manager: CPUOffloadingManager, *ids: int):
    """Stores the keys in one call and completes the write."""
    out = manager.prepare_store(_ks(*ids), CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX)
    return out


def _states(manager: CPUOffloadingManager, *ids: int):
    return [manager.lookup(_k(i), CTX) for i in ids]


# --- slots -------------------------------------------------------------------------------


def test_slots_are_handed_out_fresh_in_order():
    manager = CPUOffloadingManager(4)
    out = manager.prepare_store(_ks(10, 11, 12), CTX)
    assert out.keys_to_store == _ks(10, 11, 12)
    assert out.slot_ids == (0, 1, 2)
    assert out.evicted_keys == ()
    assert (manager.num_used_slots, manager.num_free_slots) == (3, 1)
    assert [manager.slot_of(_k(i)) for i in (10, 11, 12, 13)] == [0, 1, 2, None]


def test_fresh_slots_are_used_before_recycled_ones():
    manager = CPUOffloadingManager(3)
    _store(manager, 0)
    failed = manager.prepare_store(_ks(1), CTX)
    manager.complete_store(failed.keys_to_store, CTX, success=False)  # frees slot 1
    assert manager.prepare_store(_ks(2), CTX).slot_ids == (2,)
    assert manager.prepare_store(_ks(3), CTX).slot_ids == (1,)


def test_evicted_slots_are_recycled_oldest_freed_first():
    manager = CPUOffloadingManager(3)
    _store(manager, 0, 1, 2)
    out = manager.prepare_store(_ks(3, 4), CTX)
    # One store call: its last chunk is least recently used (a prefix's tail goes first).
    assert out.evicted_keys == _ks(2, 1)
    assert out.slot_ids == (2, 1)
    assert _states(manager, 0, 1, 2, 3, 4) == [HIT, MISS, MISS, HIT_PENDING, HIT_PENDING]


# --- lookups, loads, touch -----------------------------------------------------------------


def test_lookup_is_miss_then_hit_pending_during_the_write_then_hit():
    manager = CPUOffloadingManager(2)
    assert _states(manager, 0) == [MISS]
    out = manager.prepare_store(_ks(0), CTX)
    assert _states(manager, 0) == [HIT_PENDING]
    manager.complete_store(out.keys_to_store, CTX)
    assert _states(manager, 0) == [HIT]
    assert list(manager.keys()) == [_k(0)]


def test_a_failed_store_frees_the_slot_and_the_key_misses():
    manager = CPUOffloadingManager(1)
    manager.prepare_store(_ks(0), CTX)
    manager.complete_store(_ks(0), CTX, success=False)
    assert _states(manager, 0) == [MISS]
    assert (manager.num_used_slots, manager.num_free_slots, manager.slot_of(_k(0))) == (0, 1, None)
    assert manager.take_events() == []
    assert _store(manager, 1).slot_ids == (0,)


def test_keys_lists_readable_keys_only():
    manager = CPUOffloadingManager(4)
    _store(manager, 0, 1)
    manager.prepare_store(_ks(2), CTX)
    assert sorted(manager.keys()) == sorted(_ks(0, 1))


def test_prepare_load_pins_and_returns_slot_ids():
    manager = CPUOffloadingManager(4)
    _store(manager, 0, 1, 2)
    assert manager.prepare_load(_ks(2, 0), CTX) == [2, 0]
    assert _states(manager, 0, 2) == [HIT, HIT]  # pinned keys stay readable


@pytest.mark.parametrize("bad", [1, 2], ids=["write-pending", "absent"])
def test_prepare_load_of_a_key_that_is_not_a_hit_raises_and_pins_nothing(bad):
    manager = CPUOffloadingManager(2)
    _store(manager, 0)
    manager.prepare_store(_ks(1), CTX)
    with pytest.raises(ValueError, match="not a HIT"):
        manager.prepare_load(_ks(0, bad), CTX)
    # Key 0 was not pinned: it is still evictable.
    manager.complete_store(_ks(1), CTX)
    assert manager.prepare_store(_ks(5), CTX).evicted_keys == _ks(0)


def test_pinned_keys_are_never_evicted():
    manager = CPUOffloadingManager(2)
    _store(manager, 0)
    _store(manager, 1)
    manager.prepare_load(_ks(0), CTX)  # key 0 is the LRU one, but pinned
    assert manager.prepare_store(_ks(2), CTX).evicted_keys == _ks(1)
    manager.complete_store(_ks(2), CTX)
    manager.prepare_load(_ks(2), CTX)
    assert manager.prepare_store(_ks(3), CTX) is None
    manager.complete_load(_ks(0), CTX)
    assert manager.prepare_store(_ks(3), CTX).evicted_keys == _ks(0)


def test_a_key_pinned_twice_stays_pinned_until_both_loads_complete():
    manager = CPUOffloadingManager(1)
    _store(manager, 0)
    manager.prepare_load(_ks(0), CTX)
    manager.prepare_load(_ks(0), ReqContext("req-1"))
    manager.complete_load(_ks(0), CTX)
    assert manager.prepare_store(_ks(1), CTX) is None
    manager.complete_load(_ks(0), CTX)
    assert manager.prepare_store(_ks(1), CTX).evicted_keys == _ks(0)


def test_complete_load_of_an_unpinned_key_raises_and_changes_nothing():
    manager = CPUOffloadingManager(2)
    _store(manager, 0, 1)
    manager.prepare_load(_ks(0), CTX)
    with pytest.raises(ValueError, match="pin"):
        manager.complete_load(_ks(0, 1), CTX)
    with pytest.raises(ValueError, match="pin"):
        manager.complete_load(_ks(0, 0), CTX)
    assert manager.prepare_store(_ks(2), CTX).evicted_keys == _ks(1)  # key 0 still pinned


def test_touch_makes_a_key_most_recently_used():
    manager = CPUOffloadingManager(3)
    for i in range(3):
        _store(manager, i)
    manager.touch(_ks(0), CTX)
    assert manager.prepare_store(_ks(3), CTX).evicted_keys == _ks(1)


def test_touch_leaves_the_first_chunk_of_a_prefix_most_recently_used():
    manager = CPUOffloadingManager(3)
    for i in range(3):
        _store(manager, i)
    manager.touch(_ks(0, 1), CTX)  # order now: 2, 1, 0 (LRU first)
    assert manager.prepare_store(_ks(3), CTX).evicted_keys == _ks(2)
    manager.complete_store(_ks(3), CTX)
    assert manager.prepare_store(_ks(4), CTX).evicted_keys == _ks(1)


def test_touch_ignores_write_pending_and_absent_keys():
    manager = CPUOffloadingManager(3, eviction_policy="arc")
    _store(manager, 100)
    manager.touch(_ks(100), CTX)  # ARC: T2
    out = manager.prepare_store(_ks(0), CTX)
    manager.touch(_ks(0, 9), CTX)  # same step as its store: not a reuse, key 0 stays in T1
    manager.complete_store(out.keys_to_store, CTX)
    _store(manager, 1)
    # |T1| = 2 > p = 0: T1's LRU key goes. Had the touch promoted key 0, key 1 would go.
    assert manager.prepare_store(_ks(2), CTX).evicted_keys == _ks(0)


# --- stores --------------------------------------------------------------------------------


def test_prepare_store_skips_keys_already_present_in_any_state():
    manager = CPUOffloadingManager(4)
    _store(manager, 0)
    manager.prepare_store(_ks(1), CTX)
    out = manager.prepare_store(_ks(0, 1, 2, 2), CTX)
    assert (out.keys_to_store, out.slot_ids, out.evicted_keys) == (_ks(2), (2,), ())
    empty = manager.prepare_store(_ks(0, 1), CTX)
    assert (empty.keys_to_store, empty.slot_ids, empty.evicted_keys) == ((), (), ())


def test_prepare_store_never_evicts_the_keys_it_was_passed():
    manager = CPUOffloadingManager(2)
    _store(manager, 0)
    _store(manager, 1)  # key 0 is the LRU one
    out = manager.prepare_store(_ks(0, 2), CTX)
    assert (out.keys_to_store, out.evicted_keys) == (_ks(2), _ks(1))


def test_prepare_store_evicts_exactly_the_shortfall():
    manager = CPUOffloadingManager(4)
    for i in range(3):
        _store(manager, i)
    out = manager.prepare_store(_ks(3, 4), CTX)  # one free slot, two new keys
    assert out.evicted_keys == _ks(0)
    assert out.slot_ids == (3, 0)


def test_write_pending_keys_are_never_evicted_and_no_room_changes_nothing():
    manager = CPUOffloadingManager(1)
    manager.prepare_store(_ks(0), CTX)
    assert manager.prepare_store(_ks(1), CTX) is None
    assert _states(manager, 0, 1) == [HIT_PENDING, MISS]
    assert (manager.num_free_slots, manager.slot_of(_k(0))) == (0, 0)
    assert manager.take_events() == []


def test_no_room_because_of_protected_keys_returns_none_and_changes_nothing():
    manager = CPUOffloadingManager(2)
    _store(manager, 0)
    _store(manager, 1)
    manager.take_events()
    # Two new keys need two evictions; key 0 is passed in, so only key 1 could go.
    assert manager.prepare_store(_ks(0, 2, 3), CTX) is None
    assert _states(manager, 0, 1, 2, 3) == [HIT, HIT, MISS, MISS]
    assert [manager.slot_of(_k(i)) for i in (0, 1)] == [0, 1]
    assert manager.take_events() == []
    assert manager.stats()["cpu"].evicted_chunks == 0
    assert manager.prepare_store(_ks(2), CTX).evicted_keys == _ks(0)  # LRU order untouched


def test_complete_store_of_a_key_that_is_not_write_pending_raises():
    manager = CPUOffloadingManager(2)
    _store(manager, 0)
    manager.prepare_store(_ks(1), CTX)
    with pytest.raises(ValueError, match="not write pending"):
        manager.complete_store(_ks(1, 0), CTX)
    with pytest.raises(ValueError, match="not write pending"):
        manager.complete_store(_ks(7), CTX, success=False)
    assert _states(manager, 1) == [HIT_PENDING]


# --- events ------------------------------------------------------------------------------


def test_evictions_emit_one_removed_event_and_completed_stores_one_stored_event():
    manager = CPUOffloadingManager(2)
    out = manager.prepare_store(_ks(0, 1), CTX)
    assert manager.take_events() == []  # nothing readable yet
    manager.complete_store(out.keys_to_store, CTX)
    assert manager.take_events() == [OffloadingEvent(keys=_ks(0, 1), medium=MEDIUM_CPU, removed=False)]
    assert manager.take_events() == []  # drained
    out = manager.prepare_store(_ks(2, 3), CTX)
    manager.complete_store(out.keys_to_store, CTX)
    assert manager.take_events() == [
        OffloadingEvent(keys=_ks(1, 0), medium=MEDIUM_CPU, removed=True),
        OffloadingEvent(keys=_ks(2, 3), medium=MEDIUM_CPU, removed=False),
    ]


def test_a_failed_store_emits_nothing():
    manager = CPUOffloadingManager(2)
    manager.prepare_store(_ks(0), CTX)
    manager.complete_store(_ks(0), CTX, success=False)
    assert manager.take_events() == []


# --- store_threshold -----------------------------------------------------------------------


def test_store_threshold_admits_a_key_only_after_enough_lookups():
    manager = CPUOffloadingManager(4, store_threshold=2)
    manager.lookup(_k(0), CTX)
    out = manager.prepare_store(_ks(0, 1), CTX)
    assert out.keys_to_store == ()
    assert manager.stats()["cpu"].extra["skipped_stores"] == 2
    manager.lookup(_k(0), CTX)
    assert manager.prepare_store(_ks(0, 1), CTX).keys_to_store == _ks(0)
    assert manager.stats()["cpu"].extra["skipped_stores"] == 3


@pytest.mark.parametrize("threshold", [0, 1])
def test_store_threshold_below_two_admits_everything(threshold):
    manager = CPUOffloadingManager(4, store_threshold=threshold)
    assert manager.prepare_store(_ks(0, 1), CTX).keys_to_store == _ks(0, 1)
    assert manager.stats()["cpu"].extra["skipped_stores"] == 0


def test_the_lookup_tracker_forgets_its_least_recently_looked_up_key():
    manager = CPUOffloadingManager(4, store_threshold=2, max_tracker_size=2)
    for i in (0, 0, 1, 1, 0, 2):  # key 2 pushes out key 1, the LRU one
        manager.lookup(_k(i), CTX)
    assert manager.prepare_store(_ks(0, 1), CTX).keys_to_store == _ks(0)


def test_keys_already_present_are_not_counted_as_skipped_stores():
    manager = CPUOffloadingManager(4, store_threshold=2)
    manager.lookup(_k(0), CTX)
    manager.lookup(_k(0), CTX)
    _store(manager, 0)
    manager.prepare_store(_ks(0), CTX)
    assert manager.stats()["cpu"].extra["skipped_stores"] == 0


def test_reset_cache_forgets_lookup_counts():
    manager = CPUOffloadingManager(4, store_threshold=2)
    manager.lookup(_k(0), CTX)
    manager.lookup(_k(0), CTX)
    manager.reset_cache()
    assert manager.prepare_store(_ks(0), CTX).keys_to_store == ()


def test_a_refused_store_does_not_count_skipped_stores():
    manager = CPUOffloadingManager(1, store_threshold=2)
    for key in (0, 0, 1, 1):
        manager.lookup(_k(key), CTX)
    manager.prepare_store(_ks(0), CTX)  # write pending: no room for key 1
    assert manager.prepare_store(_ks(1, 2), CTX) is None
    assert manager.stats()["cpu"].extra["skipped_stores"] == 0


# --- reset, stats --------------------------------------------------------------------------


def test_reset_cache_drops_every_key_frees_every_slot_and_emits_nothing():
    manager = CPUOffloadingManager(2)
    _store(manager, 0, 1)
    manager.prepare_store(_ks(2), CTX)  # evicts one
    manager.complete_store(_ks(2), CTX)
    manager.take_events()
    manager.prepare_store(_ks(3), CTX)
    manager.complete_store(_ks(3), CTX)  # an undrained stored event
    manager.reset_cache()
    assert _states(manager, 0, 1, 2, 3) == [MISS] * 4
    assert (manager.num_used_slots, manager.num_free_slots, list(manager.keys())) == (0, 2, [])
    assert manager.take_events() == []
    assert manager.prepare_store(_ks(4, 5), CTX).slot_ids == (0, 1)


@pytest.mark.parametrize("in_flight", ["pinned", "write-pending"])
def test_reset_cache_with_transfers_in_flight_raises_and_changes_nothing(in_flight):
    manager = CPUOffloadingManager(2)
    _store(manager, 0)
    if in_flight == "pinned":
        manager.prepare_load(_ks(0), CTX)
    else:
        manager.prepare_store(_ks(1), CTX)
    with pytest.raises(RuntimeError, match="flush"):
        manager.reset_cache()
    assert _states(manager, 0) == [HIT]


def test_stats_count_lookups_hits_stores_and_evictions():
    manager = CPUOffloadingManager(1)
    manager.lookup(_k(0), CTX)  # miss
    out = manager.prepare_store(_ks(0), CTX)
    manager.lookup(_k(0), CTX)  # hit pending
    manager.complete_store(out.keys_to_store, CTX)
    manager.lookup(_k(0), CTX)  # hit
    _store(manager, 1)  # evicts key 0
    stats = manager.stats()
    assert list(stats) == ["cpu"]
    cpu = stats["cpu"]
    assert (cpu.lookups, cpu.hits, cpu.stored_chunks, cpu.evicted_chunks) == (3, 1, 2, 1)
    assert cpu.extra == {"skipped_stores": 0, "hit_pending": 1, "num_used_slots": 1, "num_slots": 1}


def test_stats_returns_a_copy():
    manager = CPUOffloadingManager(1)
    manager.stats()["cpu"].extra["hit_pending"] = 99
    manager.stats()["cpu"].lookups = 99
    assert manager.stats()["cpu"].extra["hit_pending"] == 0 and manager.stats()["cpu"].lookups == 0


@pytest.mark.parametrize(
    "kwargs", [{"num_slots": 0}, {"num_slots": 1, "store_threshold": -1}, {"num_slots": 1, "max_tracker_size": 0}]
)
def test_constructor_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError):
        CPUOffloadingManager(**kwargs)


# --- policies through the manager ------------------------------------------------------------


def _scan(manager: CPUOffloadingManager) -> None:
    _store(manager, 100)
    _store(manager, 101)
    manager.touch(_ks(100, 101), CTX)  # reused once: frequent
    for i in range(20):
        _store(manager, i)


def test_arc_keeps_frequently_used_chunks_through_a_one_time_scan():
    manager = CPUOffloadingManager(4, eviction_policy="arc")
    _scan(manager)
    assert _states(manager, 100, 101) == [HIT, HIT]
    assert _states(manager, 18, 19) == [HIT, HIT]


def test_lru_loses_frequently_used_chunks_to_a_one_time_scan():
    manager = CPUOffloadingManager(4, eviction_policy="lru")
    _scan(manager)
    assert _states(manager, 100, 101) == [MISS, MISS]


def test_create_offloading_manager_builds_the_cpu_tier_from_the_config():
    config = parse_offloading_config({"cpu_bytes_to_use": 1000, "eviction_policy": "arc", "store_threshold": 2})
    manager = create_offloading_manager(config, num_slots=config.num_slots(250))
    assert isinstance(manager, CPUOffloadingManager)
    assert (manager.num_slots, manager.eviction_policy) == (4, "arc")
    assert (manager.store_threshold, manager.max_tracker_size) == (2, 64_000)


def test_create_offloading_manager_refuses_secondary_tiers_for_now():
    config = parse_offloading_config(
        {"cpu_bytes_to_use": 1000, "secondary_tiers": [{"type": "fs", "path": "/tmp/kv", "capacity_bytes": "1G"}]}
    )
    with pytest.raises(NotImplementedError, match="TieringOffloadingSpec"):
        create_offloading_manager(config, num_slots=4)


# --- abandoned stores whose writer may still be writing -----------------------------------------


def test_an_abandoned_store_drops_its_key_at_once_and_its_slot_only_when_released():
    manager = CPUOffloadingManager(2)
    out = manager.prepare_store(_ks(0), CTX)
    (slot,) = out.slot_ids
    assert manager.abandon_store(_k(0)) == slot
    assert _states(manager, 0) == [MISS] and manager.still_pending(_k(0)) is False
    assert (manager.num_used_slots, manager.num_free_slots) == (0, 1)
    _store(manager, 1)
    assert manager.prepare_store(_ks(2), CTX).slot_ids != (slot,)  # evicts 1 rather than reuse it
    manager.complete_store(_ks(2), CTX)
    manager.release_slot(slot)
    assert manager.num_free_slots == 1
    assert manager.prepare_store(_ks(3), CTX).slot_ids == (slot,)
    with pytest.raises(ValueError, match="not write pending"):
        manager.abandon_store(_k(2))  # readable, not write pending


def test_reset_cache_keeps_a_slot_reserved_until_its_release():
    manager = CPUOffloadingManager(3)
    out = manager.prepare_store(_ks(0, 1), CTX)
    reserved = out.slot_ids[1]
    manager.complete_store(_ks(0), CTX)
    manager.abandon_store(_k(1))
    manager.reset_cache()
    assert manager.num_free_slots == 2
    handed = manager.prepare_store(_ks(5, 6), CTX).slot_ids
    assert reserved not in handed and len(set(handed)) == 2
    assert manager.prepare_store(_ks(7), CTX) is None  # the reserved slot is not free
    manager.release_slot(reserved)
    assert manager.prepare_store(_ks(7), CTX).slot_ids == (reserved,)


def test_still_pending_is_true_only_while_a_store_is_in_flight():
    manager = CPUOffloadingManager(2)
    assert not manager.still_pending(_k(0))
    manager.prepare_store(_ks(0), CTX)
    assert manager.still_pending(_k(0))
    manager.complete_store(_ks(0), CTX)
    assert not manager.still_pending(_k(0))
