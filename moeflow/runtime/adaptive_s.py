"""Adaptive step size S (ExpertFlow 3.2.1-3.2.2, 3.3.2): how many MoE layers ahead to prefetch.

    S_formula = N_e * E_s / (C_s * T_l)      (`moeflow.calibrate.stepsize.s_formula`)

with N_e the experts needed per layer (`moeflow calibrate` records top-k), E_s the bytes of one
expert, C_s the host->device bandwidth (bytes/s) and T_l the compute time of one layer (s). The
controller keeps S = ceil(S_formula) + bias, clamped to [min_s, max_s]:

- every needed expert that was not resident (the layer waited on a transfer) counts a stall; when
  the stall counter passes `stall_threshold` it resets and bias += 1 (prefetch further ahead);
- every needed expert already resident counts an overfetch; when that counter passes
  `overfetch_threshold` it resets and bias -= 1 (prefetch closer, more accurately);
- observed transfers update C_s (exponential moving average of bytes / seconds), observed layer
  times update T_l, and S is recomputed with the formula (ExpertFlow 3.3.2 (2)).

It has no clock or device of its own: the engine feeds it per-pass stats (`on_pass`, via
`attach(engine)`), so it is tested with synthetic numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..calibrate.stepsize import ceil_s, s_formula


@dataclass
class StepSizeController:
    initial_s: int
    min_s: int = 1
    max_s: int = 4
    stall_threshold: int = 4
    overfetch_threshold: int = 32
    expert_bytes: float | None = None  # E_s
    bandwidth: float | None = None  # C_s, bytes/s
    layer_time_s: float | None = None  # T_l
    experts_per_layer: float | None = None  # N_e
    ema: float = 0.2  # weight of a new observation in C_s / T_l
    num_layers: int = 0  # decoder layers (to turn a decode pass's time into T_l)
    listeners: list[Callable[[int], None]] = field(default_factory=list)  # called with the new S on a change

    def __post_init__(self) -> None:
        if not 1 <= self.min_s <= self.max_s:
            raise ValueError(f"need 1 <= min_s <= max_s, got {self.min_s}, {self.max_s}")
        self.stalls = 0
        self.overfetches = 0
        f = self.formula_s()
        base = ceil_s(f) if f is not None else self.initial_s
        self.bias = self.initial_s - base  # so that S starts at initial_s
        self._s = self._clamp(self.initial_s)
        self.history: list[tuple[str, int]] = [("init", self._s)]

    # -- S --
    @property
    def s(self) -> int:
        return self._s

    def formula_s(self) -> float | None:
        """S_formula from the current estimates; None while one is unknown (or C_s, T_l not positive)."""
        n_e, e_s, c_s, t_l = self.experts_per_layer, self.expert_bytes, self.bandwidth, self.layer_time_s
        if n_e is None or e_s is None or c_s is None or t_l is None or c_s <= 0 or t_l <= 0:
            return None
        return s_formula(n_e, e_s, c_s, t_l)

    def _clamp(self, s: int) -> int:
        return max(self.min_s, min(self.max_s, int(s)))

    def _recompute(self, why: str) -> int:
        f = self.formula_s()
        base = ceil_s(f) if f is not None else self.initial_s
        # keep the bias inside what can still move S, so a long run of stalls does not wind up
        self.bias = max(self.min_s - base, min(self.max_s - base, self.bias))
        new = self._clamp(base + self.bias)
        if new != self._s:
            self._s = new
            self.history.append((why, new))
            for cb in self.listeners:
                cb(new)
        return self._s

    # -- feedback (ExpertFlow 3.2.2) --
    def observe_access(self, *, stalled: bool, n: int = 1) -> int:
        """`n` needed experts of one layer: stalled (waited on a transfer / miss) or already resident."""
        for _ in range(n):
            if stalled:
                self.stalls += 1
                if self.stalls >= self.stall_threshold:
                    self.stalls = 0
                    self.bias += 1
                    self._recompute("stall")
            else:
                self.overfetches += 1
                if self.overfetches >= self.overfetch_threshold:
                    self.overfetches = 0
                    self.bias -= 1
                    self._recompute("overfetch")
        return self._s

    # -- estimates (ExpertFlow 3.2.1, 3.3.2) --
    def observe_transfer(self, nbytes: float, seconds: float) -> int:
        if seconds > 0 and nbytes > 0:
            bw = nbytes / seconds
            self.bandwidth = bw if self.bandwidth is None else (1 - self.ema) * self.bandwidth + self.ema * bw
            return self._recompute("bandwidth")
        return self._s

    def observe_layer_time(self, seconds: float) -> int:
        if seconds > 0:
            self.layer_time_s = seconds if self.layer_time_s is None else (1 - self.ema) * self.layer_time_s + self.ema * seconds
            return self._recompute("layer_time")
        return self._s

    def on_pass(self, stats: Any) -> int:
        """Engine observer (`engine.observers.append(ctrl.on_pass)`), given a `PassStats` per forward pass.

        As ExpertFlow 3.2.2 defines them: experts already loaded when needed (`ready_hits`) feed the
        overfetch counter; experts the layer had to wait for (`waited` = demand misses + prefetches
        still in flight) feed the stall counter. The link's busy time and bytes update C_s; on
        decode passes (one token) (wall - stall) / decoder layers updates T_l.
        """
        c = stats.counters
        if c.ready_hits:
            self.observe_access(stalled=False, n=int(c.ready_hits))
        if c.waited:
            self.observe_access(stalled=True, n=int(c.waited))
        if stats.transfer_bytes and stats.transfer_s > 0:
            self.observe_transfer(float(stats.transfer_bytes), float(stats.transfer_s))
        if stats.tokens == 1 and self.num_layers:
            self.observe_layer_time(max(stats.wall_s - stats.stall_s, 0.0) / self.num_layers)
        return self._s

    def attach(self, engine: Any) -> Callable[[], None]:
        """Subscribe to `engine`'s per-pass stats and drive `engine.lookahead`; returns the unsubscribe."""
        engine.lookahead = self._s
        self.num_layers = self.num_layers or engine.spec.num_layers

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
    def from_calibration(cls, calib: dict[str, Any], *, max_s: int, **kw: Any) -> StepSizeController:
        """Initial S (`initial_s`) and E_s, C_s, T_l, N_e from a `moeflow calibrate` record (its JSON keys)."""
        c = cls(
            initial_s=int(calib.get("initial_s") or 1),
            max_s=max_s,
            expert_bytes=calib.get("expert_bytes"),
            bandwidth=calib.get("bandwidth_bytes_per_s"),
            layer_time_s=calib.get("layer_time_s"),
            experts_per_layer=calib.get("experts_per_layer"),
            **kw,
        )
        return c
