import pytest

from kvtier.base import make_offload_key
from kvtier.policy import ARCPolicy, LRUPolicy, make_policy


def _k(name: str):
    return make_offload_key(name.encode().ljust(8, b"."), 0)


def _filled(policy, names):
    for name in names:
        policy.insert(_k(name))
    return policy


def _keys(*names):
    return [_k(name) for name in names]


# --- LRU ---------------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_inserted_first():
    policy = _filled(LRUPolicy(), "abc")
    assert policy.evict(2, set()) == _keys("a", "b")
    assert len(policy) == 1 and _k("c") in policy and _k("a") not in policy


def test_lru_touch_moves_a_key_to_the_most_recently_used_end():
    policy = _filled(LRUPolicy(), "abc")
    policy.touch(_k("a"))
    assert policy.keys_in_eviction_order() == _keys("b", "c", "a")
    assert policy.evict(1, set()) == _keys("b")


def test_lru_touch_of_an_absent_key_is_ignored():
    policy = _filled(LRUPolicy(), "ab")
    policy.touch(_k("z"))
    assert _k("z") not in policy and policy.keys_in_eviction_order() == _keys("a", "b")


def test_lru_evict_skips_protected_keys():
    policy = _filled(LRUPolicy(), "abc")
    assert policy.evict(2, {_k("a")}) == _keys("b", "c")
    assert policy.keys_in_eviction_order() == _keys("a")


def test_insert_of_a_resident_key_is_an_error():
    for policy in (LRUPolicy(), ARCPolicy(4)):
        policy.insert(_k("a"))
        with pytest.raises(KeyError):
            policy.insert(_k("a"))


def test_remove_drops_a_resident_key_and_rejects_an_absent_one():
    for policy in (_filled(LRUPolicy(), "ab"), _filled(ARCPolicy(4), "ab")):
        policy.remove(_k("a"))
        assert _k("a") not in policy and len(policy) == 1
        with pytest.raises(KeyError):
            policy.remove(_k("a"))


@pytest.mark.parametrize("make", [LRUPolicy, lambda: ARCPolicy(4)], ids=["lru", "arc"])
def test_evict_is_atomic_when_too_few_keys_are_evictable(make):
    policy = _filled(make(), "abc")
    assert policy.evict(3, {_k("b")}) is None
    assert policy.evict(4, set()) is None
    assert len(policy) == 3
    # Nothing moved: the order is the original one.
    assert policy.evict(3, set()) == _keys("a", "b", "c")


@pytest.mark.parametrize("make", [LRUPolicy, lambda: ARCPolicy(4)], ids=["lru", "arc"])
def test_evict_zero_returns_nothing_and_negative_is_an_error(make):
    policy = _filled(make(), "ab")
    assert policy.evict(0, set()) == []
    assert len(policy) == 2
    with pytest.raises(ValueError):
        policy.evict(-1, set())


# --- ARC ---------------------------------------------------------------------------------


def test_arc_new_keys_enter_t1_and_a_touch_promotes_to_t2():
    policy = _filled(ARCPolicy(4), "abc")
    assert policy.t1 == _keys("a", "b", "c") and policy.t2 == []
    policy.touch(_k("b"))
    assert policy.t1 == _keys("a", "c") and policy.t2 == _keys("b")
    policy.touch(_k("z"))  # absent: ignored
    assert len(policy) == 3


def test_arc_touch_in_t2_moves_to_its_mru_end():
    policy = _filled(ARCPolicy(4), "ab")
    policy.touch(_k("a"))
    policy.touch(_k("b"))
    policy.touch(_k("a"))
    assert policy.t2 == _keys("b", "a")


def test_arc_evicts_from_t1_while_t1_exceeds_the_target_and_ghosts_it_in_b1():
    policy = _filled(ARCPolicy(4), "abc")
    policy.touch(_k("a"))  # T1 = [b, c], T2 = [a], p = 0
    assert policy.evict(1, set()) == _keys("b")
    assert policy.t1 == _keys("c") and policy.t2 == _keys("a")
    assert policy.b1 == _keys("b") and policy.b2 == []


def test_arc_evicts_from_t2_into_b2_when_t1_has_nothing_evictable():
    policy = _filled(ARCPolicy(4), "abc")
    policy.touch(_k("a"))
    assert policy.evict(1, _keys("b", "c")) == _keys("a")
    assert policy.b2 == _keys("a") and policy.b1 == []


def test_arc_evicts_from_t2_while_t1_is_within_the_target():
    policy = _filled(ARCPolicy(4), "ab")
    assert policy.evict(2, set()) == _keys("a", "b")
    policy.insert(_k("a"))
    policy.insert(_k("b"))  # two B1 ghost hits: p = 2, T2 = [a, b]
    assert policy.target_t1_size == 2.0
    _filled(policy, "cd")
    assert policy.evict(1, set()) == _keys("a")  # |T1| = 2 is not above p: T2 (the paper's REPLACE)
    policy.insert(_k("e"))
    # |T1| = 3 > p: c from T1; then T1 counts 2, no longer above p: b from T2.
    assert policy.evict(2, set()) == _keys("c", "b")
    assert (policy.t1, policy.t2, policy.b1, policy.b2) == (_keys("d", "e"), [], _keys("c"), _keys("a", "b"))


def test_arc_b1_ghost_hit_grows_the_target_by_the_ghost_ratio_and_enters_t2():
    policy = _filled(ARCPolicy(4), ["k0", "k1", "k2", "k3"])
    for name in ["k0", "k1", "k2", "k3"]:
        policy.touch(_k(name))
    assert policy.evict(3, set()) == _keys("k0", "k1", "k2")  # T1 empty: from T2
    _filled(policy, ["x", "y"])
    assert policy.evict(1, set()) == _keys("x")  # |T1| = 2 > p = 0
    assert (policy.b1, policy.b2) == (_keys("x"), _keys("k0", "k1", "k2"))
    policy.insert(_k("x"))
    assert policy.target_t1_size == 3.0  # 0 + max(1, |B2| / |B1| = 3 / 1)
    assert policy.t2 == _keys("k3", "x") and policy.b1 == []


def test_arc_b2_ghost_hit_shrinks_the_target_by_the_ghost_ratio():
    policy = _filled(ARCPolicy(8), "abcd")
    assert policy.evict(4, set()) == _keys("a", "b", "c", "d")
    for name in "abcd":  # four B1 ghost hits with B2 empty: +1 each
        policy.insert(_k(name))
    assert policy.target_t1_size == 4.0 and policy.t2 == _keys("a", "b", "c", "d")
    assert policy.evict(1, set()) == _keys("a")  # |T1| = 0 <= p: from T2
    _filled(policy, "efg")
    # |T1| = 3 <= p = 4 asks for T2, but every T2 key is protected: T1 after all.
    assert policy.evict(3, _keys("b", "c", "d")) == _keys("e", "f", "g")
    assert (policy.b1, policy.b2) == (_keys("e", "f", "g"), _keys("a"))
    policy.insert(_k("a"))
    assert policy.target_t1_size == 1.0  # 4 - max(1, |B1| / |B2| = 3 / 1)
    assert _k("a") in policy.t2 and policy.b2 == []


def test_arc_target_stays_within_zero_and_capacity():
    policy = _filled(ARCPolicy(2), "ab")
    policy.touch(_k("a"))
    assert policy.evict(1, _keys("b")) == _keys("a")
    policy.insert(_k("a"))  # B2 hit at p = 0
    assert policy.target_t1_size == 0.0
    for name in "xyz":
        policy.insert(_k(name))
        assert policy.evict(1, set(policy.t1 + policy.t2) - {_k(name)}) == [_k(name)]
        policy.insert(_k(name))  # B1 hit: +1, capped at the capacity
    assert policy.target_t1_size == 2.0


def test_arc_a_one_time_scan_does_not_evict_frequently_used_keys():
    policy = _filled(ARCPolicy(4), ["hot0", "hot1"])
    policy.touch(_k("hot0"))
    policy.touch(_k("hot1"))
    for i in range(20):
        if len(policy) == 4:
            policy.evict(1, set())
        policy.insert(_k(f"scan{i}"))
    assert policy.t2 == _keys("hot0", "hot1")
    assert policy.t1 == _keys("scan18", "scan19")


def test_lru_is_not_scan_resistant():
    policy = _filled(LRUPolicy(), ["hot0", "hot1"])
    policy.touch(_k("hot0"))
    policy.touch(_k("hot1"))
    for i in range(20):
        if len(policy) == 4:
            policy.evict(1, set())
        policy.insert(_k(f"scan{i}"))
    assert _k("hot0") not in policy and _k("hot1") not in policy


def test_arc_b1_is_bounded_so_that_t1_plus_b1_fits_the_capacity():
    policy = ARCPolicy(3)
    for i in range(10):
        policy.insert(_k(f"k{i}"))
        assert policy.evict(1, set()) == [_k(f"k{i}")]
    assert policy.b1 == _keys("k7", "k8", "k9")
    policy.insert(_k("t"))
    assert policy.b1 == _keys("k8", "k9")  # |T1| + |B1| <= 3


def test_arc_ghosts_together_fit_the_capacity_dropping_b2_first():
    policy = _filled(ARCPolicy(3), "abc")
    for name in "abc":
        policy.touch(_k(name))
    assert policy.evict(3, set()) == _keys("a", "b", "c")
    assert policy.b2 == _keys("a", "b", "c")
    policy.insert(_k("d"))
    assert policy.evict(1, set()) == _keys("d")
    assert policy.b1 == _keys("d") and policy.b2 == _keys("b", "c")


def test_arc_remove_leaves_no_ghost_and_reinsert_does_not_adapt():
    policy = _filled(ARCPolicy(4), "ab")
    policy.remove(_k("a"))
    assert policy.b1 == [] and policy.b2 == []
    policy.insert(_k("a"))
    assert policy.target_t1_size == 0.0 and policy.t1 == _keys("b", "a")


def test_arc_clear_forgets_keys_ghosts_and_target():
    policy = _filled(ARCPolicy(4), "ab")
    policy.evict(1, set())
    policy.insert(_k("a"))
    assert policy.target_t1_size == 1.0
    policy.clear()
    assert (len(policy), policy.b1, policy.b2, policy.target_t1_size) == (0, [], [], 0.0)


def test_arc_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        ARCPolicy(0)


# --- factory -----------------------------------------------------------------------------


def test_make_policy_picks_by_name():
    assert isinstance(make_policy("lru", 4), LRUPolicy)
    arc = make_policy("arc", 4)
    assert isinstance(arc, ARCPolicy) and arc.capacity == 4


def test_make_policy_rejects_unknown_names_listing_the_choices():
    with pytest.raises(ValueError, match=r"'lfu'.*lru, arc"):
        make_policy("lfu", 4)
