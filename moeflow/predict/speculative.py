"""Speculative execution (Speculating Experts, section 4): run the experts predicted one MoE layer
ahead instead of the router's own choice, and measure what that costs in quality.

`speculative_routing(model, predictor)` installs router hooks: when MoE layer l routes, the hook
stores the predictor's scores for the next MoE layer (computed from layer l's true router output,
as in the paper's Algorithm 1, line 7); when that next layer routes, its (weights, indices) are
replaced by the family's own selection rule applied to the predicted scores (log-probabilities as
logits). The first MoE layer keeps its router. A forward pre-hook on each MoE layer's
`post_attention_layernorm` captures the residual r_l the quasi-hidden state needs.
This is LOSSY by design: `moeflow.quality.speculative.measure_quality` reports greedy (argmax) agreement
and perplexity against the same model with its own routing, teacher-forced on token sequences.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..moe import RouterEvent, get_adapter, residual_hooks, router_hooks
from .data import SourceBatch


@contextlib.contextmanager
def speculative_routing(
    model: torch.nn.Module, predictor: Any, *, stats: dict | None = None, engine: Any = None, adapter: Any = None
) -> Iterator[dict]:
    """Replace each MoE layer's routing (after the first) by the prediction made one layer earlier.

    The hooks are prepended, so an `OffloadEngine`'s router hooks (registered before or after) see the
    speculated experts and load those. With `engine`, the predictor's router calls are flagged as
    predictions (`engine._predicting`) so the engine ignores them; pass `adapter` (made before the engine
    offloaded the experts) when the model is already offloaded.
    """
    ad = adapter or get_adapter(model)
    ml = ad.moe_layers
    state: dict[str, Any] = {"pending": {}, "busy": False}
    stats = stats if stats is not None else {}
    stats.setdefault("replaced", 0)
    stats.setdefault("agree", 0.0)
    resid: dict[int, torch.Tensor] = {}  # MoE layer -> its post-attention residual [T,H], this pass

    def route(layer: int, x: torch.Tensor) -> torch.Tensor:
        state["busy"] = True
        if engine is not None:
            engine._predicting = True
        try:
            return ad.router_logits(layer, x)
        finally:
            state["busy"] = False
            if engine is not None:
                engine._predicting = False

    def on_route(ev: RouterEvent):
        if state["busy"] or (engine is not None and getattr(engine, "_predicting", False)):
            return None  # a router call made by a predictor, not the layer's routing
        l = ev.layer
        r = ml.index(l)
        replaced = None
        pred = state["pending"].pop(l, None)
        if pred is not None and pred.shape[0] == ev.indices.shape[0]:
            logits = torch.log(pred.clamp(min=1e-12)).to(ev.logits.dtype)  # [T,E]
            w, idx = ad.select(l, logits)
            stats["replaced"] += 1
            stats["agree"] += float((idx.sort(-1).values == ev.indices.sort(-1).values).all(-1).float().mean())
            replaced = (ev.logits, w.to(ev.weights.dtype), idx)
        if r + 1 < len(ml):
            b = SourceBatch(l, ev.x.float(), ev.indices, ev.weights.float(), residual=resid.get(l), route=route)
            state["pending"][ml[r + 1]] = predictor.predict(ml[r + 1], 1, b).float()
        resid.pop(l, None)
        return replaced

    with (
        residual_hooks(ad, resid.__setitem__, hint="speculative routing needs the residual r_l"),
        router_hooks(ad, on_route, prepend=True),
    ):
        yield stats
