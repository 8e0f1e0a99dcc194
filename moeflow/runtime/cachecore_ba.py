"""belady-approx in the compiled cache core: `BeladyApprox`'s events and victim (`moeflow.policies.belady_approx`)
over the flat state, the same floats term by term.

The victim is the candidate of largest E[next use] = d + (1 - p1) * L * I (ties within 1e-9: least recent, then
key). With every layer seen and one part, the search visits layers, not all slots: each layer keeps its
resident slots (O_LSL) and bounds on its keys' fields (an interval EMA at most OF_BIV, a PK_REF at least
O_BREF, O_BNOINT: a key may have no interval), loosened as keys change and made exact when the layer is
scanned; E[next use] <= d + L * max(interval, mean if BNOINT, passes since BREF, 1) in floats too (every step of
the arithmetic is monotone), so layers are scanned by decreasing bound until the next bound is below the top
found less 1e-9: no unscanned slot can be the victim or tie with it.
"""

from __future__ import annotations

from .cachecore_layout import (
    H_C,
    H_L,
    H_PER,
    H_PERLAYER,
    NEVER_PASS,
    NO_REF,
    NPK,
    O_BIN,
    O_BNOINT,
    O_BPROP,
    O_BREF,
    O_BSCAN,
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
    O_SKEY,
    O_SOF,
    O_SPA,
    O_SPOS,
    O_SPP,
    O_SRANK,
    O_SREF,
    O_SRK,
    OF_BIV,
    OF_FAR,
    OF_PAH,
    OF_PGF,
    OF_PKF,
    OF_SIV,
    OF_UB,
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
    PK_LAST,
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
    I[_u(I[O_SREF] + s)] = ref
    I[_u(I[O_SPP] + s)] = spp
    I[_u(I[O_SPA] + s)] = I[_u(b + PK_PAHEAD)]
    bin_ = I[O_BIN] + s
    if I[_u(bin_)] and F[_u(I[OF_SIV] + s)] < 0.0:  # its old value leaves the count of keys without interval
        I[_u(I[O_BNOINT] + q)] -= 1
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
    q, C, L = I[_u(I[O_KR] + k)], I[H_C], I[H_L]
    _slot_list_remove(I, q, C, s)
    if not I[_u(I[O_BIN] + s)]:
        return
    I[_u(I[O_BIN] + s)] = 0
    iv, ref, bi, br = F[_u(I[OF_SIV] + s)], I[_u(I[O_SREF] + s)], I[OF_BIV] + q, I[O_BREF] + q
    if iv < 0.0:
        I[_u(I[O_BNOINT] + q)] -= 1
    elif iv == F[_u(bi)]:
        F[_u(bi)] = F[_u(bi + L)]
    if ref == I[_u(br)]:
        I[_u(br)] = I[_u(br + L)]


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


@_fn
def _far(I, F, s, pr, p, L, mean):
    """E[next use] of slot s's key seen from rank pr, every layer seen (`expected_next_use`'s arithmetic)."""
    d = I[_u(I[O_SRK] + s)] - pr - 1
    d = d + L + 1 if d < 0 else d + 1
    iv = F[_u(I[OF_SIV] + s)]  # max(interval (none: the mean), passes since last use or load, 1)
    Ik = iv if iv >= 0.0 else mean
    age = float(p - I[_u(I[O_SREF] + s)])
    Ik = age if age > Ik else Ik
    Ik = 1.0 if 1.0 > Ik else Ik
    p1 = F[_u(I[OF_PAH] + I[_u(I[O_SPA] + s)])] if I[_u(I[O_SPP] + s)] == p and d < L else 1.0 / Ik
    return d + (1.0 - p1) * L * Ik


@_inline
def _pmin(I, F):
    """The least calibrated probability (PGF_PMIN, recomputed if stale)."""
    pm = I[OF_PGF] + PGF_PMIN
    if not I[_u(I[O_PG] + PG_PMINOK)]:
        pah, v = I[OF_PAH], 1.0
        for a in range(I[H_L] + 2):
            v = F[_u(pah + a)] if F[_u(pah + a)] < v else v
        F[_u(pm)] = v
        I[_u(I[O_PG] + PG_PMINOK)] = 1
    return F[_u(pm)]


@_fn
def _ba_layers(I, F, pr):
    """The victim search over layers (one part, every layer seen); -1: no candidate. A layer's bound: a key
    not proposed in this pass has p1 = 1 / I, so E = d + L * (I - 1); a proposed one (BPROP) p1 >= the least
    calibrated probability, so E <= d + (1 - that) * L * I; both plus a margin far above the rounding."""
    C, L = I[H_C], I[H_L]
    skey, pin, prot, far, ub, pk = I[O_SKEY], I[O_PIN], I[O_PROT], I[OF_FAR], I[OF_UB], I[O_PK]
    lsl, lsn, bref, bnoint, biv, scan = I[O_LSL], I[O_LSN], I[O_BREF], I[O_BNOINT], I[OF_BIV], I[O_BSCAN]
    bprop, siv, sref, spp, spa, pah = I[O_BPROP], I[OF_SIV], I[O_SREF], I[O_SPP], I[O_SPA], I[OF_PAH]
    bin_ = I[O_BIN]
    mean = F[I[OF_PGF] + PGF_MEAN]
    p = I[I[O_SC] + SC_PASS]
    pmin = 2.0  # the least calibrated probability, computed when a layer first needs it (2.0: not yet)
    for q in range(L):
        if I[_u(lsn + q)] == 0:
            F[_u(ub + q)] = -1.0
            continue
        d = q - pr - 1
        d = d + L + 1 if d < 0 else d + 1
        Im = F[_u(biv + q)]
        if I[_u(bnoint + q)] > 0 and mean > Im:
            Im = mean
        age = float(p - I[_u(bref + q)])
        Im = age if age > Im else Im
        Im = 1.0 if 1.0 > Im else Im
        e = Im - 1.0
        if I[_u(bprop + q)] >= p and d < L:
            if pmin > 1.0:
                pmin = _pmin(I, F)
            if (1.0 - pmin) * Im > e:
                e = (1.0 - pmin) * Im
        F[_u(ub + q)] = d + L * e + 1e-9 * (1.0 + d + L * Im)
    top = -1.0  # every E[next use] is >= 1
    best, bt, recheck = -1, 0, False  # the least recent candidate within 1e-9 of the top so far
    nscan = 0
    while True:
        q, bq = -1, -1.0
        for r in range(L):
            if F[_u(ub + r)] > bq:
                q, bq = r, F[_u(ub + r)]
        if q < 0 or bq < top - 1e-9:  # no slot of an unscanned layer reaches the window
            break
        F[_u(ub + q)] = -1.0
        I[_u(scan + nscan)] = q
        nscan += 1
        d = q - pr - 1
        d = d + L + 1 if d < 0 else d + 1
        iv1, iv2, ref1, ref2, noint, nprop = -1.0, -1.0, NO_REF, NO_REF, 0, NEVER_PASS  # exact bounds again
        for i in range(I[_u(lsn + q)]):
            s = I[_u(lsl + q * C + i)]
            if I[_u(pin + s)] or I[_u(prot + s)]:  # not a candidate: out of the bounds until `ba_candidate`
                F[_u(far + s)] = -1.0
                I[_u(bin_ + s)] = 0
                continue
            iv, ref, pp = F[_u(siv + s)], I[_u(sref + s)], I[_u(spp + s)]
            # the top two intervals (-1: none) and the least two references of the candidates, without branches
            noint += iv < 0.0
            lo = iv if iv < iv1 else iv1
            iv1 = iv if iv > iv1 else iv1
            iv2 = lo if lo > iv2 else iv2
            hi = ref if ref > ref1 else ref1
            ref1 = ref if ref < ref1 else ref1
            ref2 = hi if hi < ref2 else ref2
            nprop = pp if pp > nprop else nprop
            Ik = iv if iv >= 0.0 else mean  # `expected_next_use`'s arithmetic
            age = float(p - ref)
            Ik = age if age > Ik else Ik
            Ik = 1.0 if 1.0 > Ik else Ik
            if pp == p and d < L:
                p1 = F[_u(pah + I[_u(spa + s)])]
            elif d + L * (Ik - 1.0) + 1e-9 * (1.0 + d + L * Ik) < top - 1e-9:
                F[_u(far + s)] = -1.0  # E = d + L * (I - 1) up to rounding: below the window, no division
                continue
            else:
                p1 = 1.0 / Ik
            f = d + (1.0 - p1) * L * Ik
            F[_u(far + s)] = f
            if f > top:
                if top < f - 1e-9:  # every earlier slot falls out of the window
                    best = -1
                else:  # a rise within 1e-9: the window is sorted out below
                    recheck = True
                top = f
            if f >= top - 1e-9:
                k = I[_u(skey + s)]
                t = I[_u(pk + k * NPK + PK_LAST)]
                if best < 0 or t < bt or (t == bt and k < best):
                    best, bt = k, t
        F[_u(biv + q)], F[_u(biv + L + q)], I[_u(bref + q)], I[_u(bref + L + q)] = iv1, iv2, ref1, ref2
        I[_u(bnoint + q)], I[_u(bprop + q)] = noint, nprop
    if top < 0.0 or not recheck:
        return best
    best, bt = -1, 0
    cut = top - 1e-9
    for j in range(nscan):
        q = I[_u(scan + j)]
        for i in range(I[_u(lsn + q)]):
            s = I[_u(lsl + q * C + i)]
            if F[_u(far + s)] < cut:
                continue
            k = I[_u(skey + s)]
            t = I[_u(pk + k * NPK + PK_LAST)]
            if best < 0 or t < bt or (t == bt and k < best):
                best, bt = k, t
    return best


@_fn
def ba_victim(I, F, part, pr):
    """The candidate of largest E[next use] (ties within 1e-9: least recent, then key); -1: no candidate.
    `BeladyApprox.victim`'s arithmetic, term by term (the same floats), over the per-slot copies (`_ba_slot`);
    the layers' ranks among the layers seen so far (`_ahead`), once every layer is seen the ranks themselves."""
    C, per, L = I[H_C], I[H_PER], I[H_L]
    perlayer = I[H_PERLAYER]
    if not perlayer and I[_u(I[O_PG] + PG_NSEEN)] == L:
        return _ba_layers(I, F, pr)
    skey, pin, prot, srk, far = I[O_SKEY], I[O_PIN], I[O_PROT], I[O_SRK], I[OF_FAR]
    mean = F[_u(I[OF_PGF] + PGF_MEAN)]
    p = I[_u(I[O_SC] + SC_PASS)]
    lo, hi = (part * per, part * per + per) if perlayer else (0, C)
    for s in range(lo, hi):
        if I[_u(skey + s)] < 0 or I[_u(pin + s)] or I[_u(prot + s)]:
            F[_u(far + s)] = -1.0
            continue
        if I[_u(I[O_PG] + PG_NSEEN)] == L:
            F[_u(far + s)] = _far(I, F, s, pr, p, L, mean)
            continue
        d = _ahead(I, I[_u(srk + s)], pr)
        Ls = I[_u(I[O_PG] + PG_NSEEN)]
        iv = F[_u(I[OF_SIV] + s)]
        Ik = iv if iv >= 0.0 else mean
        age = float(p - I[_u(I[O_SREF] + s)])
        Ik = age if age > Ik else Ik
        Ik = 1.0 if 1.0 > Ik else Ik
        p1 = F[_u(I[OF_PAH] + I[_u(I[O_SPA] + s)])] if I[_u(I[O_SPP] + s)] == p and d < Ls else 1.0 / Ik
        F[_u(far + s)] = d + (1.0 - p1) * Ls * Ik
    top = -1.0  # every E[next use] is >= 1
    for s in range(lo, hi):
        f = F[_u(far + s)]
        top = f if f > top else top
    if top < 0.0:
        return -1
    best, bt = -1, 0
    cut = top - 1e-9
    for s in range(lo, hi):
        if F[_u(far + s)] < cut:
            continue
        k = I[_u(skey + s)]
        t = I[_u(I[O_PK] + k * NPK + PK_LAST)]
        if best < 0 or t < bt or (t == bt and k < best):
            best, bt = k, t
    return best
