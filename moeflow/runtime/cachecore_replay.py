"""The simulator's replay in the compiled cache core: `moeflow.sim.simulator.simulate`'s loop (instant link,
fetch misses) over a whole access stream (`pack_stream`) in one kernel call, through the mechanism's own
functions (`cachecore_mech`) in the order the simulator makes the cache calls."""

from __future__ import annotations

from .cachecore_layout import (
    C_ACC,
    C_COLL,
    C_HIT,
    H_E,
    H_K,
    H_LOGON,
    NCNT,
    O_CNT,
    O_SC,
    O_SOF,
    SC_GENSEQ,
    SC_PASS,
    SC_PHSEQ,
    SC_PSEQ,
    _fn,
    _jit,
)
from .cachecore_mech import _demand, _prefetch, _release
from .cachecore_policy import pol_layer_start, pol_pass_start


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
                _release(I, F, slots, wave.shape[0], 1, 0)
    if seg_phase >= 0:
        for c in range(NCNT):
            sums[seg_phase, c] += C[c] - seg0[c]
    out[5] += res[1]
    out[6] += res[2]
