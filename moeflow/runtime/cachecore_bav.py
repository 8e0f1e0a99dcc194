"""belady-approx's victim search in the compiled cache core (`BeladyApprox.victim`, the same floats term by
term; its events, which keep the per-slot copies and the per-layer bounds, are `cachecore_ba`'s).

The victim is the candidate of largest E[next use] = d + (1 - p1) * L * I (ties within 1e-9: least recent, then
key). With every layer seen and one part, the search visits layers, not all slots: each layer keeps its
resident slots (O_LSL) and bounds on its candidates' fields (an interval EMA at most OF_BIV, a PK_REF at least
O_BREF, O_BNOINT: a key may have no interval), loosened as keys change and made exact when the layer is
scanned; E[next use] <= d + L * max(interval, mean if BNOINT, passes since BREF, 1) in floats too (every step of
the arithmetic is monotone), so layers are scanned by decreasing bound until the next bound is below the top
found less 1e-9: no unscanned slot can be the victim or tie with it.

The bounds count candidates only (O_BIN, per slot): a pinned or just-issued slot leaves them when its key's
fields change or a scan meets it, and joins them again when it is a candidate again (`ba_candidate`, from the
mechanism's release and the end of a prefetch call); its fields would otherwise keep the running layer's bound
high although none of its slots can be the victim. A key's changed fields first leave the bounds (`_ba_leave`, as
at an eviction: a value at a bound hands it the second bound) and then join them, so accessing a layer's
stalest key does not leave its old reference as the layer's bound. With pregate (olmoe-deep, 25%,
`benchmarks/sim_speed.py`'s replay) a victim search scans 1.06 layers and 12.1 slots (1.94 / 26.2 with every
slot in the bounds and values left in place; 1.21 / 13.7 with candidates only); prefetch none: 1.01 / 11.8
(1.50 / 18.3; 1.36 / 16.4); bounds exact over the candidates at every search would scan 1.00 / 11.3.
The least calibrated probability (the bound of proposed keys) is kept in PGF_PMIN (`_outcome`, `_pmin`).
Tried and not kept: each layer's bound kept between searches and recomputed only when its fields, the pass,
the mean interval (BNOINT) or a proposal (BPROP) made it stale: 2.85 of 12 layers recomputed per pregate search
(fields 2.0, proposed layers 1.5, a new pass 0.3), the same layers and slots scanned, and no faster (3.46-3.47 vs
3.49-3.53 M accesses per CPU second pregate, 4.9-5.0 vs 5.1-5.2 none, interleaved, load 1.3-2.0). Also tried and
not kept (same replay, `benchmarks/sim_speed.py --model models/olmoe-deep --evictions belady-approx
--python-passes 10`, quiet host, same counters): the largest bound and the runner-up found while the bounds are
made, so the first layer needs no scan for the largest and the runner-up ends the loop without a second one:
slower (4.7 / 3.0-3.1 M per CPU s, none / pregate, against 4.9-5.4 / 3.3-3.5, alternating); and a search that resumes
the last one within a prefetch call (its E values, its pruned slots' bounds and the unscanned layers' bounds kept
until an event other than evicting its victim or inserting a key that is no candidate): the searches after a
call's first resume where no other event came between, but a resumed search still reads its scanned slots again for
the new largest, the window and its pruned slots, and often scans another layer, so pregate ran at 3.12 against 3.53
(none 5.54 against 5.30).
"""

from __future__ import annotations

from .cachecore_ba import _ahead
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
    O_LSL,
    O_LSN,
    O_PG,
    O_PIN,
    O_PK,
    O_PROT,
    O_SC,
    O_SKEY,
    O_SPA,
    O_SPP,
    O_SREF,
    O_SRK,
    OF_BIV,
    OF_FAR,
    OF_PAH,
    OF_PGF,
    OF_SIV,
    OF_UB,
    PG_NSEEN,
    PG_PMINOK,
    PGF_MEAN,
    PGF_PMIN,
    PK_LAST,
    SC_PASS,
    _fn,
    _inline,
    _u,
)


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
