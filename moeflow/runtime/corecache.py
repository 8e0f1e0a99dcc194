"""`CacheCore`: one `ExpertCache`'s compiled bookkeeping (`moeflow.runtime.cachecore`) and the calls into it.

`ExpertCache` builds one when its eviction policy declares a `kernel` and its link's copies complete at submit
(`Link.instant`, with no transfer estimate: the prefetch gate then admits by its budget alone); every other
cache keeps the Python mechanism. The core owns the decisions (slot map, pins, free slots, counters, the
policy's state); the cache keeps what Python needs (tensors, tickets, `slot_of`, `slots`, the device table),
applying the evictions, loads and upgrades each call records (`records`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..policies.base import EvictionPolicy
from . import cachecore as cc
from .counters import CacheCounters

_ENTRY: list[Any] = []


def _entry() -> Any:
    if not _ENTRY:
        _ENTRY.append(cc.k_call_entry())
    return _ENTRY[0]


def kernel_kind(policy: Any) -> int | None:
    """The compiled kind (`cachecore.KIND_*`) of an eviction policy object, None for the Python mechanism.

    A policy opts in by declaring `kernel` (a name of `cachecore.KINDS`) on a class that subclasses
    `EvictionPolicy`; a wrapper that only forwards attributes (it is not a subclass) keeps the Python events."""
    if policy is None or EvictionPolicy not in type(policy).__mro__:
        return None
    name = policy.kernel
    return cc.KINDS.get(name) if name else None


@dataclass
class ReplayResult:
    """What `CacheCore.replay` measured: `out` [status, passes, tokens, proposed accesses, proposals, admitted,
    refused], `sums` [2, NCNT] (counters of prefill / decode passes), `per_layer` [3, L] (hits, accesses,
    collision misses of the counted passes)."""

    out: np.ndarray
    sums: np.ndarray
    per_layer: np.ndarray

    def phase_counters(self, phase: int) -> CacheCounters:
        return counters_of(self.sums[phase])


def counters_of(cnt: np.ndarray, into: CacheCounters | None = None) -> CacheCounters:
    """`into` (or new `CacheCounters`) with the integer counters of a core's counter array."""
    c = into if into is not None else CacheCounters()
    c.__dict__.update(zip(cc.COUNTERS, cnt.tolist()))  # a plain dataclass: one dict update, not 19 setattr
    return c


class CacheCore:
    """The state arrays of one cache and one method per cache call."""

    def __init__(
        self,
        *,
        capacity: int,
        num_layers: int,
        num_experts: int,
        per_layer: bool,
        kind: int,
        policy: Any,
        bytes_of_bits: Sequence[int],
        log: bool,
    ):
        opts: dict[str, Any] = {}
        if kind == cc.KIND_BA:
            opts = {"ema": float(policy.ema), "prior": float(policy.prior)}
        elif kind == cc.KIND_NU:
            opts = {"decay": policy.decay, "shrink": policy.shrink, "recency": policy.recency, "proposals": policy.proposals}
        self.kind, self.E, self.L = kind, num_experts, num_layers
        self.I, self.F = cc.layout(C=capacity, L=num_layers, E=num_experts, per_layer=per_layer, kind=kind, log=log, **opts)
        self.X = np.ascontiguousarray(policy.kernel_tables(), dtype=np.int64) if kind == cc.KIND_MIN else np.zeros(0, np.int64)
        st = cc.views(self.I, self.F)
        st.byb[:] = np.asarray(bytes_of_bits, dtype=np.int64)
        self.st = st
        self.per = int(st.hdr[cc.H_PER])
        self._call = _entry()  # `cachecore.k_call` without the dispatcher: every array below is C-contiguous
        self._res = np.zeros(3, dtype=np.int64)
        self._left = np.zeros(1, dtype=np.int64)
        self._none = np.zeros(0, dtype=np.int64)
        ex, out, zeros = (np.zeros(num_experts, dtype=np.int64) for _ in range(3))
        # views of n = 0..E elements, made once: a call slices nothing (one layer's experts at most)
        self._ex, self._out, self._zeros = ([x[:n] for n in range(num_experts + 1)] for x in (ex, out, zeros))

    # ---- state ------------------------------------------------------------------------------------------
    @property
    def time(self) -> int:
        return int(self.st.sc[cc.SC_TIME])

    @property
    def num_resident(self) -> int:
        return int(self.st.sc[cc.SC_NRES])

    def counters(self, into: CacheCounters) -> CacheCounters:
        """`into` with every integer counter set from the core (`stall_s` is the Python cache's)."""
        return counters_of(self.st.cnt, into)

    def records(self) -> list[list[int]]:
        """The last call's evictions, loads and upgrades: [op, slot, key, arg] (`cachecore.LOG_*`)."""
        n = int(self.st.sc[cc.SC_NLOG])
        return self.st.log[:n].tolist() if n else []

    def resident(self) -> list[tuple[int, int]]:
        """(slot, key) of every resident slot."""
        skey = self.st.skey
        return [(s, int(skey[s])) for s in np.flatnonzero(skey >= 0).tolist()]

    # ---- calls --------------------------------------------------------------------------------------------
    def mark_phase(self, new_generation: bool) -> None:
        sc = self.st.sc
        sc[cc.SC_PHSEQ] = sc[cc.SC_PSEQ]
        if new_generation:
            sc[cc.SC_GENSEQ] = sc[cc.SC_PSEQ]

    def begin_pass(self, pass_id: int) -> None:
        self._call(self.I, self.F, self.X, cc.OP_BEGIN_PASS, int(pass_id), self._none, self._none, self._none)

    def begin_layer(self, rank: int) -> None:
        """Left pending in the state: the next kernel call starts the layer first (one call fewer per layer)."""
        sc = self.st.sc
        if sc[cc.SC_PENDL] >= 0:
            self._flush()
        sc[cc.SC_PENDL] = rank

    def _flush(self) -> None:
        self._call(self.I, self.F, self.X, cc.OP_NONE, 0, self._none, self._none, self._none)

    def demand(self, rank: int, experts: Sequence[int], bits: dict[int, int] | None) -> list[int]:
        n = len(experts)
        ex, out = self._ex[n], self._out[n]
        ex[:] = experts
        nb = self._zeros[n]
        if bits:
            nb = np.fromiter((bits.get(e, 0) for e in experts), dtype=np.int64, count=n)
        i = self._call(self.I, self.F, self.X, cc.OP_DEMAND, int(rank), ex, nb, out)
        if i >= 0:
            raise RuntimeError(f"no evictable slot for MoE layer #{rank}'s expert {int(ex[i])}: all {self.per} are pinned")
        return out.tolist()

    def prefetch(self, rank: int, keys: Sequence[int], left: int) -> tuple[int, int, int]:
        """Keys (`rank * E + expert`, -1: skipped) in priority order; `left` copies admitted (-1: all).
        Returns (issued, admitted, refused)."""
        ks = np.fromiter(keys, dtype=np.int64, count=len(keys))
        res = self._res
        self._left[0] = left
        self._call(self.I, self.F, self.X, cc.OP_PREFETCH, int(rank), ks, self._left, res)
        issued, admitted, refused = res.tolist()
        return issued, admitted, refused

    def release(self, slots: Sequence[int], retain: bool, upgrade: bool) -> bool:
        """Unpin `slots` (evicting them without `retain`, queueing upgrades with `upgrade`); True when that
        evicted or upgraded something (`records`)."""
        ss = self._ex[len(slots)]
        ss[:] = slots
        self._call(self.I, self.F, self.X, cc.OP_RELEASE, int(retain) + 2 * int(upgrade), ss, self._none, self._none)
        return bool(self.st.sc[cc.SC_NLOG])

    def replay(self, stream: Any, proposals: Any, *, wave_cap: int, count_phase: int | None, left: int) -> ReplayResult:
        """A whole access stream (`moeflow.sim.stream.Stream`) and its proposals (`Proposals` or None) in one
        kernel call, as the simulator's loop makes the cache calls."""
        if self.st.sc[cc.SC_PENDL] >= 0:
            self._flush()
        out = np.zeros(7, dtype=np.int64)
        sums = np.zeros((2, cc.NCNT), dtype=np.int64)
        per_layer = np.zeros((3, self.L), dtype=np.int64)
        R = stream.packed(proposals)
        count = -1 if count_phase is None else int(count_phase)
        W = cc.replay_scratch(self.I)
        wcap = min(int(wave_cap), self.E)  # a step has at most E experts: a larger wave never splits
        cc.k_replay(self.I, self.F, self.X, R, W, wcap, count, int(left), out, sums, per_layer)
        if out[0] >= 0:
            raise RuntimeError(f"no evictable slot at step {int(out[0])}: every slot of the cache is pinned")
        return ReplayResult(out, sums, per_layer)
