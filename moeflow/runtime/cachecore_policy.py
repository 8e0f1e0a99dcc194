"""The eviction policies' events in the compiled cache core (lru, lfu, least-stale, Belady's MIN here; belady-approx
in `cachecore_ba` and `cachecore_bav`, next-use in `cachecore_nu`): `pol_*` dispatch on the policy kind in the
header, as the cache calls the Python policy's `on_insert`, `on_access`, `on_evict`, `on_predicted`,
`on_pass_start`, `on_layer_start` and `victim` (`moeflow.policies.eviction`, `least_stale`, `belady_approx`,
`next_use`, `moeflow.sim.belady.Belady`).
"""

from __future__ import annotations

from .cachecore_ba import _see, ba_access, ba_candidate, ba_evict, ba_expire, ba_insert, ba_predicted
from .cachecore_bav import ba_victim
from .cachecore_layout import (
    H_K,
    H_KIND,
    H_L,
    H_PERLAYER,
    KIND_BA,
    KIND_LFU,
    KIND_LRU,
    KIND_LS,
    KIND_MIN,
    KIND_NU,
    NPK,
    O_KR,
    O_LST,
    O_PG,
    O_PK,
    O_SC,
    O_SRANK,
    PG_LSPASS,
    PG_STEP,
    PG_TICK,
    PK_CNT,
    PK_CUR,
    PK_ENT,
    PK_LAST,
    PK_NEXT,
    PK_NU,
    PK_PREV,
    PK_SCORE,
    PK_TR,
    SC_PASS,
    _fn,
    _inline,
    _u,
)
from .cachecore_nu import nu_access, nu_evict, nu_insert, nu_layer_start, nu_pass_start, nu_predicted, nu_victim
from .cachecore_struct import (
    _bk_first,
    _bk_touch,
    _bk_unlink,
    _hx_first,
    _hx_insert,
    _hx_remove,
    _hx_set,
    _list_first,
    _ll_append,
    _ll_unlink,
)


@_inline
def _touch(I, k, order):
    """`_Base._touch`: a new tick; lru: to the end of its part's list; with `order`, lfu: to the end of its
    count's bucket (a demand load's insert skips it: the access that follows at once places it, and nothing
    asks for a victim between the two)."""
    kind, pg = I[H_KIND], I[O_PG]
    I[_u(pg + PG_TICK)] += 1
    t = I[_u(pg + PG_TICK)]
    if kind == KIND_LRU:
        li = I[_u(I[O_KR] + k)] if I[H_PERLAYER] else 0
        if I[_u(I[O_PK] + k * NPK + PK_TR)]:
            _ll_unlink(I, li, k)
        _ll_append(I, li, k)
    I[_u(I[O_PK] + k * NPK + PK_TR)] = 1
    I[_u(I[O_PK] + k * NPK + PK_LAST)] = t
    if kind == KIND_LFU and order:
        _bk_touch(I, k)


@_fn
def _ls_pass_start(I, p):
    """least-stale `on_pass_start`: every current queue joins the end of its layer's stale queue."""
    pg = I[O_PG]
    if p == I[_u(pg + PG_LSPASS)]:
        return
    I[_u(pg + PG_LSPASS)] = p
    L, lst = I[H_L], I[O_LST]
    for r in range(L):
        cur, stale = lst + 2 * (L + r), lst + 2 * r
        h = I[_u(cur)]
        if h < 0:
            continue
        k = h
        while k >= 0:
            I[_u(I[O_PK] + k * NPK + PK_CUR)] = 0
            k = I[_u(I[O_PK] + k * NPK + PK_NEXT)]
        tail = I[_u(stale + 1)]
        if tail >= 0:
            I[_u(I[O_PK] + tail * NPK + PK_NEXT)] = h
            I[_u(I[O_PK] + h * NPK + PK_PREV)] = tail
        else:
            I[_u(stale)] = h
        I[_u(stale + 1)] = I[_u(cur + 1)]
        I[_u(cur)] = -1
        I[_u(cur + 1)] = -1


@_inline
def _ls_sync(I):
    p = I[_u(I[O_SC] + SC_PASS)]
    if p != I[_u(I[O_PG] + PG_LSPASS)]:
        _ls_pass_start(I, p)


@_fn
def _ls_make_current(I, k):
    _ls_sync(I)
    if I[_u(I[O_PK] + k * NPK + PK_CUR)]:
        return
    r, L = I[_u(I[O_KR] + k)], I[H_L]
    I[_u(I[O_PK] + k * NPK + PK_CUR)] = 1
    if I[_u(I[O_PK] + k * NPK + PK_ENT)]:
        _ll_unlink(I, r, k)
    I[_u(I[O_PK] + k * NPK + PK_ENT)] = 1
    _ll_append(I, L + r, k)


@_fn
def _min_set(I, k, step):
    """belady: key k's score from `step`, the step of its next use (`never` = S + 1 when none)."""
    I[_u(I[O_PK] + k * NPK + PK_TR)] = 1
    I[_u(I[O_PK] + k * NPK + PK_SCORE)] = step * I[H_K] + k
    _hx_set(I, k, -I[_u(I[O_PK] + k * NPK + PK_SCORE)], 0)


@_inline
def pol_insert(I, F, X, k, pr, prefetched):
    """`on_insert(key, pos, prefetched)`; `pr`: the position's layer rank."""
    kind = I[H_KIND]
    if kind == KIND_MIN:
        if prefetched:  # not accessed now: its first use from the current step on
            step, S, A = I[_u(I[O_PG] + PG_STEP)], X[0], X[1]
            nu = I[_u(I[O_PK] + k * NPK + PK_NU)]  # the use after its last access: none since, so at or after now
            if nu < step:  # not accessed yet (or no such use): search its access steps
                ko = 2 + (S + 1) + 2 * A  # per key, the offsets of its access steps
                ks = ko + I[H_K] + 1
                lo, hi = X[ko + k], X[ko + k + 1]
                if lo < hi and X[ks + lo] >= step:  # never accessed: its first use is at or after now
                    hi = lo
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
            r, L = I[_u(I[O_KR] + k)], I[H_L]
            li = L + r if I[_u(I[O_PK] + k * NPK + PK_CUR)] else r
            if I[_u(I[O_PK] + k * NPK + PK_ENT)]:
                _ll_unlink(I, li, k)
            I[_u(I[O_PK] + k * NPK + PK_ENT)] = 1
            _ll_append(I, li, k)
    elif kind == KIND_BA:
        ba_insert(I, F, k, pr, prefetched)
    elif kind == KIND_NU:
        nu_insert(I, F, k, pr, prefetched)


@_inline
def pol_access(I, F, X, k):
    """`on_access(key, pos)` (the gate weight matters to none of the compiled policies)."""
    kind = I[H_KIND]
    if kind == KIND_MIN:
        step, S, A = I[_u(I[O_PG] + PG_STEP)], X[0], X[1]
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
        I[_u(I[O_PK] + k * NPK + PK_NU)] = nu
        _min_set(I, k, nu)
        return
    if kind == KIND_LFU:
        I[_u(I[O_PK] + k * NPK + PK_CNT)] += 1
    _touch(I, k, 1)
    if kind == KIND_LS:
        _ls_make_current(I, k)
    elif kind == KIND_BA:
        ba_access(I, F, k)
    elif kind == KIND_NU:
        nu_access(I, F, k)


@_inline
def pol_evict(I, F, k, s):
    """`on_evict(key)`; s: the slot it leaves."""
    kind = I[H_KIND]
    if kind == KIND_LRU and I[_u(I[O_PK] + k * NPK + PK_TR)]:
        _ll_unlink(I, I[_u(I[O_KR] + k)] if I[H_PERLAYER] else 0, k)
    elif kind == KIND_LS:
        if I[_u(I[O_PK] + k * NPK + PK_ENT)]:
            r = I[_u(I[O_KR] + k)]
            _ll_unlink(I, I[H_L] + r if I[_u(I[O_PK] + k * NPK + PK_CUR)] else r, k)
            I[_u(I[O_PK] + k * NPK + PK_ENT)] = 0
        I[_u(I[O_PK] + k * NPK + PK_CUR)] = 0
    elif kind == KIND_LFU:
        _bk_unlink(I, k)
    elif kind == KIND_MIN:
        _hx_remove(I, k)
    elif kind == KIND_BA:
        ba_evict(I, F, k, s)
    elif kind == KIND_NU:
        nu_evict(I, F, k, s)
    I[_u(I[O_PK] + k * NPK + PK_TR)] = 0


@_inline
def pol_predicted(I, F, k, pr):
    """`on_predicted(key, pos)`: a proposal of a resident key."""
    kind = I[H_KIND]
    if kind == KIND_LS:
        if I[_u(I[O_PK] + k * NPK + PK_TR)]:
            _ls_make_current(I, k)
    elif kind == KIND_BA:
        ba_predicted(I, F, k, pr)
    elif kind == KIND_NU:
        nu_predicted(I, F, k, pr)


@_inline
def pol_candidate(I, F, k):
    """Resident key k is a victim candidate again (unpinned, or its prefetch call over)."""
    if I[H_KIND] == KIND_BA:
        ba_candidate(I, F, k)
    else:
        _hx_insert(I, k)


@_fn
def pol_pass_start(I, F, p):
    kind = I[H_KIND]
    if kind == KIND_LS:
        _ls_pass_start(I, p)
    elif kind == KIND_BA:
        ba_expire(I, F, p, -1)
    elif kind == KIND_NU:
        nu_pass_start(I, F, p)


@_inline
def pol_layer_start(I, F, r):
    kind = I[H_KIND]
    if kind == KIND_MIN:
        I[_u(I[O_PG] + PG_STEP)] += 1
    elif kind == KIND_BA:
        _see(I, r)
        ba_expire(I, F, I[_u(I[O_SC] + SC_PASS)], I[_u(I[O_SRANK] + r)])
    elif kind == KIND_NU:
        nu_layer_start(I, F, r)


@_inline
def pol_victim(I, F, part, pr):
    """The policy's victim among `part`'s candidates (-1: no candidate); `pr`: the position's layer rank."""
    kind = I[H_KIND]
    if kind == KIND_LRU:
        return _list_first(I, part, part)
    if kind == KIND_LFU:
        return _bk_first(I, part)
    if kind == KIND_MIN:
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
    if kind == KIND_NU:
        return nu_victim(I, F, part, pr)
    return ba_victim(I, F, part, pr)
