"""The run-time predictors' compiled kernels (numba, nogil): what `moeflow.predict.fast`'s runners call once per
decode step, and what `moeflow.policies.learned` calls to turn a step's scores into requests.

- `forest_walk`: the trees of a compiled forest walked for [T,F] rows, leaves summed in scikit-learn's order.
- `forest_scores`: a forest call whole (the pre-gate, feature rows, walk, base and finish).
- `chain_probs`: Router-PF's quasi-hidden chain and router probabilities for every S of a source layer.
- `estimator_probs`: the chain, the estimator's network and its softmax (Hybrid's router steps too) in one call.
- `decode_requests`: a decode step's requests (target, expert, priority, confidence) in issue order (`decode_into`
  writes them into the caller's buffers).
- `chain_requests`, `estimator_requests`, `forest_requests`: a runner's kernel and `decode_into` in one call, what a
  prefetch policy's decode step calls (`runner.requests`): one dispatch per step, no array handed back.

Each is compiled once and cached next to this file (or in numba's user-wide cache where that is read-only); the
runners call them at bind so the first decode step does not.
"""

from __future__ import annotations

import numpy as np

from ..numba_cache import njit_cached


def _jit(fn):  # numba caches the compiled kernel next to this file, or in its user-wide cache when that is read-only
    return njit_cached(fn, True, nogil=True, error_model="numpy")


def _inline(fn):  # a helper only the kernels below call, inlined into them (same file: an edit recompiles them)
    return njit_cached(fn, True, inline="always", no_cpython_wrapper=True, no_cfunc_wrapper=True, nogil=True, error_model="numpy")


@_inline
def _chain_start(r, w, ids, D0, h):  # pragma: no cover - compiled
    """h [H] = the source layer's residual r [H] plus its own top-k weights w [k] times their default vectors
    D0[ids] (D0 [E,H]): the chain's first state."""
    for j in range(h.shape[0]):
        h[j] = r[j]
    for i in range(ids.shape[0]):
        wi, d = w[i], D0[ids[i]]
        for j in range(h.shape[0]):
            h[j] += wi * d[j]


@_inline
def _sumsq(h):  # pragma: no cover - compiled
    """sum of h [H]'s squares, in float64 (the RMS norm's reduction)."""
    ss = 0.0
    for j in range(h.shape[0]):
        ss += np.float64(h[j]) * np.float64(h[j])
    return ss


@_inline
def _route_next(p, chosen, top_k, renorm, d2, h):  # pragma: no cover - compiled
    """The chain's next step: h [H] += the top k of the probabilities p [E] (ties to the lower expert; their
    float32 weights renormalised to sum 1 when `renorm`) times their default vectors d2 [E,H]. `chosen` [E] scratch."""
    E = p.shape[0]
    chosen[:] = False
    wsum = 0.0
    for _ in range(top_k):
        b = -1
        for e in range(E):
            if not chosen[e] and (b < 0 or p[e] > p[b]):
                b = e
        chosen[b] = True
        wsum += np.float32(p[b])
    for e in range(E):
        if chosen[e]:
            wi = np.float32(p[e])
            if renorm:
                wi = np.float32(wi / wsum)
            for j in range(h.shape[0]):
                h[j] += wi * d2[e, j]


@_jit
def _softmax(x, p):  # pragma: no cover - compiled
    """p [E] (float64) = the softmax of x [E] (float32 or float64; p may be x): the maximum, the exponentials and
    their sum in float64, one division per entry. Not inlined: numba aborted when an inlined copy of one helper
    appeared twice in one kernel (`estimator_probs` calls this twice)."""
    zmax = -np.inf
    for e in range(x.shape[0]):
        if x[e] > zmax:
            zmax = x[e]
    tot = 0.0
    for e in range(x.shape[0]):
        p[e] = np.exp(np.float64(x[e]) - zmax)
        tot += p[e]
    for e in range(x.shape[0]):
        p[e] /= tot


@_jit
def forest_walk(X, nodes, value, roots):  # pragma: no cover - compiled
    """[T,F] float32 rows -> [T,E] float64: the mean over trees of the leaf each row reaches (tree order, as
    scikit-learn sums). `nodes` [N,6] float64 rows (left, right, feature, leaf, NaN goes left, threshold; the
    integers are exact in float64) keep one node's fields together, so a step of a walk reads one row;
    `value` [leaves,E]; `roots` [trees]."""
    T = X.shape[0]
    E = value.shape[1]
    n = roots.shape[0]
    out = np.zeros((T, E), np.float64)
    for i in range(T):
        for j in range(n):
            nd = roots[j]
            while nodes[nd, 0] >= 0:
                x = np.float64(X[i, int(nodes[nd, 2])])
                if x <= nodes[nd, 5] or (np.isnan(x) and nodes[nd, 4] != 0):
                    nd = int(nodes[nd, 0])
                else:
                    nd = int(nodes[nd, 1])
            v = int(nodes[nd, 3])
            for e in range(E):
                out[i, e] += value[v, e]
    for i in range(T):
        for e in range(E):
            out[i, e] /= n
    return out


@_jit
def forest_scores(probs, u, W, emb, pc, pp, hrows, sv, rv, nf, nodes, value, roots, base_kind, top_k):  # pragma: no cover
    """The forest's whole call in one compiled call: [P,T,E] scores of the pairs (target rank rv[p], S sv[p]) from
    their pre-gate probabilities `probs` [P,T,E] (float32). With routers W [H,P*E] (the pairs' targets' routers side
    by side; W [0,0]: `probs` is the input) the pre-gate is computed here first and written into `probs`: softmax of
    the router input u [T,H] times pair p's block of W (products and softmax in float64, rounded to float32 once),
    as `ForestRunner.probs` up to float32 rounding. Each row of `Forest.features` is built in a buffer of `nf` floats
    (embedding emb [T,d], S, rank, the history's multi-hot at columns d + 2 + hrows [T,c] (rank x E + expert), the
    probabilities, the priors pc/pp [L,T,E+1] of the target), walked as `forest_walk` does (float64 leaf sums in
    tree order, mean, float32), added to the base (base_kind 0: none, 1: k x the prior, 2: the pre-gate's top k,
    ties to the lower expert) and finished as `ForestRunner.finish`: max(base + delta, 0) + 1e-3 probs + 1e-6."""
    P, T, E = probs.shape
    d = emb.shape[1]
    o = nf - 3 * E - 2
    n = roots.shape[0]
    x = np.empty(nf, np.float32)
    acc = np.empty(E, np.float64)
    base = np.empty(E, np.float32)
    chosen = np.empty(E, np.bool_)
    out = np.empty((P, T, E), np.float32)
    if W.shape[1] > 0:  # the pre-gate of every pair: one pass over W's rows per token, its P*E columns vectorised
        z = np.empty(W.shape[1], np.float64)
        for t in range(T):
            z[:] = 0.0
            for j in range(W.shape[0]):
                uj = np.float64(u[t, j])
                for c in range(W.shape[1]):
                    z[c] += uj * np.float64(W[j, c])
            for p in range(P):
                _softmax(z[p * E : (p + 1) * E], acc)
                for e in range(E):
                    probs[p, t, e] = np.float32(acc[e])
    for p in range(P):
        r = rv[p]
        for t in range(T):
            x[:] = 0.0
            for j in range(d):
                x[j] = emb[t, j]
            x[d] = sv[p]
            x[d + 1] = r
            for j in range(hrows.shape[1]):
                x[d + 2 + hrows[t, j]] = 1.0
            for e in range(E):
                x[o + e] = probs[p, t, e]
            for e in range(E + 1):
                x[o + E + e] = pc[r, t, e]
                x[o + 2 * E + 1 + e] = pp[r, t, e]
            acc[:] = 0.0
            for j in range(n):
                nd = roots[j]
                while nodes[nd, 0] >= 0:
                    xv = np.float64(x[int(nodes[nd, 2])])
                    if xv <= nodes[nd, 5] or (np.isnan(xv) and nodes[nd, 4] != 0):
                        nd = int(nodes[nd, 0])
                    else:
                        nd = int(nodes[nd, 1])
                v = int(nodes[nd, 3])
                for e in range(E):
                    acc[e] += value[v, e]
            base[:] = 0.0
            if base_kind == 1:
                for e in range(E):
                    base[e] = np.float32(top_k) * pc[r, t, e]
            elif base_kind == 2:
                chosen[:] = False
                for _ in range(top_k):
                    b = -1
                    for e in range(E):
                        if not chosen[e] and (b < 0 or probs[p, t, e] > probs[p, t, b]):
                            b = e
                    chosen[b] = True
                    base[b] = 1.0
            for e in range(E):
                v32 = np.float32(base[e] + np.float32(acc[e] / n))
                if v32 < 0.0:
                    v32 = np.float32(0.0)
                v32 = np.float32(v32 + np.float32(np.float32(1e-3) * probs[p, t, e]))
                out[p, t, e] = np.float32(v32 + np.float32(1e-6))
    return out


@_jit
def chain_probs(r0, w0, ids0, Fs, eps, Ds, top_k, renorm):  # pragma: no cover - compiled
    """Router-PF's chain in one compiled call: [T,H] residual r_l, [T,k] gate weights and ids of layer l ->
    [S,T,E] float32 probabilities of the targets l+1..l+S. `Fs` [S,H,E] the targets' norm weights folded into
    their routers (`ChainRunner.fused`), `eps` [S] their norms' epsilons, `Ds` [S,E,H] the default vectors
    added after each step (Ds[0] layer l's, Ds[s] target s's), `renorm` [S] whether target s renormalises its
    top-k weights. The same arithmetic as `ChainRunner.run` (float32 products; the reductions in float64)."""
    T, H = r0.shape
    S, _, E = Fs.shape
    out = np.empty((S, T, E), np.float32)
    h = np.empty(H, np.float32)
    p = np.empty(E, np.float64)
    chosen = np.empty(E, np.bool_)
    for t in range(T):
        _chain_start(r0[t], w0[t], ids0[t], Ds[0], h)
        for s in range(S):
            ss = _sumsq(h)
            inv = 1.0 / np.sqrt(np.float64(np.float32(ss / H) + eps[s]))
            F = Fs[s]
            for e in range(E):
                acc = 0.0
                for j in range(H):
                    acc += np.float64(h[j]) * np.float64(F[j, e])
                p[e] = np.float64(np.float32(acc * inv))
            _softmax(p, p)
            for e in range(E):
                out[s, t, e] = np.float32(p[e])
            if s + 1 < S:  # the top k of target s route the chain's next step
                _route_next(p, chosen, top_k, renorm[s], Ds[s + 1], h)
    return out


@_jit
def _vecmat(x, W, y):  # pragma: no cover - compiled
    """y [n] += x [m] @ W [m,n] (float32; the inner loop over n vectorises)."""
    for i in range(W.shape[0]):
        xi = x[i]
        for o in range(W.shape[1]):
            y[o] += xi * W[i, o]


@_jit
def estimator_probs(r0, w0, ids0, u, zbase, hrows, soff, Fs, eps, Ds, renorm, top_k, AuT, AgT, b0, pos, BT, bb, CT, cb,
                    headT, hb, ln_eps, residual, use):  # pragma: no cover - compiled  # fmt: skip
    """The estimator's (and Hybrid's) whole decode call in one compiled call: [T,H] residual r_l, [T,k] gate weights
    and ids of layer l -> [S,T,E] float32 probabilities of the targets l+1..l+S. The chain as `chain_probs`, with
    `Fs` [S,H,E+m] the targets' norm weights folded into [router | AqT] (`ChainRunner.fused(t, AqT)`), so one
    product per step gives the router logits and q's first-layer term; the first layer's per-call part
    z0 = zbase [T,m] (the token terms) + b0 + the earlier layers' gate rows AgT[hrows[t, j]] (those below soff: hrows
    [T,c] rank x E + expert of the gate history) + u @ AuT + sum_k w_k AgT[soff + id_k], then per
    step s with use[s]: + q-term + pos[s], the SiLU blocks (BT [nb,m,n], bb, CT [nb,n,m], cb), the LayerNorm
    (affine folded into headT [m,E], hb), + the router logits when `residual`; without use[s] the router logits
    (Hybrid's Router-PF pairs). The same arithmetic as `EstimatorRunner.logits` up to float32 rounding order."""
    T, H = r0.shape
    S, _, EM = Fs.shape
    m = b0.shape[0]
    E = EM - m
    nb, _, n = BT.shape
    out = np.empty((S, T, E), np.float32)
    h = np.empty(H, np.float32)
    y = np.empty(EM, np.float32)
    z0 = np.empty(m, np.float32)
    z = np.empty(m, np.float32)
    a = np.empty(n, np.float32)
    p = np.empty(E, np.float64)
    pl = np.empty(E, np.float32)
    chosen = np.empty(E, np.bool_)
    for t in range(T):
        for c in range(m):
            z0[c] = zbase[t, c] + b0[c]
        for j in range(hrows.shape[1]):  # earlier layers' chosen experts weigh 1 (the source's: its gate weights below)
            if hrows[t, j] < soff:
                g = AgT[hrows[t, j]]
                for c in range(m):
                    z0[c] += g[c]
        _vecmat(u[t], AuT, z0)
        for i in range(ids0.shape[1]):
            wi, g = w0[t, i], AgT[soff + ids0[t, i]]
            for c in range(m):
                z0[c] += wi * g[c]
        _chain_start(r0[t], w0[t], ids0[t], Ds[0], h)
        for s in range(S):
            ss = _sumsq(h)
            inv = np.float32(1.0 / np.sqrt(np.float64(np.float32(ss / H) + eps[s])))
            y[:] = 0.0
            _vecmat(h, Fs[s], y)
            for o in range(EM):
                y[o] *= inv
            if use[s]:
                for c in range(m):
                    z[c] = y[E + c] + z0[c] + pos[s, c]
                for b in range(nb):
                    for o in range(n):
                        a[o] = bb[b, o]
                    _vecmat(z, BT[b], a)
                    for o in range(n):
                        a[o] = a[o] * (np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * a[o]))
                    for c in range(m):
                        z[c] += cb[b, c]
                    _vecmat(a, CT[b], z)
                mu = 0.0
                for c in range(m):
                    mu += z[c]
                mu /= m
                var = 0.0
                for c in range(m):
                    z[c] = np.float32(z[c] - mu)
                    var += np.float64(z[c]) * np.float64(z[c])
                rs = np.float32(1.0 / np.sqrt(np.float64(np.float32(var / m) + ln_eps)))
                for c in range(m):
                    z[c] *= rs
                for e in range(E):
                    pl[e] = hb[e] + (y[e] if residual else np.float32(0.0))
                _vecmat(z, headT, pl)
            else:
                for e in range(E):
                    pl[e] = y[e]
            _softmax(pl, p)
            for e in range(E):
                out[s, t, e] = np.float32(p[e])
            if s + 1 < S:  # the router's top k of target s route the chain's next step
                _softmax(y[:E], p)
                _route_next(p, chosen, top_k, renorm[s], Ds[s + 1], h)
    return out


@_jit
def decode_into(sc, m, targets, k, ib, fb):  # pragma: no cover - compiled
    """A decode step's prefetch requests written in issue order into ib [2,>=S*m] int64 (target, expert) and fb
    [2,>=S*m] float64 (priority, confidence); returns their count. Scores sc [S,1,E] (float32) of the targets
    `targets` [S]: each target's top m experts (ties to the lower expert), probability b = score / tot (float32;
    tot the row's sum, at least 1e-12, summed in float64), priority (S - s) + b (nearer target first, then by
    probability; a stable order, experts ascending within a target), confidence min(1, k b); a negative
    probability is never requested."""
    S, E = sc.shape[0], sc.shape[2]
    flat = sc.reshape(S, E)  # [S,E]
    tot = np.empty(S, np.float32)
    for s in range(S):
        acc = 0.0
        for e in range(E):
            acc += np.float64(flat[s, e])
        tot[s] = np.float32(max(acc, 1e-12))
    chosen = np.empty(E, np.bool_)
    n = 0
    for s in range(S):
        chosen[:] = False
        for _ in range(m):
            bi = -1
            for e in range(E):
                if not chosen[e] and (bi < 0 or flat[s, e] > flat[s, bi]):
                    bi = e
            chosen[bi] = True
        for e in range(E):  # experts ascending
            if chosen[e]:
                b = np.float64(np.float32(flat[s, e] / tot[s]))
                if b >= 0.0:
                    p = (S - s) + b
                    i = n  # insertion sort by descending priority, stable
                    while i > 0 and fb[0, i - 1] < p:
                        ib[0, i], ib[1, i], fb[0, i], fb[1, i] = ib[0, i - 1], ib[1, i - 1], fb[0, i - 1], fb[1, i - 1]
                        i -= 1
                    ib[0, i], ib[1, i], fb[0, i], fb[1, i] = targets[s], e, p, min(1.0, max(0.0, k * b))
                    n += 1
    return n


@_jit
def decode_requests(sc, m, targets, k):  # pragma: no cover - compiled
    """`decode_into` as arrays: (target [R], expert [R], priority [R], confidence [R]) in issue order."""
    R = sc.shape[0] * m
    ib = np.empty((2, R), np.int64)
    fb = np.empty((2, R), np.float64)
    n = decode_into(sc, m, targets, k, ib, fb)
    return ib[0, :n], ib[1, :n], fb[0, :n], fb[1, :n]


@_jit
def chain_requests(r0, w0, ids0, Fs, eps, Ds, top_k, renorm, m, targets, k, ib, fb):  # pragma: no cover - compiled
    """Router-PF's decode step whole in one compiled call: `decode_into` of `chain_probs`'s [S,1,E] probabilities
    (the same arithmetic, one call instead of two, no array handed back): the count of requests in ib, fb."""
    return decode_into(chain_probs(r0, w0, ids0, Fs, eps, Ds, top_k, renorm), m, targets, k, ib, fb)


@_jit
def estimator_requests(r0, w0, ids0, u, zbase, hrows, soff, Fs, eps, Ds, renorm, top_k, AuT, AgT, b0, pos, BT, bb, CT, cb,
                       headT, hb, ln_eps, residual, use, m, targets, k, ib, fb):  # pragma: no cover - compiled  # fmt: skip
    """The estimator's (and Hybrid's) decode step whole in one compiled call: `decode_into` of `estimator_probs`'s
    [S,1,E] probabilities."""
    sc = estimator_probs(r0, w0, ids0, u, zbase, hrows, soff, Fs, eps, Ds, renorm, top_k, AuT, AgT, b0, pos, BT, bb, CT, cb,
                         headT, hb, ln_eps, residual, use)  # fmt: skip
    return decode_into(sc, m, targets, k, ib, fb)


@_jit
def forest_requests(
    probs, u, W, emb, pc, pp, hrows, sv, rv, nf, nodes, value, roots, base_kind, top_k, m, targets, k, ib, fb
):  # pragma: no cover
    """The forest's decode step whole in one compiled call: `decode_into` of `forest_scores`'s [P,1,E] scores."""
    sc = forest_scores(probs, u, W, emb, pc, pp, hrows, sv, rv, nf, nodes, value, roots, base_kind, top_k)
    return decode_into(sc, m, targets, k, ib, fb)
