"""The compiled cache core's state layout: the jit decorators, the constants that name every section and
column, and the host-side builders of the arrays the kernels read (`layout`, `views`, `pack_stream`,
`replay_scratch`, `belady_tables`). The kernels themselves: `cachecore` (its overview), `cachecore_struct`,
`cachecore_policy`, `cachecore_ba`, `cachecore_bav`, `cachecore_mech`, `cachecore_replay`.

Kernels are compiled once per machine (`cache=True`: next to these files, or numba's user-wide cache when that
is read-only; with neither, once per process). numba stamps a cached kernel with its own file only, while a
kernel here inlines functions of the other `cachecore*` modules: `_CoreStamp` stamps every core function with
all of their sources, so an edit to any of them recompiles every kernel.
"""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path
from typing import Any

import numpy as np

from ..numba_cache import file_digest, njit_cached, stamped_locators

try:  # an index cast to unsigned skips numba's negative-index wraparound (the kernels' indices are never negative)
    from numba import uintp as _u
except ImportError:  # pragma: no cover - without numba the kernels run as Python
    _u = int  # type: ignore[assignment]

_HERE = Path(__file__).resolve().parent
_SHARED = (_HERE.parent / "policies" / "next_use_sums.py",)  # outside this folder, inlined by the kernels
_STAMP: list[str] = []


def _core_stamp() -> str:
    """A digest of every `cachecore*.py` source and of next-use's shared float routines (computed once per process)."""
    if not _STAMP:
        _STAMP.append(file_digest([*sorted(_HERE.glob("cachecore*.py")), *_SHARED]))
    return _STAMP[0]


def _stamped_locators() -> list[type]:
    """numba's cache locators stamped with every core source (`_core_stamp`), for the core's functions only; []
    when numba's caching internals differ from the ones this was written for."""
    return stamped_locators(lambda p: p.parent == _HERE and p.name.startswith("cachecore"), _core_stamp)


# numba caches compiled kernels next to this file, or in its user-wide cache when that is read-only
_OPTS: dict[str, Any] = dict(nogil=True, error_model="numpy", _nrt=False)  # no exception paths, no reference counting
_CACHE = bool(_stamped_locators())  # without the stamp, a stale kernel could survive an edit: no cache


def _jit(fn):  # a kernel called from Python
    return njit_cached(fn, _CACHE, **_OPTS)


def _fn(fn):  # a function only kernels call: no Python entry to compile
    return njit_cached(fn, _CACHE, no_cpython_wrapper=True, no_cfunc_wrapper=True, **_OPTS)


def _inline(fn):  # a small function only kernels call, on their per-access paths: inlined into them (numba
    # inline='always': the call, its argument moves and the state offsets it reloads cost more than its body;
    # inlining the dispatchers, the mechanism's steps and the list helpers made lru 1.5x faster, lfu 1.3x)
    return njit_cached(fn, _CACHE, inline="always", no_cpython_wrapper=True, no_cfunc_wrapper=True, **_OPTS)


# ---- policy kinds ---------------------------------------------------------------------------------------
KIND_LRU, KIND_LFU, KIND_LS, KIND_BA, KIND_MIN, KIND_NU = 1, 2, 3, 4, 5, 6
KINDS = {
    "lru": KIND_LRU,
    "lfu": KIND_LFU,
    "least-stale": KIND_LS,
    "belady-approx": KIND_BA,
    "belady": KIND_MIN,
    "next-use": KIND_NU,
}

# ---- counters: `CacheCounters`' integer fields, in this order (moeflow.runtime.counters) ------------------
COUNTERS = (
    "accesses",
    "hits",
    "misses",
    "late",
    "loads",
    "demand_loads",
    "prefetch_issued",
    "prefetch_used",
    "prefetch_used_prior_phase",
    "prefetch_used_prior_generation",
    "prefetch_unused_evicted",
    "prefetch_refused",
    "prefetch_cancelled",
    "collision_misses",
    "evictions",
    "bytes_moved",
    "lowbit_loads",
    "lowbit_hits",
    "upgrades",
)
(
    C_ACC,
    C_HIT,
    C_MISS,
    C_LATE,
    C_LOADS,
    C_DEM,
    C_PFI,
    C_PFU,
    C_PFU_PH,
    C_PFU_GEN,
    C_PF_UNUSED,
    C_REFUSED,
    C_CANCELLED,
    C_COLL,
    C_EVICT,
    C_BYTES,
    C_LB_LOADS,
    C_LB_HITS,
    C_UPGRADES,
) = range(len(COUNTERS))
NCNT = len(COUNTERS)

# ---- header of I: sizes, then section offsets ----------------------------------------------------------------
(
    H_C,  # slots
    H_K,  # keys (L * E)
    H_L,  # MoE layers
    H_E,  # experts per layer
    H_PARTS,  # 1, or L with per_layer
    H_PER,  # slots per part
    H_PERLAYER,
    H_KIND,
    H_LOGCAP,
    H_HCAP,  # heap capacity
    H_LOGON,  # 1: record evictions / loads / upgrades for the Python mirror (runtime)
    O_SC,
    O_CNT,
    O_SKEY,
    O_PIN,
    O_PREF,
    O_USED,
    O_BITS,
    O_ISS,
    O_PROT,
    O_SOF,
    O_EVP,
    O_RES,
    O_FREE,
    O_NFREE,
    O_BYB,
    O_LOG,
    O_PK,
    O_LST,
    O_HEAP,
    O_HSKIP,
    O_PG,
    O_SEEN,
    O_SRANK,
    O_PLIST,
    O_ISL,
    O_SRK,
    O_SREF,  # belady-approx, per slot: its key's PK_REF, PK_PPASS (NEVER_PASS: no proposal) and PK_PAHEAD
    O_SPP,
    O_SPA,
    O_HPOS,  # belady: each key's position in the heap (-1: none)
    O_LSL,  # belady-approx, next-use: per layer its resident slots [L, C], their number [L], each slot's index there [C]
    O_LSN,
    O_SPOS,
    O_BREF,  # belady-approx, per layer: <= the least and <= the second least PK_REF of its resident keys [2, L]
    O_BNOINT,  # belady-approx, per layer: how many of its resident keys have no interval EMA [L]
    O_BSCAN,  # belady-approx: the layers a victim search scanned [L]
    O_BPROP,  # belady-approx, per layer: >= the latest pass a resident key was proposed in [L]
    O_BIN,  # belady-approx, per slot: 1 if counted in its layer's bounds (every candidate is; `cachecore_bav`) [C]
    O_KR,  # each key's layer rank (`key // E`: a lookup, not a division) [K]
    O_BK,  # lfu: count buckets, each (count, first key, last key, previous bucket, next bucket, candidates) [C + 2, 6]
    O_BKF,  # lfu: the free buckets (a stack of PG_NBFREE) [C + 2]
    O_BKH,  # lfu: each part's bucket of the least count, then of the largest (-1: none) [2, parts]
    O_NU,  # next-use's integers: NU_* scalars, then per key, per expert, per layer (`cachecore_nu`)
    OF_PKF,
    OF_PGF,
    OF_PAH,
    OF_FAR,
    OF_SIV,  # belady-approx, per slot: its key's interval EMA (-1: none)
    OF_BIV,  # belady-approx, per layer: >= the largest and >= the second largest interval EMA of its keys [2, L]
    OF_UB,  # belady-approx, per layer: the bound of a victim search [L]
    OF_NU,  # next-use's floats: NUF_* scalars and tables, then per key, per layer (`cachecore_nu`)
    NHDR,
) = range(63)

# mechanism scalars (sc)
SC_TIME, SC_PASS, SC_PSEQ, SC_PHSEQ, SC_GENSEQ, SC_NLOG, SC_NRES, SC_PENDL, NSC = range(9)  # PENDL: `k_call`
# per-key policy columns (pk)
(
    PK_TR,  # tracked (inserted, not evicted)
    PK_LAST,  # tick of the last insert or access (`_Base._last`)
    PK_PREV,  # linked lists: LRU order per part, Least-Stale's queues per layer
    PK_NEXT,
    PK_CNT,  # lfu: accesses over the whole run
    PK_SCORE,  # belady: next use * K + key
    PK_CUR,  # least-stale: current
    PK_ENT,  # least-stale: in a queue
    PK_HASLU,  # belady-approx: last access pass known
    PK_LASTUSE,
    PK_REF,  # belady-approx: pass of the last access or load
    PK_HASPRED,  # belady-approx: a proposal pending
    PK_PPASS,
    PK_PAHEAD,
    PK_PIDX,  # its index in the pending list
    PK_HASINT,  # belady-approx: an interval EMA exists
    PK_NU,  # belady: the step of the next use after the key's last access (-1: not accessed yet)
    PK_HA,  # belady: the key's heap entry (a, b), kept while it is out of the heap (pinned, just issued)
    PK_HB,
    PK_BKT,  # lfu: the key's count bucket (-1: none; resident keys, pinned ones too, from their first access)
    PK_BKC,  # lfu: counted among its bucket's candidates
    NPK,
) = range(22)
# policy scalars (pg)
PG_TICK, PG_HSIZE, PG_LSPASS, PG_STEP, PG_NSEEN, PG_NINTS, PG_NPRED, PG_NBFREE, PG_PMINOK, NPG = range(10)
# policy float scalars (pgf)
PGF_MEAN, PGF_EMA, PGF_PRIOR, PGF_PMIN, NPGF = range(5)  # PMIN: belady-approx's least calibrated probability
# (the least of OF_PAH) while PG_PMINOK
# next-use (`moeflow.policies.next_use.NextUse`), integers at I[O_NU]: scalars, then used_pass [K], prop_pass [K]
# (-1: none), the running layer's per-expert bucket, recent, proposed, resident [4, E], per layer: its row sum is
# stale, the pass of its last run, covered by proposals, its victim-search terms are stale [4, L]
(
    NU_RUN,  # the layer (rank) whose run is in progress (-1: none)
    NU_RUNPASS,  # its pass
    NU_RUNCOV,  # the prefetch policy predicted it in that pass
    NU_RUNNEXP,  # the experts seen when it started
    NU_CPASS,  # pass of the latest proposal (-1)
    NU_CSRC,  # rank (among the layers seen) of its source layer
    NU_CSTEPS,  # the largest distance proposals were seen at
    NU_NEXP,  # experts seen so far (the Python arrays' width: row sums run over it)
    NU_RECENCY,
    NU_PROPOSALS,
    NU_TVALID,  # every layer's victim-search terms hold for (NU_R0, NU_TPASS) (0: recompute them all)
    NU_R0,
    NU_TPASS,
    NNU,
) = range(14)
# floats at F[I[OF_NU]]: scalars, the calibration counts, their ratios, then uses [K], and per layer: passes,
# the row sum of uses, and a victim search's terms: shrink * mean, passes + shrink, steps until the layer runs,
# <= the least uses of its resident keys, its bound and a working copy [8, L]
NUF_DECAY, NUF_SHRINK, NUF_REC_USED, NUF_REC_SEEN, NUF_PROP_USED, NUF_PROP_SEEN = 0, 1, 2, 18, 34, 36
NUF_RATIO, NUF_PP, NUF_SUFMIN = 38, 54, 56  # rec_used / rec_seen [16], prop_used / prop_seen [2], the least
NNUF = 64  #   recency ratio of a bucket or any above [8]
NU_BUCKETS = 8
NU_NO_USES = 1e300  # the least uses of a layer with no resident key

# log records: (op, slot, key, arg)
LOG_EVICT, LOG_LOAD, LOG_UPGRADE = 1, 2, 3
NEVER_PASS = -(1 << 62)  # `_evicted_in_pass` of a key never evicted
NO_REF = 1 << 62  # O_BREF of a layer with no resident key

# entry point ops (`k_call`)
OP_NONE, OP_DEMAND, OP_PREFETCH, OP_RELEASE, OP_BEGIN_PASS, OP_BEGIN_LAYER = 0, 1, 2, 3, 4, 5

Views = namedtuple(
    "Views",
    "hdr sc cnt skey pin pref used bits iss prot sof evp res free nfree byb log pk lst heap pg seen srank hpos pkf pgf pah",
)


def layout(
    *,
    C: int,
    L: int,
    E: int,
    per_layer: bool,
    kind: int,
    log: bool,
    ema: float = 0.3,
    prior: float = 0.5,
    decay: float = 0.9,
    shrink: float = 4.0,
    recency: bool = True,
    proposals: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Fresh state arrays (I, F) for a cache of C slots over L MoE layers x E experts (`kind`: KIND_*;
    belady-approx's `ema`, `prior`; next-use's `decay`, `shrink`, `recency`, `proposals`)."""
    K = L * E
    parts = L if per_layer else 1
    per = C // L if per_layer else C
    logcap = 2 * K + 16
    hcap = C + 2
    sizes = [
        (O_SC, NSC),
        (O_CNT, NCNT),
        (O_SKEY, C),
        (O_PIN, C),
        (O_PREF, C),
        (O_USED, C),
        (O_BITS, C),
        (O_ISS, C),
        (O_PROT, C),
        (O_SOF, K),
        (O_EVP, K),
        (O_RES, L),
        (O_FREE, max(1, parts * per)),
        (O_NFREE, parts),
        (O_BYB, 9),
        (O_LOG, logcap * 4),
        (O_PK, K * NPK),
        (O_LST, 2 * L * 2),
        (O_HEAP, hcap * 3),
        (O_HSKIP, hcap * 3),
        (O_PG, NPG),
        (O_SEEN, L),
        (O_SRANK, L),
        (O_PLIST, K),
        (O_ISL, C),
        (O_SRK, C),
        (O_SREF, C),
        (O_SPP, C),
        (O_SPA, C),
        (O_HPOS, K),
        (O_LSL, L * C),
        (O_LSN, L),
        (O_SPOS, C),
        (O_BREF, 2 * L),
        (O_BNOINT, L),
        (O_BSCAN, L),
        (O_BPROP, L),
        (O_BIN, C),
        (O_KR, K),
        (O_BK, 6 * (C + 2)),
        (O_BKF, C + 2),
        (O_BKH, 2 * parts),
        (O_NU, NNU + 2 * K + 4 * E + 4 * L),
    ]
    hdr = np.zeros(NHDR, np.int64)
    off = NHDR
    for o, n in sizes:
        hdr[o] = off
        off += n
    fsizes = [
        (OF_PKF, K),
        (OF_PGF, NPGF),
        (OF_PAH, L + 2),
        (OF_FAR, C),
        (OF_SIV, C),
        (OF_BIV, 2 * L),
        (OF_UB, L),
        (OF_NU, NNUF + K + 8 * L),
    ]
    foff = 0
    for o, n in fsizes:
        hdr[o] = foff
        foff += n
    hdr[H_C], hdr[H_K], hdr[H_L], hdr[H_E] = C, K, L, E
    hdr[H_PARTS], hdr[H_PER], hdr[H_PERLAYER], hdr[H_KIND] = parts, per, int(per_layer), kind
    hdr[H_LOGCAP], hdr[H_HCAP], hdr[H_LOGON] = logcap, hcap, int(log)
    I = np.zeros(off, np.int64)
    F = np.zeros(foff, np.float64)
    I[:NHDR] = hdr
    v = views(I, F)
    v.skey[:] = -1
    v.sof[:] = -1
    v.evp[:] = NEVER_PASS
    v.sc[SC_PASS] = -1
    v.sc[SC_PENDL] = -1
    for p in range(parts):  # `reversed(part slots)`: popping from the end gives the part's first slot first
        v.free[p * per : (p + 1) * per] = np.arange(p * per + per - 1, p * per - 1, -1)
        v.nfree[p] = per
    v.pk[:, PK_PREV] = -1
    v.pk[:, PK_NEXT] = -1
    v.pk[:, PK_NU] = -1
    v.pk[:, PK_BKT] = -1
    v.hpos[:] = -1
    v.lst[:] = -1
    v.pg[PG_LSPASS] = -1
    v.pg[PG_STEP] = -1
    v.pgf[PGF_MEAN], v.pgf[PGF_EMA], v.pgf[PGF_PRIOR] = 1.0, ema, prior
    v.pah[:] = prior
    I[I[O_BREF] : I[O_BREF] + 2 * L] = NO_REF
    F[I[OF_BIV] : I[OF_BIV] + 2 * L] = -1.0
    I[I[O_BPROP] : I[O_BPROP] + L] = NEVER_PASS
    I[I[O_KR] : I[O_KR] + K] = np.arange(K) // E
    I[I[O_BKF] : I[O_BKF] + C + 2] = np.arange(C + 2)
    I[I[O_BKH] : I[O_BKH] + 2 * parts] = -1
    v.pg[PG_NBFREE] = C + 2
    nu, fu = int(I[O_NU]), int(I[OF_NU])
    I[nu + NU_RUN], I[nu + NU_CPASS], I[nu + NU_CSRC] = -1, -1, -1
    I[nu + NU_RECENCY], I[nu + NU_PROPOSALS] = int(recency), int(proposals)
    I[nu + NNU : nu + NNU + 2 * K] = -1  # used_pass, prop_pass
    I[nu + NNU + 2 * K + 4 * E : nu + NNU + 2 * K + 4 * E + L] = 1  # every row sum stale
    F[fu + NUF_DECAY], F[fu + NUF_SHRINK] = decay, shrink
    F[fu + NUF_REC_USED : fu + NUF_REC_SEEN] = 1.0  # Laplace-smoothed counts (`NextUse.rec_used`, ...)
    F[fu + NUF_REC_SEEN : fu + NUF_PROP_USED] = 2.0
    F[fu + NUF_PROP_USED : fu + NUF_PROP_SEEN] = 1.0
    F[fu + NUF_PROP_SEEN], F[fu + NUF_PROP_SEEN + 1] = 8.0, 2.0
    F[fu + NNUF + K + 5 * L : fu + NNUF + K + 6 * L] = NU_NO_USES
    return I, F


def views(I: np.ndarray, F: np.ndarray) -> Views:
    """Numpy views of the state's sections (Python side; the kernels index `I` and `F` directly)."""
    C, K, L = int(I[H_C]), int(I[H_K]), int(I[H_L])
    lc, hc = int(I[H_LOGCAP]), int(I[H_HCAP])

    def sec(o: int, n: int) -> np.ndarray:
        return I[I[o] : I[o] + n]

    return Views(
        I[:NHDR],
        sec(O_SC, NSC),
        sec(O_CNT, NCNT),
        sec(O_SKEY, C),
        sec(O_PIN, C),
        sec(O_PREF, C),
        sec(O_USED, C),
        sec(O_BITS, C),
        sec(O_ISS, C),
        sec(O_PROT, C),
        sec(O_SOF, K),
        sec(O_EVP, K),
        sec(O_RES, L),
        sec(O_FREE, max(1, int(I[H_PARTS] * I[H_PER]))),
        sec(O_NFREE, int(I[H_PARTS])),
        sec(O_BYB, 9),
        sec(O_LOG, lc * 4).reshape(lc, 4),
        sec(O_PK, K * NPK).reshape(K, NPK),
        sec(O_LST, 4 * L).reshape(2 * L, 2),
        sec(O_HEAP, hc * 3).reshape(hc, 3),
        sec(O_PG, NPG),
        sec(O_SEEN, L),
        sec(O_SRANK, L),
        sec(O_HPOS, K),
        F[I[OF_PKF] : I[OF_PKF] + K],
        F[I[OF_PGF] : I[OF_PGF] + NPGF],
        F[I[OF_PAH] : I[OF_PAH] + L + 2],
    )


# ---- the replay's arrays ----------------------------------------------------------------------------------


def replay_scratch(I: np.ndarray) -> np.ndarray:
    """Zeroed scratch for `k_replay` (the kernels allocate nothing)."""
    K, E = int(I[H_K]), int(I[H_E])
    return np.zeros(2 * K + 4 * E + 3 + NCNT, dtype=np.int64)


def pack_stream(phase, tokens, pass_off, step_rank, exp_off, experts, prop_off=None, prop_keys=None) -> np.ndarray:
    """`R` for `k_replay`: [P, S, A, Q (-1: no proposals), phase [P], tokens [P], pass_off [P+1], step_rank [S],
    exp_off [S+1], experts [A], (prop_off [S+1], prop_keys [Q])]: per pass its steps, per step its MoE layer
    rank and ascending experts, and the prefetch keys of each step in issue order."""
    P, S, A = len(phase), len(step_rank), len(experts)
    Q = -1 if prop_off is None else len(prop_keys)
    parts = [np.array([P, S, A, Q]), phase, tokens, pass_off, step_rank, exp_off, experts]
    if prop_off is not None:
        parts += [prop_off, prop_keys]
    return np.concatenate([np.asarray(x, dtype=np.int64) for x in parts])


def belady_tables(step_off: np.ndarray, step_keys: np.ndarray, K: int) -> np.ndarray:
    """`X` for Belady's MIN over a stream of S steps (`step_off` [S+1], each step's keys ascending in
    `step_keys` [A]): [S, A, step_off, step_keys, the next step each access's key is used again (S + 1: never)
    [A], per key the offsets [K+1] of its access steps, ascending [A]]."""
    S, A = len(step_off) - 1, len(step_keys)
    step_of = np.repeat(np.arange(S, dtype=np.int64), np.diff(step_off))  # [A]
    keys = step_keys.astype(np.int64)
    order = np.lexsort((step_of, keys))  # by key, then step
    k_sorted, s_sorted = keys[order], step_of[order]
    nxt_sorted = np.full(A, S + 1, dtype=np.int64)
    same = k_sorted[1:] == k_sorted[:-1]
    nxt_sorted[:-1][same] = s_sorted[1:][same]
    nxt = np.empty(A, dtype=np.int64)
    nxt[order] = nxt_sorted
    key_off = np.searchsorted(k_sorted, np.arange(K + 1))
    head = np.array([S, A], dtype=np.int64)
    return np.concatenate([head, step_off.astype(np.int64), keys, nxt, key_off.astype(np.int64), s_sorted])
