"""Routing policies: change which experts a layer selects, or the order the engine computes them in.

The runtime engine applies them in its router hook; the simulator replays recorded routing and ignores them.

| name | effect | exact |
|---|---|---|
| standard | none: the router's own choice (SpecMD "Standard") | yes |
| cache-aware | SpecMD eq. 1, z' = z + lambda * D_avg * 1_C selects, z weights (dual-logit) | no |
| hit-first | ExpertFlow 3.4: resident experts' rows computed while the misses load | yes |
| plan-restricted | CasMoE restricted mode: only a prompt's planned experts can be chosen (`--plan casmoe`) | no |

D_avg: this layer's running mean over tokens of (mean top-k logit - mean other logit). Misses are
demand copies, which the link schedules ahead of every queued prefetch (moeflow.runtime.link).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .base import ROUTING, ExpertKey, RoutingPolicy

FORCE = 1e4  # added to the selection score of the experts z' chose, so the original scores select exactly them


@ROUTING.register
class Standard(RoutingPolicy):
    """Unmodified routing: `bias` is always None."""

    name: ClassVar[str] = "standard"
    changes_output = False
    reroutes: ClassVar[bool] = False

    def bias(self, layer: int, num_experts: int, resident: Callable[[ExpertKey], bool]) -> torch.Tensor | None:
        return None


@ROUTING.register
class CacheAware(RoutingPolicy):
    """SpecMD eq. 1 (Skliar et al. 2025): boost resident experts' logits by lambda * D_avg.

    D_avg, "the historical average logit value", is taken as the running mean (all tokens this layer has
    routed, the current ones included) of the gap between a token's mean top-k logit and its mean other
    logit: lambda = 1 lifts a resident expert by one typical chosen-vs-rest gap. Kept on the device (no
    host read). Option `lambda` (or `lam`), default 0.3."""

    name: ClassVar[str] = "cache-aware"
    changes_output = True  # per instance: lambda = 0 never changes routing (exact)
    reroutes: ClassVar[bool] = True
    dual_logits: ClassVar[bool] = True

    def __init__(self, lam: float = 0.3, **opts: Any):
        extra = set(opts) - {"lambda"}
        if extra:
            raise TypeError(f"unknown option(s) {sorted(extra)}; cache-aware takes lambda")
        self.lam = float(opts.get("lambda", lam))
        if self.lam < 0:
            raise ValueError("lambda must be >= 0")
        self.changes_output = self.lam != 0
        self._gap: dict[int, tuple[torch.Tensor, int]] = {}  # layer -> (summed gaps, tokens)

    def delta_avg(self, layer: int, logits: torch.Tensor, top_k: int) -> torch.Tensor:
        """Update and return this layer's D_avg (0-dim tensor) with logits [T,E]."""
        z = logits.float()
        top = torch.topk(z, top_k, dim=-1).values.sum(-1)  # [T]
        E = z.shape[-1]
        gap = top / top_k - (z.sum(-1) - top) / max(1, E - top_k)  # [T]
        s, n = self._gap.get(layer, (torch.zeros((), device=z.device), 0))
        s, n = s + gap.sum(), n + gap.numel()
        self._gap[layer] = (s, n)
        return s / n

    def select_logits(
        self, layer: int, logits: torch.Tensor, resident: Callable[[ExpertKey], bool], top_k: int
    ) -> torch.Tensor | None:
        """z' [T,E] = z + lambda * D_avg * 1_C (float32), or None when lambda is 0 or nothing is resident."""
        z = logits.reshape(-1, logits.shape[-1]).float()
        d = self.delta_avg(layer, z, top_k)
        E = z.shape[-1]
        cached = [resident((layer, e)) for e in range(E)]
        if self.lam == 0 or not any(cached):
            return None
        ind = torch.tensor(cached, dtype=torch.float32, device=z.device)  # [E] 1_C
        return z + self.lam * d * ind


def dual_select(select: Callable[..., tuple[torch.Tensor, torch.Tensor]], layer: int, logits: torch.Tensor, z2: torch.Tensor):
    """Dual-logit routing: the experts `select(layer, z2)` chooses, weighted as the family weights them from
    the original `logits` (an adapter's `select(layer, logits, bias)`: a bias of FORCE on the chosen ones
    makes the original scores select exactly them; weights come from the original scores)."""
    _, idx = select(layer, z2)
    force = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, idx, FORCE)
    return select(layer, logits, force)


@ROUTING.register
class HitFirst(RoutingPolicy):
    """ExpertFlow 3.4: exact; the engine computes resident experts' rows before waiting for the misses."""

    name: ClassVar[str] = "hit-first"
    changes_output = False
    reroutes: ClassVar[bool] = False
    hit_first: ClassVar[bool] = True

    def bias(self, layer: int, num_experts: int, resident: Callable[[ExpertKey], bool]) -> torch.Tensor | None:
        return None


@ROUTING.register
class PlanRestricted(RoutingPolicy):
    """CasMoE's restricted mode: each layer selects its top-k among the experts the prompt-level plan allowed
    (`set_allowed`; `moeflow.plan.run`); the others' logits are -inf for selection. `renorm` (default, as
    CasMoE) weights the chosen experts as the family does over the allowed experts only (a softmax family's
    denominator is the allowed set); `renorm=false` keeps the model's own weights of the chosen experts
    (dual-logit). Without a plan (`allowed` None) routing is the router's own. Set through
    `moeflow run --plan casmoe --plan-opt mode=restricted`, not `--routing`."""

    name: ClassVar[str] = "plan-restricted"
    changes_output = True
    reroutes: ClassVar[bool] = True
    dual_logits: ClassVar[bool] = True

    def __init__(self, renorm: bool | str = True, **opts: Any):
        if opts:
            raise TypeError(f"unknown option(s) {sorted(opts)}; plan-restricted takes renorm")
        self.renorm = renorm if isinstance(renorm, bool) else str(renorm).lower() in ("1", "true", "yes")
        self.allowed: dict[int, torch.Tensor] | None = None  # layer -> bool [E]
        self._on: dict[tuple[int, str], torch.Tensor] = {}

    def set_allowed(self, allowed: dict[int, list[int]] | None, num_experts: int) -> None:
        """layer -> allowed expert ids (each layer at least top-k of them), or None for unrestricted routing."""
        self._on = {}
        if allowed is None:
            self.allowed = None
            return
        self.allowed = {}
        for l, ids in allowed.items():
            m = torch.zeros(num_experts, dtype=torch.bool)
            m[list(ids)] = True
            self.allowed[l] = m

    def select_logits(
        self, layer: int, logits: torch.Tensor, resident: Callable[[ExpertKey], bool], top_k: int
    ) -> torch.Tensor | None:
        """Logits [T,E] (their dtype) with -inf on the experts the plan did not allow, or None (no plan)."""
        if self.allowed is None or layer not in self.allowed:
            return None
        z = logits.reshape(-1, logits.shape[-1])
        key = (layer, str(z.device))
        m = self._on.get(key)
        if m is None:
            m = self._on[key] = self.allowed[layer].to(z.device)
        return z.masked_fill(~m, float("-inf"))
