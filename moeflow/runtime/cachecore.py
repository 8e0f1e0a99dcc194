"""The compiled cache core: `ExpertCache`'s bookkeeping and five eviction policies as numba kernels over arrays.

One mechanism for the runtime and the simulator. With an eviction policy that declares a `kernel` (lru, lfu,
least-stale, belady-approx, and the simulator's Belady MIN) and a link whose copies complete at submit
(`Link.instant`: the simulator's instant link, the runtime's direct link), `ExpertCache` keeps every decision
and counter here (`moeflow.runtime.corecache.CacheCore`) and calls one kernel per cache call (`k_demand`,
`k_prefetch`, `k_release`, `k_begin_pass`, `k_begin_layer`); the simulator's `k_replay` replays a whole
access stream through the same internal functions (`_demand`, `_prefetch`, `_release`, ...) in one call.
Every other policy or link keeps the Python mechanism (`ExpertCache`'s own methods and the policy's events),
in the runtime and the simulator alike.

The kernels follow `ExpertCache`'s Python mechanism with an instant link step for step (hits pinned first,
misses in id order, each evicting the policy's victim; prefetches in priority order, resident proposals told
to the policy (`on_predicted`), a slot issued in the same call never a victim) and the Python policies' events
(`moeflow.policies.eviction`, `least_stale`, `belady_approx`, `moeflow.sim.simulator.Belady`): the same
victims, the same counters (tests/test_sim_core.py checks both against the Python path on random streams).

State: ONE int64 array `I` (a header of sizes and section offsets, then every integer section), one float64
array `F` and one int64 array `X` (Belady MIN's next-use tables; empty otherwise), so a call from Python
unboxes three arrays. Keys are `rank * E + expert` (rank: the MoE layer's index), slots `0..C-1`, -1 = none.
Compiled once per machine (`cache=True`, next to this file or numba's user cache; without a writable one
each process compiles again).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

try:  # numba caches compiled kernels next to this file, or in its user-wide cache when that is read-only
    from numba import njit as _njit

    def _jit(fn):
        try:
            return _njit(cache=True, nogil=True)(fn)
        except RuntimeError:  # no writable cache location: compile in every process instead
            return _njit(nogil=True)(fn)

except ImportError:  # pragma: no cover - numba is a dependency; without it the kernels run as Python (slow)

    def _jit(fn):
        return fn


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
    OF_PKF,
    OF_PGF,
    OF_PAH,
    OF_FAR,
    NHDR,
) = range(41)

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
    NPK,
) = range(17)
# policy scalars (pg)
PG_TICK, PG_HSIZE, PG_LSPASS, PG_STEP, PG_NSEEN, PG_NINTS, PG_NPRED, NPG = range(8)
# policy float scalars (pgf)
PGF_MEAN, PGF_EMA, PGF_PRIOR, NPGF = range(4)
# log records: (op, slot, key, arg)
LOG_EVICT, LOG_LOAD, LOG_UPGRADE = 1, 2, 3
NEVER_PASS = -(1 << 62)  # `_evicted_in_pass` of a key never evicted

St = namedtuple(
    "St",
    "hdr sc cnt skey pin pref used bits iss prot sof evp res free nfree byb log pk lst heap hskip pg seen srank "
    "plist isl pkf pgf pah far X",
)


def layout(
    *, C: int, L: int, E: int, per_layer: bool, kind: int, log: bool, ema: float = 0.3, prior: float = 0.5
) -> tuple[np.ndarray, np.ndarray]:
    """Fresh state arrays (I, F) for a cache of C slots over L MoE layers x E experts (`kind`: KIND_*)."""
    K = L * E
    parts = L if per_layer else 1
    per = C // L if per_layer else C
    logcap = 2 * K + 16
    hcap = 4 * C + 130
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
    ]
    hdr = np.zeros(NHDR, np.int64)
    off = NHDR
    for o, n in sizes:
        hdr[o] = off
        off += n
    fsizes = [(OF_PKF, K), (OF_PGF, NPGF), (OF_PAH, L + 2), (OF_FAR, C)]
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
    st = unpack(I, F, np.zeros(0, np.int64))
    st.skey[:] = -1
    st.sof[:] = -1
    st.evp[:] = NEVER_PASS
    st.sc[SC_PASS] = -1
    for p in range(parts):  # `reversed(part slots)`: popping from the end gives the part's first slot first
        st.free[p * per : (p + 1) * per] = np.arange(p * per + per - 1, p * per - 1, -1)
        st.nfree[p] = per
    st.pk[:, PK_PREV] = -1
    st.pk[:, PK_NEXT] = -1
    st.lst[:] = -1
    st.pg[PG_LSPASS] = -1
    st.pg[PG_STEP] = -1
    st.pgf[PGF_MEAN], st.pgf[PGF_EMA], st.pgf[PGF_PRIOR] = 1.0, ema, prior
    st.pah[:] = prior
    return I, F


@_jit
def _sec(I, o, n):
    return I[I[o] : I[o] + n]


@_jit
def unpack(I, F, X):
    """Views of every section of the state."""
    C, K, L = I[H_C], I[H_K], I[H_L]
    lc, hc = I[H_LOGCAP], I[H_HCAP]
    return St(
        I[:NHDR],
        _sec(I, O_SC, NSC),
        _sec(I, O_CNT, NCNT),
        _sec(I, O_SKEY, C),
        _sec(I, O_PIN, C),
        _sec(I, O_PREF, C),
        _sec(I, O_USED, C),
        _sec(I, O_BITS, C),
        _sec(I, O_ISS, C),
        _sec(I, O_PROT, C),
        _sec(I, O_SOF, K),
        _sec(I, O_EVP, K),
        _sec(I, O_RES, L),
        _sec(I, O_FREE, max(1, I[H_PARTS] * I[H_PER])),
        _sec(I, O_NFREE, I[H_PARTS]),
        _sec(I, O_BYB, 9),
        _sec(I, O_LOG, lc * 4).reshape((lc, 4)),
        _sec(I, O_PK, K * NPK).reshape((K, NPK)),
        _sec(I, O_LST, 4 * L).reshape((2 * L, 2)),
        _sec(I, O_HEAP, hc * 3).reshape((hc, 3)),
        _sec(I, O_HSKIP, hc * 3).reshape((hc, 3)),
        _sec(I, O_PG, NPG),
        _sec(I, O_SEEN, L),
        _sec(I, O_SRANK, L),
        _sec(I, O_PLIST, K),
        _sec(I, O_ISL, C),
        F[I[OF_PKF] : I[OF_PKF] + K],
        F[I[OF_PGF] : I[OF_PGF] + NPGF],
        F[I[OF_PAH] : I[OF_PAH] + L + 2],
        F[I[OF_FAR] : I[OF_FAR] + C],
        X,
    )


# ---- small structures ------------------------------------------------------------------------------------


@_jit
def _log(st, op, s, k, arg):
    if st.hdr[H_LOGON]:
        n = st.sc[SC_NLOG]
        st.log[n, 0], st.log[n, 1], st.log[n, 2], st.log[n, 3] = op, s, k, arg
        st.sc[SC_NLOG] = n + 1


@_jit
def _ll_unlink(st, li, k):
    pk, lst = st.pk, st.lst
    prev, nxt = pk[k, PK_PREV], pk[k, PK_NEXT]
    if prev >= 0:
        pk[prev, PK_NEXT] = nxt
    else:
        lst[li, 0] = nxt
    if nxt >= 0:
        pk[nxt, PK_PREV] = prev
    else:
        lst[li, 1] = prev
    pk[k, PK_PREV] = -1
    pk[k, PK_NEXT] = -1


@_jit
def _ll_append(st, li, k):
    pk, lst = st.pk, st.lst
    tail = lst[li, 1]
    pk[k, PK_PREV] = tail
    pk[k, PK_NEXT] = -1
    if tail >= 0:
        pk[tail, PK_NEXT] = k
    else:
        lst[li, 0] = k
    lst[li, 1] = k


@_jit
def _h_less(h, i, j):
    return h[i, 0] < h[j, 0] or (h[i, 0] == h[j, 0] and (h[i, 1] < h[j, 1] or (h[i, 1] == h[j, 1] and h[i, 2] < h[j, 2])))


@_jit
def _h_swap(h, i, j):
    for c in range(3):
        h[i, c], h[j, c] = h[j, c], h[i, c]


@_jit
def _h_down(h, n, i):
    while True:
        c = 2 * i + 1
        if c >= n:
            return
        if c + 1 < n and _h_less(h, c + 1, c):
            c += 1
        if not _h_less(h, c, i):
            return
        _h_swap(h, i, c)
        i = c


@_jit
def _h_up(h, i):
    while i > 0:
        p = (i - 1) // 2
        if not _h_less(h, i, p):
            return
        _h_swap(h, i, p)
        i = p


@_jit
def _h_pop(st):
    h, n = st.heap, st.pg[PG_HSIZE] - 1
    for c in range(3):
        h[0, c] = h[n, c]
    st.pg[PG_HSIZE] = n
    _h_down(h, n, 0)


@_jit
def _h_live(st, i):
    """lfu: the entry's tick is its key's last use; belady: its score is its key's score (both: tracked)."""
    k = st.heap[i, 2]
    if not st.pk[k, PK_TR]:
        return False
    if st.hdr[H_KIND] == KIND_LFU:
        return st.heap[i, 1] == st.pk[k, PK_LAST]
    return -st.heap[i, 0] == st.pk[k, PK_SCORE]


@_jit
def _h_push(st, a, b, k):
    h = st.heap
    n = st.pg[PG_HSIZE]
    if n == st.hdr[H_HCAP]:  # full: keep the live entries only (a compaction, the order is unchanged)
        m = 0
        for i in range(n):
            if _h_live(st, i):
                for c in range(3):
                    h[m, c] = h[i, c]
                m += 1
        n = m
        for i in range(n // 2 - 1, -1, -1):
            _h_down(h, n, i)
    h[n, 0], h[n, 1], h[n, 2] = a, b, k
    st.pg[PG_HSIZE] = n + 1
    _h_up(h, n)


@_jit
def _is_cand(st, k, part):
    """A victim candidate of `part`: resident, not pinned, not issued by the running prefetch call."""
    s = st.sof[k]
    if s < 0 or st.pin[s] or st.prot[s]:
        return False
    return not st.hdr[H_PERLAYER] or k // st.hdr[H_E] == part


@_jit
def _h_first(st, part):
    """The smallest live heap entry whose key is a candidate (-1: none); dead entries dropped, others kept."""
    h, hs = st.heap, st.hskip
    nskip = 0
    found = -1
    while st.pg[PG_HSIZE] > 0:
        if not _h_live(st, 0):
            _h_pop(st)
            continue
        k = h[0, 2]
        if _is_cand(st, k, part):
            found = k
            break
        for c in range(3):
            hs[nskip, c] = h[0, c]
        nskip += 1
        _h_pop(st)
    for i in range(nskip):
        _h_push(st, hs[i, 0], hs[i, 1], hs[i, 2])
    return found


# ---- the policies' events ------------------------------------------------------------------------------------


@_jit
def _touch(st, k):
    """`_Base._touch`: a new tick; lru: to the end of its part's list; lfu: a heap entry (count, tick, key)."""
    pk, kind = st.pk, st.hdr[H_KIND]
    st.pg[PG_TICK] += 1
    t = st.pg[PG_TICK]
    if kind == KIND_LRU:
        li = k // st.hdr[H_E] if st.hdr[H_PERLAYER] else 0
        if pk[k, PK_TR]:
            _ll_unlink(st, li, k)
        _ll_append(st, li, k)
    pk[k, PK_TR] = 1
    pk[k, PK_LAST] = t
    if kind == KIND_LFU:
        _h_push(st, pk[k, PK_CNT], t, k)


@_jit
def _see(st, r):
    """belady-approx `_see`: layer rank `r` is known; ranks among the known layers follow."""
    if st.seen[r]:
        return
    st.seen[r] = 1
    n = 0
    for i in range(st.hdr[H_L]):
        if st.seen[i]:
            st.srank[i] = n
            n += 1
    st.pg[PG_NSEEN] = n


@_jit
def _ahead(st, kr, pr):
    _see(st, kr)
    _see(st, pr)
    return (st.srank[kr] - st.srank[pr] - 1) % st.pg[PG_NSEEN] + 1


@_jit
def _outcome(st, ahead, used):
    ema = st.pgf[PGF_EMA]
    st.pah[ahead] = (1.0 - ema) * st.pah[ahead] + ema * (1.0 if used else 0.0)


@_jit
def _pred_drop(st, k):
    """Remove `k`'s pending proposal (swap with the pending list's last)."""
    pk, pl = st.pk, st.plist
    i = pk[k, PK_PIDX]
    n = st.pg[PG_NPRED] - 1
    last = pl[n]
    pl[i] = last
    pk[last, PK_PIDX] = i
    st.pg[PG_NPRED] = n
    pk[k, PK_HASPRED] = 0


@_jit
def _predict(st, k, pr):
    pk, p = st.pk, st.sc[SC_PASS]
    if pk[k, PK_HASPRED] and pk[k, PK_PPASS] == p:
        return
    ahead = _ahead(st, k // st.hdr[H_E], pr)
    if not pk[k, PK_HASPRED]:
        n = st.pg[PG_NPRED]
        st.plist[n] = k
        pk[k, PK_PIDX] = n
        st.pg[PG_NPRED] = n + 1
        pk[k, PK_HASPRED] = 1
    pk[k, PK_PPASS] = p
    pk[k, PK_PAHEAD] = ahead


@_jit
def _ls_pass_start(st, p):
    """least-stale `on_pass_start`: every current queue joins the end of its layer's stale queue."""
    if p == st.pg[PG_LSPASS]:
        return
    st.pg[PG_LSPASS] = p
    L, pk, lst = st.hdr[H_L], st.pk, st.lst
    for r in range(L):
        h = lst[L + r, 0]
        if h < 0:
            continue
        k = h
        while k >= 0:
            pk[k, PK_CUR] = 0
            k = pk[k, PK_NEXT]
        tail = lst[r, 1]
        if tail >= 0:
            pk[tail, PK_NEXT] = h
            pk[h, PK_PREV] = tail
        else:
            lst[r, 0] = h
        lst[r, 1] = lst[L + r, 1]
        lst[L + r, 0] = -1
        lst[L + r, 1] = -1


@_jit
def _ls_make_current(st, k):
    p = st.sc[SC_PASS]
    if p != st.pg[PG_LSPASS]:
        _ls_pass_start(st, p)
    pk = st.pk
    if pk[k, PK_CUR]:
        return
    r, L = k // st.hdr[H_E], st.hdr[H_L]
    pk[k, PK_CUR] = 1
    if pk[k, PK_ENT]:
        _ll_unlink(st, r, k)
    pk[k, PK_ENT] = 1
    _ll_append(st, L + r, k)


@_jit
def pol_insert(st, k, pr, prefetched):
    """`on_insert(key, pos, prefetched)`; `pr`: the position's layer rank."""
    kind, pk = st.hdr[H_KIND], st.pk
    if kind == KIND_MIN:
        if prefetched:  # not accessed now: its first use from the current step on
            X = st.X
            step = st.pg[PG_STEP]
            S, A = X[0], X[1]
            ko = 2 + (S + 1) + 2 * A
            ks = ko + st.hdr[H_K] + 1
            lo, hi = X[ko + k], X[ko + k + 1]
            while lo < hi:
                mid = (lo + hi) // 2
                if X[ks + mid] < step:
                    lo = mid + 1
                else:
                    hi = mid
            nu = X[ks + lo] if lo < X[ko + k + 1] else S + 1
            pk[k, PK_TR] = 1
            pk[k, PK_SCORE] = nu * st.hdr[H_K] + k
            _h_push(st, -pk[k, PK_SCORE], 0, k)
        return
    _touch(st, k)
    if kind == KIND_LS:
        if prefetched:
            _ls_make_current(st, k)
        else:
            p = st.sc[SC_PASS]
            if p != st.pg[PG_LSPASS]:
                _ls_pass_start(st, p)
            r, L = k // st.hdr[H_E], st.hdr[H_L]
            if pk[k, PK_ENT]:
                _ll_unlink(st, L + r if pk[k, PK_CUR] else r, k)
            pk[k, PK_ENT] = 1
            _ll_append(st, L + r if pk[k, PK_CUR] else r, k)
    elif kind == KIND_BA:
        pk[k, PK_REF] = st.sc[SC_PASS]
        if prefetched:
            _predict(st, k, pr)


@_jit
def pol_access(st, k):
    """`on_access(key, pos)` (the gate weight matters to none of the compiled policies)."""
    kind, pk = st.hdr[H_KIND], st.pk
    if kind == KIND_MIN:
        X = st.X
        step = st.pg[PG_STEP]
        S, A = X[0], X[1]
        nu = S + 1
        if 0 <= step < S:
            lo, hi = X[2 + step], X[2 + step + 1]
            ek = 2 + S + 1
            while lo < hi:
                mid = (lo + hi) // 2
                if X[ek + mid] < k:
                    lo = mid + 1
                else:
                    hi = mid
            if lo < X[2 + step + 1] and X[ek + lo] == k:
                nu = X[ek + A + lo]
        pk[k, PK_TR] = 1
        pk[k, PK_SCORE] = nu * st.hdr[H_K] + k
        _h_push(st, -pk[k, PK_SCORE], 0, k)
        return
    if kind == KIND_LFU:
        pk[k, PK_CNT] += 1
    _touch(st, k)
    if kind == KIND_LS:
        _ls_make_current(st, k)
    elif kind == KIND_BA:
        _see(st, k // st.hdr[H_E])
        p = st.sc[SC_PASS]
        if pk[k, PK_HASLU] and p > pk[k, PK_LASTUSE]:
            ema = st.pgf[PGF_EMA]
            gap = float(p - pk[k, PK_LASTUSE])
            if pk[k, PK_HASINT]:
                st.pkf[k] = (1.0 - ema) * st.pkf[k] + ema * gap
            else:
                st.pkf[k] = gap
                pk[k, PK_HASINT] = 1
            st.pg[PG_NINTS] += 1
            st.pgf[PGF_MEAN] += (gap - st.pgf[PGF_MEAN]) / min(st.pg[PG_NINTS], 1000)
        pk[k, PK_HASLU] = 1
        pk[k, PK_LASTUSE] = p
        pk[k, PK_REF] = p
        if pk[k, PK_HASPRED]:
            pp, ahead = pk[k, PK_PPASS], pk[k, PK_PAHEAD]
            _pred_drop(st, k)
            if pp == p:
                _outcome(st, ahead, True)


@_jit
def pol_evict(st, k):
    kind, pk = st.hdr[H_KIND], st.pk
    if kind == KIND_LRU and pk[k, PK_TR]:
        _ll_unlink(st, k // st.hdr[H_E] if st.hdr[H_PERLAYER] else 0, k)
    elif kind == KIND_LS:
        if pk[k, PK_ENT]:
            r = k // st.hdr[H_E]
            _ll_unlink(st, st.hdr[H_L] + r if pk[k, PK_CUR] else r, k)
            pk[k, PK_ENT] = 0
        pk[k, PK_CUR] = 0
    pk[k, PK_TR] = 0


@_jit
def pol_predicted(st, k, pr):
    """`on_predicted(key, pos)`: a proposal of a resident key."""
    kind = st.hdr[H_KIND]
    if kind == KIND_LS:
        if st.pk[k, PK_TR]:
            _ls_make_current(st, k)
    elif kind == KIND_BA:
        _predict(st, k, pr)


@_jit
def pol_pass_start(st, p):
    kind = st.hdr[H_KIND]
    if kind == KIND_LS:
        _ls_pass_start(st, p)
    elif kind == KIND_BA:
        i = 0
        while i < st.pg[PG_NPRED]:
            k = st.plist[i]
            if st.pk[k, PK_PPASS] < p:
                ahead = st.pk[k, PK_PAHEAD]
                _pred_drop(st, k)
                _outcome(st, ahead, False)
            else:
                i += 1


@_jit
def pol_layer_start(st, r):
    kind = st.hdr[H_KIND]
    if kind == KIND_MIN:
        st.pg[PG_STEP] += 1
    elif kind == KIND_BA:
        _see(st, r)
        rr, p, E = st.srank[r], st.sc[SC_PASS], st.hdr[H_E]
        i = 0
        while i < st.pg[PG_NPRED]:  # proposals whose layer ran without using them
            k = st.plist[i]
            pp = st.pk[k, PK_PPASS]
            if pp < p or (pp == p and st.srank[k // E] < rr):
                ahead = st.pk[k, PK_PAHEAD]
                _pred_drop(st, k)
                _outcome(st, ahead, False)
            else:
                i += 1


@_jit
def _ba_victim(st, part, pr):
    """belady-approx: the candidate of largest E[next use] (ties within 1e-9: least recent, then key)."""
    C, E, per = st.hdr[H_C], st.hdr[H_E], st.hdr[H_PER]
    pk, far = st.pk, st.far
    p = st.sc[SC_PASS]
    lo, hi = (part * per, part * per + per) if st.hdr[H_PERLAYER] else (0, C)
    top = -np.inf
    n = 0
    for s in range(lo, hi):
        k = st.skey[s]
        if k < 0 or st.pin[s] or st.prot[s]:
            continue
        kr = k // E
        d = _ahead(st, kr, pr)
        L = st.pg[PG_NSEEN]
        I = max(st.pkf[k] if pk[k, PK_HASINT] else st.pgf[PGF_MEAN], float(p - pk[k, PK_REF]), 1.0)
        if pk[k, PK_HASPRED] and pk[k, PK_PPASS] == p and d < L:
            p1 = st.pah[pk[k, PK_PAHEAD]]
        else:
            p1 = 1.0 / I
        f = d + (1.0 - p1) * L * I
        far[s] = f
        if f > top:
            top = f
        n += 1
    if n == 0:
        return -1
    best, bt = -1, 0
    for s in range(lo, hi):
        k = st.skey[s]
        if k < 0 or st.pin[s] or st.prot[s]:
            continue
        if far[s] >= top - 1e-9:
            t = pk[k, PK_LAST]
            if best < 0 or t < bt or (t == bt and k < best):
                best, bt = k, t
    return best


@_jit
def pol_victim(st, part, pr):
    """The policy's victim among `part`'s candidates (-1: no candidate); `pr`: the position's layer rank."""
    kind = st.hdr[H_KIND]
    if kind == KIND_LRU:
        k = st.lst[part, 0]
        while k >= 0:
            if _is_cand(st, k, part):
                return k
            k = st.pk[k, PK_NEXT]
        return -1
    if kind == KIND_LFU or kind == KIND_MIN:
        return _h_first(st, part)
    if kind == KIND_LS:
        p = st.sc[SC_PASS]
        if p != st.pg[PG_LSPASS]:
            _ls_pass_start(st, p)
        L = st.hdr[H_L]
        r0, r1 = (part, part + 1) if st.hdr[H_PERLAYER] else (0, L)
        for base in (0, L):  # the stale queues first, by layer, then the current ones
            for r in range(r0, r1):
                k = st.lst[base + r, 0]
                while k >= 0:
                    if _is_cand(st, k, part):
                        return k
                    k = st.pk[k, PK_NEXT]
        return -1
    return _ba_victim(st, part, pr)


# ---- the cache mechanism -----------------------------------------------------------------------------------


@_jit
def _evict(st, s):
    k = st.skey[s]
    E = st.hdr[H_E]
    if st.pref[s] and not st.used[s]:
        st.cnt[C_PF_UNUSED] += 1
    st.cnt[C_EVICT] += 1
    st.evp[k] = st.sc[SC_PASS]
    st.sof[k] = -1
    st.res[k // E] -= 1
    st.sc[SC_NRES] -= 1
    st.skey[s] = -1
    st.pin[s] = 0
    st.pref[s] = 0
    st.used[s] = 0
    st.bits[s] = 0
    st.iss[s] = 0
    part = k // E if st.hdr[H_PERLAYER] else 0
    per = st.hdr[H_PER]
    st.free[part * per + st.nfree[part]] = s
    st.nfree[part] += 1
    _log(st, LOG_EVICT, s, k, 0)
    pol_evict(st, k)


@_jit
def _load(st, s, k, pr, prefetched, b):
    st.skey[s] = k
    st.bits[s] = b
    st.pref[s] = prefetched
    st.used[s] = 0
    st.sof[k] = s
    st.res[k // st.hdr[H_E]] += 1
    st.sc[SC_NRES] += 1
    st.cnt[C_LOADS] += 1
    st.cnt[C_BYTES] += st.byb[b]
    _log(st, LOG_LOAD, s, k, b + 256 * prefetched)
    pol_insert(st, k, pr, prefetched)


@_jit
def _acquire(st, k, pr):
    """A free slot of `k`'s part, evicting the policy's victim if needed; -1: no candidate."""
    part = k // st.hdr[H_E] if st.hdr[H_PERLAYER] else 0
    per = st.hdr[H_PER]
    if st.nfree[part] == 0:
        v = pol_victim(st, part, pr)
        if v < 0:
            return -1
        _evict(st, st.sof[v])
    st.nfree[part] -= 1
    return st.free[part * per + st.nfree[part]]


@_jit
def _demand(st, r, experts, nbits, out):
    """`ExpertCache.demand` (instant link): pin hits, then per expert in order hit or miss (a victim, a load);
    returns -1 on success, else the index of the expert no slot could be found for (all pinned)."""
    E = st.hdr[H_E]
    n = experts.shape[0]
    for i in range(n):
        s = st.sof[r * E + experts[i]]
        if s >= 0:
            st.pin[s] = 1
    cnt = st.cnt
    p = st.sc[SC_PASS]
    for i in range(n):
        k = r * E + experts[i]
        s = st.sof[k]
        cnt[C_ACC] += 1
        if s >= 0:
            cnt[C_HIT] += 1
            if st.bits[s] != 0:
                cnt[C_LB_HITS] += 1
        else:
            cnt[C_MISS] += 1
            if st.evp[k] == p:
                cnt[C_COLL] += 1
            s = _acquire(st, k, r)
            if s < 0:
                return i
            b = nbits[i]
            _load(st, s, k, r, 0, b)
            cnt[C_DEM] += 1
            if b != 0:
                cnt[C_LB_LOADS] += 1
            st.pin[s] = 1
        if st.pref[s] and not st.used[s]:
            cnt[C_PFU] += 1
            if st.iss[s] < st.sc[SC_PHSEQ]:
                cnt[C_PFU_PH] += 1
                if st.iss[s] < st.sc[SC_GENSEQ]:
                    cnt[C_PFU_GEN] += 1
        st.used[s] = 1
        st.sc[SC_TIME] += 1
        pol_access(st, k)
        out[i] = s
    return -1


@_jit
def _prefetch(st, pr, keys, left):
    """`ExpertCache.prefetch` over keys in priority order (-1: not a key of this cache); `left`: copies the gate
    admits (-1: all). Returns (issued, admitted, refused)."""
    issued = admitted = refused = 0
    cnt = st.cnt
    isl = st.isl  # the slots issued in this call
    for i in range(keys.shape[0]):
        k = keys[i]
        if k < 0:
            continue
        if st.sof[k] >= 0:
            pol_predicted(st, k, pr)
            continue
        if left == 0:
            cnt[C_REFUSED] += 1
            refused += 1
            continue
        admitted += 1
        if left > 0:
            left -= 1
        s = _acquire(st, k, pr)
        if s < 0:
            continue
        _load(st, s, k, pr, 1, 0)
        st.iss[s] = st.sc[SC_PSEQ]
        st.sc[SC_PSEQ] += 1
        cnt[C_PFI] += 1
        st.prot[s] = 1
        isl[issued] = s
        issued += 1
    for i in range(issued):
        st.prot[isl[i]] = 0
    return issued, admitted, refused


@_jit
def _release(st, slots, n, retain, upgrade):
    for i in range(n):
        s = slots[i]
        st.pin[s] = 0
        k = st.skey[s]
        if k < 0:
            continue
        if not retain:
            _evict(st, s)
        elif upgrade and st.bits[s] != 0:
            st.bits[s] = 0
            st.cnt[C_UPGRADES] += 1
            st.cnt[C_BYTES] += st.byb[0]
            _log(st, LOG_UPGRADE, s, k, 0)


@_jit
def _begin_pass(st, p):
    st.sc[SC_PASS] = p
    pol_pass_start(st, p)


# ---- entry points (one per cache call; the runtime's ExpertCache) -----------------------------------------


@_jit
def k_demand(I, F, X, r, experts, nbits, out):
    st = unpack(I, F, X)
    st.sc[SC_NLOG] = 0
    return _demand(st, r, experts, nbits, out)


@_jit
def k_prefetch(I, F, X, pr, keys, left):
    st = unpack(I, F, X)
    st.sc[SC_NLOG] = 0
    return _prefetch(st, pr, keys, left)


@_jit
def k_release(I, F, X, slots, retain, upgrade):
    st = unpack(I, F, X)
    st.sc[SC_NLOG] = 0
    _release(st, slots, slots.shape[0], retain, upgrade)


@_jit
def k_begin_pass(I, F, X, p):
    _begin_pass(unpack(I, F, X), p)


@_jit
def k_begin_layer(I, F, X, r):
    pol_layer_start(unpack(I, F, X), r)


# ---- the simulator: a whole access stream in one call ----------------------------------------------------


@_jit
def k_replay(
    I, F, X, phase, tokens, pass_off, step_rank, exp_off, exps, prop_off, prop_keys, wcap, count_phase, left, out, sums, per_layer
):
    """`moeflow.sim.simulator.simulate`'s loop (instant link, fetch misses) over a stream: per pass its steps
    `pass_off[p]..pass_off[p+1]`, per step its MoE layer rank and sorted unique experts `exps[exp_off[j]:...]`,
    and (`prop_off` non-empty) the prefetch policy's keys in priority order `prop_keys[prop_off[j]:...]`.
    `count_phase` -1: count every pass. Writes `out` [status, passes, tokens, proposed accesses, proposals,
    admitted, refused], `sums` [2, NCNT] (counters per phase: prefill, decode), `per_layer` [3, L] (hits,
    accesses, collision misses of counted passes). status: -1 ok, else the step whose demand found no slot."""
    st = unpack(I, F, X)
    E, K = st.hdr[H_E], st.hdr[H_K]
    cnt = st.cnt
    prefetching = prop_off.shape[0] > 0
    proposed = np.zeros(K, np.uint8)
    plist = np.empty(K, np.int64)
    nprop = 0
    slots = np.empty(max(1, wcap), np.int64)
    zeros = np.zeros(max(1, wcap), np.int64)
    seg_phase = -1
    seg0 = cnt.copy()
    out[0] = -1
    for p in range(phase.shape[0]):
        ph = phase[p]
        if ph == 0 or ph != seg_phase:  # `mark_phase`
            st.sc[SC_PHSEQ] = st.sc[SC_PSEQ]
            if ph == 0:
                st.sc[SC_GENSEQ] = st.sc[SC_PSEQ]
        if ph != seg_phase:
            if seg_phase >= 0:
                sums[seg_phase] += cnt - seg0
            seg_phase = ph
            seg0[:] = cnt
        counted = count_phase < 0 or ph == count_phase
        if counted:
            out[1] += 1
            out[2] += tokens[p]
        _begin_pass(st, p)
        for i in range(nprop):
            proposed[plist[i]] = 0
        nprop = 0
        for j in range(pass_off[p], pass_off[p + 1]):
            r = step_rank[j]
            ex = exps[exp_off[j] : exp_off[j + 1]]
            n = ex.shape[0]
            h0, a0, k0 = cnt[C_HIT], cnt[C_ACC], cnt[C_COLL]
            pol_layer_start(st, r)
            routed = n <= wcap
            if routed:
                if _demand(st, r, ex, zeros, slots) >= 0:
                    out[0] = j
                    return
                if counted:
                    per_layer[0, r] += cnt[C_HIT] - h0
                    per_layer[1, r] += cnt[C_ACC] - a0
                    per_layer[2, r] += cnt[C_COLL] - k0
                    if nprop:
                        for i in range(n):
                            out[3] += proposed[r * E + ex[i]]
            if prefetching:
                keys = prop_keys[prop_off[j] : prop_off[j + 1]]
                if keys.shape[0] > 0:
                    if counted:
                        out[4] += keys.shape[0]
                    for i in range(keys.shape[0]):
                        k = keys[i]
                        if k >= 0 and not proposed[k]:
                            proposed[k] = 1
                            plist[nprop] = k
                            nprop += 1
                    _, adm, ref = _prefetch(st, r, keys, left)
                    out[5] += adm
                    out[6] += ref
            if routed:
                _release(st, slots, n, 1, 0)
                continue
            # more experts than a wave holds: waves of <= wcap, resident experts first, each sorted by id
            order = np.empty(n, np.int64)
            m = 0
            for i in range(n):
                if st.sof[r * E + ex[i]] >= 0:
                    order[m] = ex[i]
                    m += 1
            for i in range(n):
                if st.sof[r * E + ex[i]] < 0:
                    order[m] = ex[i]
                    m += 1
            for w0 in range(0, n, wcap):
                wave = np.sort(order[w0 : min(n, w0 + wcap)])
                h0, a0, k0 = cnt[C_HIT], cnt[C_ACC], cnt[C_COLL]
                if _demand(st, r, wave, zeros, slots) >= 0:
                    out[0] = j
                    return
                if counted:
                    per_layer[0, r] += cnt[C_HIT] - h0
                    per_layer[1, r] += cnt[C_ACC] - a0
                    per_layer[2, r] += cnt[C_COLL] - k0
                    if nprop:
                        for i in range(wave.shape[0]):
                            out[3] += proposed[r * E + wave[i]]
                _release(st, slots, wave.shape[0], 1, 0)
    if seg_phase >= 0:
        sums[seg_phase] += cnt - seg0


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
