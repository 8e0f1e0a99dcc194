"""Prefetch policies: after MoE layer l has routed, which experts of later layers to load now.

| name | proposes | source |
|---|---|---|
| none | nothing (demand paging) | - |
| pregate | layer l+s's own router applied to layer l's router input, s = 1..S | pre-gating (ExpertFlow 3.2, SpecMD 3.1.4) |
| all-next-layer | every expert of the next MoE layer(s) | SE-MoE style (SpecMD/CasMoE baselines) |

Priorities: nearer layers first (S - s + 1 per layer), then higher predicted probability, so the
cache issues the most urgent and most likely loads first.

pregate selects per token the top-k x overfetch experts, or by a score percentile or a cumulative mass.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..errors import ConfigError
from ..moe.sets import mass_mask, topk_mask
from .base import PREFETCH, LayerContext, PrefetchRequest


def _steps(ctx: LayerContext, lookahead: int | None) -> list[int]:
    return ctx.next_layers(lookahead if lookahead is not None else ctx.lookahead)


@PREFETCH.register
class NoPrefetch:
    """Demand paging: never prefetch."""

    name: ClassVar[str] = "none"

    def propose(self, ctx: LayerContext) -> list[PrefetchRequest]:
        return []


@PREFETCH.register
class PreGatePrefetch:
    """`pregate`: apply the router of MoE layer l+s (s = 1..S) to this layer's router input and prefetch its choice.

    Exactly one selection rule:
    - `overfetch` (default 1.0): per token, the top round(k * overfetch) experts (SpecMD's top-k x factor);
    - `percentile` (0-100, e.g. 80): per token, experts whose softmax score is at or above the given
      percentile of the target layer's score history (every score this policy has predicted for that
      layer so far, this call included). With T=1 and no history it keeps the top (100-p)% of experts;
      as history grows the threshold is fixed per layer, so confident layers prefetch more and flat
      ones fewer (SpecMD 3.1.4 "score-based", after Zhu et al.);
    - `mass` (0-1, e.g. 0.9): per token, experts in descending score until their cumulative probability
      reaches `mass` (ExpertFlow 3.2.1's expected-activation count).
    The union over the tokens of the pass is proposed. `lookahead` overrides the context's S.
    """

    name: ClassVar[str] = "pregate"

    def __init__(
        self,
        overfetch: float = 1.0,
        percentile: float | None = None,
        mass: float | None = None,
        lookahead: int | None = None,
        history: int = 4096,
    ) -> None:
        if overfetch <= 0:
            raise ConfigError(f"pregate overfetch must be > 0, got {overfetch}")
        if percentile is not None and not 0 <= percentile < 100:
            raise ConfigError(f"pregate percentile must be in [0, 100), got {percentile}")
        if mass is not None and not 0 < mass <= 1:
            raise ConfigError(f"pregate mass must be in (0, 1], got {mass}")
        if percentile is not None and mass is not None:
            raise ConfigError("pregate takes percentile or mass, not both")
        if lookahead is not None and lookahead < 1:
            raise ConfigError(f"pregate lookahead must be >= 1, got {lookahead}")
        self.overfetch, self.percentile, self.mass = overfetch, percentile, mass
        self.lookahead = lookahead
        self.history = history
        self._scores: dict[int, torch.Tensor] = {}  # target layer -> recent predicted scores [n]

    def _threshold(self, layer: int, probs: torch.Tensor, percentile: float) -> float:
        h = torch.cat([self._scores.get(layer, probs.new_zeros(0)), probs.flatten()])[-self.history :]
        self._scores[layer] = h
        return float(torch.quantile(h.float(), percentile / 100.0))

    def _select(self, layer: int, probs: torch.Tensor, k: int) -> torch.Tensor:
        """Boolean mask [T,E] of the experts to prefetch for `layer` from predicted probs [T,E]."""
        E = probs.shape[1]
        if self.percentile is not None:
            return probs >= self._threshold(layer, probs, self.percentile)
        if self.mass is not None:
            return mass_mask(probs, self.mass)
        return topk_mask(probs, min(E, max(1, round(k * self.overfetch))))

    def propose(self, ctx: LayerContext) -> list[PrefetchRequest]:
        targets = _steps(ctx, self.lookahead)
        out: list[PrefetchRequest] = []
        for s, t in enumerate(targets):
            with torch.no_grad():
                probs = ctx.predict_logits(t, ctx.router_input).float().softmax(-1)  # [T,E]
            mask = self._select(t, probs, ctx.top_k)  # [T,E]
            best = probs.masked_fill(~mask, -1.0).amax(0)  # [E]
            near = float(len(targets) - s)
            for e in mask.any(0).nonzero().flatten().tolist():
                out.append(PrefetchRequest((t, e), priority=near + float(best[e])))
        out.sort(key=lambda r: -r.priority)
        return out


@PREFETCH.register
class AllNextLayer:
    """Prefetch every expert of the next MoE layer (or the next `lookahead` layers): recall 1, precision k/E."""

    name: ClassVar[str] = "all-next-layer"

    def __init__(self, lookahead: int = 1) -> None:
        if lookahead < 1:
            raise ConfigError(f"all-next-layer lookahead must be >= 1, got {lookahead}")
        self.lookahead = lookahead

    def propose(self, ctx: LayerContext) -> list[PrefetchRequest]:
        targets = ctx.next_layers(self.lookahead)
        return [
            PrefetchRequest((t, e), priority=float(len(targets) - s))
            for s, t in enumerate(targets)
            for e in range(ctx.num_experts)
        ]
