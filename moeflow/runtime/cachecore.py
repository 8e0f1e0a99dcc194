"""The compiled cache core: `ExpertCache`'s bookkeeping and five eviction policies as numba kernels over arrays.

One mechanism for the runtime and the simulator. With an eviction policy that declares a `kernel` (lru, lfu,
least-stale, belady-approx, and the simulator's Belady MIN) and a link whose copies complete at submit
(`Link.instant`: the simulator's instant link, the runtime's direct link), `ExpertCache` keeps every decision
and counter here (`moeflow.runtime.corecache.CacheCore`) and makes one kernel call per cache call (`k_call`:
demand, prefetch, release, begin_pass, begin_layer); the simulator's `k_replay` replays a whole access stream
through the same internal functions (`_demand`, `_prefetch`, `_release`, `pol_pass_start`, `pol_layer_start`) in
one call. Every other policy or link keeps the Python mechanism (`ExpertCache`'s own methods and the policy's
events), in the runtime and the simulator alike.

The kernels follow `ExpertCache`'s Python mechanism with an instant link step for step (hits pinned first,
misses in id order, each evicting the policy's victim; prefetches in priority order, resident proposals told
to the policy (`on_predicted`), a slot issued in the same call never a victim) and the Python policies' events
(`moeflow.policies.eviction`, `least_stale`, `belady_approx`, `moeflow.sim.simulator.Belady`): the same
victims, the same counters (tests/test_sim_core.py checks both against the Python path on random streams).

State: ONE int64 array `I` (a header of sizes and section offsets, then every integer section), one float64
array `F` and one int64 array `X` (Belady MIN's next-use tables; empty otherwise): a call from Python unboxes
three arrays, and every kernel indexes them at `I[section offset] + i` (flat code compiles fast; `views` gives
Python numpy views of the sections). Keys are `rank * E + expert` (rank: the MoE layer's index), slots
`0..C-1`, -1 = none. Compiled once per machine (`cache=True`: next to this file, or numba's user-wide cache
when that is read-only; with neither, once per process).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

try:  # numba caches compiled kernels next to this file, or in its user-wide cache when that is read-only
    from numba import njit as _njit

    _OPTS = dict(nogil=True, error_model="numpy", _nrt=False)  # no exception paths, no reference counting

    def _jit(fn):  # a kernel called from Python
        return _cached(fn, **_OPTS)

    def _fn(fn):  # a function only kernels call: no Python entry to compile
        return _cached(fn, no_cpython_wrapper=True, no_cfunc_wrapper=True, **_OPTS)

    def _cached(fn, **opts):
        try:
            return _njit(cache=True, **opts)(fn)
        except RuntimeError:  # no writable cache location: compile in every process instead
            return _njit(**opts)(fn)

except ImportError:  # pragma: no cover - numba is a dependency; without it the kernels run as Python (slow)

    def _jit(fn):
        return fn

    _fn = _jit


# ---- policy kinds ---------------------------------------------------------------------------------------
KIND_LRU, KIND_LFU, KIND_LS, KIND_BA, KIND_MIN = 1, 2, 3, 4, 5
KINDS = {"lru": KIND_LRU, "lfu": KIND_LFU, "least-stale": KIND_LS, "belady-approx": KIND_BA, "belady": KIND_MIN}

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
    O_HPOS,  # lfu, belady: each key's position in the heap (-1: none)
    OF_PKF,
    OF_PGF,
    OF_PAH,
    OF_FAR,
    OF_SIV,  # belady-approx, per slot: its key's interval EMA (-1: none)
    NHDR,
) = range(47)

# mechanism scalars (sc)
SC_TIME, SC_PASS, SC_PSEQ, SC_PHSEQ, SC_GENSEQ, SC_NLOG, SC_NRES, NSC = range(8)
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
    NPK,
) = range(18)
# policy scalars (pg)
PG_TICK, PG_HSIZE, PG_LSPASS, PG_STEP, PG_NSEEN, PG_NINTS, PG_NPRED, NPG = range(8)
# policy float scalars (pgf)
PGF_MEAN, PGF_EMA, PGF_PRIOR, NPGF = range(4)
# log records: (op, slot, key, arg)
LOG_EVICT, LOG_LOAD, LOG_UPGRADE = 1, 2, 3
NEVER_PASS = -(1 << 62)  # `_evicted_in_pass` of a key never evicted

# entry point ops (`k_call`)
OP_DEMAND, OP_PREFETCH, OP_RELEASE, OP_BEGIN_PASS, OP_BEGIN_LAYER = 1, 2, 3, 4, 5

Views = namedtuple(
    "Views",
    "hdr sc cnt skey pin pref used bits iss prot sof evp res free nfree byb log pk lst heap pg seen srank hpos pkf pgf pah",
)


def layout(
    *, C: int, L: int, E: int, per_layer: bool, kind: int, log: bool, ema: float = 0.3, prior: float = 0.5
) -> tuple[np.ndarray, np.ndarray]:
    """Fresh state arrays (I, F) for a cache of C slots over L MoE layers x E experts (`kind`: KIND_*)."""
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
    ]
    hdr = np.zeros(NHDR, np.int64)
    off = NHDR
    for o, n in sizes:
        hdr[o] = off
        off += n
    fsizes = [(OF_PKF, K), (OF_PGF, NPGF), (OF_PAH, L + 2), (OF_FAR, C), (OF_SIV, C)]
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
    for p in range(parts):  # `reversed(part slots)`: popping from the end gives the part's first slot first
        v.free[p * per : (p + 1) * per] = np.arange(p * per + per - 1, p * per - 1, -1)
        v.nfree[p] = per
    v.pk[:, PK_PREV] = -1
    v.pk[:, PK_NEXT] = -1
    v.pk[:, PK_NU] = -1
    v.hpos[:] = -1
    v.lst[:] = -1
    v.pg[PG_LSPASS] = -1
    v.pg[PG_STEP] = -1
    v.pgf[PGF_MEAN], v.pgf[PGF_EMA], v.pgf[PGF_PRIOR] = 1.0, ema, prior
    v.pah[:] = prior
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


# ---- small structures (flat: `I[base + i]`) -------------------------------------------------------------


@_fn
def _log(I, op, s, k, arg):
    if I[H_LOGON]:
        sc = I[O_SC]
        n = I[sc + SC_NLOG]
        b = I[O_LOG] + 4 * n
        I[b], I[b + 1], I[b + 2], I[b + 3] = op, s, k, arg
        I[sc + SC_NLOG] = n + 1


@_fn
def _ll_unlink(I, li, k):
    lst = I[O_LST] + 2 * li
    prev, nxt = I[I[O_PK] + k * NPK + PK_PREV], I[I[O_PK] + k * NPK + PK_NEXT]
    if prev >= 0:
        I[I[O_PK] + prev * NPK + PK_NEXT] = nxt
    else:
        I[lst] = nxt
    if nxt >= 0:
        I[I[O_PK] + nxt * NPK + PK_PREV] = prev
    else:
        I[lst + 1] = prev
    I[I[O_PK] + k * NPK + PK_PREV] = -1
    I[I[O_PK] + k * NPK + PK_NEXT] = -1


@_fn
def _ll_append(I, li, k):
    lst = I[O_LST] + 2 * li
    tail = I[lst + 1]
    I[I[O_PK] + k * NPK + PK_PREV] = tail
    I[I[O_PK] + k * NPK + PK_NEXT] = -1
    if tail >= 0:
        I[I[O_PK] + tail * NPK + PK_NEXT] = k
    else:
        I[lst] = k
    I[lst + 1] = k


# The heap (lfu, belady): an indexed min-heap of the tracked keys, one entry (a, b, key) each at I[O_HEAP],
# ordered by (a, b), unique among keys (lfu: (count, tick), ticks are unique; belady: (-score, 0), a score
# names its key); O_HPOS holds each key's position, so an update sifts it in place.


@_fn
def _hx_less(I, x, y):
    return I[x] < I[y] or (I[x] == I[y] and I[x + 1] < I[y + 1])


@_fn
def _hx_sift(I, i):
    """Restore the heap order around position i: its entry moves up, else down, parents or children moving
    into the hole it leaves."""
    h, n, hp = I[O_HEAP], I[I[O_PG] + PG_HSIZE], I[O_HPOS]
    a, b, k = I[h + 3 * i], I[h + 3 * i + 1], I[h + 3 * i + 2]
    j = i
    while j > 0:
        q = (j - 1) // 2
        y = h + 3 * q
        if not (a < I[y] or (a == I[y] and b < I[y + 1])):
            break
        x = h + 3 * j
        I[x], I[x + 1], I[x + 2] = I[y], I[y + 1], I[y + 2]
        I[hp + I[x + 2]] = j
        j = q
    if j == i:
        while True:
            c = 2 * j + 1
            if c >= n:
                break
            if c + 1 < n and _hx_less(I, h + 3 * c + 3, h + 3 * c):
                c += 1
            y = h + 3 * c
            if not (I[y] < a or (I[y] == a and I[y + 1] < b)):
                break
            x = h + 3 * j
            I[x], I[x + 1], I[x + 2] = I[y], I[y + 1], I[y + 2]
            I[hp + I[x + 2]] = j
            j = c
    x = h + 3 * j
    I[x], I[x + 1], I[x + 2] = a, b, k
    I[hp + k] = j


@_fn
def _hx_set(I, k, a, b):
    """Key k's entry is now (a, b)."""
    h, pg, at = I[O_HEAP], I[O_PG], I[O_HPOS] + k
    i = I[at]
    if i < 0:
        i = I[pg + PG_HSIZE]
        I[pg + PG_HSIZE] = i + 1
        I[at] = i
        I[h + 3 * i + 2] = k
    I[h + 3 * i] = a
    I[h + 3 * i + 1] = b
    _hx_sift(I, i)


@_fn
def _hx_remove(I, k):
    h, pg, at = I[O_HEAP], I[O_PG], I[O_HPOS] + k
    i = I[at]
    if i < 0:
        return
    n = I[pg + PG_HSIZE] - 1
    I[at] = -1
    I[pg + PG_HSIZE] = n
    if i != n:
        for t in range(3):
            I[h + 3 * i + t] = I[h + 3 * n + t]
        I[I[O_HPOS] + I[h + 3 * i + 2]] = i
        _hx_sift(I, i)


@_fn
def _is_cand(I, k, part):
    """A victim candidate of `part`: resident, not pinned, not issued by the running prefetch call."""
    s = I[I[O_SOF] + k]
    if s < 0 or I[I[O_PIN] + s] or I[I[O_PROT] + s]:
        return False
    return not I[H_PERLAYER] or k // I[H_E] == part


@_fn
def _hx_first(I, part):
    """The smallest entry whose key is a candidate (-1: none): best-first over the heap, a frontier of
    positions (a small heap at I[O_HSKIP]) holding the children of the non-candidates passed."""
    h, f, n = I[O_HEAP], I[O_HSKIP], I[I[O_PG] + PG_HSIZE]
    if n == 0:
        return -1
    m = 1
    I[f] = 0
    while m > 0:
        i = I[f]  # the frontier's smallest position; pop it
        m -= 1
        I[f] = I[f + m]
        j = 0
        while True:
            c = 2 * j + 1
            if c >= m:
                break
            if c + 1 < m and _hx_less(I, h + 3 * I[f + c + 1], h + 3 * I[f + c]):
                c += 1
            if not _hx_less(I, h + 3 * I[f + c], h + 3 * I[f + j]):
                break
            I[f + j], I[f + c] = I[f + c], I[f + j]
            j = c
        k = I[h + 3 * i + 2]
        if _is_cand(I, k, part):
            return k
        for c in (2 * i + 1, 2 * i + 2):  # its children join the frontier
            if c < n:
                j = m
                I[f + j] = c
                m += 1
                while j > 0:
                    q = (j - 1) // 2
                    if not _hx_less(I, h + 3 * I[f + j], h + 3 * I[f + q]):
                        break
                    I[f + j], I[f + q] = I[f + q], I[f + j]
                    j = q
    return -1


# ---- the policies' events ------------------------------------------------------------------------------------


@_fn
def _touch(I, k, order):
    """`_Base._touch`: a new tick; lru: to the end of its part's list; with `order`, lfu: its heap entry
    (count, tick) (a demand load's insert skips it: the access that follows at once sets it, and nothing asks
    for a victim between the two)."""
    kind, pg = I[H_KIND], I[O_PG]
    I[pg + PG_TICK] += 1
    t = I[pg + PG_TICK]
    if kind == KIND_LRU:
        li = k // I[H_E] if I[H_PERLAYER] else 0
        if I[I[O_PK] + k * NPK + PK_TR]:
            _ll_unlink(I, li, k)
        _ll_append(I, li, k)
    I[I[O_PK] + k * NPK + PK_TR] = 1
    I[I[O_PK] + k * NPK + PK_LAST] = t
    if kind == KIND_LFU and order:
        _hx_set(I, k, I[I[O_PK] + k * NPK + PK_CNT], t)


@_fn
def _see(I, r):
    """belady-approx `_see`: layer rank `r` is known; ranks among the known layers follow."""
    seen, srank = I[O_SEEN], I[O_SRANK]
    if I[seen + r]:
        return
    I[seen + r] = 1
    n = 0
    for i in range(I[H_L]):
        if I[seen + i]:
            I[srank + i] = n
            n += 1
    I[I[O_PG] + PG_NSEEN] = n


@_fn
def _ahead(I, kr, pr):
    """belady-approx `_ahead`: MoE layer steps from the running layer (rank pr) until layer rank kr runs."""
    _see(I, kr)
    _see(I, pr)
    srank = I[O_SRANK]
    return (I[srank + kr] - I[srank + pr] - 1) % I[I[O_PG] + PG_NSEEN] + 1


@_fn
def _pred_drop(I, k):
    """Remove `k`'s pending proposal (the pending list's last takes its place)."""
    pl, pg = I[O_PLIST], I[O_PG]
    i = I[I[O_PK] + k * NPK + PK_PIDX]
    n = I[pg + PG_NPRED] - 1
    last = I[pl + n]
    I[pl + i] = last
    I[I[O_PK] + last * NPK + PK_PIDX] = i
    I[pg + PG_NPRED] = n
    I[I[O_PK] + k * NPK + PK_HASPRED] = 0


@_fn
def _ba_slot(I, F, k):
    """belady-approx: the per-slot copy of resident key k's fields (the victim scan reads slots in order)."""
    s = I[I[O_SOF] + k]
    if s < 0:
        return
    b = I[O_PK] + k * NPK
    I[I[O_SREF] + s] = I[b + PK_REF]
    I[I[O_SPP] + s] = I[b + PK_PPASS] if I[b + PK_HASPRED] else NEVER_PASS
    I[I[O_SPA] + s] = I[b + PK_PAHEAD]
    F[I[OF_SIV] + s] = F[I[OF_PKF] + k] if I[b + PK_HASINT] else -1.0


@_fn
def _predict(I, k, pr):
    p = I[I[O_SC] + SC_PASS]
    if I[I[O_PK] + k * NPK + PK_HASPRED] and I[I[O_PK] + k * NPK + PK_PPASS] == p:
        return
    ahead = _ahead(I, k // I[H_E], pr)
    if not I[I[O_PK] + k * NPK + PK_HASPRED]:
        pg = I[O_PG]
        n = I[pg + PG_NPRED]
        I[I[O_PLIST] + n] = k
        I[I[O_PK] + k * NPK + PK_PIDX] = n
        I[pg + PG_NPRED] = n + 1
        I[I[O_PK] + k * NPK + PK_HASPRED] = 1
    I[I[O_PK] + k * NPK + PK_PPASS] = p
    I[I[O_PK] + k * NPK + PK_PAHEAD] = ahead


@_fn
def _ls_pass_start(I, p):
    """least-stale `on_pass_start`: every current queue joins the end of its layer's stale queue."""
    pg = I[O_PG]
    if p == I[pg + PG_LSPASS]:
        return
    I[pg + PG_LSPASS] = p
    L, lst = I[H_L], I[O_LST]
    for r in range(L):
        cur, stale = lst + 2 * (L + r), lst + 2 * r
        h = I[cur]
        if h < 0:
            continue
        k = h
        while k >= 0:
            I[I[O_PK] + k * NPK + PK_CUR] = 0
            k = I[I[O_PK] + k * NPK + PK_NEXT]
        tail = I[stale + 1]
        if tail >= 0:
            I[I[O_PK] + tail * NPK + PK_NEXT] = h
            I[I[O_PK] + h * NPK + PK_PREV] = tail
        else:
            I[stale] = h
        I[stale + 1] = I[cur + 1]
        I[cur] = -1
        I[cur + 1] = -1


@_fn
def _ls_sync(I):
    p = I[I[O_SC] + SC_PASS]
    if p != I[I[O_PG] + PG_LSPASS]:
        _ls_pass_start(I, p)


@_fn
def _ls_make_current(I, k):
    _ls_sync(I)
    if I[I[O_PK] + k * NPK + PK_CUR]:
        return
    r, L = k // I[H_E], I[H_L]
    I[I[O_PK] + k * NPK + PK_CUR] = 1
    if I[I[O_PK] + k * NPK + PK_ENT]:
        _ll_unlink(I, r, k)
    I[I[O_PK] + k * NPK + PK_ENT] = 1
    _ll_append(I, L + r, k)


@_fn
def _min_set(I, k, step):
    """belady: key k's score from `step`, the step of its next use (`never` = S + 1 when none)."""
    I[I[O_PK] + k * NPK + PK_TR] = 1
    I[I[O_PK] + k * NPK + PK_SCORE] = step * I[H_K] + k
    _hx_set(I, k, -I[I[O_PK] + k * NPK + PK_SCORE], 0)


@_fn
def pol_insert(I, F, X, k, pr, prefetched):
    """`on_insert(key, pos, prefetched)`; `pr`: the position's layer rank."""
    kind = I[H_KIND]
    if kind == KIND_MIN:
        if prefetched:  # not accessed now: its first use from the current step on
            step, S, A = I[I[O_PG] + PG_STEP], X[0], X[1]
            nu = I[I[O_PK] + k * NPK + PK_NU]  # the use after its last access: none since, so at or after now
            if nu < step:  # not accessed yet (or no such use): search its access steps
                ko = 2 + (S + 1) + 2 * A  # per key, the offsets of its access steps
                ks = ko + I[H_K] + 1
                lo, hi = X[ko + k], X[ko + k + 1]
                while lo < hi:
                    mid = (lo + hi) // 2
                    if X[ks + mid] < step:
                        lo = mid + 1
                    else:
                        hi = mid
                nu = X[ks + lo] if lo < X[ko + k + 1] else S + 1
            _min_set(I, k, nu)
        return
    _touch(I, k, prefetched)
    if kind == KIND_LS:
        if prefetched:
            _ls_make_current(I, k)
        else:
            _ls_sync(I)
            r, L = k // I[H_E], I[H_L]
            li = L + r if I[I[O_PK] + k * NPK + PK_CUR] else r
            if I[I[O_PK] + k * NPK + PK_ENT]:
                _ll_unlink(I, li, k)
            I[I[O_PK] + k * NPK + PK_ENT] = 1
            _ll_append(I, li, k)
    elif kind == KIND_BA:
        I[I[O_PK] + k * NPK + PK_REF] = I[I[O_SC] + SC_PASS]
        if prefetched:
            _predict(I, k, pr)
        _ba_slot(I, F, k)


@_fn
def pol_access(I, F, X, k):
    """`on_access(key, pos)` (the gate weight matters to none of the compiled policies)."""
    kind = I[H_KIND]
    if kind == KIND_MIN:
        step, S, A = I[I[O_PG] + PG_STEP], X[0], X[1]
        nu = S + 1
        if 0 <= step < S:  # this step's keys, ascending, and the step of each one's next use
            lo, end = X[2 + step], X[2 + step + 1]
            hi = end
            ek = 2 + S + 1
            while lo < hi:
                mid = (lo + hi) // 2
                if X[ek + mid] < k:
                    lo = mid + 1
                else:
                    hi = mid
            if lo < end and X[ek + lo] == k:
                nu = X[ek + A + lo]
        I[I[O_PK] + k * NPK + PK_NU] = nu
        _min_set(I, k, nu)
        return
    if kind == KIND_LFU:
        I[I[O_PK] + k * NPK + PK_CNT] += 1
    _touch(I, k, 1)
    if kind == KIND_LS:
        _ls_make_current(I, k)
    elif kind == KIND_BA:
        _see(I, k // I[H_E])
        p = I[I[O_SC] + SC_PASS]
        pg, pgf = I[O_PG], I[OF_PGF]
        ema = F[pgf + PGF_EMA]
        if I[I[O_PK] + k * NPK + PK_HASLU] and p > I[I[O_PK] + k * NPK + PK_LASTUSE]:
            gap = float(p - I[I[O_PK] + k * NPK + PK_LASTUSE])
            f = I[OF_PKF] + k
            if I[I[O_PK] + k * NPK + PK_HASINT]:
                F[f] = (1.0 - ema) * F[f] + ema * gap
            else:
                F[f] = gap
                I[I[O_PK] + k * NPK + PK_HASINT] = 1
            I[pg + PG_NINTS] += 1
            F[pgf + PGF_MEAN] += (gap - F[pgf + PGF_MEAN]) / min(I[pg + PG_NINTS], 1000)
        I[I[O_PK] + k * NPK + PK_HASLU] = 1
        I[I[O_PK] + k * NPK + PK_LASTUSE] = p
        I[I[O_PK] + k * NPK + PK_REF] = p
        if I[I[O_PK] + k * NPK + PK_HASPRED]:
            pp, ahead = I[I[O_PK] + k * NPK + PK_PPASS], I[I[O_PK] + k * NPK + PK_PAHEAD]
            _pred_drop(I, k)
            if pp == p:  # `_outcome(ahead, True)`
                a = I[OF_PAH] + ahead
                F[a] = (1.0 - ema) * F[a] + ema * 1.0
        _ba_slot(I, F, k)


@_fn
def pol_evict(I, k):
    kind = I[H_KIND]
    if kind == KIND_LRU and I[I[O_PK] + k * NPK + PK_TR]:
        _ll_unlink(I, k // I[H_E] if I[H_PERLAYER] else 0, k)
    elif kind == KIND_LS:
        if I[I[O_PK] + k * NPK + PK_ENT]:
            r = k // I[H_E]
            _ll_unlink(I, I[H_L] + r if I[I[O_PK] + k * NPK + PK_CUR] else r, k)
            I[I[O_PK] + k * NPK + PK_ENT] = 0
        I[I[O_PK] + k * NPK + PK_CUR] = 0
    elif kind == KIND_LFU or kind == KIND_MIN:
        _hx_remove(I, k)
    I[I[O_PK] + k * NPK + PK_TR] = 0


@_fn
def pol_predicted(I, F, k, pr):
    """`on_predicted(key, pos)`: a proposal of a resident key."""
    kind = I[H_KIND]
    if kind == KIND_LS:
        if I[I[O_PK] + k * NPK + PK_TR]:
            _ls_make_current(I, k)
    elif kind == KIND_BA:
        _predict(I, k, pr)
        _ba_slot(I, F, k)


@_fn
def _ba_expire(I, F, p, rr):
    """belady-approx: proposals of an earlier pass, or (rr >= 0) of a layer before rank rr of this pass, were
    wasted (their layer ran without them)."""
    pg, pl, E, srank = I[O_PG], I[O_PLIST], I[H_E], I[O_SRANK]
    ema = F[I[OF_PGF] + PGF_EMA]
    i = 0
    while i < I[pg + PG_NPRED]:
        k = I[pl + i]
        pp = I[I[O_PK] + k * NPK + PK_PPASS]
        if pp < p or (rr >= 0 and pp == p and I[srank + k // E] < rr):
            a = I[OF_PAH] + I[I[O_PK] + k * NPK + PK_PAHEAD]
            _pred_drop(I, k)
            _ba_slot(I, F, k)
            F[a] = (1.0 - ema) * F[a] + ema * 0.0  # `_outcome(ahead, False)`
        else:
            i += 1


@_fn
def pol_pass_start(I, F, p):
    kind = I[H_KIND]
    if kind == KIND_LS:
        _ls_pass_start(I, p)
    elif kind == KIND_BA:
        _ba_expire(I, F, p, -1)


@_fn
def pol_layer_start(I, F, r):
    kind = I[H_KIND]
    if kind == KIND_MIN:
        I[I[O_PG] + PG_STEP] += 1
    elif kind == KIND_BA:
        _see(I, r)
        _ba_expire(I, F, I[I[O_SC] + SC_PASS], I[I[O_SRANK] + r])


@_fn
def _ba_victim(I, F, part, pr):
    """belady-approx: the candidate of largest E[next use] (ties within 1e-9: least recent, then key).
    `BeladyApprox.victim`'s arithmetic, term by term (the same floats), over the per-slot copies (`_ba_slot`);
    the layers' ranks among the layers seen so far (`_ahead`), once every layer is seen the ranks themselves."""
    C, per, L = I[H_C], I[H_PER], I[H_L]
    skey, pin, prot, srk, far = I[O_SKEY], I[O_PIN], I[O_PROT], I[O_SRK], I[OF_FAR]
    sref, spp, spa, siv, pk, pah = I[O_SREF], I[O_SPP], I[O_SPA], I[OF_SIV], I[O_PK], I[OF_PAH]
    mean = F[I[OF_PGF] + PGF_MEAN]
    p = I[I[O_SC] + SC_PASS]
    lo, hi = (part * per, part * per + per) if I[H_PERLAYER] else (0, C)
    if I[I[O_PG] + PG_NSEEN] == L:  # every layer seen: d from the ranks, nothing to `_see` (branch-free)
        for s in range(lo, hi):
            ok = I[skey + s] >= 0 and I[pin + s] == 0 and I[prot + s] == 0
            d = I[srk + s] - pr - 1
            d = d + L + 1 if d < 0 else d + 1
            iv = F[siv + s]  # max(interval (none: the mean), passes since last use or load, 1)
            Ik = iv if iv >= 0.0 else mean
            age = float(p - I[sref + s])
            Ik = age if age > Ik else Ik
            Ik = 1.0 if 1.0 > Ik else Ik
            pa = F[pah + I[spa + s]]
            p1 = pa if I[spp + s] == p and d < L else 1.0 / Ik
            f = d + (1.0 - p1) * L * Ik
            F[far + s] = f if ok else -1.0
    else:
        for s in range(lo, hi):
            if I[skey + s] < 0 or I[pin + s] or I[prot + s]:
                F[far + s] = -1.0
                continue
            d = _ahead(I, I[srk + s], pr)
            Ls = I[I[O_PG] + PG_NSEEN]
            iv = F[siv + s]
            Ik = iv if iv >= 0.0 else mean
            age = float(p - I[sref + s])
            Ik = age if age > Ik else Ik
            Ik = 1.0 if 1.0 > Ik else Ik
            p1 = F[pah + I[spa + s]] if I[spp + s] == p and d < Ls else 1.0 / Ik
            F[far + s] = d + (1.0 - p1) * Ls * Ik
    top = -1.0  # every E[next use] is >= 1
    for s in range(lo, hi):
        f = F[far + s]
        top = f if f > top else top
    if top < 0.0:
        return -1
    best, bt = -1, 0
    cut = top - 1e-9
    for s in range(lo, hi):
        if F[far + s] < cut:
            continue
        k = I[skey + s]
        t = I[pk + k * NPK + PK_LAST]
        if best < 0 or t < bt or (t == bt and k < best):
            best, bt = k, t
    return best


@_fn
def _list_first(I, li, part):
    """The first candidate of list `li` (-1: none)."""
    k = I[I[O_LST] + 2 * li]
    while k >= 0:
        if _is_cand(I, k, part):
            return k
        k = I[I[O_PK] + k * NPK + PK_NEXT]
    return -1


@_fn
def pol_victim(I, F, part, pr):
    """The policy's victim among `part`'s candidates (-1: no candidate); `pr`: the position's layer rank."""
    kind = I[H_KIND]
    if kind == KIND_LRU:
        return _list_first(I, part, part)
    if kind == KIND_LFU or kind == KIND_MIN:
        return _hx_first(I, part)
    if kind == KIND_LS:
        _ls_sync(I)
        L = I[H_L]
        r0, r1 = (part, part + 1) if I[H_PERLAYER] else (0, L)
        for base in (0, L):  # the stale queues first, by layer, then the current ones
            for r in range(r0, r1):
                k = _list_first(I, base + r, part)
                if k >= 0:
                    return k
        return -1
    return _ba_victim(I, F, part, pr)


# ---- the cache mechanism -----------------------------------------------------------------------------------


@_fn
def _evict(I, s):
    k = I[I[O_SKEY] + s]
    E, cnt, sc = I[H_E], I[O_CNT], I[O_SC]
    if I[I[O_PREF] + s] and not I[I[O_USED] + s]:
        I[cnt + C_PF_UNUSED] += 1
    I[cnt + C_EVICT] += 1
    I[I[O_EVP] + k] = I[sc + SC_PASS]
    I[I[O_SOF] + k] = -1
    I[I[O_RES] + k // E] -= 1
    I[sc + SC_NRES] -= 1
    I[I[O_SKEY] + s] = -1
    I[I[O_PIN] + s] = 0
    I[I[O_PREF] + s] = 0
    I[I[O_USED] + s] = 0
    I[I[O_BITS] + s] = 0
    I[I[O_ISS] + s] = 0
    part = k // E if I[H_PERLAYER] else 0
    nf = I[O_NFREE] + part
    I[I[O_FREE] + part * I[H_PER] + I[nf]] = s
    I[nf] += 1
    _log(I, LOG_EVICT, s, k, 0)
    pol_evict(I, k)


@_fn
def _load(I, F, X, s, k, pr, prefetched, b):
    cnt, sc = I[O_CNT], I[O_SC]
    I[I[O_SKEY] + s] = k
    I[I[O_SRK] + s] = k // I[H_E]
    I[I[O_BITS] + s] = b
    I[I[O_PREF] + s] = prefetched
    I[I[O_USED] + s] = 0
    I[I[O_SOF] + k] = s
    I[I[O_RES] + k // I[H_E]] += 1
    I[sc + SC_NRES] += 1
    I[cnt + C_LOADS] += 1
    I[cnt + C_BYTES] += I[I[O_BYB] + b]
    _log(I, LOG_LOAD, s, k, b + 256 * prefetched)
    pol_insert(I, F, X, k, pr, prefetched)


@_fn
def _acquire(I, F, X, k, pr):
    """A free slot of `k`'s part, evicting the policy's victim if needed; -1: no candidate."""
    part = k // I[H_E] if I[H_PERLAYER] else 0
    nf = I[O_NFREE] + part
    if I[nf] == 0:
        v = pol_victim(I, F, part, pr)
        if v < 0:
            return -1
        _evict(I, I[I[O_SOF] + v])
    I[nf] -= 1
    return I[I[O_FREE] + part * I[H_PER] + I[nf]]


@_fn
def _demand(I, F, X, r, experts, nbits, out):
    """`ExpertCache.demand` (instant link): pin hits, then per expert in order hit or miss (a victim, a load);
    returns -1 on success, else the index of the expert no slot could be found for (all pinned)."""
    E, cnt, sc = I[H_E], I[O_CNT], I[O_SC]
    sof, pin, bits, pref, used, iss = I[O_SOF], I[O_PIN], I[O_BITS], I[O_PREF], I[O_USED], I[O_ISS]
    n = experts.shape[0]
    for i in range(n):
        s = I[sof + r * E + experts[i]]
        if s >= 0:
            I[pin + s] = 1
    p = I[sc + SC_PASS]
    for i in range(n):
        k = r * E + experts[i]
        s = I[sof + k]
        I[cnt + C_ACC] += 1
        if s >= 0:
            I[cnt + C_HIT] += 1
            if I[bits + s] != 0:
                I[cnt + C_LB_HITS] += 1
        else:
            I[cnt + C_MISS] += 1
            if I[I[O_EVP] + k] == p:
                I[cnt + C_COLL] += 1
            s = _acquire(I, F, X, k, r)
            if s < 0:
                return i
            b = nbits[i]
            _load(I, F, X, s, k, r, 0, b)
            I[cnt + C_DEM] += 1
            if b != 0:
                I[cnt + C_LB_LOADS] += 1
            I[pin + s] = 1
        if I[pref + s] and not I[used + s]:
            I[cnt + C_PFU] += 1
            if I[iss + s] < I[sc + SC_PHSEQ]:
                I[cnt + C_PFU_PH] += 1
                if I[iss + s] < I[sc + SC_GENSEQ]:
                    I[cnt + C_PFU_GEN] += 1
        I[used + s] = 1
        I[sc + SC_TIME] += 1
        pol_access(I, F, X, k)
        out[i] = s
    return -1


@_fn
def _prefetch(I, F, X, pr, keys, n, left, res):
    """`ExpertCache.prefetch` over keys[:n] in priority order (-1: not a key of this cache); `left`: copies the
    gate admits (-1: all). Adds (issued, admitted, refused) to res[0:3]."""
    cnt, sc, prot, isl = I[O_CNT], I[O_SC], I[O_PROT], I[O_ISL]
    issued = 0
    for i in range(n):
        k = keys[i]
        if k < 0:
            continue
        if I[I[O_SOF] + k] >= 0:
            pol_predicted(I, F, k, pr)
            continue
        if left == 0:
            I[cnt + C_REFUSED] += 1
            res[2] += 1
            continue
        res[1] += 1
        if left > 0:
            left -= 1
        s = _acquire(I, F, X, k, pr)
        if s < 0:
            continue
        _load(I, F, X, s, k, pr, 1, 0)
        I[I[O_ISS] + s] = I[sc + SC_PSEQ]
        I[sc + SC_PSEQ] += 1
        I[cnt + C_PFI] += 1
        I[prot + s] = 1
        I[isl + issued] = s
        issued += 1
    for i in range(issued):
        I[prot + I[isl + i]] = 0
    res[0] += issued


@_fn
def _release(I, slots, n, retain, upgrade):
    cnt = I[O_CNT]
    for i in range(n):
        s = slots[i]
        I[I[O_PIN] + s] = 0
        k = I[I[O_SKEY] + s]
        if k < 0:
            continue
        if not retain:
            _evict(I, s)
        elif upgrade and I[I[O_BITS] + s] != 0:
            I[I[O_BITS] + s] = 0
            I[cnt + C_UPGRADES] += 1
            I[cnt + C_BYTES] += I[I[O_BYB]]
            _log(I, LOG_UPGRADE, s, k, 0)


# ---- entry points: one per kernel, the runtime's cache calls and the simulator's replay -------------------


@_jit
def k_call(I, F, X, op, arg, a, b, out):
    """One cache call. OP_DEMAND: rank `arg`, experts `a`, their bits `b`, slots -> `out`, returns -1 or the
    index of the expert no slot was found for; OP_PREFETCH: source rank `arg`, keys `a`, `b[0]` copies admitted
    (-1: all), (issued, admitted, refused) -> `out`; OP_RELEASE: slots `a`, `arg` = retain + 2 * upgrade;
    OP_BEGIN_PASS / OP_BEGIN_LAYER: pass / rank `arg`."""
    I[I[O_SC] + SC_NLOG] = 0
    if op == OP_DEMAND:
        return _demand(I, F, X, arg, a, b, out)
    if op == OP_PREFETCH:
        out[0] = out[1] = out[2] = 0
        _prefetch(I, F, X, arg, a, a.shape[0], b[0], out)
    elif op == OP_RELEASE:
        _release(I, a, a.shape[0], arg & 1, arg >> 1)
    elif op == OP_BEGIN_PASS:
        I[I[O_SC] + SC_PASS] = arg
        pol_pass_start(I, F, arg)
    elif op == OP_BEGIN_LAYER:
        pol_layer_start(I, F, arg)
    return -1


@_jit
def k_replay(I, F, X, R, W, wcap, count_phase, left, out, sums, per_layer):
    """`moeflow.sim.simulator.simulate`'s loop (instant link, fetch misses) over a stream `R` (`pack_stream`),
    with zeroed scratch `W` (`replay_scratch`); a wave holds `wcap` <= E experts.
    `count_phase` -1: count every pass. Writes `out` [status, passes, tokens, proposed accesses, proposals,
    admitted, refused], `sums` [2, NCNT] (counters per phase: prefill, decode), `per_layer` [3, L] (hits,
    accesses, collision misses of counted passes). status: -1 ok, else the step whose demand found no slot."""
    logon = I[H_LOGON]
    I[H_LOGON] = 0  # nothing to follow call by call
    P, S, A = R[0], R[1], R[2]
    phase = R[4 : 4 + P]
    tokens = R[4 + P : 4 + 2 * P]
    pass_off = R[4 + 2 * P : 5 + 3 * P]
    step_rank = R[5 + 3 * P : 5 + 3 * P + S]
    exp_off = R[5 + 3 * P + S : 6 + 3 * P + 2 * S]
    exps = R[6 + 3 * P + 2 * S : 6 + 3 * P + 2 * S + A]
    q0 = 6 + 3 * P + 2 * S + A
    prop_off = R[q0 : q0 + S + 1] if R[3] >= 0 else R[q0:q0]
    prop_keys = R[q0 + S + 1 :] if R[3] >= 0 else R[q0:q0]
    _replay(
        I,
        F,
        X,
        W,
        phase,
        tokens,
        pass_off,
        step_rank,
        exp_off,
        exps,
        prop_off,
        prop_keys,
        wcap,
        count_phase,
        left,
        out,
        sums,
        per_layer,
    )
    I[H_LOGON] = logon


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


@_fn
def _propose(I, F, X, r, keys, left, res, proposed, plist, nprop, counted, out):
    """The step's prefetch proposals: marked as proposed in this pass, then issued (`_prefetch`); returns the
    number of marked keys."""
    if keys.shape[0] == 0:
        return nprop
    if counted:
        out[4] += keys.shape[0]
    for i in range(keys.shape[0]):
        k = keys[i]
        if k >= 0 and not proposed[k]:
            proposed[k] = 1
            plist[nprop] = k
            nprop += 1
    _prefetch(I, F, X, r, keys, keys.shape[0], left, res)
    return nprop


@_fn
def _replay(
    I,
    F,
    X,
    W,
    phase,
    tokens,
    pass_off,
    step_rank,
    exp_off,
    exps,
    prop_off,
    prop_keys,
    wcap,
    count_phase,
    left,
    out,
    sums,
    per_layer,
):
    E, K, cnt, sc, sof = I[H_E], I[H_K], I[O_CNT], I[O_SC], I[O_SOF]
    C = I[cnt : cnt + NCNT]
    prefetching = prop_off.shape[0] > 0
    # scratch, zeroed (`replay_scratch`): proposed flags and their list [K each]; slots, zero bits, the wave
    # order, one wave [E each]; gate results [3]; the counters when the phase began [NCNT]
    proposed, plist = W[:K], W[K : 2 * K]
    w0 = 2 * K
    slots, zeros, order, wbuf = W[w0 : w0 + E], W[w0 + E : w0 + 2 * E], W[w0 + 2 * E : w0 + 3 * E], W[w0 + 3 * E : w0 + 4 * E]
    res, seg0 = W[w0 + 4 * E : w0 + 4 * E + 3], W[w0 + 4 * E + 3 : w0 + 4 * E + 3 + NCNT]
    nprop = 0
    seg_phase = -1
    for c in range(NCNT):
        seg0[c] = C[c]
    out[0] = -1
    for p in range(phase.shape[0]):
        ph = phase[p]
        if ph == 0 or ph != seg_phase:  # `mark_phase`
            I[sc + SC_PHSEQ] = I[sc + SC_PSEQ]
            if ph == 0:
                I[sc + SC_GENSEQ] = I[sc + SC_PSEQ]
        if ph != seg_phase:
            for c in range(NCNT):
                if seg_phase >= 0:
                    sums[seg_phase, c] += C[c] - seg0[c]
                seg0[c] = C[c]
            seg_phase = ph
        counted = count_phase < 0 or ph == count_phase
        if counted:
            out[1] += 1
            out[2] += tokens[p]
        I[sc + SC_PASS] = p  # `begin_pass`
        pol_pass_start(I, F, p)
        for i in range(nprop):
            proposed[plist[i]] = 0
        nprop = 0
        for j in range(pass_off[p], pass_off[p + 1]):
            r = step_rank[j]
            ex = exps[exp_off[j] : exp_off[j + 1]]
            n = ex.shape[0]
            keys = prop_keys[prop_off[j] : prop_off[j + 1]] if prefetching else prop_keys
            pol_layer_start(I, F, r)
            routed = n <= wcap  # one wave: demand, the prefetch, release; else the prefetch, then the waves
            nw = 1
            if not routed:  # the prefetch, then waves of <= wcap experts, resident ones first, each ascending
                nprop = _propose(I, F, X, r, keys, left, res, proposed, plist, nprop, counted, out)
                nw = (n + wcap - 1) // wcap
                m = 0
                for i in range(n):
                    if I[sof + r * E + ex[i]] >= 0:
                        order[m] = ex[i]
                        m += 1
                for i in range(n):
                    if I[sof + r * E + ex[i]] < 0:
                        order[m] = ex[i]
                        m += 1
            for w in range(nw):
                wave = ex
                if not routed:
                    m0, m1 = w * wcap, min(n, w * wcap + wcap)
                    for i in range(m0, m1):  # insertion sort
                        v, t = order[i], i - m0
                        while t > 0 and wbuf[t - 1] > v:
                            wbuf[t] = wbuf[t - 1]
                            t -= 1
                        wbuf[t] = v
                    wave = wbuf[: m1 - m0]
                h0, a0, k0 = C[C_HIT], C[C_ACC], C[C_COLL]
                if _demand(I, F, X, r, wave, zeros, slots) >= 0:
                    out[0] = j
                    return
                if counted:
                    per_layer[0, r] += C[C_HIT] - h0
                    per_layer[1, r] += C[C_ACC] - a0
                    per_layer[2, r] += C[C_COLL] - k0
                    if nprop:
                        for i in range(wave.shape[0]):
                            out[3] += proposed[r * E + wave[i]]
                if routed:
                    nprop = _propose(I, F, X, r, keys, left, res, proposed, plist, nprop, counted, out)
                _release(I, slots, wave.shape[0], 1, 0)
    if seg_phase >= 0:
        for c in range(NCNT):
            sums[seg_phase, c] += C[c] - seg0[c]
    out[5] += res[1]
    out[6] += res[2]


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
