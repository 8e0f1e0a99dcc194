"""Prefetch policies driven by trained predictors (`moeflow train`): router-pf, estimator, hybrid, forest, token-id.

| name | proposes for layers l+1..l+S | source |
|---|---|---|
| router-pf | router_{l+s}(quasi-hidden state q chained from layer l) | Speculating Experts 3 |
| estimator | the neural estimator's logits from q | Speculating Experts 6.1 |
| hybrid | estimator on the (layer, S) pairs where Router-PF was weak in training, else Router-PF | Speculating Experts 6.3 |
| forest | ExpertFlow's random forest on CPU (`worker=on`: asynchronously, see below) | ExpertFlow 3.2.2 |
| token-id | baseline: the experts most often routed for the current token id in the training trace | - |

Options (`--prefetch-opt key=value`): `predictors=DIR` (required: a `moeflow train` folder for this
model), `lookahead=S` (default: the engine's S), `overfetch=1.0` (top round(k*overfetch) per token)
or `mass=0.9` (experts in descending score up to that cumulative mass); the gate's `gate=on|off`,
`cancel=on|off`, `budget=auto|BYTES`, `weight=1.0` (`moeflow.policies.prefetch.PrefetchGate`, default on).

Every policy makes ONE predictor call per MoE layer for all its targets l+1..l+S (`predictor.runner()`,
`moeflow.predict.fast`: the quasi-hidden chain once, the estimator's network once on [S,T], the forest's rows of
every target in one tree walk), on the model's thread, without the engine's router hooks (the runners apply the
model's norms and routers directly); `predict_s` is the time `propose` takes there (`predict_decode_s` its part
in decode steps, of which there were `decode_passes`; `predict_decode_cpu_s` the thread's CPU time in them). The
forest's `worker=on` (default off) runs ExpertFlow's asynchronous dual mode instead: one forest call per source
layer for every later layer it knows runs in a worker thread (`AsyncForest.submit_group`); predictions are cached
per (token sequence, layer, S), and until one is ready the policy uses the pre-gate's top-k.

The policy needs the running model (routers and norms) and the post-attention residual r_l, which
the engine captures and passes as `LayerContext.residual` (`needs_residual`): the engine calls
`policy.bind(ctx)` (`needs_model`) when it attaches; it loads the predictor folder, checks its model
fingerprint and returns the function that releases it. Bind before the engine offloads the experts (the
adapters read the stacked expert tensors).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ..errors import ConfigError
from ..moe import get_adapter, residual_norm
from ..moe.sets import mass_mask
from .base import PREFETCH, BindContext, LayerContext, PrefetchPolicy, PrefetchRequest
from .prefetch import _on, make_gate

if TYPE_CHECKING:  # the predictors' package (and numba) stays out of the policies' import
    from ..predict.base import Runner


def _request_objects(keys: Any, priorities: list[float], confidences: list[float]) -> list[PrefetchRequest]:
    """PrefetchRequest(key, priority, confidence) of each triple, made without the frozen dataclass's `__init__`
    (which sets every field through `object.__setattr__`): the same objects (equal, same hash) at a third of
    the cost, for the few dozen a decode step's call returns."""
    new, out = object.__new__, []
    for key, pr, cf in zip(keys, priorities, confidences):
        r = new(PrefetchRequest)
        d = r.__dict__
        d["key"], d["priority"], d["confidence"] = key, pr, cf
        out.append(r)
    return out


_F32, _I64 = np.dtype(np.float32), np.dtype(np.int64)


def _host(x: torch.Tensor, dt: np.dtype) -> np.ndarray:
    """x as C-contiguous host numpy of dtype `dt`: a CPU tensor's own memory when it already is one (one torch call,
    `numpy()`), else converted."""
    try:
        a = x.numpy()
    except (TypeError, RuntimeError):  # on a GPU, bfloat16, or requiring grad
        a = x.detach().to("cpu", torch.float32 if dt is _F32 else torch.int64).numpy()
    return np.ascontiguousarray(a, dt)


@functools.cache
def _kernels() -> Any:
    """`moeflow.predict.kernels`, imported on first use (numba stays out of the policies' import)."""
    from ..predict import kernels

    return kernels


@functools.cache
def _source_batch() -> Any:
    """`moeflow.predict.data.SourceBatch`, imported on first use."""
    from ..predict.data import SourceBatch

    return SourceBatch


class LearnedPrefetch(PrefetchPolicy):
    """Shared mechanics: predictor loading, per-pass layer history, token context."""

    name: ClassVar[str] = ""
    predictor: ClassVar[str] = ""
    needs_router_input: ClassVar[bool] = True
    needs_residual: ClassVar[bool] = True
    needs_model: ClassVar[bool] = True

    def __init__(
        self,
        predictors: str | None = None,
        lookahead: int | None = None,
        overfetch: float = 1.0,
        mass: float | None = None,
        window: int | None = None,
        gate: Any = True,
        budget: Any = None,
        cancel: Any = True,
        weight: float = 1.0,
    ) -> None:
        self.gate = make_gate(gate, budget, cancel, weight)  # traffic-aware admission (policies.prefetch.PrefetchGate)
        if not predictors:
            raise ConfigError(
                f"prefetch policy {self.name!r} needs --prefetch-opt predictors=DIR (a folder written by `moeflow train`)"
            )
        if lookahead is not None and lookahead < 1:
            raise ConfigError(f"{self.name} lookahead must be >= 1, got {lookahead}")
        if overfetch <= 0 or (mass is not None and not 0 < mass <= 1):
            raise ConfigError(f"{self.name}: overfetch must be > 0 and mass in (0, 1]")
        self.folder, self.lookahead, self.overfetch, self.mass = str(predictors), lookahead, overfetch, mass
        self.window = window
        self.model: torch.nn.Module | None = None
        self.pred: Any = None
        self._hist: dict[int, torch.Tensor] = {}
        self._pass = -1
        self._tokens: torch.Tensor | None = None  # [T,w] token context of the current pass
        self._hrows = np.zeros((0, 0), np.int64)  # [T,L*k] the pass's gate history as rank x E + expert
        self._targets: dict[tuple[int, int], np.ndarray] = {}  # (first target, S) -> the targets [S] int64
        self._hn = 0  # its columns filled so far
        self._nt = self._k = self._ntok = 0  # the pass's tokens, experts per token, token-context rows
        self._ib = np.zeros((2, 0), np.int64)  # `runner.requests`' output: (target, expert) [2,R] of a decode step
        self._fb = np.zeros((2, 0), np.float64)  # and (priority, confidence) [2,R]
        self._seq: list[int] = []  # token ids of the current prompt so far (batch 1)
        self.predict_s = 0.0  # time spent in propose on the model's thread (predictor overhead on the critical path)
        self.predict_decode_s = 0.0  # the part of it in decode steps (passes of one token)
        self.predict_decode_cpu_s = 0.0  # the model thread's CPU time in it (without the waits for a core under load)
        self.decode_passes = 0
        self.calls = 0
        self.fast: Runner | None = None  # the predictor's run-time path (`moeflow.predict.fast`), set by bind

    @property
    def horizon(self) -> int | None:
        """The bound predictor's trained S (`max_lookahead`): it predicts no further."""
        return int(self.pred.max_lookahead) if self.pred is not None else None

    # -- binding to the running model --
    def bind(self, ctx: BindContext) -> Callable[[], None]:
        from ..predict.io import load_predictors

        self.model = model = ctx.model
        _, preds = load_predictors(self.folder, model, [self.predictor])
        self.pred = preds[self.predictor]
        runner = getattr(self.pred, "runner", None)  # the learned predictors have one; pregate and the baselines not
        self.fast = runner() if runner is not None else None
        if self.fast is not None:
            self.fast.warm()  # compile (or load) a runner's kernel now, not in the first decode step
            self.fast.precompute(int(self.pred.max_lookahead))  # and stack its per-(layer, S) arrays for every S
        self._requests([0], np.ones((1, 1, 2), np.float32), 1)  # and the decode step's request kernel
        R = int(self.pred.max_lookahead) * ctx.adapter.spec.num_experts  # the most requests one decode step makes
        self._ib, self._fb = np.zeros((2, R), np.int64), np.zeros((2, R), np.float64)
        if self.window is None:
            self.window = getattr(self.pred, "window", 4)
        ad = get_adapter(model)
        for l in ad.moe_layers:  # r_l comes from the engine's hook on this norm: refuse a model without it
            residual_norm(ad, l, hint=f"prefetch policy {self.name!r} needs the residual r_l")
        return self.close

    def close(self) -> None:
        pass

    # -- per-pass state --
    def _begin(self, ctx: LayerContext) -> None:
        if ctx.pos.pass_id == self._pass:
            return
        self._pass = ctx.pos.pass_id
        self._hist = {}
        self.decode_passes += int(len(ctx.indices) == 1)
        ids = ctx.token_ids.reshape(-1).tolist() if ctx.token_ids is not None else []
        if len(ids) != 1:  # a prefill: a new prompt (batch 1)
            self._seq = []
        start = len(self._seq)
        self._seq.extend(ids)
        w = self.window or 1
        rows = [
            [-1] * max(0, w - (start + i + 1)) + self._seq[max(0, start + i + 1 - w) : start + i + 1] for i in range(len(ids))
        ]
        self._tokens = torch.tensor(rows, dtype=torch.long) if rows else None
        ind = ctx.indices  # [T,k]
        self._nt, self._k = int(ind.shape[0]), int(ind.shape[1])  # tokens of this pass, experts per token
        self._ntok = len(rows)
        self._hrows = np.empty((self._nt, len(ctx.moe_layers) * self._k), np.int64)  # [T,L*k] this pass's
        self._hn = 0  # history as rank x E + expert (`SourceBatch.history_rows`), filled layer by layer

    def _batch(self, ctx: LayerContext):
        """The SourceBatch of this layer. At a decode step its tensors are converted to host numpy once
        (`SourceBatch.arrays`: one `numpy()` per tensor and no other torch call, so the runner's compiled call touches
        no tensor); this layer's ids are appended to the pass's history rows."""
        ind, n, k = ctx.indices, self._hn, self._k  # [T,k]
        u, w, res = ctx.router_input, ctx.weights, ctx.residual
        ids = _host(ind, _I64)  # [T,k]
        arrays = None  # a decode step's, for a runner with a compiled call (a prefill's tensors stay on their device)
        if self._nt == 1 and res is not None and self.fast is not None and ids.shape == (1, k):
            arrays = (_host(res, _F32), _host(u, _F32), _host(w, _F32), ids)
        rows = None  # the history's rows: this layer's appended to the pass's buffer (no tensor converted per layer)
        if ctx.layer not in self._hist and n + k <= self._hrows.shape[1] and ids.shape[0] == self._nt:
            self._hn = n + k
            np.add(ids, ctx.moe_layers.index(ctx.layer) * ctx.num_experts, out=self._hrows[:, n : self._hn])
            rows = self._hrows[:, : self._hn]  # [T,c]
        self._hist[ctx.layer] = ind
        tokens = self._tokens if self._ntok == self._nt else None
        return _source_batch()(
            ctx.layer,
            u if u.dtype is torch.float32 else u.float(),
            ind,
            w if w.dtype is torch.float32 else w.float(),
            residual=res,
            token_ctx=tokens,
            history=dict(self._hist),
            route=ctx.predict_logits,
            history_rows=rows,
            arrays=arrays,
        )

    def _submit(self, ctx: LayerContext, batch: Any) -> None:
        """Hook for asynchronous predictors: start work for later layers from this layer's batch."""

    def scores(self, target: int, s: int, batch: Any) -> torch.Tensor:
        return self.pred.predict(target, s, batch)

    def step_scores(self, targets: list[int], batch: Any) -> np.ndarray:
        """[S,T,E] scores of the targets l+1..l+S: the predictor's runner in ONE call when it has one
        (`moeflow.predict.fast`), else `scores` per target."""
        if self.fast is not None:
            return self.fast.scores(batch, len(targets))
        with torch.no_grad():
            return np.stack([self.scores(t, s, batch).float().cpu().numpy() for s, t in enumerate(targets, start=1)])

    def _target_array(self, targets: list[int]) -> np.ndarray:
        """The targets as the request kernels' int64 array [S], kept per (first target, S)."""
        tga = self._targets.get((targets[0], len(targets)))
        if tga is None:
            tga = self._targets[(targets[0], len(targets))] = np.asarray(targets, np.int64)
        return tga

    def _decode_requests(self, targets: list[int], batch: Any, k: int, E: int) -> list[PrefetchRequest] | None:
        """A decode step's requests from ONE compiled call of the runner (`runner.requests`: its kernel and
        `decode_requests` together, no scores handed back): what `_requests(targets, step_scores(...), k)` gives;
        None without a runner or when this call does not run compiled (then the scores path runs)."""
        if self.fast is None:
            return None
        S, m = len(targets), min(E, max(1, round(k * self.overfetch)))
        if self._ib.shape[1] < S * m:  # the kernel's output buffers, grown to the largest call so far
            self._ib, self._fb = np.zeros((2, S * m), np.int64), np.zeros((2, S * m), np.float64)
        n = self.fast.requests(batch, S, m, self._target_array(targets), float(k), self._ib, self._fb)
        if n is None:
            return None
        (tg, ex), (pr, cf) = self._ib[:, :n].tolist(), self._fb[:, :n].tolist()
        return _request_objects(zip(tg, ex), pr, cf)

    def _requests(self, targets: list[int], sc: np.ndarray, k: int) -> list[PrefetchRequest]:
        """The prefetch requests of scores sc [S,T,E]: each target's selected experts (top round(k x overfetch)
        or the `mass` set, per token), priority nearer target first then by probability, confidence k x p.
        No loop per target or expert in Python: a decode step (T = 1) selects, orders and scores its few requests in
        one compiled call (`moeflow.predict.kernels.decode_requests`); more tokens are reduced over T in numpy."""
        S, T, E = sc.shape
        m = min(E, max(1, round(k * self.overfetch)))
        if self.mass is None and T == 1:  # a decode step: one compiled call orders them, then only the objects
            tga = self._target_array(targets)
            sc32 = sc if sc.dtype == np.float32 and sc.flags.c_contiguous else np.ascontiguousarray(sc, np.float32)
            tg, ex, pr, cf = _kernels().decode_requests(sc32, m, tga, float(k))
            return _request_objects(zip(tg.tolist(), ex.tolist()), pr.tolist(), cf.tolist())
        flat = np.asarray(sc, dtype=np.float32).reshape(S * T, E)  # [S*T,E]
        tot = np.maximum(np.add.reduce(flat, -1, keepdims=True), np.float32(1e-12))  # [S*T,1]
        p = flat / tot  # [S*T,E]
        if self.mass is not None:
            mask = mass_mask(torch.from_numpy(p), self.mass).numpy()  # [S*T,E]
            best = np.where(mask, p, np.float32(-1.0)).reshape(S, T, E).max(1)  # [S,E] best probability per target
        else:
            rows = np.arange(S * T)[:, None]  # [S*T,1]
            top = np.argpartition(-flat, m - 1, axis=-1)[:, :m]  # [S*T,m] top m per row
            pm = np.full((S * T, E), np.float32(-1.0))
            pm[rows, top] = p[rows, top]
            best = pm.reshape(S, T, E).max(1)  # [S,E]
        ti, ei = np.nonzero(best >= 0.0)  # target rank (nearest first), expert ascending: the reference order
        b = best[ti, ei].astype(np.float64)  # [R]
        prio = (S - ti) + b  # [R] nearer target first, then by probability
        conf = np.clip(k * b, 0.0, 1.0)  # `topk_confidence`, vectorised
        order = np.argsort(-prio, kind="stable")
        tg = np.asarray(targets)[ti[order]].tolist()
        return [
            PrefetchRequest((t, e), priority=pr, confidence=c)
            for t, e, pr, c in zip(tg, ei[order].tolist(), prio[order].tolist(), conf[order].tolist())
        ]

    def propose(self, ctx: LayerContext) -> list[PrefetchRequest]:
        if self.pred is None:
            raise ConfigError(
                f"prefetch policy {self.name!r} was not bound to the model; the engine must call policy.bind(ctx) on attach"
            )
        t0, c0 = time.perf_counter(), time.thread_time()
        self._begin(ctx)
        steps = min(self.lookahead or ctx.lookahead, self.pred.max_lookahead)
        targets = ctx.next_layers(steps)
        batch = self._batch(ctx)
        self._submit(ctx, batch)
        out = None
        decode = self._nt == 1
        if targets and self.mass is None and decode:  # a decode step: the runner's one call
            out = self._decode_requests(targets, batch, ctx.top_k, ctx.num_experts)
        if out is None:
            out = self._requests(targets, self.step_scores(targets, batch), ctx.top_k) if targets else []
        dt = time.perf_counter() - t0
        self.predict_s += dt
        if decode:
            self.predict_decode_s += dt
            self.predict_decode_cpu_s += time.thread_time() - c0
        self.calls += 1
        return out


@PREFETCH.register
class RouterPFPrefetch(LearnedPrefetch):
    name: ClassVar[str] = "router-pf"
    predictor: ClassVar[str] = "router-pf"
    speculates: ClassVar[bool] = True


@PREFETCH.register
class EstimatorPrefetch(LearnedPrefetch):
    name: ClassVar[str] = "estimator"
    predictor: ClassVar[str] = "estimator"
    speculates: ClassVar[bool] = True


@PREFETCH.register
class HybridPrefetch(LearnedPrefetch):
    name: ClassVar[str] = "hybrid"
    predictor: ClassVar[str] = "hybrid"
    speculates: ClassVar[bool] = True


@PREFETCH.register
class TokenIdPrefetch(LearnedPrefetch):
    """The token-id baseline: the most frequent experts of each target layer for the current token id
    (a table lookup; global frequency for an unseen id or without token ids)."""

    name: ClassVar[str] = "token-id"
    predictor: ClassVar[str] = "token-id"


@PREFETCH.register
class ForestPrefetch(LearnedPrefetch):
    """One forest call per MoE layer for its targets l+1..l+S on the model's thread (features in numpy, the trees in
    a compiled kernel). `worker=on`: ExpertFlow's asynchronous dual mode instead: the call for every later layer
    the forest knows runs in a worker thread, and a target's scores come from the prediction cache when a
    prediction for (token sequence, target, any S) is ready, else from the pre-gate (its top-k)."""

    name: ClassVar[str] = "forest"
    predictor: ClassVar[str] = "forest"

    def __init__(
        self,
        predictors: str | None = None,
        lookahead: int | None = None,
        overfetch: float = 1.0,
        mass: float | None = None,
        window: int | None = None,
        gate: Any = True,
        budget: Any = None,
        cancel: Any = True,
        weight: float = 1.0,
        worker: Any = False,
    ) -> None:
        super().__init__(predictors, lookahead, overfetch, mass, window, gate, budget, cancel, weight)
        self.worker = _on(worker, "forest worker")

    def bind(self, ctx: BindContext) -> Callable[[], None]:
        from ..predict.forest_async import AsyncForest

        unbind = super().bind(ctx)
        if self.worker:
            self.runner = AsyncForest(self.pred)
            self.fast = None  # `step_scores` below: the prediction cache, else the pre-gate
        self._now: tuple[list, np.ndarray] = ([], np.zeros((0, 0, 0), np.float32))
        return unbind

    def close(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()

    def _keys(self, batch: Any) -> list:
        if batch.token_ctx is None:
            return [None] * batch.t
        return [tuple(r) for r in batch.token_ctx.tolist()]

    def _submit(self, ctx: LayerContext, batch: Any) -> None:
        # with the worker: ONE forest call serves this layer, every later layer the forest knows, grouped by
        # (tokens, S); the pre-gate probabilities of those layers (one product with the stacked routers) are the fallback
        if not self.worker:
            return
        keys = self._keys(batch)
        targets = ctx.next_layers(self.pred.max_lookahead)
        probs = self.runner.fast.probs(batch, targets)  # [P,T,E]
        self._now = (keys, probs)
        if targets and keys[0] is not None:
            self.runner.submit_group([(t, s) for s, t in enumerate(targets, start=1)], batch, keys, probs)

    def step_scores(self, targets: list[int], batch: Any) -> np.ndarray:
        if not self.worker:
            return super().step_scores(targets, batch)
        keys, probs = self._now  # targets are the first len(targets) layers `_submit` saw
        if keys[0] is None:
            return probs[: len(targets)]
        return np.stack([self.runner.lookup(t, keys, probs[i].__array__) for i, t in enumerate(targets)])
