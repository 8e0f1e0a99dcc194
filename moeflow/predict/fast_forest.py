"""The forest's run-time runner (`ForestRunner`; see `moeflow.predict.fast`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .fast import (
    LayerOps,
    _request_buffers,
    _sources,
    history_rows,
    np32,
    softmax,
)
from .kernels import forest_requests, forest_scores

if TYPE_CHECKING:
    from .data import SourceBatch


class ForestRunner:
    """`Forest.predict_group` for every (target, S) of a source layer (see the module docstring)."""

    def __init__(self, forest: Any):
        assert forest.rf is not None, "fit or load first"
        self.f = forest
        self.ml, self.E, self.k = list(forest.spec.moe_layers), forest.spec.num_experts, forest.spec.top_k
        self.ops = LayerOps(forest.adapter, self.ml)
        forest.rf.predict(np.zeros((1, forest.rf.n_features), np.float32))  # compile or load the walk now, not in a pass
        self._tok_key: Any = None
        self._pass: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._priors: dict[int, np.ndarray] = {}  # token id -> its prior of every target [L,1,E+1]
        self._stacked: dict[tuple[int, ...], Any] = {}  # target layers -> their routers [H,P*E] (False: not numpy)
        self.rank = {l: i for i, l in enumerate(self.ml)}
        self._pairs: dict[tuple, tuple[np.ndarray, np.ndarray, Any]] = {}  # pairs -> (S [P], target rank [P], routers)
        self._steps: dict[tuple[int, int], tuple] = {}  # (source layer, S) -> its pairs ((target, s), ...)
        self._no_w = (np.zeros((1, 0), np.float32), np.zeros((0, 0), np.float32))  # `forest_scores` given its probs

    def per_pass(self, batch: SourceBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(embedding [T,d], prior of the current token [L,T,E+1], of the previous token [L,T,E+1]), once per
        token context."""
        ctx = batch.token_ctx
        if ctx is not None and ctx is self._tok_key and self._pass is not None and len(self._pass[0]) == batch.t:
            return self._pass
        f, t = self.f, batch.t
        c = ctx.cpu().numpy() if ctx is not None else np.full((t, 1), -1)
        prev_tok = c[:, -2] if c.shape[1] > 1 else np.full(t, -1)
        emb = np.ascontiguousarray(f.embed(c), np.float32)  # as the float32 rows hold it
        if t == 1:  # a decode step: its previous token's prior is the last step's current token's
            pc, pp = self._prior(int(c[0, -1])), self._prior(int(prev_tok[0]))
        else:
            pc, pp = f.prior_all(c[:, -1]), f.prior_all(prev_tok)
        self._tok_key, self._pass = ctx, (emb, pc, pp)
        return self._pass

    def _prior(self, tok: int) -> np.ndarray:
        """[L,1,E+1] `Forest.prior_all` of one token id, kept per id (at most 4096 ids; then the store restarts)."""
        p = self._priors.get(tok)
        if p is None:
            if len(self._priors) >= 4096:
                self._priors.clear()
            p = self._priors[tok] = self.f.prior_all(np.array([tok], np.int64))
        return p

    def probs(self, batch: SourceBatch, targets: list[int]) -> np.ndarray:
        """Pre-gate probabilities [P,T,E] of each target layer from the source's router input (0 without one)."""
        if not batch.router_input.numel() or not targets:
            return np.zeros((len(targets), batch.t, self.E), np.float32)
        u = np32(batch.router_input)  # [T,H]
        key = tuple(targets)
        W = self._stacked.get(key)
        if W is None:
            W = self._stack(key)
        if W is False:
            return softmax(np.stack([self.ops.logits(t, u) for t in targets]))
        P, T = len(targets), len(u)
        return softmax((u @ W).reshape(T, P, self.E).transpose(1, 0, 2))  # [P,T,E]

    def _stack(self, key: tuple[int, ...]) -> Any:
        """The target layers' routers side by side [H,P*E] (False: one runs as its module), kept per target list."""
        rws = [r for r in (self.ops.rw[t] for t in key) if r is not None]
        W = self._stacked[key] = np.ascontiguousarray(np.concatenate(rws, 1)) if len(rws) == len(key) else False
        return W

    def _pair_arrays(self, pk: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray, Any]:
        """(S [P] float32, target rank [P], the targets' routers side by side [H,P*E] or False) of every pair, kept
        per pair list."""
        tg = tuple(t for t, _ in pk)
        W = self._stacked[tg] if tg in self._stacked else self._stack(tg)
        sr = self._pairs[pk] = (np.array([s for _, s in pk], np.float32), np.array([self.ml.index(t) for t in tg]), W)
        return sr

    def _pairs_of(self, l: int, steps: int) -> tuple[tuple[int, int], ...]:
        """The pairs (target l+s, s) of source layer `l` for s = 1..steps, kept per (l, S)."""
        r = self.ml.index(l)
        pk = self._steps[(l, steps)] = tuple((self.ml[r + s], s) for s in range(1, steps + 1))
        return pk

    def precompute(self, horizon: int) -> ForestRunner:
        """The stacked routers and the pair arrays of every source layer and S up to `horizon`, now (at bind)."""
        for l, top in _sources(self.ml, horizon):
            for steps in range(1, top + 1):
                pk = self._steps.get((l, steps)) or self._pairs_of(l, steps)
                if pk not in self._pairs:
                    self._pair_arrays(pk)
        return self

    def features(self, pairs: list[tuple[int, int]], batch: SourceBatch, probs: np.ndarray) -> np.ndarray:
        """[P*T,F] the forest's rows for every pair (`Forest.features`, stacked)."""
        emb, pc, pp = self.per_pass(batch)
        ml, E, T, P = self.ml, self.E, batch.t, len(pairs)
        d, LE = emb.shape[1], len(ml) * E
        X = np.zeros((P, T, self.f.n_features), np.float32)
        X[:, :, :d] = emb
        if batch.history:  # prev_act: the experts each layer so far chose, multi-hot per layer rank
            cols = np.concatenate([h.cpu().numpy() + (d + 2 + ml.index(l) * E) for l, h in batch.history.items()], 1)
            X[:, np.arange(T)[:, None], cols] = 1.0
        o = d + 2 + LE
        for p, (t, s) in enumerate(pairs):
            r = ml.index(t)
            X[p, :, d], X[p, :, d + 1] = s, r
            X[p, :, o : o + E] = probs[p]
            X[p, :, o + E : o + 2 * E + 1] = pc[r]
            X[p, :, o + 2 * E + 1 :] = pp[r]
        return X.reshape(P * T, -1)

    def bases(self, targets: list[int], batch: SourceBatch, probs: np.ndarray) -> np.ndarray:
        """[P,T,E] what the forest's delta is added to (`Forest.base`)."""
        f = self.f
        if f.base_kind == "prior":
            _, pc, _ = self.per_pass(batch)
            return np.stack([self.k * pc[self.ml.index(t)][:, : self.E] for t in targets])
        if f.base_kind == "pregate" and batch.router_input.numel():
            top = np.argsort(-probs, -1, kind="stable")[..., : self.k]
            out = np.zeros_like(probs)
            np.put_along_axis(out, top, 1.0, axis=-1)
            return out
        return np.zeros_like(probs)

    def prepare(self, pairs: list[tuple[int, int]], batch: SourceBatch, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(forest rows X [P*T,F], bases [P,T,E]): everything but the tree walk."""
        return self.features(pairs, batch, probs), self.bases([t for t, _ in pairs], batch, probs)

    def finish(self, X: np.ndarray, base: np.ndarray, probs: np.ndarray) -> np.ndarray:
        """[P,T,E] scores: the tree walk (compiled, releases the GIL) on `prepare`'s rows, added to the bases."""
        d = self.f.rf.predict(X).astype(np.float32).reshape(base.shape)
        return np.clip(base + d, 0.0, None) + 1e-3 * probs + 1e-6

    def scores_pairs(self, pairs: Sequence[tuple[int, int]], batch: SourceBatch, probs: np.ndarray | None = None) -> np.ndarray:
        """[P,T,E] scores of every (target, S) in `pairs` with ONE tree walk; `probs` their pre-gate probabilities
        (None: computed here). For the compiled forest the pre-gate (when the targets' routers run in numpy), the
        features, walk, base and finish run in one compiled call (`forest_scores`)."""
        rf = self.f.rf
        if not hasattr(rf, "nodes"):
            probs = self.probs(batch, [t for t, _ in pairs]) if probs is None else probs
            return self.finish(*self.prepare(list(pairs), batch, probs), probs)
        return forest_scores(*self._args(tuple(pairs), batch, probs))

    def _args(self, pk: tuple[tuple[int, int], ...], batch: SourceBatch, probs: np.ndarray | None) -> tuple:
        """`forest_scores`'s arguments for the pairs `pk` (the compiled forest only)."""
        rf = self.f.rf
        sr = self._pairs.get(pk)
        if sr is None:  # S, target rank and routers of every pair
            sr = self._pair_arrays(pk)
        uw, arr = self._no_w, batch.arrays  # arr: the policy's host arrays (no tensor touched), else the tensors
        has_u = arr[1].size if arr is not None else batch.router_input.numel()
        if probs is None:
            if sr[2] is not False and has_u:  # the kernel computes the pre-gate into `probs`
                uw = (arr[1] if arr is not None else np.ascontiguousarray(np32(batch.router_input)), sr[2])
                probs = np.empty((len(pk), batch.t, self.E), np.float32)  # [P,T,E]
            else:
                probs = self.probs(batch, [t for t, _ in pk])
        emb, pc, pp = self.per_pass(batch)
        kind = self.f.base_kind
        base_kind = 1 if kind == "prior" else 2 if kind == "pregate" and has_u else 0
        return (
            np.ascontiguousarray(probs, np.float32),
            uw[0],
            uw[1],
            emb,
            pc,
            pp,
            history_rows(batch, self.rank, self.E),  # [T,c] the history's multi-hot columns after the first d + 2
            sr[0],
            sr[1],
            int(self.f.n_features),
            rf.nodes,
            rf.a["value"],
            rf.a["roots"],
            base_kind,
            self.k,
        )

    def warm(self) -> ForestRunner:
        """Compile `forest_scores` and `forest_requests` (or load them from numba's cache) now, not in the first decode
        call."""
        rf, L, E = self.f.rf, len(self.ml), self.E
        if hasattr(rf, "nodes"):
            d = self.f.dim
            z = np.zeros((1, 1, E), np.float32)
            pz = np.zeros((L, 1, E + 1), np.float32)
            h0, s0, r0 = np.zeros((1, 0), np.int64), np.ones(1, np.float32), np.zeros(1, np.int64)
            nf, a = int(self.f.n_features), rf.a
            u, W = self._no_w
            args = (z, u, W, np.zeros((1, d), np.float32), pz, pz, h0, s0, r0, nf, rf.nodes, a["value"], a["roots"], 0,
                    self.k)  # fmt: skip
            forest_scores(*args)
            forest_requests(*args, 1, np.zeros(1, np.int64), 1.0, *_request_buffers(1))
        return self

    def scores(self, batch: SourceBatch, steps: int) -> np.ndarray:
        pk = self._steps.get((batch.layer, steps)) or self._pairs_of(batch.layer, steps)
        return self.scores_pairs(pk, batch)

    def requests(
        self, batch: SourceBatch, steps: int, m: int, targets: np.ndarray, k: float, ib: np.ndarray, fb: np.ndarray
    ) -> int | None:
        """A decode step's requests (`ChainRunner.requests`' buffers and count) in ONE compiled call
        (`forest_requests`), or None when the call is not one token or the forest is not compiled."""
        if batch.t != 1 or not hasattr(self.f.rf, "nodes"):
            return None
        pk = self._steps.get((batch.layer, steps)) or self._pairs_of(batch.layer, steps)
        return forest_requests(*self._args(pk, batch, None), m, targets, k, ib, fb)
