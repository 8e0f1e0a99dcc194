"""`moeflow simulate` stage: replay a trace through eviction x prefetch x capacity, plus Belady's bound."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..policies import EVICTION, PREFETCH, parse_policy
from ..policies.parse import build_policy, parse_capacity, policy_args


@dataclass(frozen=True)
class SimulateConfig:
    trace: str  # folder written by `moeflow trace`
    capacities: tuple[str, ...] = ("10%",)  # experts ("13") or percent of all routed experts ("10%")
    evictions: tuple[str, ...] = ("lru",)  # name[:k=v,...]
    prefetches: tuple[str, ...] = ("none",)
    lookahead: int = 1  # step size S handed to prefetchers
    phase: str = "decode"  # decode | prefill | all
    max_prompts: int | None = None  # --limit: replay only the first N prompts
    model: str | None = None  # needed for pregate (routers) and checked against the trace
    belady: bool = True
    progress: bool = True
    eviction_opts: tuple[tuple[str, str], ...] = ()  # --eviction-opt key=value, for every eviction policy
    prefetch_opts: tuple[tuple[str, str], ...] = ()  # --prefetch-opt key=value, for every prefetch policy

    def __post_init__(self) -> None:
        """Check every value before any work: phase, S, each capacity's syntax, each policy with its options
        (built once, so `pregate:overfetch=abc` fails here); capacities against the trace's top-k in `main`."""
        if self.phase not in ("decode", "prefill", "all"):
            raise ConfigError(f"--phase must be decode, prefill or all (got {self.phase!r})")
        if self.lookahead < 1:
            raise ConfigError(f"--lookahead must be >= 1 (got {self.lookahead})")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError(f"--limit must be >= 1 (got {self.max_prompts})")
        if not self.capacities or not self.evictions or not self.prefetches:
            raise ConfigError("--capacity, --eviction and --prefetch need at least one value each")
        for c in self.capacities:
            if parse_capacity(c, total_experts=1 << 40, expert_bytes=1) < 1:
                raise ConfigError(f"--capacity {c!r} gives no expert slot; use at least top-k experts (e.g. 8 or 10%)")
        for e in self.evictions:
            build_policy(EVICTION, e, self.eviction_opts)
        for p in self.prefetches:
            build_policy(PREFETCH, p, self.prefetch_opts)

    def eviction(self, text: str) -> tuple[str, dict[str, Any]]:
        """(name, options) of `text` with --eviction-opt merged (inline options win)."""
        return policy_args(text, self.eviction_opts)

    def prefetch(self, text: str) -> tuple[str, dict[str, Any]]:
        """(name, options) of `text` with --prefetch-opt merged (inline options win)."""
        return policy_args(text, self.prefetch_opts)


def capacity_slots(text: str, total: int, expert_bytes: int | None = None, top_k: int = 1) -> int:
    """Experts for `--capacity` (`moeflow.policies.parse.parse_capacity`), within top_k..total: a cache
    below top-k cannot hold the experts one token needs in one layer."""
    c = parse_capacity(text, total_experts=total, expert_bytes=expert_bytes)
    if not top_k <= c <= total:
        raise ConfigError(
            f"--capacity {text!r} = {c} experts; use {top_k} (top-k, the experts one token needs "
            f"per layer) .. {total} (all routed experts)"
        )
    return c


def main(cfg: SimulateConfig) -> dict[str, Any]:
    from rich.progress import Progress

    from ..trace import Trace
    from .access import from_trace
    from .simulator import belady, simulate

    tr = Trace(cfg.trace)
    spec = tr.spec
    caps = [capacity_slots(c, spec.total_experts, spec.expert_bytes, spec.top_k) for c in cfg.capacities]
    needs_router = any(parse_policy(p)[0] == "pregate" for p in cfg.prefetches)
    predict = None
    if needs_router:
        if not cfg.model:
            raise ConfigError("--prefetch pregate needs --model (the routers of later layers)")
        if not tr.record_hidden:
            raise ConfigError(
                f"--prefetch pregate needs router inputs: re-run `moeflow trace --record-hidden` ({cfg.trace} has none)"
            )
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
    rows = []
    jobs = [(c, e, p) for c in caps for e in cfg.evictions for p in cfg.prefetches]
    with Progress(transient=True, disable=not cfg.progress) as prog:
        task = prog.add_task("simulating", total=len(jobs) + (len(caps) if cfg.belady else 0))
        for c, e, p in jobs:
            st = simulate(acc, c, cfg.eviction(e), cfg.prefetch(p), lookahead=cfg.lookahead, predict_logits=predict)
            rows.append({"capacity": c, "eviction": e, "prefetch": p, **_summary(st)})
            prog.advance(task)
        if cfg.belady:
            for c in caps:
                rows.append({"capacity": c, "eviction": "belady", "prefetch": "none", **_summary(belady(acc, c))})
                prog.advance(task)
    return {
        "trace": cfg.trace,
        "phase": cfg.phase,
        "passes": len(acc.passes),
        "tokens": sum(p.tokens for p in acc.passes),
        "total_experts": total,
        "working_set": acc.working_set(),
        "rows": rows,
    }


def _summary(st) -> dict[str, Any]:
    d = st.to_dict()
    keep = (
        "hit_rate",
        "hits",
        "misses",
        "collisions",
        "collision_rate",
        "loads",
        "loads_per_token",
        "prefetch_loads",
        "prefetch_precision",
        "prefetch_recall",
        "evictions",
        "max_resident",
    )
    return {k: d[k] for k in keep}
