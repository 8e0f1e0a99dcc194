"""Eviction policies: who leaves the device cache when a slot is needed.

Every policy keeps its own bookkeeping from the cache's events (see `base.EvictionPolicy`). The cache
reports, for a demand miss: `victim` (if full) -> `on_evict(victim)` -> `on_insert(key, prefetched=False)`
-> `on_access(key)`; for a hit: `on_access(key)`; for a prefetch: `victim` -> `on_evict` ->
`on_insert(key, prefetched=True)`; for a proposal of a resident expert: `on_predicted(key)`.
`on_access` of a key never inserted is treated as an insert (policies stay consistent if a cache
reports in another order). Ties are always broken by least-recent use, then by key, so every
policy is deterministic.

Victims are found without scanning when the cache passes its candidates as a `base.Candidates` view (every
key in it is resident, hence tracked): each policy keeps its order incrementally (insertion-ordered dicts
for recency, per-layer queues, lazy heaps keyed by the rank) and returns the first key of that order that
is a candidate; pinned or in-flight keys are skipped, which is O(1) amortised as few are. Any other
sequence of candidates gets the full scan (`min` by the rank); both give the same victim.

| name | victim | source |
|---|---|---|
| lru | least recently accessed (insert counts as a use) | classic; SpecMD App. B |
| lfu | fewest accesses over the whole run (counts survive eviction) | SpecMD App. B |
| lhu | low-precision slots first, then fewest full-precision uses (counts survive eviction) | HOBBIT via SpecMD App. B |
| fld | expert whose layer is farthest ahead of the running layer, cyclically (needed latest) | HOBBIT via SpecMD App. B |
| score | lowest accumulated gate score (history survives eviction) | Zhu et al. via SpecMD App. B |
| lru2 | ExpertFlow's two-level LRU: victims from the low tier first, LRU within a tier | ExpertFlow 3.3.1 |
| least-stale | stale (previous-pass) queue first, current queue only when no stale one is left; FIFO by layer | SpecMD 4.2 |
| belady-approx | longest predicted time to next use (layer distance, reuse interval, proposals) | Belady's MIN, approx. |
| next-use | longest expected time to next use, calibrated online (use share, recency, proposals) | Belady's MIN, approx. |

`least-stale` lives in `least_stale.py`, `belady-approx` in `belady_approx.py`, `next-use` in `next_use.py` (all
built on `_Base`).

Compiled twins: lru, lfu, least-stale (its `fifo` order), belady-approx and next-use declare a `kernel`; with an instant
link (the simulator's, the runtime's `direct`) the cache keeps their bookkeeping in numba kernels
(`moeflow.runtime.cachecore`: the same victims and counters, tests/test_sim_core.py) and never calls the events
below, in the runtime and the simulator alike. These classes are the reference, and the mechanism on every
other link; fld, lhu, score and lru2 have no kernel (always these events).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Sequence
from typing import Any, ClassVar

from ..errors import ConfigError
from .base import EVICTION, Candidates, EvictionPolicy, ExpertKey, Position


class _Base(EvictionPolicy):
    """Shared bookkeeping: last-use time per resident key; no-op defaults for unused events."""

    name: ClassVar[str] = ""

    def __init__(self) -> None:
        # resident key -> last use (local tick; insert counts); the dict's order is the LRU order (oldest first)
        self._last: dict[ExpertKey, int] = {}
        self._tick = 0  # local counter so equal cache times still order

    def _touch(self, key: ExpertKey) -> None:
        self._tick += 1
        last = self._last
        last.pop(key, None)  # re-insert at the end: iteration order stays ascending by tick
        last[key] = self._tick

    def _age(self, key: ExpertKey) -> tuple[int, ExpertKey]:
        return (self._last.get(key, 0), key)

    # events
    def on_insert(self, key: ExpertKey, pos: Position, *, prefetched: bool) -> None:
        self._touch(key)

    def on_access(self, key: ExpertKey, pos: Position, *, score: float) -> None:
        self._touch(key)

    def on_evict(self, key: ExpertKey) -> None:
        self._last.pop(key, None)

    def on_pass_start(self, pos: Position) -> None:
        pass

    def on_layer_start(self, pos: Position) -> None:
        pass

    def on_predicted(self, key: ExpertKey, pos: Position) -> None:
        pass

    def victim(self, candidates: Sequence[ExpertKey], pos: Position) -> ExpertKey:
        if type(candidates) is Candidates:
            v = self._first(candidates, pos)
            if v is not None:
                return v
        if not candidates:
            raise RuntimeError(f"{self.name}: asked for a victim among no candidates")
        return min(candidates, key=self._rank)

    def _first(self, cands: Candidates, pos: Position) -> ExpertKey | None:
        """The victim when every candidate is tracked: the first candidate in the policy's order (None: scan)."""
        for k in self._last:  # LRU order
            if k in cands:
                return k
        return None

    def _rank(self, key: ExpertKey):  # smallest is evicted
        return self._age(key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def reuse_steps(self, key: ExpertKey, pos: Position, p: float | None = None) -> float | None:
        """Expected MoE layer steps from `pos` until `key` is used next, for the victim-aware prefetch gate (which
        compares a proposal's with its victim's); `p`: the probability that `key` is used when its layer next runs
        (a proposal's confidence), else the policy's own estimate. None: the policy does not predict it."""
        return None


class _HeapRanked(_Base):
    """A rank `(value(key), last use, key)` kept in a min-heap with lazy deletion: every touch pushes the key's
    current entry; an entry is live while its tick is the key's last use (a value only changes with a touch)."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[Any, int, ExpertKey]] = []

    def _value(self, key: ExpertKey) -> Any:
        raise NotImplementedError

    def _touch(self, key: ExpertKey) -> None:
        self._tick += 1
        last = self._last
        last.pop(key, None)
        last[key] = t = self._tick
        heap = self._heap
        heapq.heappush(heap, (self._value(key), t, key))
        if len(heap) > 4 * len(last) + 64:  # drop dead entries
            self._heap = [(self._value(k), t, k) for k, t in last.items()]
            heapq.heapify(self._heap)

    def _first(self, cands: Candidates, pos: Position) -> ExpertKey | None:
        return _heap_first(self._heap, self._last, cands)


def _heap_first(heap: list, last: dict[ExpertKey, int], cands: Candidates, out: Any = ()) -> ExpertKey | None:
    """Smallest live entry (`entry[-2] == last[key]`, key not in `out`) of `heap` whose key is a candidate;
    dead entries are dropped, live non-candidates are put back."""
    skipped = []
    found = None
    pop = heapq.heappop
    while heap:
        e = heap[0]
        k = e[-1]
        if last.get(k) != e[-2] or k in out:
            pop(heap)
        elif k in cands:
            found = k
            break
        else:
            skipped.append(pop(heap))
    for e in skipped:
        heapq.heappush(heap, e)
    return found


@EVICTION.register
class LRU(_Base):
    """Evict the least recently used resident expert (an insert, demand or prefetch, counts as a use)."""

    name = "lru"
    kernel = "lru"


@EVICTION.register
class LFU(_HeapRanked):
    """Evict the expert with the fewest accesses over the whole run; ties by LRU.

    Counts persist after eviction ("lowest access count over the entire inference history",
    SpecMD App. B), so a popular expert that was pushed out comes back with its history.
    """

    name = "lfu"
    kernel = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[ExpertKey, int] = {}

    def _value(self, key: ExpertKey) -> int:
        return self.count.get(key, 0)

    def on_access(self, key: ExpertKey, pos: Position, *, score: float) -> None:
        self.count[key] = self.count.get(key, 0) + 1
        self._touch(key)

    def _rank(self, key: ExpertKey):
        return (self.count.get(key, 0), *self._age(key))


@EVICTION.register
class LHU(_HeapRanked):
    """Least High-precision Used (HOBBIT): evict a slot holding a low-precision copy first (cheap to miss
    again), else the expert with the fewest accesses made while it was at full precision over the whole
    run (its miss costs a full copy); ties by LRU. The cache reports each slot's precision through
    `on_precision(key, bits)` (0 = full) on every load and cascade upgrade; with only full-precision loads
    (miss policy `fetch`) it is LFU over high-precision uses."""

    name = "lhu"
    hears_precision = True

    def __init__(self) -> None:
        super().__init__()
        self.bits: dict[ExpertKey, int] = {}  # resident key -> precision of its copy (0: full)
        self.hp_uses: dict[ExpertKey, int] = {}

    def _value(self, key: ExpertKey) -> tuple[bool, int]:
        return (self.bits.get(key, 0) == 0, self.hp_uses.get(key, 0))  # low precision (False) first

    def on_precision(self, key: ExpertKey, bits: int) -> None:
        self.bits[key] = int(bits)
        if key in self._last:  # an upgrade of a resident slot: its rank changes (counts as a use)
            self._touch(key)

    def on_access(self, key: ExpertKey, pos: Position, *, score: float) -> None:
        if self.bits.get(key, 0) == 0:
            self.hp_uses[key] = self.hp_uses.get(key, 0) + 1
        self._touch(key)

    def on_evict(self, key: ExpertKey) -> None:
        super().on_evict(key)
        self.bits.pop(key, None)

    def _rank(self, key: ExpertKey):
        return (*self._value(key), *self._age(key))


@EVICTION.register
class FLD(_Base):
    """Farthest Layer Distance: evict the expert whose layer is farthest ahead of the running layer.

    Distance is cyclic in execution order, d = (layer - current) mod L: layers ahead of the running
    one are near (d = 1, 2, ...), layers already passed are needed only in the next forward pass
    (d = L - 1 for the layer just run, the farthest). The running layer itself has d = 0. Layer
    indices are decoder-layer indices; only their order matters, so L is not needed. Ties by LRU.
    """

    name = "fld"

    def __init__(self) -> None:
        super().__init__()
        self._by_layer: dict[int, dict[ExpertKey, None]] = {}  # layer -> its tracked keys, LRU order
        self._layers: list[int] = []  # layers of `_by_layer`, sorted

    def _touch(self, key: ExpertKey) -> None:
        super()._touch(key)
        q = self._by_layer.get(key[0])
        if q is None:
            q = self._by_layer[key[0]] = {}
            insort(self._layers, key[0])
        q.pop(key, None)
        q[key] = None

    def on_evict(self, key: ExpertKey) -> None:
        super().on_evict(key)
        q = self._by_layer.get(key[0])
        if q is not None:
            q.pop(key, None)

    def _first(self, cands: Candidates, pos: Position) -> ExpertKey | None:
        # farthest first: layers already passed, latest first, then the running layer and those ahead, latest first
        layers, i = self._layers, bisect_left(self._layers, pos.layer)
        for l in (*reversed(layers[:i]), *reversed(layers[i:])):
            for k in self._by_layer[l]:  # LRU within the layer
                if k in cands:
                    return k
        return None

    def _dist(self, layer: int, current: int) -> tuple[int, int]:
        # lexicographic stand-in for (layer - current) mod L: passed layers are farther than any ahead
        return (1, layer) if layer < current else (0, layer)

    def victim(self, candidates: Sequence[ExpertKey], pos: Position) -> ExpertKey:
        if not candidates:
            raise RuntimeError("fld: asked for a victim among no candidates")
        if type(candidates) is Candidates:
            v = self._first(candidates, pos)
            if v is not None:
                return v
        far = max(self._dist(k[0], pos.layer) for k in candidates)
        return min((k for k in candidates if self._dist(k[0], pos.layer) == far), key=self._age)


@EVICTION.register
class ScoreBased(_HeapRanked):
    """Evict the expert with the lowest accumulated router (gate) score; ties by LRU.

    The history is kept per expert for the whole run, also while it is not resident (Zhu et al.:
    "a running history of gate scores"). A prefetched expert never routed yet has score 0.
    """

    name = "score"

    def __init__(self) -> None:
        super().__init__()
        self.score: dict[ExpertKey, float] = {}

    def _value(self, key: ExpertKey) -> float:
        return self.score.get(key, 0.0)

    def on_access(self, key: ExpertKey, pos: Position, *, score: float) -> None:
        self.score[key] = self.score.get(key, 0.0) + float(score)
        self._touch(key)

    def _rank(self, key: ExpertKey):
        return (self.score.get(key, 0.0), *self._age(key))


@EVICTION.register
class TwoLevelLRU(_Base):
    """ExpertFlow's two-level LRU (Sec. 3.3.1): LRU_high and LRU_low; victims come from LRU_low first.

    Promotion to high ("demonstrated high reuse potential"): an expert that is accessed again while
    resident (a cache hit), or that the prefetcher predicted (inserted by prefetch, or proposed while
    resident). A demand-loaded expert enters low. Demotion ("continuously updated"): the high tier
    holds at most `high_fraction` of the resident experts; when it overflows, its least recently used
    expert moves to low. Within a tier the order is LRU. An expert predicted but then evicted unused
    is not special: it simply ages out like the others.
    """

    name = "lru2"

    def __init__(self, high_fraction: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= high_fraction <= 1.0:
            raise ConfigError(f"lru2 high_fraction must be in [0, 1], got {high_fraction}")
        self.high_fraction = high_fraction
        self.high: dict[ExpertKey, None] = {}  # the high tier, LRU order (oldest first)
        self._fresh: set[ExpertKey] = set()
        self._low: list[tuple[int, ExpertKey]] = []  # lazy min-heap (last use, key) of the low tier

    def _touch(self, key: ExpertKey) -> None:
        super()._touch(key)
        high = self.high
        if key in high:  # keep the high tier in LRU order
            del high[key]
            high[key] = None
        else:
            heapq.heappush(self._low, (self._tick, key))
            if len(self._low) > 4 * len(self._last) + 64:
                self._low = [(t, k) for k, t in self._last.items() if k not in high]
                heapq.heapify(self._low)

    def _promote(self, key: ExpertKey) -> None:
        high = self.high
        high[key] = None  # just touched: the newest of the tier
        cap = int(self.high_fraction * len(self._last))
        while len(high) > cap:
            old = next(iter(high))  # demote the high tier's LRU
            del high[old]
            heapq.heappush(self._low, (self._last.get(old, 0), old))

    def on_insert(self, key: ExpertKey, pos: Position, *, prefetched: bool) -> None:
        super().on_insert(key, pos, prefetched=prefetched)
        if prefetched:
            self._promote(key)
        else:
            self._fresh.add(key)  # its first access is the miss that loaded it, not a reuse

    def on_access(self, key: ExpertKey, pos: Position, *, score: float) -> None:
        hit = key in self._last and key not in self._fresh
        self._fresh.discard(key)
        super().on_access(key, pos, score=score)
        if hit:
            self._promote(key)

    def on_predicted(self, key: ExpertKey, pos: Position) -> None:
        if key in self._last:
            self._touch(key)
            self._promote(key)

    def on_evict(self, key: ExpertKey) -> None:
        super().on_evict(key)
        self.high.pop(key, None)
        self._fresh.discard(key)

    def tier(self, key: ExpertKey) -> str:
        return "high" if key in self.high else "low"

    def _first(self, cands: Candidates, pos: Position) -> ExpertKey | None:
        v = _heap_first(self._low, self._last, cands, self.high)
        if v is None:
            for k in self.high:
                if k in cands:
                    return k
        return v

    def _rank(self, key: ExpertKey):
        return (key in self.high, *self._age(key))
