"""belady-approx in the compiled cache core: `BeladyApprox`'s events (`moeflow.policies.belady_approx`) over the
flat state, the same floats term by term; they keep the per-slot copies of the keys' fields the victim reads and
each layer's bounds on its candidates' fields (O_BIN: which slots count there), from which `cachecore_bav`'s
victim search skips layers.
"""

from __future__ import annotations

from .cachecore_layout import (
    H_C,
    H_L,
    NEVER_PASS,
    NPK,
    O_BIN,
    O_BNOINT,
    O_BPROP,
    O_BREF,
    O_KR,
    O_LSL,
    O_LSN,
    O_PG,
    O_PIN,
    O_PK,
    O_PLIST,
    O_PROT,
    O_SC,
    O_SEEN,
    O_SOF,
    O_SPA,
    O_SPOS,
    O_SPP,
    O_SRANK,
    O_SREF,
    OF_BIV,
    OF_PAH,
    OF_PGF,
    OF_PKF,
    OF_SIV,
    PG_NINTS,
    PG_NPRED,
    PG_NSEEN,
    PG_PMINOK,
    PGF_EMA,
    PGF_MEAN,
    PGF_PMIN,
    PK_HASINT,
    PK_HASLU,
    PK_HASPRED,
    PK_LASTUSE,
    PK_PAHEAD,
    PK_PIDX,
    PK_PPASS,
    PK_REF,
    SC_PASS,
    _fn,
    _inline,
    _u,
)


@_inline
def _see(I, r):
    """`_see`: layer rank `r` is known; ranks among the known layers follow."""
    seen, srank = I[O_SEEN], I[O_SRANK]
    if I[_u(seen + r)]:
        return
    I[_u(seen + r)] = 1
    n = 0
    for i in range(I[H_L]):
        if I[_u(seen + i)]:
            I[_u(srank + i)] = n
            n += 1
    I[_u(I[O_PG] + PG_NSEEN)] = n


@_inline
def _ahead(I, kr, pr):
    """`_ahead`: MoE layer steps from the running layer (rank pr) until layer rank kr runs."""
    _see(I, kr)
    _see(I, pr)
    srank = I[O_SRANK]
    return (I[_u(srank + kr)] - I[_u(srank + pr)] - 1) % I[_u(I[O_PG] + PG_NSEEN)] + 1


@_inline
def _outcome(I, F, a, hit):
    """`_outcome(ahead, hit)`: calibrated probability a's EMA moves toward hit; the least one (PGF_PMIN) stays
    exact: lowered with it, or recomputed by the next victim search that needs it if the least one rose."""
    ema, x, pm = F[_u(I[OF_PGF] + PGF_EMA)], I[OF_PAH] + a, I[OF_PGF] + PGF_PMIN
    old = F[_u(x)]
    v = (1.0 - ema) * old + ema * hit
    F[_u(x)] = v
    if v < F[_u(pm)]:
        F[_u(pm)] = v
    elif old == F[_u(pm)]:
        I[_u(I[O_PG] + PG_PMINOK)] = 0


@_inline
def _pred_drop(I, k):
    """Remove `k`'s pending proposal (the pending list's last takes its place)."""
    pl, pg = I[O_PLIST], I[O_PG]
    i = I[_u(I[O_PK] + k * NPK + PK_PIDX)]
    n = I[_u(pg + PG_NPRED)] - 1
    last = I[_u(pl + n)]
    I[_u(pl + i)] = last
    I[_u(I[O_PK] + last * NPK + PK_PIDX)] = i
    I[_u(pg + PG_NPRED)] = n
    I[_u(I[O_PK] + k * NPK + PK_HASPRED)] = 0


@_inline
def _ba_join(I, F, q, ref, spp, iv):
    """A slot's fields (its key's PK_REF, PK_PPASS, interval EMA: -1 none) join layer rank q's bounds: a new
    value joins the top two (bottom two) bounds; a value it replaces stays counted, which only loosens them."""
    L = I[H_L]
    br = I[O_BREF] + q
    if ref < I[_u(br)]:
        I[_u(br + L)] = I[_u(br)]
        I[_u(br)] = ref
    elif ref < I[_u(br + L)]:
        I[_u(br + L)] = ref
    if spp > I[_u(I[O_BPROP] + q)]:
        I[_u(I[O_BPROP] + q)] = spp
    if iv < 0.0:
        I[_u(I[O_BNOINT] + q)] += 1
        return
    bi = I[OF_BIV] + q
    if iv > F[_u(bi)]:
        F[_u(bi + L)] = F[_u(bi)]
        F[_u(bi)] = iv
    elif iv > F[_u(bi + L)]:
        F[_u(bi + L)] = iv


@_inline
def _ba_leave(I, F, q, s):
    """Slot s's fields leave layer rank q's bounds (a value at a bound is the largest (least) there: the second
    bound takes its place)."""
    L = I[H_L]
    iv, ref, bi, br = F[_u(I[OF_SIV] + s)], I[_u(I[O_SREF] + s)], I[OF_BIV] + q, I[O_BREF] + q
    if iv < 0.0:
        I[_u(I[O_BNOINT] + q)] -= 1
    elif iv == F[_u(bi)]:
        F[_u(bi)] = F[_u(bi + L)]
    if ref == I[_u(br)]:
        I[_u(br)] = I[_u(br + L)]


@_inline
def _ba_slot(I, F, k):
    """The per-slot copy of resident key k's fields (the victim reads slots), and its layer's bounds: a
    candidate's new fields join them; a pinned or issued slot leaves them (O_BIN) until `ba_candidate`."""
    s = I[_u(I[O_SOF] + k)]
    if s < 0:
        return
    b = I[O_PK] + k * NPK
    q = I[_u(I[O_KR] + k)]
    ref = I[_u(b + PK_REF)]
    spp = I[_u(b + PK_PPASS)] if I[_u(b + PK_HASPRED)] else NEVER_PASS
    iv = F[_u(I[OF_PKF] + k)] if I[_u(b + PK_HASINT)] else -1.0
    bin_ = I[O_BIN] + s
    if I[_u(bin_)]:  # its old values leave the bounds
        _ba_leave(I, F, q, s)
    I[_u(I[O_SREF] + s)] = ref
    I[_u(I[O_SPP] + s)] = spp
    I[_u(I[O_SPA] + s)] = I[_u(b + PK_PAHEAD)]
    F[_u(I[OF_SIV] + s)] = iv
    if I[_u(I[O_PIN] + s)] or I[_u(I[O_PROT] + s)]:  # not a candidate: out of the bounds
        I[_u(bin_)] = 0
        return
    I[_u(bin_)] = 1
    _ba_join(I, F, q, ref, spp, iv)


@_fn
def ba_candidate(I, F, k):
    """Resident key k is a candidate again (unpinned, or its prefetch call over): its slot's fields join its
    layer's bounds if they left them."""
    s = I[_u(I[O_SOF] + k)]
    if s < 0 or I[_u(I[O_BIN] + s)] or I[_u(I[O_PIN] + s)] or I[_u(I[O_PROT] + s)]:
        return
    I[_u(I[O_BIN] + s)] = 1
    _ba_join(I, F, I[_u(I[O_KR] + k)], I[_u(I[O_SREF] + s)], I[_u(I[O_SPP] + s)], F[_u(I[OF_SIV] + s)])


@_inline
def _predict(I, k, pr):
    p = I[_u(I[O_SC] + SC_PASS)]
    if I[_u(I[O_PK] + k * NPK + PK_HASPRED)] and I[_u(I[O_PK] + k * NPK + PK_PPASS)] == p:
        return
    ahead = _ahead(I, I[_u(I[O_KR] + k)], pr)
    if not I[_u(I[O_PK] + k * NPK + PK_HASPRED)]:
        pg = I[O_PG]
        n = I[_u(pg + PG_NPRED)]
        I[_u(I[O_PLIST] + n)] = k
        I[_u(I[O_PK] + k * NPK + PK_PIDX)] = n
        I[_u(pg + PG_NPRED)] = n + 1
        I[_u(I[O_PK] + k * NPK + PK_HASPRED)] = 1
    I[_u(I[O_PK] + k * NPK + PK_PPASS)] = p
    I[_u(I[O_PK] + k * NPK + PK_PAHEAD)] = ahead


@_fn
def ba_insert(I, F, k, pr, prefetched):
    """`on_insert` (after `_Base`'s tick): the key's slot joins its layer's list."""
    q, s, C = I[_u(I[O_KR] + k)], I[_u(I[O_SOF] + k)], I[H_C]
    n = I[_u(I[O_LSN] + q)]
    I[_u(I[O_LSL] + q * C + n)] = s
    I[_u(I[O_SPOS] + s)] = n
    I[_u(I[O_LSN] + q)] = n + 1
    I[_u(I[O_PK] + k * NPK + PK_REF)] = I[_u(I[O_SC] + SC_PASS)]
    if prefetched:
        _predict(I, k, pr)
    _ba_slot(I, F, k)


@_fn
def ba_evict(I, F, k, s):
    """`on_evict`: slot s leaves its layer's list (the list's last takes its place) and its bounds (a key at a
    bound is the largest (least) there: the second bound takes its place), if counted there (O_BIN)."""
    q, C = I[_u(I[O_KR] + k)], I[H_C]
    _slot_list_remove(I, q, C, s)
    if not I[_u(I[O_BIN] + s)]:
        return
    I[_u(I[O_BIN] + s)] = 0
    _ba_leave(I, F, q, s)


@_fn
def _slot_list_remove(I, q, C, s):
    """Slot s leaves layer rank q's slot list (the list's last takes its place); next-use's core shares it."""
    lsl, i = I[O_LSL] + q * C, I[_u(I[O_SPOS] + s)]
    n = I[_u(I[O_LSN] + q)] - 1
    last = I[_u(lsl + n)]
    I[_u(lsl + i)] = last
    I[_u(I[O_SPOS] + last)] = i
    I[_u(I[O_LSN] + q)] = n


@_fn
def ba_access(I, F, k):
    """`on_access` (after `_Base`'s tick)."""
    _see(I, I[_u(I[O_KR] + k)])
    p = I[_u(I[O_SC] + SC_PASS)]
    pg, pgf = I[O_PG], I[OF_PGF]
    b = I[O_PK] + k * NPK
    ema = F[_u(pgf + PGF_EMA)]
    if I[_u(b + PK_HASLU)] and p > I[_u(b + PK_LASTUSE)]:
        gap = float(p - I[_u(b + PK_LASTUSE)])
        f = I[OF_PKF] + k
        if I[_u(b + PK_HASINT)]:
            F[_u(f)] = (1.0 - ema) * F[_u(f)] + ema * gap
        else:
            F[_u(f)] = gap
            I[_u(b + PK_HASINT)] = 1
        I[_u(pg + PG_NINTS)] += 1
        F[_u(pgf + PGF_MEAN)] += (gap - F[_u(pgf + PGF_MEAN)]) / min(I[_u(pg + PG_NINTS)], 1000)
    I[_u(b + PK_HASLU)] = 1
    I[_u(b + PK_LASTUSE)] = p
    I[_u(b + PK_REF)] = p
    if I[_u(b + PK_HASPRED)]:
        pp, ahead = I[_u(b + PK_PPASS)], I[_u(b + PK_PAHEAD)]
        _pred_drop(I, k)
        if pp == p:
            _outcome(I, F, ahead, 1.0)
    _ba_slot(I, F, k)


@_fn
def ba_predicted(I, F, k, pr):
    _predict(I, k, pr)
    _ba_slot(I, F, k)


@_fn
def ba_expire(I, F, p, rr):
    """Proposals of an earlier pass, or (rr >= 0) of a layer before rank rr of this pass, were wasted (their
    layer ran without them)."""
    pg, pl, srank = I[O_PG], I[O_PLIST], I[O_SRANK]
    i = 0
    while i < I[_u(pg + PG_NPRED)]:
        k = I[_u(pl + i)]
        pp = I[_u(I[O_PK] + k * NPK + PK_PPASS)]
        if pp < p or (rr >= 0 and pp == p and I[_u(srank + I[_u(I[O_KR] + k)])] < rr):
            a = I[_u(I[O_PK] + k * NPK + PK_PAHEAD)]
            _pred_drop(I, k)
            _ba_slot(I, F, k)
            _outcome(I, F, a, 0.0)
        else:
            i += 1
