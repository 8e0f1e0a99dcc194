"""`moeflow simulate` stage: replay a trace through eviction x prefetch x capacity, plus Belady's bound."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..policies import DEFAULT_EVICTION, EVICTION, PREFETCH, parse_policy
from ..policies.lossy import Lossy, lossy
from ..policies.parse import build_policy, parse_capacity, policy_args
from ..sim.simulator import EXACT_MISSES, replayable


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
    """The defaults are `moeflow run`'s: 25% of the routed experts, next-use, pregate (none for a trace without router
    inputs, which pregate replays), the calibration's S (else 1); the link `instant` is run's CPU default `direct`."""

    trace: str  # folder written by `moeflow trace`
    capacities: tuple[str, ...] = ("25%",)  # experts ("13") or percent of all routed experts ("25%")
    evictions: tuple[str, ...] = (DEFAULT_EVICTION,)  # name[:k=v,...]
    prefetches: tuple[str, ...] | None = None  # None: pregate if the trace has router inputs, else none
    lookahead: int | None = None  # step size S handed to prefetchers; None: the calibration's, else 1
    phase: str = "decode"  # decode | prefill | all: whose counters the rows' headline metrics count (all passes replay)
    max_prompts: int | None = None  # --limit: replay only the first N prompts
    model: str | None = None  # needed for pregate (routers) and checked against the trace; None: the trace's, else the default
    calibration: str | None = None  # calibration JSON giving S (None: calibration/<device>.json as `moeflow run`)
    belady: bool = True
    progress: bool = True
    eviction_opts: tuple[tuple[str, str], ...] = ()  # --eviction-opt key=value, for every eviction policy
    prefetch_opts: tuple[tuple[str, str], ...] = ()  # --prefetch-opt key=value, for every prefetch policy
    link: str = "instant"  # instant | emulated:GBPS[,LATENCY_US] (modelled on a virtual clock)
    layer_time_us: float = 0.0  # compute per MoE layer per pass on the modelled link's clock
    calibrated_time: bool = False  # the clock advances by the calibration's engine_time / link_timing (TimeModel)
    misses: tuple[str, ...] = ("fetch",)  # miss policies replayed: fetch (copy) and cpu (the host computes the miss)

    def __post_init__(self) -> None:
        """Check every value before any work: phase, S, each capacity's syntax, each policy with its options
        (built once, so `pregate:overfetch=abc` fails here); capacities against the trace's top-k in `main`."""
        if self.phase not in ("decode", "prefill", "all"):
            raise ConfigError(f"--phase must be decode, prefill or all (got {self.phase!r})")
        if self.lookahead is not None and self.lookahead < 1:
            raise ConfigError(f"--lookahead must be >= 1 (got {self.lookahead})")
        if self.layer_time_us < 0:
            raise ConfigError(f"--layer-time-us must be >= 0 (got {self.layer_time_us})")
        if self.calibrated_time and self.layer_time_us:
            raise ConfigError("--calibrated-time takes the layer times from the calibration; drop --layer-time-us")
        from ..sim.link import make_sim_link

        instant = bool(getattr(make_sim_link(self.link), "instant", False))  # instant, direct: copies take no time
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError(f"--limit must be >= 1 (got {self.max_prompts})")
        if not self.capacities or not self.evictions or self.prefetches == ():
            raise ConfigError("--capacity, --eviction and --prefetch need at least one value each")
        for c in self.capacities:
            if parse_capacity(c, total_experts=1 << 40, expert_bytes=1) < 1:
                raise ConfigError(f"--capacity {c!r} gives no expert slot; use at least top-k experts (e.g. 8 or 10%)")
        if "cpu" in self.misses and not self.calibrated_time and (self.layer_time_us or not instant):
            raise ConfigError(
                "--miss cpu times the host's experts with the calibration's host_miss_s: add --calibrated-time (a "
                "calibration from `moeflow calibrate --link-gbps X` on a CPU device), or drop --layer-time-us / --link"
            )
        for m in self.misses:
            if m not in EXACT_MISSES:
                raise ConfigError(
                    f"--miss {m!r}: simulate replays {' and '.join(EXACT_MISSES)} (on a CPU device auto sends every miss "
                    "to the host, as cpu; drop, substitute and the low-bit fetches change the output: measure them "
                    "with moeflow run or moeflow quality)"
                )
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

    def lossy(
        self, device_type: str = "cpu", eviction: str | None = None, prefetch: str | None = None, miss: str = "fetch"
    ) -> Lossy:
        """Whether a `moeflow run` with this replay's policies (one `eviction` x `prefetch` x `miss` row; None: every
        eviction / prefetch) on a `device_type` device can change the model's output: `moeflow.policies.lossy`, the
        answer run and quality give. Simulate's rows are asked for the CPU, where fetch and cpu are both exact (cpu
        is lossy on CUDA, whose host kernels sum in another order)."""
        from ..policies import MISS, ROUTING

        evictions = [eviction] if eviction is not None else list(self.evictions)
        prefetches = [prefetch] if prefetch is not None else list(self.prefetches or ("none",))
        return lossy(
            device_type=device_type,
            eviction=[build_policy(EVICTION, t, self.eviction_opts) for t in evictions],
            prefetch=[build_policy(PREFETCH, t, self.prefetch_opts) for t in prefetches],
            miss=MISS.create(miss),
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
    `counters` (all passes), `accesses_per_s` (replayed accesses / the replay's wall seconds `seconds`), `cpu_s`
    (its CPU seconds, this process), `prepare_s` (the compiled replay's one-time preparation, not in `seconds`;
    0 for a replay call by call; Belady's rows count it and the next-use precomputation in `seconds` and `cpu_s`),
    `time_s` and `predicted_tpot_s` (the link's clock per decode pass: `moeflow.sim.timemodel.TimeModel`, from
    `--calibrated-time` or `--layer-time-us`)."""
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
        from ..models import default_model_path, load_routing_model
        from ..moe import get_adapter

        model = load_routing_model(cfg.model or tr.model_folder() or default_model_path())  # no --model: the trace's
        tr.check_model(model)
        predict = _router_predictor(get_adapter(model))
    count = {"decode": 1, "prefill": 0, "all": None}[cfg.phase]
    acc = from_trace(tr, max_prompts=cfg.max_prompts, with_router_input=bool(needs_router))
    if not any(count is None or p.phase == count for p in acc.passes):
        raise ConfigError(f"{cfg.trace} has no {cfg.phase} passes")
    total = len(acc.moe_layers) * acc.num_experts
    timing = _time_models(cfg, tr, prefetches)  # per prefetch text, or None (--layer-time-us)
    kw: dict[str, Any] = dict(link=cfg.link, count_phase=count)
    if timing is None:
        kw["layer_time_s"] = cfg.layer_time_us * 1e-6
    rows = []
    jobs = [(c, m, e, p) for c in caps for m in cfg.misses for e in cfg.evictions for p in prefetches]
    replayed, seconds = 0, 0.0
    with progress("simulate", enabled=cfg.progress) as prog:
        task = prog.add_task("simulating", total=len(jobs) + (len(caps) if cfg.belady else 0), unit="configs")
        for c, m, e, p in jobs:
            tkw = {} if timing is None else {"timing": timing[p]}
            st = simulate(
                acc, c, cfg.eviction(e), cfg.prefetch(p), miss=m, lookahead=lookahead, predict_logits=predict, **kw, **tkw
            )
            lossy_row = cfg.lossy("cpu", e, p, m).lossy
            rows.append({"capacity": c, "eviction": e, "prefetch": p, "miss": m, "lossy": lossy_row, **_summary(st, count)})
            replayed, seconds = replayed + st.replayed_accesses, seconds + st.seconds
            prog.advance(task)
        if cfg.belady:
            for c in caps:
                t0, c0 = time.perf_counter(), time.process_time()
                st = belady(acc, c, **kw, **({} if timing is None else {"timing": timing["none"]}))
                st.seconds, st.cpu_s = time.perf_counter() - t0, time.process_time() - c0  # next-use precomputation included
                row = {"capacity": c, "eviction": "belady", "prefetch": "none", "miss": "fetch", "lossy": False}
                rows.append({**row, **_summary(st, count)})
                replayed, seconds = replayed + st.replayed_accesses, seconds + st.seconds
                prog.advance(task)
    counted = [p for p in acc.passes if count is None or p.phase == count]
    return {
        "trace": cfg.trace,
        "phase": cfg.phase,
        "link": rows[0]["link"] if rows else cfg.link,
        "lookahead": lookahead,
        "lookahead_source": lookahead_source,
        "time_model": "calibration" if timing is not None else f"--layer-time-us {cfg.layer_time_us:g}",
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
    from ..runtime.adaptive_s import check_step_size

    L = tr.spec.num_moe_layers
    if cfg.lookahead is not None:
        check_step_size(cfg.lookahead, L, f"the trace's model ({tr.path})")
        return cfg.lookahead, "--lookahead"
    names = [parse_policy(p)[0] for p in prefetches]
    classes = [PREFETCH.get(n) for n in names]
    if all(cls is not None and not cls.proposes for cls in classes):
        return 1, "no prefetch"
    from ..calibrate import load_calibration, missing_calibration

    path = _calibration_file(cfg)
    if not path.is_file():
        if cfg.calibration:
            raise ConfigError(missing_calibration(path))
        return 1, f"no calibration at {path}"
    cal = load_calibration(path, fingerprint=tr.fingerprint, against="the trace's model")
    s = cal.get("initial_s")
    if isinstance(s, bool) or not isinstance(s, int) or s < 1:
        raise ConfigError(f"calibration {path} has step size S = {s!r}; re-run `moeflow calibrate` or pass --lookahead")
    hi = max(1, L - 1)
    if s > hi:  # a calibration made with other settings: clamped, as `moeflow run` does
        return hi, f"calibration {path}'s S={s} clamped to {hi}"
    return s, f"calibration {path}"


def _calibration_file(cfg: SimulateConfig) -> Any:
    """The calibration `moeflow run` reads on the CPU for this link: `--calibration FILE`, else
    `calibration/cpu.json` (instant link) or `calibration/cpu-emulated-<X>gbps.json`; it may not exist."""
    from pathlib import Path

    from ..calibrate import calibration_path, device_name
    from ..runtime.link import parse_link

    if cfg.calibration:
        return Path(cfg.calibration)
    kind, gbps, _ = parse_link("direct" if cfg.link.strip().lower() == "instant" else cfg.link)
    return calibration_path(device_name("cpu", gbps if kind == "emulated" else None))


def _time_models(cfg: SimulateConfig, tr: Any, prefetches: tuple[str, ...]) -> dict[str, Any] | None:
    """With --calibrated-time: one `TimeModel` per prefetch text (its predictor's measured time; `none` too, for
    Belady), from the calibration's `engine_time` and `link_timing`; else None."""
    if not cfg.calibrated_time:
        return None
    from ..calibrate import load_calibration
    from ..sim.timemodel import TimeModel

    path = _calibration_file(cfg)
    if not path.is_file():
        raise ConfigError(f"--calibrated-time needs a calibration at {path}; run `moeflow calibrate` or pass --calibration")
    cal = load_calibration(path, fingerprint=tr.fingerprint, against="the trace's model")
    if not isinstance(cal.get("engine_time"), dict):
        raise ConfigError(f"calibration {path} has no engine_time; re-run `moeflow calibrate` to measure it")
    if not cfg.link.strip().lower().startswith("emulated") or cal.get("link_timing") is None:
        host = {k: v for k, v in (cal.get("link_timing") or {}).items() if k in ("host_miss_s", "host_split_s")}
        cal = {**cal, "link_timing": host or None}  # submit / wake terms belong to the emulated link; host terms do not
    names = {p: parse_policy(p)[0] for p in prefetches}
    measured = (cal["engine_time"].get("predict_s") or {}).keys()
    for n in names.values():
        cls = PREFETCH.get(n)
        if cls is not None and cls.proposes and n not in measured:
            raise ConfigError(
                f"calibration {path} has no predictor time for prefetch {n!r} (measured: {', '.join(measured) or 'none'}); "
                "drop --calibrated-time or simulate a measured policy"
            )
    out = {p: TimeModel.from_calibration(cal, n) for p, n in names.items()}
    out.setdefault("none", TimeModel.from_calibration(cal, "none"))
    return out


def _router_predictor(adapter: Any):
    """`predict_logits(layer, x)`: the layer's own router on x cast to the router's dtype (the runtime applies
    it to the live router input, in the model's dtype)."""
    import torch

    def predict(layer: int, x: Any) -> Any:
        w = adapter.router_weight(layer)
        with torch.no_grad():
            return adapter.router_logits(layer, x.to(w.dtype))

    return predict


def _summary(st, count_phase: int | None = 1) -> dict[str, Any]:
    """A row's fields; `time_s` (modelled seconds of the counted passes) and, when decode passes are counted,
    `predicted_tpot_s` (`SimStats.pass_s`: what `moeflow run --json` reports as `tpot_s`)."""
    d = st.to_dict()
    d["predicted_tpot_s"] = st.pass_s if count_phase == 1 else None
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
        "host_misses",
        "decode_counters",
        "counters",
        "replayed_accesses",
        "seconds",
        "cpu_s",
        "prepare_s",
        "accesses_per_s",
        "link",
        "time_s",
        "predicted_tpot_s",
    )
    return {k: d[k] for k in keep}
