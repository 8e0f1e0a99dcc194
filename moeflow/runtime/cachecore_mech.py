"""The cache mechanism in the compiled cache core: `ExpertCache`'s bookkeeping with an instant link (slot map,
pins, free slots, counters), calling the policy's events (`cachecore_policy`) as the Python mechanism does:
hits pinned first, misses in id order, each evicting the policy's victim; prefetches in priority order,
resident proposals told to the policy, a slot issued in the same call never a victim."""

from __future__ import annotations

from .cachecore_layout import (
    C_ACC,
    C_BYTES,
    C_COLL,
    C_DEM,
    C_EVICT,
    C_HIT,
    C_LB_HITS,
    C_LB_LOADS,
    C_LOADS,
    C_MISS,
    C_PF_UNUSED,
    C_PFI,
    C_PFU,
    C_PFU_GEN,
    C_PFU_PH,
    C_REFUSED,
    C_UPGRADES,
    H_E,
    H_PER,
    H_PERLAYER,
    LOG_EVICT,
    LOG_LOAD,
    LOG_UPGRADE,
    O_BITS,
    O_BYB,
    O_CNT,
    O_EVP,
    O_FREE,
    O_ISL,
    O_ISS,
    O_KR,
    O_NFREE,
    O_PIN,
    O_PREF,
    O_PROT,
    O_RES,
    O_SC,
    O_SKEY,
    O_SOF,
    O_SRK,
    O_USED,
    SC_GENSEQ,
    SC_NRES,
    SC_PASS,
    SC_PHSEQ,
    SC_PSEQ,
    SC_TIME,
    _fn,
    _inline,
    _u,
)
from .cachecore_policy import pol_access, pol_candidate, pol_evict, pol_insert, pol_predicted, pol_victim
from .cachecore_struct import _hx_hold, _log


@_inline
def _evict(I, F, s):
    k = I[_u(I[O_SKEY] + s)]
    cnt, sc = I[O_CNT], I[O_SC]
    if I[_u(I[O_PREF] + s)] and not I[_u(I[O_USED] + s)]:
        I[_u(cnt + C_PF_UNUSED)] += 1
    I[_u(cnt + C_EVICT)] += 1
    I[_u(I[O_EVP] + k)] = I[_u(sc + SC_PASS)]
    I[_u(I[O_SOF] + k)] = -1
    I[_u(I[O_RES] + I[_u(I[O_KR] + k)])] -= 1
    I[_u(sc + SC_NRES)] -= 1
    I[_u(I[O_SKEY] + s)] = -1
    I[_u(I[O_PIN] + s)] = 0
    I[_u(I[O_PREF] + s)] = 0
    I[_u(I[O_USED] + s)] = 0
    I[_u(I[O_BITS] + s)] = 0
    I[_u(I[O_ISS] + s)] = 0
    part = I[_u(I[O_KR] + k)] if I[H_PERLAYER] else 0
    nf = I[O_NFREE] + part
    I[_u(I[O_FREE] + part * I[H_PER] + I[_u(nf)])] = s
    I[_u(nf)] += 1
    _log(I, LOG_EVICT, s, k, 0)
    pol_evict(I, F, k, s)


@_inline
def _load(I, F, X, s, k, pr, prefetched, b):
    cnt, sc = I[O_CNT], I[O_SC]
    I[_u(I[O_SKEY] + s)] = k
    I[_u(I[O_SRK] + s)] = I[_u(I[O_KR] + k)]
    I[_u(I[O_BITS] + s)] = b
    I[_u(I[O_PREF] + s)] = prefetched
    I[_u(I[O_USED] + s)] = 0
    I[_u(I[O_SOF] + k)] = s
    I[_u(I[O_RES] + I[_u(I[O_KR] + k)])] += 1
    I[_u(sc + SC_NRES)] += 1
    I[_u(cnt + C_LOADS)] += 1
    I[_u(cnt + C_BYTES)] += I[_u(I[O_BYB] + b)]
    _log(I, LOG_LOAD, s, k, b + 256 * prefetched)
    pol_insert(I, F, X, k, pr, prefetched)


@_inline
def _acquire(I, F, X, k, pr):
    """A free slot of `k`'s part, evicting the policy's victim if needed; -1: no candidate."""
    part = I[_u(I[O_KR] + k)] if I[H_PERLAYER] else 0
    nf = I[O_NFREE] + part
    if I[_u(nf)] == 0:
        v = pol_victim(I, F, part, pr)
        if v < 0:
            return -1
        _evict(I, F, I[_u(I[O_SOF] + v)])
    I[_u(nf)] -= 1
    return I[_u(I[O_FREE] + part * I[H_PER] + I[_u(nf)])]


@_fn
def _demand(I, F, X, r, experts, nbits, out):
    """`ExpertCache.demand` (instant link): pin hits, then per expert in order hit or miss (a victim, a load);
    returns -1 on success, else the index of the expert no slot could be found for (all pinned)."""
    E, cnt, sc = I[H_E], I[O_CNT], I[O_SC]
    sof, pin, bits, pref, used, iss = I[O_SOF], I[O_PIN], I[O_BITS], I[O_PREF], I[O_USED], I[O_ISS]
    n = experts.shape[0]
    for i in range(n):
        s = I[_u(sof + r * E + experts[i])]
        if s >= 0:
            I[_u(pin + s)] = 1
            _hx_hold(I, r * E + experts[i])
    p = I[_u(sc + SC_PASS)]
    for i in range(n):
        k = r * E + experts[i]
        s = I[_u(sof + k)]
        I[_u(cnt + C_ACC)] += 1
        if s >= 0:
            I[_u(cnt + C_HIT)] += 1
            if I[_u(bits + s)] != 0:
                I[_u(cnt + C_LB_HITS)] += 1
        else:
            I[_u(cnt + C_MISS)] += 1
            if I[_u(I[O_EVP] + k)] == p:
                I[_u(cnt + C_COLL)] += 1
            s = _acquire(I, F, X, k, r)
            if s < 0:
                return i
            b = nbits[i]
            _load(I, F, X, s, k, r, 0, b)
            I[_u(cnt + C_DEM)] += 1
            if b != 0:
                I[_u(cnt + C_LB_LOADS)] += 1
            I[_u(pin + s)] = 1
            _hx_hold(I, k)
        if I[_u(pref + s)] and not I[_u(used + s)]:
            I[_u(cnt + C_PFU)] += 1
            if I[_u(iss + s)] < I[_u(sc + SC_PHSEQ)]:
                I[_u(cnt + C_PFU_PH)] += 1
                if I[_u(iss + s)] < I[_u(sc + SC_GENSEQ)]:
                    I[_u(cnt + C_PFU_GEN)] += 1
        I[_u(used + s)] = 1
        I[_u(sc + SC_TIME)] += 1
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
        if I[_u(I[O_SOF] + k)] >= 0:
            pol_predicted(I, F, k, pr)
            continue
        if left == 0:
            I[_u(cnt + C_REFUSED)] += 1
            res[2] += 1
            continue
        res[1] += 1
        if left > 0:
            left -= 1
        s = _acquire(I, F, X, k, pr)
        if s < 0:
            continue
        I[_u(prot + s)] = 1  # never a victim in this call (out of the heap from its insert on)
        _load(I, F, X, s, k, pr, 1, 0)
        I[_u(I[O_ISS] + s)] = I[_u(sc + SC_PSEQ)]
        I[_u(sc + SC_PSEQ)] += 1
        I[_u(cnt + C_PFI)] += 1
        I[_u(isl + issued)] = s
        issued += 1
    for i in range(issued):
        s = I[_u(isl + i)]
        I[_u(prot + s)] = 0
        pol_candidate(I, F, I[_u(I[O_SKEY] + s)])
    res[0] += issued


@_fn
def _release(I, F, slots, n, retain, upgrade):
    cnt = I[O_CNT]
    for i in range(n):
        s = slots[i]
        I[_u(I[O_PIN] + s)] = 0
        k = I[_u(I[O_SKEY] + s)]
        if k < 0:
            continue
        if not retain:
            _evict(I, F, s)
            continue
        pol_candidate(I, F, k)
        if upgrade and I[_u(I[O_BITS] + s)] != 0:
            I[_u(I[O_BITS] + s)] = 0
            I[_u(cnt + C_UPGRADES)] += 1
            I[_u(cnt + C_BYTES)] += I[_u(I[O_BYB])]
            _log(I, LOG_UPGRADE, s, k, 0)
