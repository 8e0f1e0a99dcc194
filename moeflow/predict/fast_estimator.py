"""The estimator's and hybrid's run-time runners (`EstimatorRunner`, `HybridRunner`; see `moeflow.predict.fast`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .fast import (
    ChainRunner,
    _keep_prefixes,
    _request_buffers,
    _sources,
    history_rows,
    np32,
    npi,
    softmax,
)
from .kernels import estimator_probs, estimator_requests

if TYPE_CHECKING:
    from .data import SourceBatch


class EstimatorRunner:
    """`Estimator.predict` for every S of a source layer in one pass through the network (see the module
    docstring); `chain` is shared with Hybrid's Router-PF."""

    def __init__(self, est: Any, chain: ChainRunner | None = None):
        net, feat = est.net, est.feat
        assert net is not None and feat is not None and est.qh is not None, "fit or load first"
        self.chain = chain or ChainRunner(est.qh)
        spec = feat.spec
        self.ml, self.E, self.H, self.context = list(spec.moe_layers), spec.num_experts, spec.hidden_size, est.context
        self.residual = est.residual
        H, cH = self.H, est.context * spec.hidden_size
        with torch.no_grad():
            W = (net.A.weight / net.sd[None, :]).float()  # [m,F] standardisation folded in
            self.b0 = np32(net.A.bias - W @ net.mu)  # [m]
            W = np32(W)
        self.AqT = np.ascontiguousarray(W[:, :H].T)  # [H,m]
        self.AuT = np.ascontiguousarray(W[:, H : 2 * H].T)  # [H,m]
        self.AtT = np.ascontiguousarray(W[:, 2 * H : 2 * H + cH].T)  # [cH,m]
        self.AgT = np.ascontiguousarray(W[:, 2 * H + cH :].T)  # [L*E,m]
        self.pos = np32(net.pos.weight)  # [P,m]
        self.pair_row = {(int(l), int(s)): i for i, (l, s) in enumerate(est.pairs)}
        self.rank = {l: i for i, l in enumerate(self.ml)}
        self.blocks = [
            (np32(B.weight).T.copy(), np32(B.bias), np32(C.weight).T.copy(), np32(C.bias)) for B, C in zip(net.B, net.C)
        ]
        g, b = np32(net.norm.weight), np32(net.norm.bias)  # the LayerNorm's affine folded into the head
        self.eps = np.float32(net.norm.eps)
        hT = np32(net.head.weight).T  # [m,E]
        self.headT, self.hb = np.ascontiguousarray(g[:, None] * hT), b @ hT + np32(net.head.bias)
        self.emb = np32(feat.emb)  # [V,H]
        m, n = self.b0.shape[0], (self.blocks[0][0].shape[1] if self.blocks else 1)
        self.kblocks = tuple(  # the blocks stacked for `estimator_probs`: BT [nb,m,n], bb [nb,n], CT [nb,n,m], cb [nb,m]
            np.ascontiguousarray(np.stack([b[i] for b in self.blocks])) if self.blocks else np.zeros((0, *shp), np.float32)
            for i, shp in enumerate([(m, n), (n,), (n, m), (m,)])
        )
        self.hb = np.ascontiguousarray(self.hb, np.float32)
        self._compiled: dict[tuple[int, int], tuple[np.ndarray, ...] | None] = {}
        self._all: dict[int, np.ndarray] = {}  # S -> [S] all True: the estimator at every step
        self._tails: dict[tuple[int, int, int], tuple] = {}  # (source layer, S, id(use)) -> (use, `_tail`)
        self._tok_key: Any = None
        self._ztok = np.zeros((0, self.b0.shape[0]), np.float32)
        self._gate: tuple[Any, int, np.ndarray] = (None, -1, self._ztok)  # (token context, source rank, earlier layers' term)

    def _token_term(self, batch: SourceBatch) -> np.ndarray:
        """[T,m] the token embeddings' first-layer term, once per token context (the policy passes one per pass)."""
        ctx = batch.token_ctx
        if ctx is not None and ctx is self._tok_key and len(self._ztok) == batch.t:
            return self._ztok
        T, H = batch.t, self.H
        tok = np.zeros((T, self.context * H), np.float32)  # as `EstimatorFeatures.tokens`
        if ctx is not None and self.context:
            c = ctx.cpu().numpy()
            for j in range(min(self.context, c.shape[1])):
                ids = c[:, -1 - j]
                ok = (ids >= 0) & (ids < len(self.emb))
                tok[ok, j * H : (j + 1) * H] = self.emb[ids[ok]]
        self._tok_key, self._ztok = ctx, tok @ self.AtT
        return self._ztok

    def _gate_term(self, batch: SourceBatch) -> np.ndarray:
        """[T,m]: the gate history's first-layer term (earlier layers' chosen experts weigh 1, the source's its gate
        weights; as `EstimatorFeatures.of_batch`)."""
        ids = batch.topk_ids.numpy(force=True)  # [T,k]
        r_src = self.rank[batch.layer]
        return self._gate_acc(batch) + np.matmul(np32(batch.topk_weights)[:, None, :], self.AgT[ids + r_src * self.E])[:, 0]

    def _gate_acc(self, batch: SourceBatch) -> np.ndarray:
        """[T,m]: the earlier layers' part of `_gate_term`, kept per token context (one per forward pass); it grows
        by one layer when the next source layer of that pass follows."""
        rank, E, AgT = self.rank, self.E, self.AgT
        r_src = rank[batch.layer]
        ctx, T = batch.token_ctx, batch.t
        key, prev_r, acc = self._gate
        hist = batch.history
        if ctx is not None and ctx is key and prev_r == r_src - 1 and len(acc) == T and self.ml[prev_r] in hist:
            acc = acc + np.add.reduce(AgT[hist[self.ml[prev_r]].numpy(force=True) + prev_r * E], 1)  # [T,m]
        else:
            acc = np.zeros((T, AgT.shape[1]), np.float32)  # [T,m]
            for l, h in hist.items():
                if rank.get(l, r_src) < r_src:
                    acc = acc + np.add.reduce(AgT[h.numpy(force=True) + rank[l] * E], 1)
        self._gate = (ctx, r_src, acc)
        return acc

    def logits(self, batch: SourceBatch, qa: np.ndarray, rl: np.ndarray, ss: list[int]) -> np.ndarray:
        """Estimator logits [len(ss),T,E] for steps `ss` from the chain's q's first-layer term qa = q @ AqT [S,T,m]
        (`ChainRunner.run(batch, S, self.AqT)`) and router logits rl [S,T,E]."""
        i = np.asarray(ss) - 1
        S, T = len(ss), batch.t
        rows = [self.pair_row[(batch.layer, s)] for s in ss]
        z0 = self._token_term(batch) + np32(batch.router_input) @ self.AuT + self._gate_term(batch) + self.b0  # [T,m]
        z = (qa if S == len(qa) else qa[i]) + (z0[None] + self.pos[rows][:, None, :])  # [S',T,m]
        z = z.reshape(S * T, -1)  # [S'T,m]
        for BT, bb, CT, cb in self.blocks:
            a = z @ BT + bb  # [S'T,n]
            z = z + (a * (0.5 + 0.5 * np.tanh(0.5 * a))) @ CT + cb  # SiLU (a x sigmoid(a)) block, residual
        inv_m = np.float32(1.0 / z.shape[-1])
        z = z - np.add.reduce(z, -1, keepdims=True) * inv_m
        z = z / np.sqrt(np.add.reduce(z * z, -1, keepdims=True) * inv_m + self.eps)  # LayerNorm (affine in the head)
        out = (z @ self.headT + self.hb).reshape(S, T, -1)  # [S',T,E]
        return out + (rl if S == len(rl) else rl[i]) if self.residual else out

    def compiled(self, l: int, steps: int) -> tuple[np.ndarray, ...] | None:
        """`estimator_probs`'s per-(source layer, S) arrays (Fs [S,H,E+m], eps [S], Ds [S,E,H], renorm [S], pos [S,m],
        has [S]: whether (l, s) is one of the estimator's pairs), or None when the chain cannot run compiled."""
        key = (l, steps)
        if key not in self._compiled:
            c = self.chain.compiled(l, steps)
            if c is None:
                self._compiled[key] = None
            else:
                r = self.rank[l]
                tg = self.ml[r + 1 : r + 1 + steps]
                Fs = [F for t in tg if (F := self.chain.fused(t, self.AqT)) is not None]  # all: `compiled` checked
                rows = [self.pair_row.get((l, s)) for s in range(1, steps + 1)]
                pos = np.stack([self.pos[i] if i is not None else np.zeros_like(self.pos[0]) for i in rows])  # [S,m]
                has = np.array([i is not None for i in rows], np.bool_)
                self._compiled[key] = (np.ascontiguousarray(np.stack(Fs)), c[1], c[2], c[3], np.ascontiguousarray(pos), has)
                _keep_prefixes(self._compiled, l, steps)
        return self._compiled[key]

    def precompute(self, horizon: int) -> EstimatorRunner:
        """`ChainRunner.precompute` for the estimator's compiled call, the all-estimator masks of every S and the
        compiled call's argument tails of every (source layer, S)."""
        for s in range(1, horizon + 1):
            self._use_all(s)
        for l, top in _sources(self.ml, horizon):
            self.compiled(l, top)
            for steps in range(1, top + 1):
                self._tail(l, steps, self._all[steps])
        return self

    def _tail(self, l: int, steps: int, use: np.ndarray) -> tuple | None:
        """`estimator_probs`'s arguments after the per-call ones (source offset in AgT's rows, the per-(layer, S)
        arrays, the network, `use`), kept per (source layer, S, use array): a decode call unpacks one tuple; None when
        a part runs as its module or a step in `use` is not one of the estimator's pairs."""
        key = (l, steps, id(use))
        kept = self._tails.get(key)
        if kept is not None:
            return kept[1]
        c = self.compiled(l, steps)
        t = None
        if c is not None and c[5][use].all():
            Fs, eps, Ds, renorm, pos, _ = c
            BT, bb, CT, cb = self.kblocks
            t = (self.rank[l] * self.E, Fs, eps, Ds, renorm, self.chain.spec.top_k, self.AuT, self.AgT, self.b0, pos,
                 BT, bb, CT, cb, self.headT, self.hb, self.eps, bool(self.residual), use)  # fmt: skip
        if len(self._tails) >= 4096:  # callers that pass a new `use` per call: the store restarts
            self._tails.clear()
        self._tails[key] = (use, t)  # holds `use`, so its id is not reused while the entry lives
        return t

    def _args(self, batch: SourceBatch, steps: int, use: np.ndarray) -> tuple | None:
        """`estimator_probs`'s arguments for this call, or None (more than 4 tokens, no residual or router input, or
        `_tail` None: then the numpy path runs)."""
        arr = batch.arrays
        if arr is not None:  # the policy's host arrays: no tensor touched
            T = arr[3].shape[0]
            tail = self._tail(batch.layer, steps, use) if T <= 4 and arr[1].size else None
            if tail is None:
                return None
            zb = self._token_term(batch)
            return (arr[0], arr[2], arr[3], arr[1], zb, history_rows(batch, self.rank, self.E), *tail)
        res = batch.residual
        if res is None or len(res) > 4 or not batch.router_input.numel():
            return None
        tail = self._tail(batch.layer, steps, use)
        if tail is None:
            return None
        return (  # C-contiguous inputs: one compiled signature
            np.ascontiguousarray(np32(res)),
            np.ascontiguousarray(np32(batch.topk_weights)),
            np.ascontiguousarray(npi(batch.topk_ids), np.int64),
            np.ascontiguousarray(np32(batch.router_input)),
            np.ascontiguousarray(self._token_term(batch), np.float32),
            history_rows(batch, self.rank, self.E),
            *tail,
        )

    def fast_probs(self, batch: SourceBatch, steps: int, use: np.ndarray) -> np.ndarray | None:
        """[S,T,E] probabilities in ONE compiled call (`estimator_probs`): the estimator's where use[s-1], the
        router's elsewhere; None when the call has more than 4 tokens or a part runs as its module (then the
        numpy path runs)."""
        a = self._args(batch, steps, use)
        return None if a is None else estimator_probs(*a)

    def fast_requests(
        self,
        batch: SourceBatch,
        steps: int,
        use: np.ndarray,
        m: int,
        targets: np.ndarray,
        k: float,
        ib: np.ndarray,
        fb: np.ndarray,
    ) -> int | None:
        """`kernels.decode_into` of `fast_probs` in ONE compiled call (`estimator_requests`), or None (not one
        token, or `fast_probs` would be None)."""
        a = self._args(batch, steps, use) if batch.t == 1 else None
        return None if a is None else estimator_requests(*a, m, targets, k, ib, fb)

    def _use_all(self, steps: int) -> np.ndarray:
        use = self._all.get(steps)
        if use is None:
            use = self._all[steps] = np.ones(steps, np.bool_)
        return use

    def warm(self) -> EstimatorRunner:
        """Compile `estimator_probs` and `estimator_requests` (or load them from numba's cache) now, at bind, not in
        the first decode call."""
        l = next((x for x in self.ml[:-1] if self.compiled(x, 1) is not None), None)
        if l is not None:
            H, k = self.H, self.chain.spec.top_k
            Fs, eps, Ds, renorm, pos, _ = self._compiled[(l, 1)]  # type: ignore[misc]
            BT, bb, CT, cb = self.kblocks
            z = np.zeros((1, self.b0.shape[0]), np.float32)
            a = (np.zeros((1, H), np.float32), np.zeros((1, k), np.float32), np.zeros((1, k), np.int64),
                 np.zeros((1, H), np.float32), z, np.zeros((1, 0), np.int64), 0, Fs, eps, Ds, renorm, k,
                 self.AuT, self.AgT, self.b0, pos, BT, bb, CT, cb, self.headT, self.hb, self.eps,
                 bool(self.residual), np.ones(1, np.bool_))  # fmt: skip
            estimator_probs(*a)
            estimator_requests(*a, 1, np.zeros(1, np.int64), 1.0, *_request_buffers(1))
        return self

    def scores(self, batch: SourceBatch, steps: int) -> np.ndarray:
        use = self._use_all(steps)
        out = self.fast_probs(batch, steps, use)
        if out is not None:
            return out
        qa, rl = self.chain.run(batch, steps, self.AqT)
        return softmax(self.logits(batch, qa, rl, list(range(1, steps + 1))))

    def requests(
        self, batch: SourceBatch, steps: int, m: int, targets: np.ndarray, k: float, ib: np.ndarray, fb: np.ndarray
    ) -> int | None:
        """A decode step's requests (`ChainRunner.requests`' buffers and count) in one compiled call, or None."""
        return self.fast_requests(batch, steps, self._use_all(steps), m, targets, k, ib, fb)


class HybridRunner:
    """Hybrid-PF: the estimator's scores on its (layer, S) pairs, Router-PF's elsewhere, from one chain."""

    def __init__(self, hybrid: Any):
        assert hybrid.estimator is not None, "fit or load first"
        self.est = EstimatorRunner(hybrid.estimator)
        self.use = hybrid.use_estimator
        self._use: dict[tuple[int, int], np.ndarray] = {}

    def warm(self) -> HybridRunner:
        self.est.warm()
        return self

    def precompute(self, horizon: int) -> HybridRunner:
        """The estimator's `precompute`, and which steps take the estimator (and the compiled call's argument tail)
        for every source layer and S."""
        self.est.precompute(horizon)
        for l, top in _sources(self.est.ml, horizon):
            for steps in range(1, top + 1):
                self.est._tail(l, steps, self._use_of(l, steps))
        return self

    def _use_of(self, l: int, steps: int) -> np.ndarray:
        """[S] whether step s of source layer `l` takes the estimator (kept per (l, S))."""
        use = self._use.get((l, steps))
        if use is None:
            use = self._use[(l, steps)] = np.array([(l, s) in self.use for s in range(1, steps + 1)], np.bool_)
        return use

    def requests(
        self, batch: SourceBatch, steps: int, m: int, targets: np.ndarray, k: float, ib: np.ndarray, fb: np.ndarray
    ) -> int | None:
        """A decode step's requests (`ChainRunner.requests`' buffers and count) in one compiled call, or None."""
        return self.est.fast_requests(batch, steps, self._use_of(batch.layer, steps), m, targets, k, ib, fb)

    def scores(self, batch: SourceBatch, steps: int) -> np.ndarray:
        use = self._use_of(batch.layer, steps)  # [S]
        fast = self.est.fast_probs(batch, steps, use)
        if fast is not None:
            return fast
        qa, rl = self.est.chain.run(batch, steps, self.est.AqT)
        out = rl.copy()
        ss = (np.flatnonzero(use) + 1).tolist()
        if ss:
            out[np.asarray(ss) - 1] = self.est.logits(batch, qa, rl, ss)
        return softmax(out)
