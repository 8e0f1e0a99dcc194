"""Adaptive step size S (ExpertFlow 3.2.1-3.2.2, 3.3.2): how many MoE layers ahead to prefetch.

    S_formula = N_e * E_s / (C_s * T_l)      (`moeflow.runtime.stepsize.s_formula`)

- N_e: the expected number of experts per MoE layer that are NOT resident yet, i.e. what must cross the
  link per layer step. Measured per pass from the prefetch policy's proposals against the cache
  (`PassStats.predicted_new / moe_layers_run`, counted by the engine when a key is first proposed in the
  pass); without proposals, the transfers per layer. It is forecast for the next pass from ExpertFlow's
  semantic diversity Dist(t) (Sec. 2.2, Obs. III: Dist grows with expert demand): an exponentially
  weighted least-squares fit N_e ~ a + b Dist over past passes, evaluated at the Dist of the latest
  `dist_window` tokens (mean pairwise distance of their input embeddings, so the window size does not
  matter). Until a fit is possible the running mean of N_e is used; until a pass was seen, the
  calibration's `experts_per_layer` (top-k).
- E_s: bytes of one expert; C_s: link bytes / link busy seconds (EMA of observed transfers).
- T_l: compute of one MoE layer step without the engine's bookkeeping: `PassStats.compute_s` (the gaps
  between experts calls up to each router hook - attention, norms, router - plus each experts call less
  its demand loads and waits) / experts calls, on decode passes (EMA). Passes that report no compute
  time (other engines, synthetic stats) leave the calibration's `layer_time_s` in place.

Control law (replaces "bias = initial_S - ceil(formula), applied before clamping", which let S cycle
3 -> 1 -> 2 -> 3):
1. base = ceil(S_formula) clamped to [min_s, hi], moved only when the formula leaves the current integer
   by more than `hysteresis` (EMA noise at a boundary does not flip S);
2. hi = min(max_s, occupancy limit): the cache must hold the running layer's experts plus S layers'
   worth of predicted experts (`occupancy_limit(C, needed/layer, proposed/layer)`, ExpertFlow 3.3.2 (1));
   S is never raised past it;
3. S = clamp(base + bias, min_s, hi), the bias kept inside what can still move S (no wind-up);
4. feedback (ExpertFlow 3.2.2): copies that stalled (`late`: a prefetch still in flight when its layer
   needed it) count toward `stall_threshold` -> S + 1; wasted prefetches (`prefetch_unused_evicted`:
   evicted before any use) count toward `overfetch_threshold` -> S - 1. Counters reset when they fire;
5. settling: the controller remembers the decode-pass wall time it measured at each S (EMA, forgotten
   after `memory_passes`); a feedback move to an S measured slower than the current one by more than
   `cost_margin` is refused. So S cannot cycle back to a step size it has seen lose, and it never
   settles at the minimum when a larger S measured faster.

It has no clock or device of its own: the engine feeds it per-pass stats (`on_pass`, via
`attach(engine)`), so it is tested with synthetic numbers (tests/test_adaptive_s.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .stepsize import ceil_s, mean_pairwise_distance, occupancy_limit, s_formula


@dataclass
class _Cost:
    mean: float
    n: int
    seen: int  # pass index (of this controller) when last updated


class _Ewls:
    """Exponentially weighted least squares of y on x (one variable), for N_e ~ a + b Dist."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.n = 0

    def add(self, x: float, y: float) -> None:
        k = 1.0 - self.decay
        self.w, self.x, self.y = k * self.w + 1, k * self.x + x, k * self.y + y
        self.xx, self.xy = k * self.xx + x * x, k * self.xy + x * y
        self.n += 1

    def mean(self) -> float | None:
        return self.y / self.w if self.w else None

    def predict(self, x: float | None) -> float | None:
        if not self.w:
            return None
        my, mx = self.y / self.w, self.x / self.w
        var = self.xx / self.w - mx * mx
        if x is None or self.n < 4 or var <= 1e-12 * max(1.0, mx * mx):
            return my
        b = (self.xy / self.w - mx * my) / var
        return max(0.0, my + b * (x - mx))


@dataclass
class StepSizeController:
    initial_s: int
    min_s: int = 1
    max_s: int = 4
    stall_threshold: int = 4  # late copies before S + 1
    overfetch_threshold: int = 8  # wasted prefetches before S - 1
    expert_bytes: float | None = None  # E_s
    bandwidth: float | None = None  # C_s, bytes/s
    layer_time_s: float | None = None  # T_l
    experts_per_layer: float | None = None  # N_e prior (the calibration's top-k) until passes are seen
    ema: float = 0.2  # weight of a new observation in C_s / T_l / occupancy / cost estimates
    num_layers: int = 0  # kept for callers; T_l is per MoE layer step (PassStats.moe_layers_run)
    capacity: int | None = None  # cache slots for the occupancy check (None: no check)
    hysteresis: float = 0.15  # how far past an integer the formula must go to move the base
    cost_margin: float = 0.03  # refuse a move to an S measured this much slower than the current one
    cost_min_samples: int = 3  # decode passes at an S before its cost is trusted
    memory_passes: int = 256  # costs older than this many passes are forgotten (re-exploration)
    dist_window: int = 8  # tokens whose embeddings give Dist(t)
    dist_decay: float = 0.05  # forgetting of the N_e ~ Dist fit
    embed: Callable[[Any], Any] | None = None  # token ids [n] -> embeddings [n,H] (attach: the model's)
    listeners: list[Callable[[int], None]] = field(default_factory=list)  # called with the new S on a change

    def __post_init__(self) -> None:
        if not 1 <= self.min_s <= self.max_s:
            raise ValueError(f"need 1 <= min_s <= max_s, got {self.min_s}, {self.max_s}")
        self.stalls = 0
        self.overfetches = 0
        self.refused = 0  # feedback moves refused by the cost memory
        self.passes = 0
        self.n_e: float | None = None  # the N_e in use (forecast); None: experts_per_layer
        self.dist: float | None = None  # Dist of the latest window (mean pairwise distance)
        self.needed_per_layer: float | None = None
        self.predicted_per_layer: float | None = None
        self.cost: dict[int, _Cost] = {}
        self._fit = _Ewls(self.dist_decay)
        self._window: list[int] = []
        f = self.formula_s()
        self.base = self._clamp(ceil_s(f) if f is not None else self.initial_s)
        self.bias = 0
        self._s = self.base
        self.history: list[tuple[str, int]] = [("init", self._s)]

    # -- S --
    @property
    def s(self) -> int:
        return self._s

    def n_e_value(self) -> float | None:
        return self.n_e if self.n_e is not None else self.experts_per_layer

    def formula_s(self) -> float | None:
        """S_formula from the current estimates; None while one is unknown (or C_s, T_l not positive)."""
        n_e, e_s, c_s, t_l = self.n_e_value(), self.expert_bytes, self.bandwidth, self.layer_time_s
        if n_e is None or e_s is None or c_s is None or t_l is None or c_s <= 0 or t_l <= 0:
            return None
        return s_formula(n_e, e_s, c_s, t_l)

    def occupancy_s(self) -> int:
        """Largest S the cache can hold (needed + S * predicted per layer <= capacity); max_s if unknown."""
        if not self.capacity or self.predicted_per_layer is None or self.needed_per_layer is None:
            return self.max_s
        return occupancy_limit(self.capacity, self.needed_per_layer, self.predicted_per_layer)

    def upper(self) -> int:
        return max(self.min_s, min(self.max_s, self.occupancy_s()))

    def _clamp(self, s: int, hi: int | None = None) -> int:
        return max(self.min_s, min(self.max_s if hi is None else hi, int(s)))

    def _update_base(self) -> None:
        f = self.formula_s()
        if f is None:
            return
        hi = self.upper()
        target = self._clamp(ceil_s(f), hi)
        if target > self.base and f <= self.base + self.hysteresis:
            return  # just past the boundary: keep
        if target < self.base and f > self.base - 1 - self.hysteresis:
            return
        self.base = target

    def _recompute(self, why: str) -> int:
        self._update_base()
        hi = self.upper()
        self.base = min(self.base, hi)
        self.bias = max(self.min_s - self.base, min(hi - self.base, self.bias))  # no wind-up
        new = self._clamp(self.base + self.bias, hi)
        if new != self._s:
            self._s = new
            self.history.append((why, new))
            for cb in self.listeners:
                cb(new)
        return self._s

    # -- feedback (ExpertFlow 3.2.2) --
    def _fresh_cost(self, s: int) -> float | None:
        c = self.cost.get(s)
        if c is None or c.n < self.cost_min_samples or self.passes - c.seen > self.memory_passes:
            return None
        return c.mean

    def _move(self, step: int, why: str) -> None:
        hi = self.upper()
        target = self._clamp(self._s + step, hi)
        if target == self._s:
            return
        here, there = self._fresh_cost(self._s), self._fresh_cost(target)
        if here is not None and there is not None and there > here * (1 + self.cost_margin):
            self.refused += 1  # measured slower there: stay (this is what makes S settle)
            return
        self.bias += target - self._s
        self._recompute(why)

    def observe_stalls(self, n: int = 1) -> int:
        """`n` copies the compute waited for (a prefetch still in flight when its layer needed it)."""
        self.stalls += int(n)
        if self.stalls >= self.stall_threshold:
            self.stalls = 0
            self._move(+1, "stall")
        return self._s

    def observe_overfetch(self, n: int = 1) -> int:
        """`n` prefetched experts evicted before any use."""
        self.overfetches += int(n)
        if self.overfetches >= self.overfetch_threshold:
            self.overfetches = 0
            self._move(-1, "overfetch")
        return self._s

    def observe_access(self, *, stalled: bool, n: int = 1) -> int:
        """Back-compatible entry: stalled copies, or (stalled=False) wasted prefetches."""
        return self.observe_stalls(n) if stalled else self.observe_overfetch(n)

    # -- estimates (ExpertFlow 3.2.1, 3.3.2) --
    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new

    def observe_transfer(self, nbytes: float, seconds: float) -> int:
        if seconds > 0 and nbytes > 0:
            self.bandwidth = self._ema(self.bandwidth, nbytes / seconds)
            return self._recompute("bandwidth")
        return self._s

    def observe_layer_time(self, seconds: float) -> int:
        if seconds > 0:
            self.layer_time_s = self._ema(self.layer_time_s, seconds)
            return self._recompute("layer_time")
        return self._s

    def observe_new_experts(self, per_layer: float, dist: float | None = None) -> int:
        """One pass's N_e observation (experts not resident per MoE layer), with the Dist(t) it came with."""
        self._fit.add(dist if dist is not None else 0.0, float(per_layer))
        self.n_e = self._fit.predict(dist)  # forecast at the latest window's Dist (its mean without one)
        return self._recompute("n_e")

    def observe_occupancy(self, needed_per_layer: float, predicted_per_layer: float) -> int:
        self.needed_per_layer = self._ema(self.needed_per_layer, needed_per_layer)
        self.predicted_per_layer = self._ema(self.predicted_per_layer, predicted_per_layer)
        return self._recompute("occupancy")

    def observe_cost(self, s: int, wall_s: float) -> None:
        """Wall time of a decode pass run at step size `s` (the settling memory)."""
        c = self.cost.get(s)
        if c is None or self.passes - c.seen > self.memory_passes:
            self.cost[s] = _Cost(wall_s, 1, self.passes)
        else:
            c.mean, c.n, c.seen = (1 - self.ema) * c.mean + self.ema * wall_s, c.n + 1, self.passes

    def diversity(self, token_ids: Any) -> float | None:
        """Append the pass's tokens to the window and return its Dist per pair (None without `embed`)."""
        if self.embed is None or token_ids is None:
            return None
        ids = [int(t) for t in (token_ids.reshape(-1).tolist() if hasattr(token_ids, "reshape") else token_ids)]
        self._window = (self._window + ids)[-self.dist_window :]
        if len(self._window) < 2:
            return None
        import torch

        with torch.no_grad():
            emb = self.embed(torch.tensor(self._window, dtype=torch.long, device=_device(self.embed)))
        self.dist = mean_pairwise_distance(emb)
        return self.dist

    def on_pass(self, stats: Any) -> int:
        """Engine observer (`engine.observers.append(ctrl.on_pass)`), given a `PassStats` per forward pass."""
        self.passes += 1
        c = stats.counters
        decode = bool(getattr(stats, "decode", getattr(stats, "tokens", 0) == 1))
        layers = int(getattr(stats, "moe_layers_run", 0) or 0)
        if decode:
            self.observe_cost(int(getattr(stats, "lookahead", self._s)), float(stats.wall_s))
        if stats.transfer_bytes and stats.transfer_s > 0:
            self.observe_transfer(float(stats.transfer_bytes), float(stats.transfer_s))
        compute = float(getattr(stats, "compute_s", 0.0) or 0.0)
        if decode and layers and compute > 0:
            self.observe_layer_time(compute / layers)
        dist = self.diversity(getattr(stats, "token_ids", None)) if decode else None
        if layers and decode:
            predicted = int(getattr(stats, "predicted", 0) or 0)
            new = int(getattr(stats, "predicted_new", 0)) if predicted else int(c.loads)
            self.observe_new_experts(new / layers, dist)
            self.observe_occupancy(c.accesses / layers, predicted / layers)
        if getattr(c, "late", 0):
            self.observe_stalls(int(c.late))
        if getattr(c, "prefetch_unused_evicted", 0):
            self.observe_overfetch(int(c.prefetch_unused_evicted))
        return self._recompute("pass")

    def attach(self, engine: Any) -> Callable[[], None]:
        """Subscribe to `engine`'s per-pass stats and drive `engine.lookahead`; returns the unsubscribe."""
        engine.lookahead = self._s
        self.num_layers = self.num_layers or engine.spec.num_layers
        cache = getattr(engine, "cache", None)
        if self.capacity is None and cache is not None and not getattr(engine, "per_layer", False):
            self.capacity = int(cache.capacity)
        if self.embed is None:
            get = getattr(getattr(engine, "model", None), "get_input_embeddings", None)
            self.embed = get() if get is not None else None

        def set_s(s: int) -> None:
            engine.lookahead = s

        self.listeners.append(set_s)
        engine.observers.append(self.on_pass)

        def detach() -> None:
            engine.observers.remove(self.on_pass)
            self.listeners.remove(set_s)

        return detach

    # -- construction --
    @classmethod
    def for_engine(
        cls, engine: Any, *, num_moe_layers: int, num_layers: int, calib: dict[str, Any] | None, lookahead: int
    ) -> StepSizeController:
        """The controller `--adaptive-s` attaches to a (bound) engine: S in [1, MoE layers - 1] and no further than
        a learned prefetcher's trained S (it predicts no further); started from the calibration when there is one."""
        hi = max(1, num_moe_layers - 1)
        horizon = predictor_horizon(engine.prefetcher)
        if horizon:
            hi = min(hi, horizon)
        if calib:
            return cls.from_calibration(calib, max_s=hi, num_layers=num_layers)
        return cls(initial_s=min(lookahead, hi), max_s=hi, num_layers=num_layers)

    @classmethod
    def from_calibration(cls, calib: dict[str, Any], *, max_s: int, **kw: Any) -> StepSizeController:
        """E_s, C_s, T_l, N_e (top-k) from a `moeflow calibrate` record (its JSON keys); S starts at the
        clamped formula (the calibration's `initial_s` when the record lacks a term)."""
        return cls(
            initial_s=int(calib.get("initial_s") or 1),
            max_s=max_s,
            expert_bytes=calib.get("expert_bytes"),
            bandwidth=calib.get("bandwidth_bytes_per_s"),
            layer_time_s=calib.get("layer_time_s"),
            experts_per_layer=calib.get("experts_per_layer"),
            **kw,
        )


def requested_step_size(
    flag: int | None, calib: dict[str, Any] | None, num_moe_layers: int, model: str, given_by: str = "-S"
) -> tuple[int, str]:
    """(step size S, where it came from): `-S` (or what `given_by` names: a --config file that set it), else the
    calibration's `initial_s`, else 1. S prefetches S MoE layers ahead, so it can be 1..num_moe_layers - 1: a
    larger `-S` is refused (ConfigError), a larger calibrated S (a calibration made with other settings) is
    clamped and the source says so."""
    hi = max(1, num_moe_layers - 1)
    if flag is not None:
        check_step_size(flag, num_moe_layers, model)
        return flag, given_by
    s = int((calib or {}).get("initial_s") or 0)
    if not s:
        return 1, "default"
    return (hi, f"calibration's S={s} clamped to {hi}") if s > hi else (s, "calibration")


def check_step_size(s: int, num_moe_layers: int, model: str) -> None:
    """Refuse a step size S given on the command line that `model`'s MoE layers cannot have: S prefetches S MoE
    layers ahead, so it can be 1..num_moe_layers - 1 (one line; `run`, `simulate` and `tune` alike)."""
    hi = max(1, num_moe_layers - 1)
    if not 1 <= s <= hi:
        raise ConfigError(f"-S {s}: {model} has {num_moe_layers} MoE layers, so S can be 1..{hi}")


def predictor_horizon(prefetcher: Any) -> int | None:
    """The largest S a prefetch policy can predict (its declared `horizon`: a learned predictor's trained S, it
    predicts no further); None for any other policy, or no policy."""
    return None if prefetcher is None else prefetcher.horizon


def prefetch_step_size(prefetcher: Any, s: int) -> tuple[int, str | None]:
    """(the step size a bound prefetch policy uses when the engine's S is `s`, why that is not `s` or None):
    the policy's own `lookahead=` option wins over S, and a learned predictor looks no further than its
    trained S (`moeflow.policies.learned`)."""
    name = prefetcher.name or "the prefetch policy"
    used, why = s, None
    own = prefetcher.lookahead
    if own is not None and int(own) != s:
        used, why = int(own), f"{name} has its own lookahead={own}"
    horizon = predictor_horizon(prefetcher)
    if horizon is not None and used > horizon:
        used, why = horizon, f"{name}'s predictor was trained for S <= {horizon} (moeflow train --max-s)"
    return used, why


def _device(module: Any) -> Any:
    w = getattr(module, "weight", None)
    return w.device if w is not None else "cpu"
