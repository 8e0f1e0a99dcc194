"""next-use in the compiled cache core: `NextUse`'s events and victim (`moeflow.policies.next_use`) over the flat
state, the same floats operation by operation.

The victim is the candidate of largest E[T] = d + (1 - p1) * L / f (ties: least recent, then key): per layer
once its terms (d, shrink * mean share, passes + shrink, the pass of its last run, covered by proposals), per
slot f, p1 and E[T]. A layer's row sum of uses (the mean share) is numpy's pairwise sum over the experts seen
so far (`_row_sum`), kept until the row or that width changes. With one part the search visits layers, not all
slots: each layer keeps its resident slots (O_LSL) and a lower bound of its keys' uses (exact again when it is
scanned; an insert lowers it, a decay scales it); every step of E[T] is monotone in f (>= f at that bound) and
in p1 (>= the least calibrated probability it can take there), so the same arithmetic on those extremes bounds
every key of the layer in floats too, and layers are scanned by decreasing bound until the next bound is below
the top found: no unscanned key can be the victim or tie with it. A layer's terms and bound are kept between
victims: recomputed for every layer when the running layer, the pass, the layers seen, the experts seen, the
proposals' coverage or the calibration change (once per layer step), else for a layer whose uses, passes or
bound changed.

Layout (`cachecore_layout`): integers at I[O_NU] (NU_* scalars, used_pass [K], prop_pass [K], the running
layer's bucket / recent / proposed / resident [4, E], per layer: row sum stale, pass of its last run, covered
[3, L]); floats at F[I[OF_NU]] (NUF_* scalars and calibration counts, uses [K], per layer: passes, row sum,
shrink * mean, passes + shrink, steps until it runs [5, L]). Keys `rank * E + expert`, as the Python arrays'
(layer, expert) with layers in ascending order.
"""

from __future__ import annotations

from ..policies.next_use_sums import bucket as _bucket
from ..policies.next_use_sums import row_sum as _row_sum
from .cachecore_ba import _see, _slot_list_remove
from .cachecore_layout import (
    H_C,
    H_E,
    H_K,
    H_L,
    H_PER,
    H_PERLAYER,
    NNU,
    NNUF,
    NPK,
    NU_BUCKETS,
    NU_CPASS,
    NU_CSRC,
    NU_CSTEPS,
    NU_NEXP,
    NU_NO_USES,
    NU_PROPOSALS,
    NU_R0,
    NU_RECENCY,
    NU_RUN,
    NU_RUNCOV,
    NU_RUNNEXP,
    NU_RUNPASS,
    NU_TPASS,
    NU_TVALID,
    NUF_DECAY,
    NUF_PP,
    NUF_PROP_SEEN,
    NUF_PROP_USED,
    NUF_RATIO,
    NUF_REC_SEEN,
    NUF_REC_USED,
    NUF_SHRINK,
    NUF_SUFMIN,
    O_KR,
    O_LSL,
    O_LSN,
    O_NU,
    O_PG,
    O_PIN,
    O_PK,
    O_PROT,
    O_SC,
    O_SEEN,
    O_SKEY,
    O_SOF,
    O_SPOS,
    O_SRANK,
    O_SRK,
    OF_NU,
    PG_NSEEN,
    PK_LAST,
    PK_TR,
    SC_PASS,
    _fn,
)

# ---- events ----------------------------------------------------------------------------------------------


@_fn
def _see_nu(I, r):
    """`_see`; a new layer changes every layer's terms."""
    n = I[I[O_PG] + PG_NSEEN]
    _see(I, r)
    if I[I[O_PG] + PG_NSEEN] != n:
        I[I[O_NU] + NU_TVALID] = 0


@_fn
def _dirty(I, q):
    """Layer q's victim-search terms are stale."""
    I[I[O_NU] + NNU + 2 * I[H_K] + 4 * I[H_E] + 3 * I[H_L] + q] = 1


@_fn
def _grow(I, k):
    """`_grow`: the experts seen so far (the Python arrays' width); a wider row sums in another order: every row
    sum is stale."""
    nu = I[O_NU]
    e = k - I[I[O_KR] + k] * I[H_E]
    if e + 1 > I[nu + NU_NEXP]:
        I[nu + NU_NEXP] = e + 1
        _stale_all(I)
        I[nu + NU_TVALID] = 0


@_fn
def _stale_all(I):
    nu, K, E, L = I[O_NU], I[H_K], I[H_E], I[H_L]
    o = nu + NNU + 2 * K + 4 * E
    for q in range(L):
        I[o + q] = 1


@_fn
def _proposed(I, k, pr):
    """`_proposed`: key k proposed from the layer of rank pr in this pass."""
    nu = I[O_NU]
    if not I[nu + NU_PROPOSALS]:
        return
    kr = I[I[O_KR] + k]
    _see_nu(I, kr)
    _see_nu(I, pr)
    p = I[I[O_SC] + SC_PASS]
    I[nu + NNU + I[H_K] + k] = p
    srank = I[O_SRANK]
    src = I[srank + pr]
    dist = I[srank + kr] - src
    if I[nu + NU_CPASS] != p or I[nu + NU_CSRC] != src or dist > I[nu + NU_CSTEPS]:
        I[nu + NU_TVALID] = 0  # the layers it covers change
    I[nu + NU_CPASS] = p
    I[nu + NU_CSRC] = src
    if dist > I[nu + NU_CSTEPS]:
        I[nu + NU_CSTEPS] = dist


@_fn
def nu_insert(I, F, k, pr, prefetched):
    """`on_insert` (after `_Base`'s tick); its slot joins its layer's list, its uses the layer's bound."""
    q = I[I[O_KR] + k]
    _see_nu(I, q)
    _grow(I, k)
    if prefetched:
        _proposed(I, k, pr)
    s, C, K, L = I[I[O_SOF] + k], I[H_C], I[H_K], I[H_L]
    n = I[I[O_LSN] + q]
    I[I[O_LSL] + q * C + n] = s
    I[I[O_SPOS] + s] = n
    I[I[O_LSN] + q] = n + 1
    fu = I[OF_NU]
    u, um = F[fu + NNUF + k], fu + NNUF + K + 5 * L + q
    if u < F[um]:
        F[um] = u
        _dirty(I, q)


@_fn
def nu_evict(I, F, k, s):
    """`on_evict`: slot s leaves its layer's list (the list's last takes its place)."""
    _slot_list_remove(I, I[I[O_KR] + k], I[H_C], s)


@_fn
def nu_access(I, F, k):
    """`on_access` (after `_Base`'s tick): the key's first use in this pass counts."""
    kr = I[I[O_KR] + k]
    _see_nu(I, kr)
    _grow(I, k)
    nu, K, E = I[O_NU], I[H_K], I[H_E]
    p = I[I[O_SC] + SC_PASS]
    if I[nu + NNU + k] != p:
        I[nu + NNU + k] = p
        F[I[OF_NU] + NNUF + k] += 1.0
        I[nu + NNU + 2 * K + 4 * E + kr] = 1  # its row sum is stale
        _dirty(I, kr)


@_fn
def nu_predicted(I, F, k, pr):
    if I[I[O_PK] + k * NPK + PK_TR]:
        _proposed(I, k, pr)


@_fn
def _end_run(I, F):
    """`_end_run`: score the predictions made for the run that just ended (its layer's keys, used or not)."""
    nu, fu, K, E = I[O_NU], I[OF_NU], I[H_K], I[H_E]
    q = I[nu + NU_RUN]
    if q < 0:
        return
    I[nu + NU_RUN] = -1
    I[nu + NU_TVALID] = 0  # the calibration changes
    p, n, cov = I[nu + NU_RUNPASS], I[nu + NU_RUNNEXP], I[nu + NU_RUNCOV]
    up, rb = nu + NNU, nu + NNU + 2 * K
    for e in range(n):
        used = I[up + q * E + e] == p
        j = 2 * I[rb + e] + I[rb + E + e]
        F[fu + NUF_REC_SEEN + j] += 1.0
        if used:
            F[fu + NUF_REC_USED + j] += 1.0
        if cov and I[rb + 3 * E + e]:  # resident at its start: proposed or not
            j = I[rb + 2 * E + e]
            F[fu + NUF_PROP_SEEN + j] += 1.0
            if used:
                F[fu + NUF_PROP_USED + j] += 1.0


@_fn
def nu_pass_start(I, F, p):
    _end_run(I, F)
    fu = I[OF_NU]
    decay = F[fu + NUF_DECAY]
    if decay < 1.0:
        K, L = I[H_K], I[H_L]
        for k in range(K):
            F[fu + NNUF + k] *= decay
        for q in range(L):
            F[fu + NNUF + K + q] *= decay
            F[fu + NNUF + K + 5 * L + q] *= decay  # the bound scales with its keys' uses (rounding is monotone)
        _stale_all(I)
        I[I[O_NU] + NU_TVALID] = 0


@_fn
def _fresh_sum(I, F, q):
    """Layer q's row sum of uses over the experts seen (numpy's order), recomputed when stale."""
    nu, fu, K, E = I[O_NU], I[OF_NU], I[H_K], I[H_E]
    st = nu + NNU + 2 * K + 4 * E + q
    o = fu + NNUF + K + I[H_L] + q
    if I[st]:
        F[o] = _row_sum(F, fu + NNUF + q * E, I[nu + NU_NEXP])
        I[st] = 0
    return F[o]


@_fn
def nu_layer_start(I, F, r):
    """`on_layer_start`: the layer's run begins; what its keys' next run will be scored on."""
    _end_run(I, F)
    nu, fu, K, E = I[O_NU], I[OF_NU], I[H_K], I[H_E]
    p = I[I[O_SC] + SC_PASS]
    _see_nu(I, r)
    if I[nu + NU_NEXP] < 1:  # `_see` grows the arrays to one column at least
        I[nu + NU_NEXP] = 1
        _stale_all(I)
        I[nu + NU_TVALID] = 0
    F[fu + NNUF + K + r] += 1.0
    _dirty(I, r)
    nexp = I[nu + NU_NEXP]
    I[nu + NU_RUN], I[nu + NU_RUNPASS], I[nu + NU_RUNNEXP] = r, p, nexp
    # `_share(l)`: (uses + shrink * mean) / (n + shrink), n = max(passes, 1e-9), mean = row sum / n / width
    n = F[fu + NNUF + K + r]
    n = n if n > 1e-9 else 1e-9
    mean = _fresh_sum(I, F, r) / n / float(nexp)
    shrink = F[fu + NUF_SHRINK]
    sm, den = shrink * mean, n + shrink
    up, pp, rb = nu + NNU, nu + NNU + K, nu + NNU + 2 * K
    for e in range(nexp):
        k = r * E + e
        I[rb + e] = _bucket((F[fu + NNUF + k] + sm) / den)
        I[rb + E + e] = 1 if I[up + k] == p - 1 else 0
        I[rb + 2 * E + e] = 1 if I[pp + k] == p else 0
        I[rb + 3 * E + e] = I[I[O_PK] + k * NPK + PK_TR]
    cov = 0
    if I[nu + NU_PROPOSALS] and I[nu + NU_CPASS] == p:
        d = I[I[O_SRANK] + r] - I[nu + NU_CSRC]
        cov = 1 if 0 < d <= I[nu + NU_CSTEPS] else 0
    I[nu + NU_RUNCOV] = cov


# ---- the victim ------------------------------------------------------------------------------------------


@_fn
def _terms(I, F, q, full, r0, p, Ls, Lf, width):
    """Layer q's victim-search terms: shrink * mean share and passes + shrink; with `full` the step's d, the pass
    of its last run and whether proposals cover it; then its bound (an exact upper bound of E[T] over its keys)."""
    nu, fu, K, E, L = I[O_NU], I[OF_NU], I[H_K], I[H_E], I[H_L]
    fl, lq = fu + NNUF + K, nu + NNU + 2 * K + 4 * E + L
    n = F[fl + q]
    n = n if n > 1e-9 else 1e-9
    mean = _fresh_sum(I, F, q) / n / width
    shrink = F[fu + NUF_SHRINK]
    F[fl + 2 * L + q] = shrink * mean
    F[fl + 3 * L + q] = n + shrink
    if full:
        rq = I[I[O_SRANK] + q]
        d = rq - r0 - 1  # (rq - r0 - 1) % Ls + 1, ranks in [0, Ls)
        F[fl + 4 * L + q] = float(d + Ls + 1 if d < 0 else d + 1)
        ahead = rq > r0
        I[lq + q] = p - 1 if ahead else p
        steps = rq - I[nu + NU_CSRC]
        cov_on = I[nu + NU_PROPOSALS] != 0 and I[nu + NU_CPASS] == p
        I[lq + L + q] = 1 if cov_on and steps > 0 and steps <= I[nu + NU_CSTEPS] and ahead else 0
    fm = (F[fl + 5 * L + q] + F[fl + 2 * L + q]) / F[fl + 3 * L + q]  # <= f of every key of the layer
    fm = fm if fm > 1e-3 else 1e-3
    if I[lq + L + q]:
        pl = F[fu + NUF_PP] if F[fu + NUF_PP] < F[fu + NUF_PP + 1] else F[fu + NUF_PP + 1]
    elif I[nu + NU_RECENCY]:  # a key's bucket is at least the bound's
        pl = F[fu + NUF_SUFMIN + _bucket(fm)]
    else:
        pl = fm
    num = (1.0 - pl) * Lf
    num = num if num > 0.0 else 0.0  # a key with a negative one is below d
    F[fl + 6 * L + q] = F[fl + 4 * L + q] + num / fm


@_fn
def nu_victim(I, F, part, pr):
    """The candidate of largest E[T] (ties: least recent, then key); -1: no candidate. `expected_next_use`'s
    arithmetic, operation by operation: per layer its terms (kept between victims), per candidate slot f, p1 and
    E[T]; with one part, layers by decreasing bound."""
    _see_nu(I, pr)
    nu, fu, K, E, L, C = I[O_NU], I[OF_NU], I[H_K], I[H_E], I[H_L], I[H_C]
    seen = I[O_SEEN]
    Ls = I[I[O_PG] + PG_NSEEN]
    r0 = I[I[O_SRANK] + pr]
    p = I[I[O_SC] + SC_PASS]
    nexp = I[nu + NU_NEXP]
    width = float(nexp if nexp > 1 else 1)
    Lf = float(Ls)
    full = I[nu + NU_TVALID] == 0 or I[nu + NU_R0] != r0 or I[nu + NU_TPASS] != p
    if full:
        for j in range(16):  # rec_used / rec_seen, and the least ratio from each bucket on
            F[fu + NUF_RATIO + j] = F[fu + NUF_REC_USED + j] / F[fu + NUF_REC_SEEN + j]
        low = 1.0
        for b in range(NU_BUCKETS - 1, -1, -1):
            for j in (2 * b + 1, 2 * b):
                low = F[fu + NUF_RATIO + j] if F[fu + NUF_RATIO + j] < low else low
            F[fu + NUF_SUFMIN + b] = low
        F[fu + NUF_PP] = F[fu + NUF_PROP_USED] / F[fu + NUF_PROP_SEEN]
        F[fu + NUF_PP + 1] = F[fu + NUF_PROP_USED + 1] / F[fu + NUF_PROP_SEEN + 1]
        I[nu + NU_TVALID], I[nu + NU_R0], I[nu + NU_TPASS] = 1, r0, p
    td = nu + NNU + 2 * K + 4 * E + 3 * L
    for q in range(L):
        if I[seen + q] and (full or I[td + q]):
            _terms(I, F, q, full, r0, p, Ls, Lf, width)
            I[td + q] = 0
    pp0, pp1, recency = F[fu + NUF_PP], F[fu + NUF_PP + 1], I[nu + NU_RECENCY]
    fl = fu + NNUF + K
    if I[H_PERLAYER]:  # the part is one layer: its slots
        per = I[H_PER]
        best, bt, top = -1, 0, 0.0
        for s in range(part * per, part * per + per):
            best, bt, top = _consider(I, F, s, best, bt, top, p, Lf, pp0, pp1, recency)
        return best
    # one part: layers by decreasing bound (`nu_insert` keeps the lists and the bounds of the least uses)
    lsn, lsl, um, ub, ubw = I[O_LSN], I[O_LSL], fl + 5 * L, fl + 6 * L, fl + 7 * L
    for q in range(L):
        F[ubw + q] = F[ub + q] if I[lsn + q] > 0 else -1.0
    best, bt, top = -1, 0, 0.0
    while True:
        q, bq = -1, -1.0
        for r in range(L):
            if F[ubw + r] > bq:
                q, bq = r, F[ubw + r]
        if q < 0 or (best >= 0 and bq < top):  # no key of an unscanned layer reaches the top
            break
        F[ubw + q] = -1.0
        low = NU_NO_USES
        for i in range(I[lsn + q]):
            s = I[lsl + q * C + i]
            u = F[fu + NNUF + I[I[O_SKEY] + s]]
            low = u if u < low else low
            best, bt, top = _consider(I, F, s, best, bt, top, p, Lf, pp0, pp1, recency)
        if low > F[um + q]:  # exact again: a tighter bound for the next victim
            F[um + q] = low
            I[td + q] = 1
    return best


@_fn
def _consider(I, F, s, best, bt, top, p, Lf, pp0, pp1, recency):
    """Slot s's key against the best so far (E[T] `top`, its tick `bt`): `expected_next_use`'s arithmetic over the
    layer terms `nu_victim` set."""
    k = I[I[O_SKEY] + s]
    if k < 0 or I[I[O_PIN] + s] or I[I[O_PROT] + s]:
        return best, bt, top
    nu, fu, K, E, L = I[O_NU], I[OF_NU], I[H_K], I[H_E], I[H_L]
    fl, lq = fu + NNUF + K, nu + NNU + 2 * K + 4 * E + L
    q = I[I[O_SRK] + s]
    f = (F[fu + NNUF + k] + F[fl + 2 * L + q]) / F[fl + 3 * L + q]
    f = f if f > 1e-3 else 1e-3
    if I[lq + L + q]:
        p1 = pp1 if I[nu + NNU + K + k] == p else pp0
    elif recency:
        p1 = F[fu + NUF_RATIO + 2 * _bucket(f) + (1 if I[nu + NNU + k] == I[lq + q] else 0)]
    else:
        p1 = f
    x = F[fl + 4 * L + q] + (1.0 - p1) * Lf / f
    t = I[I[O_PK] + k * NPK + PK_LAST]
    if best < 0 or x > top or (x == top and (t < bt or (t == bt and k < best))):
        return k, t, x
    return best, bt, top
