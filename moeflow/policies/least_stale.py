"""SpecMD's Least-Stale eviction (Sec. 4.2): stale (previous-pass) experts first, FIFO by layer."""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence

from ..errors import ConfigError
from .base import EVICTION, Candidates, ExpertKey, Position
from .eviction import _Base


@EVICTION.register
class LeastStale(_Base):
    """SpecMD's Least-Stale (Sec. 4.2).

    An expert is *current* if it was accessed in this forward pass or selected by prefetching in this
    pass (inserted by prefetch, or proposed while resident); otherwise it is *stale* (accessed in a
    previous pass). At every pass start all current experts become stale. Victims come from the stale
    queue; the current queue is used only when no stale expert is a candidate (to avoid running out of
    space). Within each queue the order is FIFO by layer position: lowest MoE layer first, which is the
    order the pass visited them; ties (same layer) by the time the expert entered the queue.

    `right="farthest"` is a variant for study, not the paper's: within a queue, experts of layers
    already passed in this pass go first (FIFO by layer), then those of layers still ahead, farthest
    first.
    """

    name = "least-stale"

    def __init__(self, right: str = "fifo") -> None:
        super().__init__()
        if right not in ("fifo", "farthest"):
            raise ConfigError(f"least-stale right must be 'fifo' (SpecMD) or 'farthest', got {right!r}")
        self.right = right
        self.kernel = "least-stale" if right == "fifo" else None  # the variant keeps the Python events
        self.pass_id = -1
        self.current: set[ExpertKey] = set()
        self._entered: dict[ExpertKey, int] = {}  # when the key entered its queue (FIFO tie-break)
        self._seq = 0
        # the queues by layer, each in entering order: layer -> keys (stale: not current; current)
        self._stale_q: dict[int, dict[ExpertKey, None]] = {}
        self._cur_q: dict[int, dict[ExpertKey, None]] = {}
        self._layers: list[int] = []  # layers of the queues, sorted

    def _queue(self, qs: dict[int, dict[ExpertKey, None]], layer: int) -> dict[ExpertKey, None]:
        q = qs.get(layer)
        if q is None:
            if layer not in self._stale_q and layer not in self._cur_q:
                insort(self._layers, layer)
            q = qs[layer] = {}
        return q

    def _enter(self, key: ExpertKey) -> None:
        self._seq += 1
        entered = self._entered
        if key in entered:  # leave the queue it was in (`current` may have just changed)
            for qs in (self._stale_q, self._cur_q):
                q = qs.get(key[0])
                if q is not None:
                    q.pop(key, None)
        entered[key] = self._seq
        self._queue(self._cur_q if key in self.current else self._stale_q, key[0])[key] = None

    def _make_current(self, key: ExpertKey, pos: Position) -> None:
        if pos.pass_id != self.pass_id:
            self.on_pass_start(pos)
        if key not in self.current:  # `_enter` into the current queue, leaving the stale one
            self.current.add(key)
            self._seq += 1
            l = key[0]
            if key in self._entered:
                sq = self._stale_q.get(l)
                if sq is not None:
                    sq.pop(key, None)
            self._entered[key] = self._seq
            q = self._cur_q.get(l)
            if q is None:
                q = self._queue(self._cur_q, l)
            q[key] = None

    def _sync(self, pos: Position) -> None:
        if pos.pass_id != self.pass_id:  # robust if on_pass_start was not reported
            self.on_pass_start(pos)

    def on_pass_start(self, pos: Position) -> None:
        if pos.pass_id == self.pass_id:
            return
        self.pass_id = pos.pass_id
        # current -> stale, keeping layer order (the stale queue is FIFO by layer)
        for k in sorted(self.current, key=lambda k: (k[0], self._entered.get(k, 0))):
            self._seq += 1
            self._entered[k] = self._seq
            self._cur_q.get(k[0], {}).pop(k, None)
            self._queue(self._stale_q, k[0])[k] = None
        self.current.clear()

    def on_insert(self, key: ExpertKey, pos: Position, *, prefetched: bool) -> None:
        super().on_insert(key, pos, prefetched=prefetched)
        if prefetched:
            self._make_current(key, pos)
        else:
            self._sync(pos)
            self._enter(key)  # demand load: stale until the access that follows makes it current

    def on_access(self, key: ExpertKey, pos: Position, *, score: float) -> None:
        super().on_access(key, pos, score=score)
        self._make_current(key, pos)

    def on_predicted(self, key: ExpertKey, pos: Position) -> None:
        if key in self._last:
            self._make_current(key, pos)

    def on_evict(self, key: ExpertKey) -> None:
        super().on_evict(key)
        if self._entered.pop(key, None) is not None:
            q = (self._cur_q if key in self.current else self._stale_q).get(key[0])
            if q is not None:
                q.pop(key, None)
        self.current.discard(key)

    def is_stale(self, key: ExpertKey) -> bool:
        return key not in self.current

    def victim(self, candidates: Sequence[ExpertKey], pos: Position) -> ExpertKey:
        if not candidates:
            raise RuntimeError("least-stale: asked for a victim among no candidates")
        self._sync(pos)
        if self.right == "fifo" and type(candidates) is Candidates:
            for qs in (self._stale_q, self._cur_q):  # stale queue first; by layer, then entering order
                for l in self._layers:
                    q = qs.get(l)
                    if q:
                        for k in q:
                            if k in candidates:
                                return k
        stale = [k for k in candidates if k not in self.current]
        queue = stale or list(candidates)
        if self.right == "fifo":
            return min(queue, key=lambda k: (k[0], self._entered.get(k, 0), k))
        # variant: passed layers FIFO by layer, then layers ahead farthest first
        return min(queue, key=lambda k: (0, k[0]) if k[0] < pos.layer else (1, -k[0]))
