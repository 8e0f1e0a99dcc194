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
- Estimator (`EstimatorRunner`, `fast_estimator.py`): the feature standardisation folded into the first layer, which
  is split by input part: the token embeddings' term once per forward pass, the gate history's rows (summed in the
  compiled call; the numpy path keeps them per pass, grown by one layer per call), q's from the chain's fused
  product; the trunk runs once on [S,T,m]. Hybrid runs it for its estimator pairs only.
- Forest (`ForestRunner`, `fast_forest.py`): the per-pass features (token embedding, the token priors of every
  target layer) once per pass, the pre-gate probabilities of every target from one product with the targets' routers
  side by side (inside the compiled call), and the trees walked by a compiled kernel (`kernels.forest_walk`, numba,
  releases the GIL) that sums leaves in scikit-learn's order.

A call is a few dozen numpy operations on [S,T,*] arrays: at a decode step (T = 1) their dispatch, not their
arithmetic, is the cost, so the runners keep the count of operations per call low rather than the FLOPs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..moe import residual_norm
from .kernels import chain_probs, chain_requests

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
            norm = self.norms[l]
            w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
            x = torch.randn(3, adapter.spec.hidden_size, generator=g) * 2.0  # [3,H]
            self.nw[l] = (np32(w), float(eps)) if isinstance(w, torch.Tensor) and eps is not None else None
            if self.nw[l] is not None and not _close(self.norm(l, x.numpy()), self._norm_module(l, x.numpy())):
                self.nw[l] = None
            rw = adapter.router_weight(l)  # [E,H], where the family keeps it
            has_bias = adapter.router_bias(l) is not None
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
        p = self.adapter.router_weight(l)
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
        p = self.adapter.router_weight(l)
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
