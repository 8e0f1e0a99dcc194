"""Prefetch policies: after MoE layer l has routed, which experts of later layers to load now.

| name | proposes | source |
|---|---|---|
| none | nothing (demand paging) | - |
| pregate | layer l+s's own router applied to layer l's router input, s = 1..S | pre-gating (ExpertFlow 3.2, SpecMD 3.1.4) |
| all-next-layer | every expert of the next MoE layer(s) | SE-MoE style (SpecMD/CasMoE baselines) |

Priorities: nearer layers first (S - s + 1 per layer), then higher predicted probability, so the
cache issues the most urgent and most likely loads first. Every request carries a confidence p, the
predictor's probability that the expert is routed when its layer runs (`topk_confidence`).

pregate selects per token the top-k x overfetch experts, or by a score percentile or a cumulative mass.

Traffic-aware prefetch (`PrefetchGate`): every prefetch policy's proposals go through ONE admission
decision, the policy's `gate`, which the cache (`ExpertCache.prefetch`, runtime and simulator alike) asks
for each proposal that is not resident, in priority order. Options of every prefetch policy
(`--prefetch-opt`): `gate=on|off` (default on for pregate and the learned policies, off for
all-next-layer), `cancel=on|off` (default on: drop queued stale prefetches when their layer routes),
`budget=auto|BYTES` (default none: bytes per source layer), `weight=1.0` (cost multiplier), `victim=on|off`
(default off: also refuse a copy whose victim the eviction policy expects to be used sooner than the proposal).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ..errors import ConfigError
from ..moe.sets import mass_mask, topk_mask
from .base import PREFETCH, ExpertKey, LayerContext, Position, PrefetchPolicy, PrefetchRequest


def topk_confidence(prob: float, k: int) -> float:
    """P(routed) of an expert from its normalised score `prob` (sums to 1 over experts) under top-k routing:
    k x prob, capped at 1 (k experts are routed, so the probabilities of being routed sum to k)."""
    return min(1.0, max(0.0, k * prob))


def _on(v: Any, what: str) -> bool:
    if isinstance(v, bool):
        return v
    low = str(v).strip().lower()
    if low in ("on", "true", "1", "yes"):
        return True
    if low in ("off", "false", "0", "no", "none"):
        return False
    raise ConfigError(f"prefetch option {what}={v!r}: use on or off")


class PrefetchGate:
    """Admission of prefetch copies by expected gain against link cost; the one place every prefetch decides.

    Per proposal (not resident, priority order) with confidence p, one expert's copy time t_x (the link's
    bandwidth model, `Link.transfer_estimate_s`; measured on CUDA), the link's backlog b (queued link
    seconds, `Link.backlog_s`, re-read after every admitted copy) and the lead time until the target layer
    runs, d x T_layer (d = MoE layers ahead, T_layer the wall time between consecutive layers' prefetch
    calls, measured on the link's clock, EMA):

        late  = max(0, b + t_x - d x T_layer)   (b when T_layer is not known yet)
        gain  = p x max(0, t_x - late)          the demand stall the copy avoids if the prediction is right
        cost  = weight x (1 - p) x t_x          the link time a wrong copy occupies (later demand loads
                                                and better prefetches wait for it) and the victim it evicts
        admit iff gain > cost                    (with no estimate of t_x, e.g. a direct link: admit)

    So on an idle link a copy needs p > 1/2 (weight 1), and as the backlog grows only higher confidences
    pass until, once a copy cannot land before its layer runs, nothing does. `budget` caps the copies per
    prefetch call (one source layer): BYTES, or `auto` = the bytes the link moves while one layer runs
    (t_x and T_layer above, i.e. the calibration's bandwidth x per-layer time). `cancel`: the cache drops
    prefetches of a layer that are still queued when that layer routes to other experts.
    `enabled=False` (`gate=off`) admits every proposal (the budget, if set, still applies).

    Victim-aware (`victim=on`): once a copy is admitted and the cache must evict for it, the cache asks
    `keep_victim` with the victim the eviction policy chose; the copy is refused (and the victim stays) when
    the policy expects the victim to be used no later than the proposal: reuse_steps(victim) <=
    reuse_steps(proposal, p), both the policy's expected MoE layer steps to the next use
    (`EvictionPolicy.reuse_steps`; the proposal's with p1 = its confidence p). A policy that predicts no
    next use (None: lru, lfu, ...) keeps today's decision. Link-independent, so it also applies with `gate=off`.
    """

    def __init__(
        self, enabled: Any = True, *, budget: Any = None, cancel: Any = True, weight: float = 1.0, victim: Any = False
    ) -> None:
        self.enabled = _on(enabled, "gate")
        self.cancel_stale = _on(cancel, "cancel")
        self.victim = _on(victim, "victim")
        if weight < 0:
            raise ConfigError(f"prefetch gate weight must be >= 0, got {weight}")
        self.weight = float(weight)
        if budget is not None and not (isinstance(budget, str) and budget.lower() == "auto"):
            try:
                budget = int(float(budget))
            except ValueError:
                raise ConfigError(f"prefetch budget={budget!r}: use auto or a number of bytes per layer") from None
            if budget < 0:
                raise ConfigError(f"prefetch budget must be >= 0 bytes, got {budget}")
        self.budget: int | str | None = budget.lower() if isinstance(budget, str) else budget
        self.layer_s: float | None = None  # EMA of the wall time between consecutive MoE layers' prefetch calls
        self._last: tuple[int, int, float] | None = None  # (pass, layer rank, clock) of the last call
        self._link: Any = None
        self._tx: float | None = None
        self._left: int | None = None  # copies still allowed in this call (budget)
        self.admitted = self.refused = 0
        self.victim_refused = 0  # copies refused by `keep_victim` (also counted in `refused`)

    def begin(self, link: Any, expert_bytes: int, pass_id: int, rank: int) -> None:
        """A prefetch call after MoE layer `rank` of pass `pass_id` routed: read the link's state."""
        now = link.clock_s()
        last = self._last
        if last is not None and last[0] == pass_id and rank > last[1] and now > last[2]:
            dt = (now - last[2]) / (rank - last[1])
            self.layer_s = dt if self.layer_s is None else 0.7 * self.layer_s + 0.3 * dt
        self._last = (pass_id, rank, now)
        self._link = link
        self._tx = link.transfer_estimate_s(expert_bytes)
        if self.budget is None:
            self._left = None
        elif self.budget == "auto":
            tx, ls = self._tx, self.layer_s
            self._left = max(1, math.floor(ls / tx)) if tx and ls else None
        else:
            self._left = int(self.budget) // max(1, expert_bytes)

    def admit(self, req: PrefetchRequest, distance: int) -> bool:
        """Issue `req` (its layer `distance` MoE layers ahead of the source)?"""
        ok = self._left is None or self._left > 0
        tx = self._tx
        if ok and self.enabled and tx is not None and tx > 0:
            p = min(1.0, max(0.0, float(req.confidence)))
            backlog = self._link.backlog_s()
            ls = self.layer_s
            late = backlog if ls is None else max(0.0, backlog + tx - max(1, distance) * ls)
            ok = p * max(0.0, tx - late) > self.weight * (1.0 - p) * tx
        if ok:
            self.admitted += 1
            if self._left is not None:
                self._left -= 1
        else:
            self.refused += 1
        return ok

    def keep_victim(self, eviction: Any, req: PrefetchRequest, victim: ExpertKey, pos: Position) -> bool:
        """`victim=on`, after `admit(req)`: refuse the copy (True: keep `victim`, evict nothing) when `eviction`
        expects `victim` to be used no later than `req.key`; a refusal undoes the admission's counts."""
        reuse = getattr(eviction, "reuse_steps", None)
        if reuse is None:
            return False
        tv = reuse(victim, pos)
        tk = reuse(req.key, pos, p=min(1.0, max(0.0, float(req.confidence)))) if tv is not None else None
        if tv is None or tk is None or tk < tv:
            return False
        self.admitted -= 1
        self.refused += 1
        self.victim_refused += 1
        if self._left is not None:
            self._left += 1
        return True

    def quota(self) -> int | None:
        """After `begin`, when no admission of this call depends on the link (gate off, or no transfer estimate)
        nor on the victims (`victim` off): how many proposals it admits, in priority order (-1: every one); None:
        ask `admit` for each."""
        if self.victim or (self.enabled and self._tx is not None and self._tx > 0):
            return None
        return -1 if self._left is None else max(0, self._left)

    def count(self, admitted: int, refused: int) -> None:
        """Account a call decided by `quota` (as `admit` would have, proposal by proposal)."""
        self.admitted += admitted
        self.refused += refused
        if self._left is not None:
            self._left -= admitted


def make_gate(gate: Any = True, budget: Any = None, cancel: Any = True, weight: float = 1.0, victim: Any = False) -> PrefetchGate:
    return PrefetchGate(gate, budget=budget, cancel=cancel, weight=weight, victim=victim)


def _steps(ctx: LayerContext, lookahead: int | None) -> list[int]:
    return ctx.next_layers(lookahead if lookahead is not None else ctx.lookahead)


@PREFETCH.register
class NoPrefetch(PrefetchPolicy):
    """Demand paging: never prefetch."""

    name: ClassVar[str] = "none"
    proposes: ClassVar[bool] = False

    def propose(self, ctx: LayerContext) -> list[PrefetchRequest]:
        return []


@PREFETCH.register
class PreGatePrefetch(PrefetchPolicy):
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
    needs_router_input: ClassVar[bool] = True

    def __init__(
        self,
        overfetch: float = 1.0,
        percentile: float | None = None,
        mass: float | None = None,
        lookahead: int | None = None,
        history: int = 4096,
        gate: Any = True,
        budget: Any = None,
        cancel: Any = True,
        weight: float = 1.0,
        victim: Any = False,
    ) -> None:
        self.gate = make_gate(gate, budget, cancel, weight, victim)
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
            best = probs.masked_fill(~mask, -1.0).amax(0)  # [E] best selected prob, -1 where no token selected e
            near = float(len(targets) - s)
            k = ctx.top_k
            for e, b in enumerate(best.tolist()):  # one device read per target layer
                if b >= 0.0:
                    out.append(PrefetchRequest((t, e), priority=near + b, confidence=topk_confidence(b, k)))
        out.sort(key=lambda r: -r.priority)
        return out


@PREFETCH.register
class AllNextLayer(PrefetchPolicy):
    """Prefetch every expert of the next MoE layer (or the next `lookahead` layers): recall 1, precision k/E."""

    name: ClassVar[str] = "all-next-layer"

    def __init__(
        self,
        lookahead: int = 1,
        gate: Any = False,
        budget: Any = None,
        cancel: Any = True,
        weight: float = 1.0,
        victim: Any = False,
    ) -> None:
        if lookahead < 1:
            raise ConfigError(f"all-next-layer lookahead must be >= 1, got {lookahead}")
        self.lookahead = lookahead
        self.gate = make_gate(gate, budget, cancel, weight, victim)

    def propose(self, ctx: LayerContext) -> list[PrefetchRequest]:
        targets = ctx.next_layers(self.lookahead)
        p = min(1.0, ctx.top_k / max(1, ctx.num_experts))
        return [
            PrefetchRequest((t, e), priority=float(len(targets) - s), confidence=p)
            for s, t in enumerate(targets)
            for e in range(ctx.num_experts)
        ]
