"""The simulator's clock (`TimeModel`): the host seconds the link's clock advances by.

The link's clock advances as the engine's host thread would, per MoE layer: `attention_s`
(attention, norms, router) and `route_s` (the router hook: host read, cache calls) before the layer's demand
copies are submitted, `predict_s` (a proposing prefetch policy's proposal) plus `predict_layer_s` of each MoE layer
it predicts (pregate applies the router of each of the S next layers: S of them, fewer near the last layer) before
its copies are submitted,
`dispatch_s` (the experts call up to its wait: the MoE block after the router, the rows sorted) while the copies
are in flight, `experts_s` (the rest of the experts call) after the layer's slots are waited for; `token_s` per
pass (final norm, head, generate's loop). `ModelledLink` adds `submit_s` per demand copy submitted (the router
hook's host time per miss: the victim, the slot table, the link's submit), `prefetch_submit_s` per prefetch copy
and `wake_s` per wait that stalls; `miss_host_s` per demand copy after the layer's wait (the rest of a pass that
copies runs slower than an all-hit one: the experts call's miss path, weights just copied; a calibrated figure,
`copy_costs`); with miss policy `cpu`, after the layer's wait `host_miss_s` per expert the host computes instead of
copying and `host_split_s` per layer call that splits (experts in slots computed beside experts on the host worker:
the hand-off, two threads' kernels, the join) (`engine_time.host_costs`, measured on a CPU device, where `cpu` is
exact), less what the layer's wait stalled where the host worker runs beside it (`host_beside`: a CUDA device, or a
CPU device at one torch thread; at several there is no worker).
`TimeModel.from_calibration` reads what `moeflow calibrate` measured (`engine_time`); `layer_time_s` alone is
`experts_s` of every layer. `SimStats.time_s` sums, over the counted passes, the clock from the end of the
previous pass to the end of the pass (as `moeflow run` times decode passes), so `pass_s` is the predicted TPOT
of decode passes. A new generation (a prefill pass) first drains the link, as `moeflow run` does between prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..runtime.host_worker import worker_is_exact


@dataclass(frozen=True)
class TimeModel:
    """Host seconds the link's clock advances by (see the module docstring). Per-layer terms are tuples indexed by MoE
    layer rank (one value: every layer); all zero is a clock that only stalls advance."""

    attention_s: tuple[float, ...] = (0.0,)  # before the router hook: attention, norms, router (layer 0: + embedding)
    route_s: tuple[float, ...] = (0.0,)  # the router hook without the prefetch proposal: host read, cache calls
    predict_s: tuple[float, ...] = (0.0,)  # the prefetch policy's proposal and gate (proposing policies only)
    experts_s: tuple[float, ...] = (0.0,)  # the experts call after its slots are ready: grouped GEMMs, combine
    token_s: float = 0.0  # per pass, outside the MoE layers: final norm, head, generate's loop between passes
    submit_s: float = 0.0  # host seconds per demand copy the router hook issues (ModelledLink)
    wake_s: float = 0.0  # seconds a wait that stalls returns after its copy is due (ModelledLink)
    dispatch_s: tuple[float, ...] = (0.0,)  # the experts call before it waits for its slots: the rows sorted
    prefetch_submit_s: float | None = None  # host seconds per prefetch copy (ModelledLink; None: submit_s)
    predict_layer_s: tuple[float, ...] = (0.0,)  # the proposal's seconds per MoE layer it predicts, by that layer's rank
    miss_host_s: float = 0.0  # host seconds per demand copy after the layer's wait (a pass that copies runs slower)
    host_miss_s: float | None = None  # seconds a pass takes longer per miss computed on the host (`cpu`; None: not measured)
    host_split_s: float = 0.0  # ... and per layer call that splits (experts in slots beside experts on the host worker)
    # whether host experts run on the engine's host worker, beside the layer's wait (a CUDA device, or a CPU device at
    # one torch thread: `runtime.host_worker.worker_is_exact`); False: serially after it, nothing hidden
    host_beside: bool = True

    def __post_init__(self) -> None:
        for name in ("attention_s", "route_s", "predict_s", "dispatch_s", "experts_s", "predict_layer_s"):
            v = getattr(self, name)
            if not v or min(v) < 0:
                raise ConfigError(f"time model {name} needs one value >= 0 or one per MoE layer, got {v!r}")
        if min(self.token_s, self.submit_s, self.wake_s, self.prefetch_copy_s, self.miss_host_s) < 0:
            raise ConfigError("time model token_s, submit_s, prefetch_submit_s, wake_s and miss_host_s must be >= 0")
        if (self.host_miss_s is not None and self.host_miss_s < 0) or self.host_split_s < 0:
            raise ConfigError("time model host_miss_s and host_split_s must be >= 0")

    @property
    def prefetch_copy_s(self) -> float:
        """Host seconds per prefetch copy (`prefetch_submit_s`, else `submit_s`)."""
        return self.submit_s if self.prefetch_submit_s is None else self.prefetch_submit_s

    @classmethod
    def layer_time(cls, layer_time_s: float) -> TimeModel:
        """`layer_time_s` of compute per MoE layer after its slots are ready (nothing else)."""
        return cls(experts_s=(float(layer_time_s),))

    @classmethod
    def from_compute(cls, compute_per_token_s: float, layer_time_s: float, num_moe_layers: int) -> TimeModel:
        """A calibration without `engine_time`: `layer_time_s` per MoE layer after its slots are ready, the rest of
        `compute_per_token_s` once per pass (`token_s`), so a pass that waits for nothing takes the compute per token."""
        rest = float(compute_per_token_s) - num_moe_layers * float(layer_time_s)
        return cls(experts_s=(float(layer_time_s),), token_s=max(0.0, rest))

    @classmethod
    def from_calibration(cls, cal: dict[str, Any], prefetch: str = "none") -> TimeModel:
        """The terms `moeflow calibrate` measured (`engine_time`, `link_timing`); `predict_s` of `prefetch` (a
        policy name; zero when it was not measured or proposes nothing), split by `predict_split` for a policy
        that predicts the S next layers (`PER_LAYER_PREDICT`)."""
        et = cal.get("engine_time")
        if not isinstance(et, dict):
            raise ConfigError("the calibration has no engine_time; re-run `moeflow calibrate` to measure it")
        lt = cal.get("link_timing") or {}
        pred = (et.get("predict_s") or {}).get(prefetch)
        base: tuple[float, ...] = tuple(pred) if pred else (0.0,)
        per_layer: tuple[float, ...] = (0.0,)
        if pred and prefetch in PER_LAYER_PREDICT and len(pred) > 1:
            base, per_layer = predict_split(pred)
        submit = float(lt.get("demand_copy_s", lt.get("submit_s", 0.0)))  # the engine's, else the link's alone
        return cls(
            attention_s=tuple(et["attention_s"]),
            route_s=tuple(et["route_s"]),
            predict_s=base,
            predict_layer_s=per_layer,
            dispatch_s=tuple(et.get("dispatch_s") or (0.0,)),  # an older calibration: inside experts_s
            experts_s=tuple(et["experts_s"]),
            token_s=float(et["token_s"]),
            submit_s=submit,
            prefetch_submit_s=float(lt.get("prefetch_copy_s", submit)),
            wake_s=float(lt.get("engine_wake_s", lt.get("wake_s", 0.0))),  # measured in the engine, else the link alone
            miss_host_s=float(lt.get("miss_host_s", 0.0)),  # an older calibration: not measured
            host_miss_s=None if lt.get("host_miss_s") is None else float(lt["host_miss_s"]),  # a CPU device's only
            host_split_s=float(lt.get("host_split_s", 0.0)),
            host_beside=worker_is_exact(str(cal.get("torch_device", "cpu")).split(":")[0], int(cal.get("cpu_threads") or 1)),
        )

    def per_layer(self, n: int, lookahead: int = 1) -> tuple[list[float], list[float], list[float], list[float]]:
        """(before the demand copies, before the prefetch copies, before the wait, after the wait) per MoE layer
        rank, `n` layers; the proposal at rank r predicts ranks r+1 .. min(r+`lookahead`, n-1)."""

        def at(v: tuple[float, ...], name: str) -> list[float]:
            if len(v) == 1:
                return [v[0]] * n
            if len(v) != n:
                raise ConfigError(f"time model {name} has {len(v)} values for {n} MoE layers; re-calibrate this model")
            return list(v)

        pre = [a + r for a, r in zip(at(self.attention_s, "attention_s"), at(self.route_s, "route_s"))]
        ahead = at(self.predict_layer_s, "predict_layer_s")
        pred = [p + sum(ahead[r + 1 : r + 1 + max(0, lookahead)]) for r, p in enumerate(at(self.predict_s, "predict_s"))]
        return pre, pred, at(self.dispatch_s, "dispatch_s"), at(self.experts_s, "experts_s")

    def pass_s(self, n: int, prefetching: bool, lookahead: int = 1) -> float:
        """Seconds of one pass through `n` MoE layers that waits for nothing (proposals `lookahead` layers ahead)."""
        pre, pred, disp, post = self.per_layer(n, lookahead)
        return self.token_s + sum(pre) + sum(disp) + sum(post) + (sum(pred) if prefetching else 0.0)


PER_LAYER_PREDICT = frozenset({"pregate"})  # proposals that apply one router per predicted layer (S of them)


def predict_split(pred: Sequence[float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(`predict_s`, `predict_layer_s`) from a proposal's seconds per MoE layer rank measured at S = 1 (`pred`,
    n >= 2 values): the last layer predicts no layer, so its time is what every proposal costs whatever it predicts
    (the context, the gate's call); rank r < n-1 predicted rank r+1, so `pred[r]` less that is rank r+1's
    (its router, the selection, the requests; >= 0). Rank 0 is never predicted."""
    base = float(pred[-1])
    return (base,), (0.0, *(max(0.0, float(p) - base) for p in pred[:-1]))
