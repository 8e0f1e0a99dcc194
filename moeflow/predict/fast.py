"""Run-time inference of the learned predictors: every S of a source layer in ONE batched call.

The prefetch policies (`moeflow.policies.learned`) call a predictor's runner (`predictor.runner()`) once per MoE
layer of a forward pass, for all its targets l+1..l+S at once, instead of `predict(target, S, batch)` per target
(which rebuilds the quasi-hidden chain and the features for every S). `runner.scores(batch, steps)` returns
[steps,T,E] float32 numpy, row s-1 the scores `predict(target_of(l, s), s, batch)` gives (equal up to float32
rounding). What the runners precompute at bind time:

- `LayerOps`: the model's post-attention norms and routers as float32 numpy arrays, checked against the modules
  on a random input when built; a layer whose modules compute something else (a bfloat16 model, another norm)
  calls the module's `forward` instead. The selection rule (softmax top-k, renormalised or not) runs in numpy
  when it reproduces the adapter's on random logits, else the adapter's `select` runs. Neither path runs module
  hooks, so the engine's router and residual hooks never see a prediction.
- Router-PF (`ChainRunner`): the quasi-hidden chain q_1..q_S once; the norm's weight is folded into the router
  (and into the estimator's q-term), so one product of the un-normalised state, scaled by its inverse RMS, gives
  the router logits of q_s (Router-PF's scores for target l+s and the chain's next step) and the estimator's
  first-layer term of q_s; q itself is not formed.
- Estimator (`EstimatorRunner`): the feature standardisation folded into the first layer, which is split by input
  part: the token embeddings' term once per forward pass, the gate history's rows (summed in the compiled call; the
  numpy path keeps them per pass, grown by one layer per call), q's from the chain's fused product; the trunk runs
  once on [S,T,m]. Hybrid runs it for its estimator pairs only.
- Forest (`ForestRunner`): the per-pass features (token embedding, the token priors of every target layer) once per
  pass, the pre-gate probabilities of every target from one product with the targets' routers side by side (inside
  the compiled call), and the trees walked by a compiled kernel (`kernels.forest_walk`, numba, releases the GIL)
  that sums leaves in scikit-learn's order.

A call is a few dozen numpy operations on [S,T,*] arrays: at a decode step (T = 1) their dispatch, not their
arithmetic, is the cost, so the runners keep the count of operations per call low rather than the FLOPs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..moe import residual_norm
from .kernels import chain_probs, chain_requests, estimator_probs, estimator_requests, forest_requests, forest_scores

if TYPE_CHECKING:
    from .data import SourceBatch


def np32(x: torch.Tensor) -> np.ndarray:
    """A tensor as float32 numpy on the host (no copy for a float32 CPU tensor: its view, without a torch call)."""
    if x.dtype is torch.float32 and x.is_cpu and not x.requires_grad:
        return x.numpy()
    return x.detach().to("cpu", torch.float32).numpy()


def npi(x: torch.Tensor) -> np.ndarray:
    """An index tensor as numpy on the host (a CPU tensor's view without `numpy(force=True)`'s conversion calls)."""
    return x.numpy() if x.is_cpu else x.numpy(force=True)


def history_rows(batch: SourceBatch, rank: dict[int, int], E: int) -> np.ndarray:
    """[T,c] int64 rank x E + expert of every id in the batch's gate history (`SourceBatch.history_rows` when the
    policy kept them, else from `history`): the estimator's gate rows of `AgT`, the forest's multi-hot columns
    after its first d + 2."""
    hr = batch.history_rows
    if hr is not None:
        return np.ascontiguousarray(hr, np.int64)
    if not batch.history:
        return np.zeros((batch.t, 0), np.int64)
    return np.ascontiguousarray(np.concatenate([npi(h) + rank[l] * E for l, h in batch.history.items()], 1), np.int64)


def _request_buffers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Buffers for `runner.requests` of up to n requests: (target, expert) [2,n] int64, (priority, confidence) [2,n]
    float64."""
    return np.zeros((2, n), np.int64), np.zeros((2, n), np.float64)


def softmax(z: np.ndarray) -> np.ndarray:
    """Softmax over the last axis (float32)."""
    e = np.exp(z - np.maximum.reduce(z, -1, keepdims=True))
    return e / np.add.reduce(e, -1, keepdims=True)


def _sources(ml: list[int], horizon: int) -> list[tuple[int, int]]:
    """(source layer, the largest S it can be asked for, at most `horizon`) of every MoE layer with a later one."""
    return [(l, min(horizon, len(ml) - 1 - r)) for r, l in enumerate(ml[:-1])]


def _keep_prefixes(cache: dict[tuple[int, int], Any], l: int, steps: int) -> None:
    """Every shorter S of source layer `l` as views of cache[(l, steps)]'s arrays: a step's arrays are the same for
    any longer S, and a prefix along the first axis stays C-contiguous (the compiled kernels' one signature)."""
    c = cache[(l, steps)]
    if c is not None:
        for s in range(1, steps):
            cache.setdefault((l, s), tuple(a[:s] for a in c))


class LayerOps:
    """The model's post-attention norms and routers of `layers`, hookless, on float32 numpy [T,H] inputs.

    An RMSNorm (`weight`, `variance_epsilon`) and a bias-free linear router run as numpy when they reproduce the
    module on a random input (relative error < 1e-4); otherwise the module's `forward` runs (no hooks)."""

    def __init__(self, adapter: Any, layers: list[int]):
        self.adapter = adapter
        self.norms = {l: residual_norm(adapter, l, hint="the predictors need the norm before the router") for l in layers}
        self.routers = {l: adapter.router(l) for l in layers}
        self.nw: dict[int, tuple[np.ndarray, float] | None] = {}
        self.rw: dict[int, np.ndarray | None] = {}  # layer -> router weight [H,E] (transposed)
        self.sel: dict[int, bool | None] = {}  # layer -> numpy softmax-top-k (True: renormalised) or None: the adapter's
        g = torch.Generator().manual_seed(0)
        for l in layers:
            norm, router = self.norms[l], self.routers[l]
            w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
            x = torch.randn(3, adapter.spec.hidden_size, generator=g) * 2.0  # [3,H]
            self.nw[l] = (np32(w), float(eps)) if isinstance(w, torch.Tensor) and eps is not None else None
            if self.nw[l] is not None and not _close(self.norm(l, x.numpy()), self._norm_module(l, x.numpy())):
                self.nw[l] = None
            rw = getattr(router, "weight", None)
            has_bias = getattr(router, "bias", None) is not None
            self.rw[l] = np.ascontiguousarray(np32(rw).T) if isinstance(rw, torch.Tensor) and not has_bias else None
            if self.rw[l] is not None and not _close(self.logits(l, x.numpy()), self._logits_module(l, x.numpy())):
                self.rw[l] = None
            self.sel[l] = self._numpy_rule(l, g)

    def _numpy_rule(self, l: int, g: torch.Generator) -> bool | None:
        """Which numpy softmax-top-k (plain or renormalised) reproduces layer `l`'s selection rule on random
        logits (same experts, weights within 1e-6), or None: `select` calls the adapter."""
        E = self.adapter.spec.num_experts
        z = (torch.randn(8, E, generator=g) * 3.0).numpy()  # [8,E]
        w, ids = self._select_module(l, z)
        for norm in (False, True):
            self.sel[l] = norm
            w2, ids2 = self.select(l, z)
            o, o2 = np.argsort(ids, -1), np.argsort(ids2, -1)
            same = np.array_equal(np.take_along_axis(ids, o, -1), np.take_along_axis(ids2, o2, -1))
            if same and np.allclose(np.take_along_axis(w, o, -1), np.take_along_axis(w2, o2, -1), rtol=1e-6, atol=1e-7):
                return norm
        return None

    def _param(self, mod: torch.nn.Module) -> torch.Tensor:
        return next(mod.parameters())

    @torch.no_grad()
    def _norm_module(self, l: int, h: np.ndarray) -> np.ndarray:
        p = self._param(self.norms[l])
        return np32(self.norms[l].forward(torch.from_numpy(h).to(p.device, p.dtype)))

    @torch.no_grad()
    def _logits_module(self, l: int, x: np.ndarray) -> np.ndarray:
        p = self.routers[l].weight
        return np32(self.routers[l].forward(torch.from_numpy(x).to(p.device, p.dtype))[0])

    def norm(self, l: int, h: np.ndarray) -> np.ndarray:
        """The norm before layer `l`'s router: [T,H] -> [T,H] float32."""
        nw = self.nw[l]
        if nw is None:
            return self._norm_module(l, h)
        w, eps = nw
        ms = np.add.reduce(h * h, -1, keepdims=True) / np.float32(h.shape[-1])  # [T,1] mean square
        return (h / np.sqrt(ms + np.float32(eps))) * w

    def logits(self, l: int, x: np.ndarray) -> np.ndarray:
        """Layer `l`'s router logits: [...,H] -> [...,E] float32."""
        rw = self.rw[l]
        return x @ rw if rw is not None else self._logits_module(l, x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)

    def select(self, l: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(weights [T,k] float32, ids [T,k]) as layer `l` routes (the adapter's selection rule; in numpy when the
        check at bind time found a softmax-top-k that reproduces it)."""
        norm = self.sel.get(l)
        if norm is None:
            return self._select_module(l, logits)
        k = self.adapter.spec.top_k
        pr = softmax(logits)  # [T,E]
        ids = np.argpartition(-pr, k - 1, axis=-1)[:, :k]  # [T,k] (order within the k does not matter here)
        w = np.take_along_axis(pr, ids, -1)  # [T,k]
        return (w / np.add.reduce(w, -1, keepdims=True) if norm else w), ids

    def _select_module(self, l: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = self.routers[l].weight
        w, ids = self.adapter.select(l, torch.from_numpy(logits).to(p.device, p.dtype))
        return np32(w), ids.cpu().numpy()


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and float(np.abs(a - b).max()) <= 1e-4 * max(1.0, float(np.abs(b).max()))


class ChainRunner:
    """Router-PF's quasi-hidden chain for every S of a source layer at once (`QuasiHidden.chain`)."""

    def __init__(self, qh: Any, ops: LayerOps | None = None):
        self.spec = qh.spec
        self.ml = list(self.spec.moe_layers)
        self.ops = ops or LayerOps(qh.adapter, self.ml)
        self.dvec = {l: np32(v) for l, v in qh.dvec.items()}  # layer -> [E,H]
        self.rank = {l: i for i, l in enumerate(self.ml)}
        self._fused: dict[tuple[int, int], np.ndarray | None] = {}
        self._compiled: dict[tuple[int, int], tuple[np.ndarray, ...] | None] = {}

    def warm(self) -> ChainRunner:
        """Compile `chain_probs` and `chain_requests` (or load them from numba's cache: about 0.4 s each) now, not in
        the first decode call: the prefetch policy calls it at bind, for the runner it calls (Router-PF's); the chain
        inside the estimator and hybrid runners only runs `run`, so theirs is never warmed, and nor is a runner held
        only to score held-out rows (`evaluate`'s large chunks run in numpy)."""
        H, E, k = self.spec.hidden_size, self.spec.num_experts, self.spec.top_k
        f32 = np.float32
        a = (np.zeros((1, H), f32), np.zeros((1, k), f32), np.zeros((1, k), np.int64), np.zeros((1, H, E), f32),
             np.ones(1, f32), np.zeros((1, E, H), f32), k, np.zeros(1, np.bool_))  # fmt: skip
        chain_probs(*a)
        chain_requests(*a, 1, np.zeros(1, np.int64), 1.0, *_request_buffers(1))
        return self

    def fused(self, l: int, proj: np.ndarray | None) -> np.ndarray | None:
        """Layer `l`'s norm weight folded into its router and `proj` [H,m]: w[:,None] x [router | proj], [H,E(+m)],
        so that one product of the un-normalised h gives both (scaled by h's inverse RMS); None when the norm or
        the router runs as its module."""
        key = (l, id(proj))
        if key not in self._fused:
            nw, rw = self.ops.nw[l], self.ops.rw[l]
            if nw is None or rw is None:
                self._fused[key] = None
            else:
                W = rw if proj is None else np.concatenate([rw, proj], 1)
                self._fused[key] = np.ascontiguousarray(nw[0][:, None] * W)
        return self._fused[key]

    def run(
        self, batch: SourceBatch, steps: int, proj: np.ndarray | None = None, need_q: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """(q_s @ proj [S,T,m] (q [S,T,H] without `proj`), router logits of q_s for its target [S,T,E]) for
        S = 1..steps (need_q=False: [S,T,0], router logits only). The norm's weight is folded into the products
        (`fused`): with `proj` or without need_q, q itself is never formed."""
        if batch.residual is None:
            from ..errors import ArtifactError

            raise ArtifactError("router-pf needs the post-attention residual; run with an engine that captures it")
        ops, ml, E = self.ops, self.ml, self.spec.num_experts
        r = self.rank[batch.layer]
        ids, w = batch.topk_ids.numpy(force=True), np32(batch.topk_weights)  # [T,k]
        h = np32(batch.residual) + np.matmul(w[:, None, :], self.dvec[batch.layer][ids])[:, 0]  # [T,H] r_l + sum_k w_k d_l,e_k
        T, H = h.shape
        qs = np.empty((steps, T, (H if need_q else 0) if proj is None else proj.shape[1]), np.float32)
        zs = np.empty((steps, T, E), np.float32)
        for s in range(1, steps + 1):
            nxt = ml[r + s]
            F = self.fused(nxt, proj)
            if F is not None:  # RMSNorm then router (and proj): (h @ (w x W)) / rms(h)
                eps = np.float32(ops.nw[nxt][1])  # type: ignore[index]
                y = (h @ F) / np.sqrt(np.add.reduce(h * h, -1, keepdims=True) / np.float32(H) + eps)  # [T,E(+m)]
                zs[s - 1] = z = y[:, :E]
                if proj is not None or need_q:
                    qs[s - 1] = ops.norm(nxt, h) if proj is None else y[:, E:]
            else:
                q = ops.norm(nxt, h)  # [T,H]
                zs[s - 1] = z = ops.logits(nxt, q)  # [T,E]
                if proj is not None or need_q:
                    qs[s - 1] = q if proj is None else q @ proj
            if s < steps:
                w2, ids2 = ops.select(nxt, z)  # [T,k]
                h = h + np.matmul(w2[:, None, :], self.dvec[nxt][ids2])[:, 0]
        return qs, zs

    def compiled(self, l: int, steps: int) -> tuple[np.ndarray, ...] | None:
        """`chain_probs`'s per-(source layer, S) arrays (Fs [S,H,E], eps [S], Ds [S,E,H], renorm [S]), or None when
        a target's norm, router or selection rule runs as its module (then `run` does the chain in numpy)."""
        key = (l, steps)
        if key not in self._compiled:
            r, ops = self.rank[l], self.ops
            tg = self.ml[r + 1 : r + 1 + steps]
            Fs = [F for t in tg if (F := self.fused(t, None)) is not None]
            sel = [ops.sel.get(t) for t in tg]  # the last target's rule is not used (nothing follows it)
            if len(Fs) < len(tg) or any(x is None for x in sel[:-1]):
                self._compiled[key] = None
            else:
                self._compiled[key] = (
                    np.ascontiguousarray(np.stack(Fs)),  # [S,H,E]
                    np.array([ops.nw[t][1] for t in tg], np.float32),  # type: ignore[index]
                    np.ascontiguousarray(np.stack([self.dvec[x] for x in [l, *tg[:-1]]])),  # [S,E,H]
                    np.array([bool(x) for x in sel], np.bool_),  # [S]
                )
                _keep_prefixes(self._compiled, l, steps)
        return self._compiled[key]

    def precompute(self, horizon: int) -> ChainRunner:
        """Build the compiled call's arrays of every source layer for S up to `horizon` now (at bind), so that no
        decode step pays for stacking them; one set of arrays per source layer, the shorter S its views."""
        for l, steps in _sources(self.ml, horizon):
            self.compiled(l, steps)
        return self

    def _args(self, batch: SourceBatch, steps: int) -> tuple | None:
        """`chain_probs`'s arguments for this call, or None: the numpy chain runs (more than 4 tokens, no residual, or
        a target's norm, router or selection rule runs as its module)."""
        arr = batch.arrays
        if arr is not None:  # the policy's host arrays: no tensor touched
            c = self.compiled(batch.layer, steps) if arr[3].shape[0] <= 4 else None
            return None if c is None else (arr[0], arr[2], arr[3], c[0], c[1], c[2], self.spec.top_k, c[3])
        res = batch.residual
        c = self.compiled(batch.layer, steps) if res is not None and len(res) <= 4 else None
        if c is None or res is None:
            return None
        Fs, eps, Ds, renorm = c
        return (  # C-contiguous inputs: the one signature compiled at bind
            np.ascontiguousarray(np32(res)),
            np.ascontiguousarray(np32(batch.topk_weights)),
            np.ascontiguousarray(npi(batch.topk_ids), np.int64),
            Fs,
            eps,
            Ds,
            self.spec.top_k,
            renorm,
        )

    def scores(self, batch: SourceBatch, steps: int) -> np.ndarray:
        """Router-PF's probabilities [S,T,E]: one compiled call (`chain_probs`) when every target's norm, router and
        selection rule run in numpy and the call has at most 4 tokens (longer prompts go to numpy's products). A
        decode step's call is then a few microseconds of arithmetic whatever ran on the core before it, where a few
        dozen numpy operations each pay their dispatch from cold caches."""
        a = self._args(batch, steps)
        return softmax(self.run(batch, steps, need_q=False)[1]) if a is None else chain_probs(*a)

    def requests(
        self, batch: SourceBatch, steps: int, m: int, targets: np.ndarray, k: float, ib: np.ndarray, fb: np.ndarray
    ) -> int | None:
        """A decode step's requests (`kernels.decode_into` of `scores`: (target, expert) into ib [2,>=S*m] int64,
        (priority, confidence) into fb [2,>=S*m] float64; their count returned) in ONE compiled call
        (`chain_requests`), or None when the call is not one token or does not run compiled."""
        a = self._args(batch, steps) if batch.t == 1 else None
        return None if a is None else chain_requests(*a, m, targets, k, ib, fb)


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
        tok = np.zeros((T, self.context * H), np.float32)  # as `_Features.tokens`
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
        weights; as `_Features.of_batch`)."""
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
