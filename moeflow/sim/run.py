"""`moeflow simulate` stage: replay a trace through eviction x prefetch x capacity, plus Belady's bound."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..policies import EVICTION, PREFETCH, parse_policy


@dataclass(frozen=True)
class SimulateConfig:
    trace: str                                   # folder written by `moeflow trace`
    capacities: tuple[str, ...] = ("10%",)       # experts ("13") or percent of all routed experts ("10%")
    evictions: tuple[str, ...] = ("lru",)        # name[:k=v,...]
    prefetches: tuple[str, ...] = ("none",)
    lookahead: int = 1                           # step size S handed to prefetchers
    phase: str = "decode"                        # decode | prefill | all
    max_prompts: int | None = None
    model: str | None = None                     # needed for pregate (routers) and checked against the trace
    belady: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if self.phase not in ("decode", "prefill", "all"):
            raise ConfigError(f"--phase must be decode, prefill or all (got {self.phase!r})")
        if self.lookahead < 1:
            raise ConfigError(f"--lookahead must be >= 1 (got {self.lookahead})")
        for e in self.evictions:
            n, _ = parse_policy(e)
            if n not in EVICTION:
                raise ConfigError(f"unknown eviction policy {n!r}; choose one of: {', '.join(sorted(EVICTION))}")
        for p in self.prefetches:
            n, _ = parse_policy(p)
            if n not in PREFETCH:
                raise ConfigError(f"unknown prefetch policy {n!r}; choose one of: {', '.join(sorted(PREFETCH))}")


def capacity_slots(text: str, total: int) -> int:
    t = text.strip()
    try:
        c = round(float(t[:-1]) / 100 * total) if t.endswith("%") else int(t)
    except ValueError:
        raise ConfigError(f"--capacity {text!r} is not a number of experts or a percentage like 10%") from None
    if not 1 <= c <= total:
        raise ConfigError(f"--capacity {text!r} = {c} experts; use 1..{total} (all routed experts)")
    return c


def main(cfg: SimulateConfig) -> dict[str, Any]:
    from rich.progress import Progress

    from ..trace import Trace
    from .access import from_trace
    from .simulator import belady, simulate

    tr = Trace(cfg.trace)
    needs_router = any(parse_policy(p)[0] == "pregate" for p in cfg.prefetches)
    predict = None
    if needs_router:
        if not cfg.model:
            raise ConfigError("--prefetch pregate needs --model (the routers of later layers)")
        if not tr.record_hidden:
            raise ConfigError(f"--prefetch pregate needs router inputs: re-run `moeflow trace --record-hidden` "
                              f"({cfg.trace} has none)")
        from ..models import load_model
        from ..moe import get_adapter
        model, _ = load_model(cfg.model)
        tr.check_model(model)
        predict = get_adapter(model).router_logits
    phase = {"decode": 1, "prefill": 0, "all": None}[cfg.phase]
    acc = from_trace(tr, phase=phase, max_prompts=cfg.max_prompts, with_router_input=needs_router)
    if not acc.passes:
        raise ConfigError(f"{cfg.trace} has no {cfg.phase} passes")
    total = len(acc.moe_layers) * acc.num_experts
    caps = [capacity_slots(c, total) for c in cfg.capacities]
    rows = []
    jobs = [(c, e, p) for c in caps for e in cfg.evictions for p in cfg.prefetches]
    with Progress(transient=True, disable=not cfg.progress) as prog:
        task = prog.add_task("simulating", total=len(jobs) + (len(caps) if cfg.belady else 0))
        for c, e, p in jobs:
            st = simulate(acc, c, parse_policy(e), parse_policy(p), lookahead=cfg.lookahead, predict_logits=predict)
            rows.append({"capacity": c, "eviction": e, "prefetch": p, **_summary(st)})
            prog.advance(task)
        if cfg.belady:
            for c in caps:
                rows.append({"capacity": c, "eviction": "belady", "prefetch": "none", **_summary(belady(acc, c))})
                prog.advance(task)
    return {"trace": cfg.trace, "phase": cfg.phase, "passes": len(acc.passes),
            "tokens": sum(p.tokens for p in acc.passes), "total_experts": total,
            "working_set": acc.working_set(), "rows": rows}


def _summary(st) -> dict[str, Any]:
    d = st.to_dict()
    keep = ("hit_rate", "hits", "misses", "collisions", "collision_rate", "loads", "loads_per_token",
            "prefetch_loads", "prefetch_precision", "prefetch_recall", "evictions", "max_resident")
    return {k: d[k] for k in keep}
