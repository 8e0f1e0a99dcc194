"""Belady's MIN as an eviction policy over a known access trace: the bound every online policy is judged against."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from ..policies import EvictionPolicy, ExpertKey, Position
from ..policies.base import Candidates
from ..runtime.cachecore import belady_tables
from .access import AccessTrace
from .stream import stream


class Belady(EvictionPolicy):
    """MIN: the victim is the candidate whose next use (layer step) is farthest away (never = after the end);
    ties go to the larger key. Built from the access trace it will be replayed on (every pass, in the
    simulator's order); it counts layer steps from `on_layer_start`. Next uses are precomputed with numpy
    (`cachecore.belady_tables`, which the compiled core reads: `kernel`); the Python events look them up
    (one dict lookup per access); `victim` takes the top of a lazy max-heap of the resident keys' next uses,
    skipping keys that are not candidates (pinned), when the cache passes its `Candidates` view; any other
    sequence gets one C-level `max` over the candidates (the same victim: every key's score is distinct)."""

    name: ClassVar[str] = "belady"
    kernel = "belady"

    def __init__(self, acc: AccessTrace):
        st = stream(acc)
        self.E = acc.num_experts
        self.M = len(acc.moe_layers) * self.E
        self._rank = {l: r for r, l in enumerate(acc.moe_layers)}
        S, A = len(st.step_rank), st.accesses
        self.never = S + 1
        self._tables = belady_tables(st.exp_off, st.step_keys(self.E), self.M)
        X = self._tables
        self._step_keys = X[3 + S : 3 + S + A]  # [A] key of each access, by step
        self._next_of = X[3 + S + A : 3 + S + 2 * A]  # [A] the step of its key's next use
        self._key_off = X[3 + S + 2 * A : 4 + S + 2 * A + self.M]  # [K+1]
        self._key_steps = X[4 + S + 2 * A + self.M :]  # [A] per key, its access steps ascending
        self._exp_off = st.exp_off
        self._next: dict[int, int] | None = None  # code (step * M + key) -> step of the next use, on first use
        self._score: dict[ExpertKey, int] = {}  # resident key -> next use * M + key index (larger = evict)
        self._heap: list[tuple[int, ExpertKey]] = []  # (-score, key), lazy: live while it is the key's score
        self.step = -1

    def kernel_tables(self) -> np.ndarray:
        """The next-use tables the compiled core reads (`cachecore.belady_tables`)."""
        return self._tables

    def on_layer_start(self, pos: Position) -> None:
        self.step += 1

    def next_use(self, key: ExpertKey) -> int:
        """First use of `key` at or after the current step (`never` if none)."""
        ki = self._rank[key[0]] * self.E + key[1]
        lo, hi = int(self._key_off[ki]), int(self._key_off[ki + 1])
        i = lo + bisect.bisect_left(self._key_steps[lo:hi].tolist(), self.step)
        return int(self._key_steps[i]) if i < hi else self.never

    def victim(self, candidates: Sequence[ExpertKey], pos: Position) -> ExpertKey:
        if type(candidates) is Candidates:  # every candidate is resident, so scored
            heap, score = self._heap, self._score
            skipped, found = [], None
            while heap:
                neg, k = heap[0]
                if score.get(k) != -neg:
                    heapq.heappop(heap)  # dead: re-scored or evicted
                elif k in candidates:
                    found = k
                    break
                else:
                    skipped.append(heapq.heappop(heap))
            for e in skipped:
                heapq.heappush(heap, e)
            if found is not None:
                return found
        return max(candidates, key=self._score.__getitem__)

    def _set(self, key: ExpertKey, score: int) -> None:
        self._score[key] = score
        heap = self._heap
        heapq.heappush(heap, (-score, key))
        if len(heap) > 4 * len(self._score) + 64:  # drop dead entries
            self._heap = [(-v, k) for k, v in self._score.items()]
            heapq.heapify(self._heap)

    def on_insert(self, key, pos, *, prefetched):
        if prefetched:  # not accessed now: its next use from here
            self._set(key, self.next_use(key) * self.M + self._rank[key[0]] * self.E + key[1])

    def on_access(self, key, pos, *, score):
        if self._next is None:
            step_of = np.repeat(np.arange(len(self._exp_off) - 1), np.diff(self._exp_off))
            self._next = dict(zip((step_of * self.M + self._step_keys).tolist(), self._next_of.tolist()))
        ki = pos.layer_rank * self.E + key[1]
        self._set(key, self._next.get(self.step * self.M + ki, self.never) * self.M + ki)

    def on_evict(self, key):
        self._score.pop(key, None)

    def on_pass_start(self, pos):
        pass

    def on_predicted(self, key, pos):
        pass
