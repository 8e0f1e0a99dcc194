"""The pass oracle: a reference between online eviction and Belady's MIN, for the simulator (not a user policy).

`PassOracle` is `next-use` (`moeflow.policies.next_use.NextUse`, calibrated online as usual) that also knows
exactly which experts the rest of the current forward pass routes to, and with `lookahead_passes=1` the whole
next pass as well (the next token's routing). Keys used within that window rank by their exact distance (in
MoE layer steps) to their first use there, nearest kept; every other key ranks after them, by next-use's own
estimate. So it is what the best exact online policy could do if its predictor of the pass in progress were
perfect: Belady's MIN knows the whole future, this one only the pass (or two). Its decode transfers bound what
prefetch-free eviction with a perfect within-pass predictor reaches; a run's transfers over the oracle's say
how much of the gap to Belady's MIN any online policy could still close.

    pass_oracle(acc, capacity, lookahead_passes=0, count_phase=1)   # -> SimStats, like `belady(...)`
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError
from ..policies.base import Position
from ..policies.next_use import NextUse
from .access import AccessTrace
from .simulator import SimStats, simulate


class PassOracle(NextUse):
    """`next-use` plus the exact routing of the rest of the current pass (and `lookahead_passes` more passes).

    Built from the access trace it will be replayed on; pass `pass_id` of the replay is `acc.passes[pass_id]`
    (the simulator numbers passes so)."""

    name: ClassVar[str] = "pass-oracle"
    kernel = None  # its victims come from the trace: never a compiled kernel (next-use has one)

    def __init__(self, acc: AccessTrace, lookahead_passes: int = 0, **opts: Any) -> None:
        super().__init__(**opts)
        if lookahead_passes not in (0, 1):
            raise ConfigError(f"pass oracle lookahead_passes must be 0 or 1, got {lookahead_passes}")
        self.window = 1 + int(lookahead_passes)  # passes known exactly, the current one included
        self.moe = np.asarray(acc.moe_layers, dtype=np.int64)  # [L] decoder layer of each MoE rank
        L, E = len(acc.moe_layers), acc.num_experts
        self.E = E
        rank = {l: r for r, l in enumerate(acc.moe_layers)}
        self.used = np.zeros((len(acc.passes), L, E), dtype=bool)  # [P,L,E] experts each pass routes to
        for i, p in enumerate(acc.passes):
            for s in p.steps:
                self.used[i, rank[s.layer], s.indices.reshape(-1)] = True
        self._grow(int(self.moe.max()), E - 1)

    def expected_next_use(self, pos: Position) -> np.ndarray:
        """Next-use's E[T] [NL,NE], with every key used in the known window at its exact distance (steps)."""
        out = super().expected_next_use(pos)  # [NL,NE]
        L, W = len(self.moe), self.window
        r0 = pos.layer_rank
        unknown = out[self.moe, : self.E] + W * L  # [L,E] after every key the window knows
        known = np.full(unknown.shape, np.inf)  # [L,E] first use in the window, steps from now
        ranks = np.arange(L)
        for j in reversed(range(W)):  # nearer passes last: they overwrite
            q = pos.pass_id + j
            if q >= len(self.used):
                continue
            t = (j * L + ranks - r0).astype(float)  # [L] steps from now to rank r of pass q
            rows = self.used[q] & (t > 0)[:, None]  # [L,E] (the current pass: layers after this one)
            known = np.where(rows, t[:, None], known)
        out[self.moe, : self.E] = np.minimum(unknown, known)
        return out


def pass_oracle(acc: AccessTrace, capacity: int, lookahead_passes: int = 0, **kw: Any) -> SimStats:
    """The pass oracle (`PassOracle`) on `acc` at `capacity` (demand paging, no prefetch), through the same
    cache as `belady(...)`; `kw` as `simulate` (e.g. `count_phase=1`: decode passes)."""
    st = simulate(acc, capacity, PassOracle(acc, lookahead_passes), "none", **kw)
    st.eviction = "pass-oracle" + ("+1" if lookahead_passes else "")
    return st
