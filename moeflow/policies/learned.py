"""Prefetch policies driven by trained predictors (`moeflow train`): router-pf, estimator, hybrid, forest, token-id.

| name | proposes for layers l+1..l+S | source |
|---|---|---|
| router-pf | router_{l+s}(quasi-hidden state q chained from layer l) | Speculating Experts 3 |
| estimator | the neural estimator's logits from q | Speculating Experts 6.1 |
| hybrid | estimator on the (layer, S) pairs where Router-PF was weak in training, else Router-PF | Speculating Experts 6.3 |
| forest | ExpertFlow's random-forest delta over pre-gate, evaluated asynchronously on CPU (see below) | ExpertFlow 3.2.2 |
| token-id | baseline: the experts most often routed for the current token id in the training trace | - |

Options (`--prefetch-opt key=value`): `predictors=DIR` (required: a `moeflow train` folder for this
model), `lookahead=S` (default: the engine's S), `overfetch=1.0` (top round(k*overfetch) per token)
or `mass=0.9` (experts in descending score up to that cumulative mass); the gate's `gate=on|off`,
`cancel=on|off`, `budget=auto|BYTES`, `weight=1.0` (`moeflow.policies.prefetch.PrefetchGate`, default on).

forest's predictions are cached per (token sequence, layer, S); until one is ready the policy uses pre-gate top-k.
One forest call per source layer serves all its targets l+1..l+S (`AsyncForest.submit_group`).

The policy needs the running model (routers and norms) and the post-attention residual r_l, which
the engine captures and passes as `LayerContext.residual` (`needs_residual`): the engine calls
`policy.bind(ctx)` (`needs_model`) when it attaches; it loads the predictor folder, checks its model
fingerprint and returns the function that releases it. Bind before the engine offloads the experts (the
adapters read the stacked expert tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..errors import ConfigError
from ..moe import get_adapter, residual_norm
from ..moe.sets import mass_mask, topk_mask
from .base import PREFETCH, BindContext, LayerContext, PrefetchPolicy, PrefetchRequest
from .prefetch import make_gate, topk_confidence


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
        self._seq: list[int] = []  # token ids of the current prompt so far (batch 1)
        self.predict_s = 0.0  # time spent in propose (predictor overhead)
        self.calls = 0

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

    def _batch(self, ctx: LayerContext):
        from ..predict.data import SourceBatch

        self._hist[ctx.layer] = ctx.indices
        tokens = self._tokens if self._tokens is not None and len(self._tokens) == len(ctx.indices) else None
        return SourceBatch(
            ctx.layer,
            ctx.router_input.float(),
            ctx.indices,
            ctx.weights.float(),
            residual=ctx.residual,
            token_ctx=tokens,
            history=dict(self._hist),
            route=ctx.predict_logits,
        )

    def _submit(self, ctx: LayerContext, batch: Any) -> None:
        """Hook for asynchronous predictors: start work for later layers from this layer's batch."""

    def scores(self, target: int, s: int, batch: Any) -> torch.Tensor:
        return self.pred.predict(target, s, batch)

    def _select(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        if self.mass is not None:
            return mass_mask(scores / scores.sum(-1, keepdim=True).clamp(min=1e-12), self.mass)
        return topk_mask(scores, min(scores.shape[1], max(1, round(k * self.overfetch))))

    def propose(self, ctx: LayerContext) -> list[PrefetchRequest]:
        import time

        if self.pred is None:
            raise ConfigError(
                f"prefetch policy {self.name!r} was not bound to the model; the engine must call policy.bind(ctx) on attach"
            )
        t0 = time.perf_counter()
        self._begin(ctx)
        steps = min(self.lookahead or ctx.lookahead, self.pred.max_lookahead)
        targets = ctx.next_layers(steps)
        batch = self._batch(ctx)
        self._submit(ctx, batch)
        out: list[PrefetchRequest] = []
        with torch.no_grad():
            for s, t in enumerate(targets, start=1):
                sc = self.scores(t, s, batch).float()  # [T,E]
                mask = self._select(sc, ctx.top_k)
                p = sc / sc.sum(-1, keepdim=True).clamp(min=1e-12)
                best = p.masked_fill(~mask, -1.0).amax(0)  # [E]
                near = float(len(targets) - s + 1)
                out += [
                    PrefetchRequest((t, e), priority=near + float(best[e]), confidence=topk_confidence(float(best[e]), ctx.top_k))
                    for e in mask.any(0).nonzero().flatten().tolist()
                ]
        out.sort(key=lambda r: -r.priority)
        self.predict_s += time.perf_counter() - t0
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
    """The forest runs in a worker thread; a target's scores come from the prediction cache when a
    prediction for (token sequence, target, any S) is ready, else from the pre-gate (its top-k)."""

    name: ClassVar[str] = "forest"
    predictor: ClassVar[str] = "forest"

    def bind(self, ctx: BindContext) -> Callable[[], None]:
        from ..predict.forest import AsyncForest
        from ..predict.pregate import PreGatePredictor

        unbind = super().bind(ctx)
        self.runner = AsyncForest(self.pred)
        self._pregate = PreGatePredictor(ctx.model)  # the fallback while a forest prediction is not ready
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
        # ONE forest call serves this layer: every later layer the forest knows, grouped by (tokens, S)
        keys = self._keys(batch)
        if keys and keys[0] is not None:
            pairs = [(t, s) for s, t in enumerate(ctx.next_layers(self.pred.max_lookahead), start=1)]
            self.runner.submit_group(pairs, batch, keys)

    def scores(self, target: int, s: int, batch: Any) -> torch.Tensor:
        keys = self._keys(batch)
        pre = lambda: self._pregate.predict(target, s, batch)  # noqa: E731
        if keys and keys[0] is None:
            return pre()
        return self.runner.lookup(target, keys, pre)
