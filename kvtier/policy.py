"""Eviction policies of the CPU tier: which resident keys go first when a store needs room.

A policy only orders keys; it knows nothing of slots, pins or writes. The manager tells it what is
resident (`insert`/`remove`), what was used (`touch`), and which keys must survive an eviction
(`protected`: the keys being stored plus every pinned or write-pending key).
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Iterator, Set

from kvtier.base import OffloadKey

POLICY_NAMES = ("lru", "arc")


class CachePolicy(abc.ABC):
    """The order in which resident keys are evicted.

    - insert(key): `key` becomes resident (it must not be). Mutates the order; ARC also adapts its
      target and drops `key` from a ghost list.
    - touch(key): `key` was used; moves it to the most-recently-used end (ARC: to T2). A key that
      is not resident is ignored.
    - remove(key): `key` stops being resident without being evicted (a failed write): no ghost entry
      is made. KeyError if it is not resident.
    - evict(n, protected): picks exactly `n` resident keys outside `protected`, removes them and
      returns them in eviction order; or returns None and changes nothing when fewer than `n`
      are evictable. `n == 0` returns [].
    - clear(): forgets every key (ghosts and ARC's target too).
    - `key in policy`, `len(policy)`: resident keys only (never ghosts).
    """

    @abc.abstractmethod
    def insert(self, key: OffloadKey) -> None: ...

    @abc.abstractmethod
    def touch(self, key: OffloadKey) -> None: ...

    @abc.abstractmethod
    def remove(self, key: OffloadKey) -> None: ...

    @abc.abstractmethod
    def evict(self, n: int, protected: Set[OffloadKey]) -> list[OffloadKey] | None: ...

    @abc.abstractmethod
    def clear(self) -> None: ...

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...


def _pick_oldest(keys: Iterator[OffloadKey], n: int, protected: Set[OffloadKey]) -> list[OffloadKey]:
    """Up to `n` keys from `keys` (oldest first) that are not protected."""
    picked: list[OffloadKey] = []
    if n <= 0:
        return picked
    for key in keys:
        if key not in protected:
            picked.append(key)
            if len(picked) == n:
                break
    return picked


def _check_evict_count(n: int) -> None:
    if n < 0:
        raise ValueError(f"cannot evict a negative number of keys ({n})")


class LRUPolicy(CachePolicy):
    """Least recently used first; `touch` and `insert` put a key at the most-recently-used end."""

    def __init__(self) -> None:
        self._keys: OrderedDict[OffloadKey, None] = OrderedDict()  # LRU first

    def insert(self, key: OffloadKey) -> None:
        if key in self._keys:
            raise KeyError(f"key already resident: {key!r}")
        self._keys[key] = None

    def touch(self, key: OffloadKey) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def remove(self, key: OffloadKey) -> None:
        del self._keys[key]

    def evict(self, n: int, protected: Set[OffloadKey]) -> list[OffloadKey] | None:
        _check_evict_count(n)
        victims = _pick_oldest(iter(self._keys), n, protected)
        if len(victims) < n:
            return None
        for key in victims:
            del self._keys[key]
        return victims

    def clear(self) -> None:
        self._keys.clear()

    def keys_in_eviction_order(self) -> list[OffloadKey]:
        return list(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)


class ARCPolicy(CachePolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) over `capacity` resident keys.

    | list | holds                                        | bound                      |
    |------|----------------------------------------------|----------------------------|
    | T1   | resident keys used once since they came in   | |T1| + |T2| <= capacity    |
    | T2   | resident keys used at least twice            | (the manager's slot count) |
    | B1   | ghosts: keys recently evicted from T1        | |T1| + |B1| <= capacity    |
    | B2   | ghosts: keys recently evicted from T2        | |B1| + |B2| <= capacity    |

    `target_t1_size` (the paper's p) is how large T1 should be. An eviction takes T1's LRU key
    while |T1| > p, else T2's (falling back to the other list when every key of the chosen one is
    protected). Re-inserting a B1 ghost means T1 was too small: p grows by max(1, |B2|/|B1|); a B2
    ghost means T2 was too small: p shrinks by max(1, |B1|/|B2|); either way the key goes to T2.
    A one-time scan therefore churns through T1 and never displaces T2.

    NOTE: the paper adapts p before making room for the missed key; here the manager evicts first
    and inserts after (so that a refused store changes nothing), so the new p steers the next
    eviction rather than this one.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"ARC capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.target_t1_size = 0.0
        self._t1: OrderedDict[OffloadKey, None] = OrderedDict()  # LRU first, in each list
        self._t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def insert(self, key: OffloadKey) -> None:
        if key in self:
            raise KeyError(f"key already resident: {key!r}")
        if key in self._b1:
            delta = max(1.0, len(self._b2) / len(self._b1))
            self.target_t1_size = min(float(self.capacity), self.target_t1_size + delta)
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            delta = max(1.0, len(self._b1) / len(self._b2))
            self.target_t1_size = max(0.0, self.target_t1_size - delta)
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def touch(self, key: OffloadKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: OffloadKey) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]

    def evict(self, n: int, protected: Set[OffloadKey]) -> list[OffloadKey] | None:
        _check_evict_count(n)
        # Decide on a virtual T1 size first and mutate only once all n victims are known.
        t1_victims = iter(_pick_oldest(iter(self._t1), n, protected))
        t2_victims = iter(_pick_oldest(iter(self._t2), n, protected))
        victims: list[tuple[OffloadKey, bool]] = []  # (key, came from T1)
        t1_size = len(self._t1)
        while len(victims) < n:
            key = next(t1_victims, None) if t1_size > self.target_t1_size else None
            if key is not None:
                t1_size -= 1
                victims.append((key, True))
                continue
            key = next(t2_victims, None)
            if key is None:
                key = next(t1_victims, None)  # T2 has nothing evictable: T1 despite the target
                if key is None:
                    return None
                t1_size -= 1
                victims.append((key, True))
                continue
            victims.append((key, False))
        for key, from_t1 in victims:
            if from_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
        self._trim_ghosts()
        return [key for key, _ in victims]

    def clear(self) -> None:
        for keys in (self._t1, self._t2, self._b1, self._b2):
            keys.clear()
        self.target_t1_size = 0.0

    def _trim_ghosts(self) -> None:
        while self._b1 and len(self._t1) + len(self._b1) > self.capacity:
            self._b1.popitem(last=False)
        while self._b2 and len(self._b1) + len(self._b2) > self.capacity:
            self._b2.popitem(last=False)

    # Read-only views, for metrics and tests.
    @property
    def t1(self) -> list[OffloadKey]:
        return list(self._t1)

    @property
    def t2(self) -> list[OffloadKey]:
        return list(self._t2)

    @property
    def b1(self) -> list[OffloadKey]:
        return list(self._b1)

    @property
    def b2(self) -> list[OffloadKey]:
        return list(self._b2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


def make_policy(name: str, capacity: int) -> CachePolicy:
    """The policy called `name` ("lru" | "arc") for a cache of `capacity` keys."""
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy(capacity)
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
