"""The compiled cache core: `ExpertCache`'s bookkeeping and six eviction policies as numba kernels over arrays.

One mechanism for the runtime and the simulator. With an eviction policy that declares a `kernel` (lru, lfu,
least-stale, belady-approx, next-use, and the simulator's Belady MIN) and a link whose copies complete at submit
(`Link.instant`: the simulator's instant link, the runtime's direct link), `ExpertCache` keeps every decision
and counter here (`moeflow.runtime.corecache.CacheCore`) and makes one kernel call per cache call (`k_call`:
demand, prefetch, release, begin_pass; begin_layer rides on the next call); the simulator's `k_replay`
replays a whole access stream through the same internal functions (`_demand`, `_prefetch`, `_release`,
`pol_pass_start`, `pol_layer_start`) in one call. Every other policy or link keeps the Python mechanism
(`ExpertCache`'s own methods and the policy's events), in the runtime and the simulator alike.

The kernels follow `ExpertCache`'s Python mechanism with an instant link step for step (hits pinned first,
misses in id order, each evicting the policy's victim; prefetches in priority order, resident proposals told
to the policy (`on_predicted`), a slot issued in the same call never a victim) and the Python policies' events
(`moeflow.policies.eviction`, `least_stale`, `belady_approx`, `next_use`, `moeflow.sim.belady.Belady`): the same
victims, the same counters (tests/test_sim_core.py checks both against the Python path on random streams).

State: ONE int64 array `I` (a header of sizes and section offsets, then every integer section), one float64
array `F` and one int64 array `X` (Belady MIN's next-use tables; empty otherwise): a call from Python unboxes
three arrays, and every kernel indexes them at `I[section offset] + i` (flat code compiles fast; `views` gives
Python numpy views of the sections); the mechanism, the dispatchers, the eviction structures and belady-approx
index through `_u(...)`, a cast to unsigned (indices here are never negative), so numba emits no negative-index
wraparound: 1.3-1.5x faster replays (lru 21 -> 31 M accesses per CPU second, belady-approx 3.7 -> 5.1, prefetch
none, `benchmarks/sim_speed.py`'s docstring). Keys are `rank * E + expert` (rank: the MoE layer's index), slots
`0..C-1`, -1 = none. Compiled once per machine (`cachecore_layout`).

Modules, one job each: `cachecore_layout` (the constants naming every section, `layout`, `views` and the
replay's arrays), `cachecore_struct` (record log, key lists, the candidate heap), `cachecore_policy` (the
policies' events), `cachecore_ba` (belady-approx's events), `cachecore_bav` (its victim
search), `cachecore_nu` (next-use), `cachecore_mech` (the mechanism),
`cachecore_replay` (the simulator's loop); this module: the runtime's entry point `k_call`, `warm`, and the
names the rest of moeflow uses.
"""

from __future__ import annotations

import numpy as np

from .cachecore_layout import (
    COUNTERS,
    H_C,
    H_E,
    H_K,
    H_L,
    H_PER,
    KIND_BA,
    KIND_LFU,
    KIND_LRU,
    KIND_LS,
    KIND_MIN,
    KIND_NU,
    KINDS,
    LOG_EVICT,
    LOG_LOAD,
    LOG_UPGRADE,
    NCNT,
    O_SC,
    OP_BEGIN_LAYER,
    OP_BEGIN_PASS,
    OP_DEMAND,
    OP_NONE,
    OP_PREFETCH,
    OP_RELEASE,
    SC_GENSEQ,
    SC_NLOG,
    SC_NRES,
    SC_PASS,
    SC_PENDL,
    SC_PHSEQ,
    SC_PSEQ,
    SC_TIME,
    Views,
    _jit,
    belady_tables,
    layout,
    pack_stream,
    replay_scratch,
    views,
)
from .cachecore_mech import _demand, _prefetch, _release
from .cachecore_policy import pol_layer_start, pol_pass_start
from .cachecore_replay import k_replay

__all__ = [
    "COUNTERS",
    "H_C",
    "H_E",
    "H_K",
    "H_L",
    "H_PER",
    "KINDS",
    "KIND_BA",
    "KIND_LFU",
    "KIND_LRU",
    "KIND_LS",
    "KIND_MIN",
    "KIND_NU",
    "LOG_EVICT",
    "LOG_LOAD",
    "LOG_UPGRADE",
    "NCNT",
    "OP_BEGIN_LAYER",
    "OP_BEGIN_PASS",
    "OP_DEMAND",
    "OP_NONE",
    "OP_PREFETCH",
    "OP_RELEASE",
    "SC_GENSEQ",
    "SC_NLOG",
    "SC_NRES",
    "SC_PENDL",
    "SC_PHSEQ",
    "SC_PSEQ",
    "SC_TIME",
    "Views",
    "belady_tables",
    "k_call",
    "k_call_entry",
    "k_replay",
    "layout",
    "pack_stream",
    "replay_scratch",
    "views",
    "warm",
]


@_jit
def k_call(I, F, X, op, arg, a, b, out):
    """One cache call. OP_DEMAND: rank `arg`, experts `a`, their bits `b`, slots -> `out`, returns -1 or the
    index of the expert no slot was found for; OP_PREFETCH: source rank `arg`, keys `a`, `b[0]` copies admitted
    (-1: all), (issued, admitted, refused) -> `out`; OP_RELEASE: slots `a`, `arg` = retain + 2 * upgrade;
    OP_BEGIN_PASS / OP_BEGIN_LAYER: pass / rank `arg`; OP_NONE: nothing. A layer start the Python side left
    pending in SC_PENDL (`CacheCore.begin_layer`: no call of its own) runs first."""
    sc = I[O_SC]
    I[sc + SC_NLOG] = 0
    if I[sc + SC_PENDL] >= 0:
        r = I[sc + SC_PENDL]
        I[sc + SC_PENDL] = -1
        pol_layer_start(I, F, r)
    if op == OP_DEMAND:
        return _demand(I, F, X, arg, a, b, out)
    if op == OP_PREFETCH:
        out[0] = out[1] = out[2] = 0
        _prefetch(I, F, X, arg, a, a.shape[0], b[0], out)
    elif op == OP_RELEASE:
        _release(I, F, a, a.shape[0], arg & 1, arg >> 1)
    elif op == OP_BEGIN_PASS:
        I[I[O_SC] + SC_PASS] = arg
        pol_pass_start(I, F, arg)
    elif op == OP_BEGIN_LAYER:
        pol_layer_start(I, F, arg)
    return -1


def k_call_entry():
    """`k_call`'s compiled entry for the argument types `CacheCore` passes (C-contiguous int64 / float64 arrays,
    int64 scalars): a call skips the dispatcher's type resolution (about 0.3 us of its 0.7 us). Only for
    those types: the entry converts nothing."""
    if not hasattr(k_call, "overloads"):  # pragma: no cover - numba missing: plain Python
        return k_call
    from numba import types as t

    a8, f8 = t.Array(t.int64, 1, "C"), t.Array(t.float64, 1, "C")
    sig = (a8, f8, a8, t.int64, t.int64, a8, a8, a8)
    k_call.compile(sig)
    return k_call.overloads[sig].entry_point


def warm() -> float:
    """Compile every kernel (or load it from numba's cache) on a tiny cache; the seconds it took. One compile
    serves every policy: the kind is data in `I`."""
    import time

    t0 = time.perf_counter()
    I, F = layout(C=2, L=2, E=2, per_layer=False, kind=KIND_LRU, log=True)
    X, none, out = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(3, np.int64)
    views(I, F).byb[:] = 1
    k_call(I, F, X, OP_BEGIN_PASS, 0, none, none, none)
    k_call(I, F, X, OP_BEGIN_LAYER, 0, none, none, none)
    views(I, F).sc[SC_PENDL] = 1
    k_call(I, F, X, OP_NONE, 0, none, none, none)
    k_call(I, F, X, OP_DEMAND, 0, np.array([0, 1]), np.zeros(2, np.int64), out)
    k_call(I, F, X, OP_PREFETCH, 0, np.array([2]), np.array([-1]), out)
    k_call(I, F, X, OP_RELEASE, 1, out[:2].copy(), none, none)
    I, F = layout(C=2, L=2, E=2, per_layer=False, kind=KIND_LRU, log=False)
    views(I, F).byb[:] = 1
    R = pack_stream([1], [1], [0, 2], [0, 1], [0, 1, 2], [0, 1], [0, 1, 1], [2])
    k_replay(
        I, F, X, R, replay_scratch(I), 2, -1, -1, np.zeros(7, np.int64), np.zeros((2, NCNT), np.int64), np.zeros((3, 2), np.int64)
    )
    return time.perf_counter() - t0
