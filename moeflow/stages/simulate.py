"""`moeflow simulate` stage: replay a trace through eviction x prefetch x capacity, plus Belady's bound."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..policies import EVICTION, PREFETCH, parse_policy
from ..policies.lossy import Lossy, lossy
from ..policies.parse import build_policy, parse_capacity, policy_args


def replayable(name: str) -> bool:
    """Whether the simulator can replay prefetch policy `name`: not one that needs the running model (a learned
    prefetcher reads the post-attention residual and binds to the model; only `moeflow run` has them)."""
    cls = PREFETCH.get(name)
    return cls is None or not (cls.needs_model or cls.needs_residual)


def replayable_prefetchers() -> tuple[str, ...]:
    return tuple(n for n in PREFETCH if replayable(n))


def _refuse_unreplayable(name: str) -> None:
    if not replayable(name):
        learned = ", ".join(n for n in PREFETCH if not replayable(n))
        raise ConfigError(
            f"moeflow simulate cannot replay prefetch policy {name!r}: the learned prefetchers ({learned}) need the "
            f"running model; simulate replays {', '.join(replayable_prefetchers())}. Measure {name} with "
            f"`moeflow run -f {name}:predictors=DIR` (its recall: `moeflow eval`)"
        )


@dataclass(frozen=True)
class SimulateConfig:
    """The defaults are `moeflow run`'s: 25% of the routed experts, lru, pregate (none for a trace without router
    inputs, which pregate replays), the calibration's S (else 1); the link `instant` is run's CPU default `direct`."""

    trace: str  # folder written by `moeflow trace`
    capacities: tuple[str, ...] = ("25%",)  # experts ("13") or percent of all routed experts ("25%")
    evictions: tuple[str, ...] = ("lru",)  # name[:k=v,...]
    prefetches: tuple[str, ...] | None = None  # None: pregate if the trace has router inputs, else none
    lookahead: int | None = None  # step size S handed to prefetchers; None: the calibration's, else 1
    phase: str = "decode"  # decode | prefill | all: whose counters the rows' headline metrics count (all passes replay)
    max_prompts: int | None = None  # --limit: replay only the first N prompts
    model: str | None = None  # needed for pregate (routers) and checked against the trace; None: the default model
    calibration: str | None = None  # calibration JSON giving S (None: calibration/<device>.json as `moeflow run`)
    belady: bool = True
    progress: bool = True
    eviction_opts: tuple[tuple[str, str], ...] = ()  # --eviction-opt key=value, for every eviction policy
    prefetch_opts: tuple[tuple[str, str], ...] = ()  # --prefetch-opt key=value, for every prefetch policy
    link: str = "instant"  # instant | emulated:GBPS[,LATENCY_US] (modelled on a virtual clock)
    layer_time_us: float = 0.0  # compute per MoE layer per pass on the modelled link's clock

    def __post_init__(self) -> None:
        """Check every value before any work: phase, S, each capacity's syntax, each policy with its options
        (built once, so `pregate:overfetch=abc` fails here); capacities against the trace's top-k in `main`."""
        if self.phase not in ("decode", "prefill", "all"):
            raise ConfigError(f"--phase must be decode, prefill or all (got {self.phase!r})")
        if self.lookahead is not None and self.lookahead < 1:
            raise ConfigError(f"--lookahead must be >= 1 (got {self.lookahead})")
        if self.layer_time_us < 0:
            raise ConfigError(f"--layer-time-us must be >= 0 (got {self.layer_time_us})")
        from ..sim.link import make_sim_link

        make_sim_link(self.link)
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError(f"--limit must be >= 1 (got {self.max_prompts})")
        if not self.capacities or not self.evictions or self.prefetches == ():
            raise ConfigError("--capacity, --eviction and --prefetch need at least one value each")
        for c in self.capacities:
            if parse_capacity(c, total_experts=1 << 40, expert_bytes=1) < 1:
                raise ConfigError(f"--capacity {c!r} gives no expert slot; use at least top-k experts (e.g. 8 or 10%)")
        for e in self.evictions:
            build_policy(EVICTION, e, self.eviction_opts)
        for p in self.prefetches or (("pregate",) if self.prefetch_opts else ()):  # the default's options too
            _refuse_unreplayable(parse_policy(p)[0])
            build_policy(PREFETCH, p, self.prefetch_opts)

    def eviction(self, text: str) -> tuple[str, dict[str, Any]]:
        """(name, options) of `text` with --eviction-opt merged (inline options win)."""
        return policy_args(text, self.eviction_opts)

    def prefetch(self, text: str) -> tuple[str, dict[str, Any]]:
        """(name, options) of `text` with --prefetch-opt merged (inline options win)."""
        return policy_args(text, self.prefetch_opts)

    def lossy(self, device_type: str = "cpu", eviction: str | None = None, prefetch: str | None = None) -> Lossy:
        """Whether a `moeflow run` with this replay's policies (one `eviction` x `prefetch` row; None: all of
        them) on a `device_type` device can change the model's output: `moeflow.policies.lossy`, the answer
        run and quality give. Simulate replays the fetch miss policy and the router's routing, so no row
        depends on the device (its rows are asked for the CPU)."""
        from ..policies import MISS, ROUTING

        evictions = [eviction] if eviction is not None else list(self.evictions)
        prefetches = [prefetch] if prefetch is not None else list(self.prefetches or ("none",))
        return lossy(
            device_type=device_type,
            eviction=[build_policy(EVICTION, t, self.eviction_opts) for t in evictions],
            prefetch=[build_policy(PREFETCH, t, self.prefetch_opts) for t in prefetches],
            miss=MISS.create("fetch"),
            routing=ROUTING.create("standard"),
        )


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
    """Replay the trace (every pass, prompts in order, as `moeflow run` runs them) for every capacity x
    eviction x prefetch, plus Belady per capacity. Each row: the headline metrics over `--phase` passes,
    `decode_counters` (CacheCounters of decode passes, the key and field names of `moeflow run --json`),
    `counters` (all passes) and `accesses_per_s` (replayed accesses / replay seconds)."""
    import time

    from ..progress import progress
    from ..sim.access import from_trace
    from ..sim.simulator import belady, simulate
    from ..trace import Trace

    tr = Trace(cfg.trace)
    spec = tr.spec
    caps = [capacity_slots(c, spec.total_experts, spec.expert_bytes, spec.top_k) for c in cfg.capacities]
    prefetches = cfg.prefetches or (("pregate",) if tr.record_hidden else ("none",))
    needs_router = [p for p in prefetches if _needs_router_input(parse_policy(p)[0])]
    lookahead, lookahead_source = _lookahead(cfg, tr, prefetches)
    predict = None
    if needs_router:
        if not tr.record_hidden:
            raise ConfigError(
                f"--prefetch {parse_policy(needs_router[0])[0]} needs router inputs: re-run `moeflow trace "
                f"--record-hidden` ({cfg.trace} has none)"
            )
        from ..models import default_model_path, load_model
        from ..moe import get_adapter

        model, _ = load_model(cfg.model or default_model_path())
        tr.check_model(model)
        predict = _router_predictor(get_adapter(model))
    count = {"decode": 1, "prefill": 0, "all": None}[cfg.phase]
    acc = from_trace(tr, max_prompts=cfg.max_prompts, with_router_input=bool(needs_router))
    if not any(count is None or p.phase == count for p in acc.passes):
        raise ConfigError(f"{cfg.trace} has no {cfg.phase} passes")
    total = len(acc.moe_layers) * acc.num_experts
    kw: dict[str, Any] = dict(link=cfg.link, layer_time_s=cfg.layer_time_us * 1e-6, count_phase=count)
    rows = []
    jobs = [(c, e, p) for c in caps for e in cfg.evictions for p in prefetches]
    replayed, seconds = 0, 0.0
    with progress("simulate", enabled=cfg.progress) as prog:
        task = prog.add_task("simulating", total=len(jobs) + (len(caps) if cfg.belady else 0), unit="configs")
        for c, e, p in jobs:
            st = simulate(acc, c, cfg.eviction(e), cfg.prefetch(p), lookahead=lookahead, predict_logits=predict, **kw)
            rows.append({"capacity": c, "eviction": e, "prefetch": p, "lossy": cfg.lossy("cpu", e, p).lossy, **_summary(st)})
            replayed, seconds = replayed + st.replayed_accesses, seconds + st.seconds
            prog.advance(task)
        if cfg.belady:
            for c in caps:
                t0 = time.perf_counter()
                st = belady(acc, c, **kw)
                st.seconds = time.perf_counter() - t0  # next-use precomputation included
                rows.append({"capacity": c, "eviction": "belady", "prefetch": "none", "lossy": False, **_summary(st)})
                replayed, seconds = replayed + st.replayed_accesses, seconds + st.seconds
                prog.advance(task)
    counted = [p for p in acc.passes if count is None or p.phase == count]
    return {
        "trace": cfg.trace,
        "phase": cfg.phase,
        "link": rows[0]["link"] if rows else cfg.link,
        "lookahead": lookahead,
        "lookahead_source": lookahead_source,
        "passes": len(counted),
        "replayed_passes": len(acc.passes),
        "tokens": sum(p.tokens for p in counted),
        "total_experts": total,
        "working_set": float(sum(sum(len(s.needed()) for s in p.steps) for p in counted) / max(1, len(counted))),
        "accesses": replayed,
        "seconds": seconds,
        "accesses_per_s": replayed / seconds if seconds > 0 else 0.0,
        "rows": rows,
    }


def _needs_router_input(name: str) -> bool:
    cls = PREFETCH.get(name)
    return cls is not None and cls.needs_router_input


def _lookahead(cfg: SimulateConfig, tr: Any, prefetches: tuple[str, ...]) -> tuple[int, str]:
    """(S, where it came from): --lookahead, else the calibration `moeflow run` reads on the CPU for this link
    (`--calibration FILE`, `calibration/cpu.json`, `calibration/cpu-emulated-<X>gbps.json`), else 1. The
    calibration is read only when a prefetch policy proposes something (S means nothing to `none`)."""
    from pathlib import Path

    if cfg.lookahead is not None:
        return cfg.lookahead, "--lookahead"
    names = [parse_policy(p)[0] for p in prefetches]
    classes = [PREFETCH.get(n) for n in names]
    if all(cls is not None and not cls.proposes for cls in classes):
        return 1, "no prefetch"
    from ..calibrate import calibration_path, device_name, load_calibration
    from ..runtime.link import parse_link

    if cfg.calibration:
        path = Path(cfg.calibration)
        if not path.is_file():
            raise ConfigError(f"calibration file {path} does not exist; run `moeflow calibrate` or drop --calibration")
    else:
        kind, gbps, _ = parse_link("direct" if cfg.link.strip().lower() == "instant" else cfg.link)
        path = calibration_path(device_name("cpu", gbps if kind == "emulated" else None))
        if not path.is_file():
            return 1, f"no calibration at {path}"
    cal = load_calibration(path, fingerprint=tr.fingerprint)
    s = cal.get("initial_s")
    if isinstance(s, bool) or not isinstance(s, int) or s < 1:
        raise ConfigError(f"calibration {path} has step size S = {s!r}; re-run `moeflow calibrate` or pass --lookahead")
    return s, f"calibration {path}"


def _router_predictor(adapter: Any):
    """`predict_logits(layer, x)`: the layer's own router on x cast to the router's dtype (the runtime applies
    it to the live router input, in the model's dtype)."""
    import torch

    def predict(layer: int, x: Any) -> Any:
        w = next(adapter.router(layer).parameters())
        with torch.no_grad():
            return adapter.router_logits(layer, x.to(w.dtype))

    return predict


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
        "late",
        "stall_s",
        "decode_counters",
        "counters",
        "replayed_accesses",
        "seconds",
        "accesses_per_s",
        "link",
    )
    return {k: d[k] for k in keep}
