"""`moeflow tune` stage: search the exact configurations the simulator replays, rank them by predicted TPOT,
write the best as a run configuration (`moeflow run --config`) with a plot beside it.

Everything that can be refused is refused before the search, and nothing is written then: the flags
(`TuneConfig`), `--out`, the trace, the budget against the trace's model (top-k .. all experts), the
calibration (its model and device), the model against the trace."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..policies.parse import parse_capacity, policy_args

DEFAULT_BUDGET = "25%"


@dataclass(frozen=True)
class TuneConfig:
    trace: str  # folder written by `moeflow trace` (with --record-hidden for pregate)
    budget: str = DEFAULT_BUDGET  # the expert cache: experts (96), percent of all routed experts (25%) or bytes (1GiB)
    calibration: str | None = None  # None: calibration/<device>[-emulated-<X>gbps].json as `moeflow run` looks
    link: str | None = None  # emulated:GBPS[,LATENCY_US]; None: the calibration's measured link
    device: str = "cpu"  # the device the configuration will run on (the calibration must be of it)
    model: str | None = None  # None: the model the trace records, else the default model
    out: str | None = None  # the run configuration file (JSON); the plot goes beside it (<stem>.png)
    force: bool = False
    evictions: tuple[str, ...] | None = None  # None: moeflow.tune.search.EVICTIONS
    prefetches: tuple[str, ...] | None = None  # None: PREFETCHES (pregate ones only for a trace with router inputs)
    s_values: tuple[int, ...] | None = None  # None: S_VALUES
    adaptive: bool = True  # also try the adaptive S
    exhaustive: bool = False  # every candidate on the whole trace (no successive halving)
    max_prompts: int | None = None  # replay the first N prompts of the trace
    plot: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        from ..policies import EVICTION, PREFETCH
        from ..policies.parse import build_policy

        parse_capacity(self.budget, total_experts=1 << 40, expert_bytes=1, flag="--budget")
        if self.link is not None:
            from ..runtime.link import parse_link

            kind, _, _ = parse_link(self.link)
            if kind != "emulated":
                raise ConfigError(f"--link {self.link!r}: tune models emulated:GBPS[,LATENCY_US] (or the calibration's link)")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError(f"--limit must be >= 1 (got {self.max_prompts})")
        for s in self.s_values or ():
            if s < 1:
                raise ConfigError(f"--lookahead values must be >= 1 (got {s})")
        from ..tune.search import refuse_unreplayable

        for e in self.evictions or ():
            build_policy(EVICTION, e)
        for p in self.prefetches or ():
            refuse_unreplayable(p)  # before building it: a learned one would ask for run's --prefetch-opt
            build_policy(PREFETCH, p)
        if self.evictions == () or self.prefetches == ():
            raise ConfigError("--eviction and --prefetch need at least one value each")


def budget_slots(budget: str, spec: Any) -> int:
    """Experts of `--budget` for the trace's model, within top-k .. all routed experts."""
    c = parse_capacity(budget, total_experts=spec.total_experts, expert_bytes=spec.expert_bytes, flag="--budget")
    if not spec.top_k <= c <= spec.total_experts:
        raise ConfigError(
            f"--budget {budget!r} = {c} experts; give at least {spec.top_k} (top-k, the experts one token needs per "
            f"layer) and at most {spec.total_experts} (all routed experts)"
        )
    return c


def plot_path(out: str | Path) -> Path:
    p = Path(out)
    return p.with_name(p.stem + ".png")


def _misses(device_type: str, cal: dict[str, Any], cal_path: Any, notes: list[str]) -> tuple[str, ...]:
    """The miss dimension: fetch, and cpu on a CPU device whose calibration measured `host_miss_s` (cpu is lossy on
    CUDA, whose host kernels sum in another order); a CPU calibration without it gets a note."""
    from ..tune.search import HOST_MISS, MISSES

    if device_type != "cpu" or not isinstance(cal.get("engine_time"), dict):
        return MISSES  # no engine_time: its own note says so (the host's time is one of its terms)
    if (cal.get("link_timing") or {}).get("host_miss_s") is None:
        notes.append(
            f"calibration {cal_path} has no host_miss_s (the host's time per expert it computes): miss cpu not "
            "searched; re-run `moeflow calibrate --link-gbps X` to measure it"
        )
        return MISSES
    if float(cal["link_timing"]["host_miss_s"]) <= 0.0:  # clamped: a host expert measured no dearer than a resident one
        notes.append(
            f"calibration {cal_path} measured host_miss_s 0 (the difference of two pass times, within the machine's "
            "noise): cpu rows may be predicted too fast; re-run `moeflow calibrate` on a quieter machine"
        )
    return (*MISSES, HOST_MISS)


def read_calibration(cfg: TuneConfig, tr: Any) -> tuple[dict[str, Any], str, str, str]:
    """(calibration, its path, the modelled link `emulated:GBPS,LATENCY_US`, the `moeflow run --link` it stands
    for): `--calibration`, else the file `moeflow run` reads for this device and link. The modelled link is
    `--link`, else the calibration's measured bandwidth and latency. Refused: none found, another model's,
    another device's."""
    from ..calibrate import calibration_path, check_calibration, device_name, load_calibration, missing_calibration
    from ..runtime.link import parse_link

    gbps = parse_link(cfg.link)[1] if cfg.link else None
    want = device_name(cfg.device, gbps)
    path = Path(cfg.calibration) if cfg.calibration else calibration_path(want)
    if not cfg.calibration and not cfg.link and not path.is_file():
        # no --link: the one emulated-link calibration of this device (`moeflow calibrate --link-gbps X`), if unique
        emulated = sorted(path.parent.glob(f"{want}-emulated-*gbps.json"))
        if len(emulated) == 1:
            path = emulated[0]
        elif len(emulated) > 1:
            names = ", ".join(e.name for e in emulated)
            raise ConfigError(f"several calibrations of {want} ({names}); pick one with --calibration or --link emulated:GBPS")
    if not path.is_file():
        if cfg.calibration:
            raise ConfigError(missing_calibration(path))
        hint = f" --link-gbps {gbps:g}" if gbps else ""
        raise ConfigError(
            f"tune predicts TPOT from a calibration and found none at {path}; run `moeflow calibrate{hint}` or pass --calibration"
        )
    cal = load_calibration(path, fingerprint=tr.fingerprint, against="the trace's model")
    need = ("compute_per_token_s", "layer_time_s", "bandwidth_bytes_per_s")  # the time model reads them all
    check_calibration(cal, path, cfg.device, exact=want if cfg.link else None, required=need)
    if cfg.link:
        return cal, str(path), cfg.link, cfg.link
    bw = float(cal.get("fitted_bandwidth_bytes_per_s") or cal["bandwidth_bytes_per_s"])
    link = f"emulated:{bw / 1e9:.6g},{float(cal.get('latency_s') or 0.0) * 1e6:.6g}"
    run_link = f"emulated:{float(cal['link_gbps']):g}" if cal.get("link") == "emulated" and cal.get("link_gbps") else "auto"
    return cal, str(path), link, run_link


def main(cfg: TuneConfig) -> dict[str, Any]:
    """Search, rank, write the run configuration and the plot; the result (`ranked` best first)."""
    t_start = time.perf_counter()
    from ..checks import check_device
    from ..outputs import check_out
    from ..runtime.adaptive_s import check_step_size
    from ..trace import Trace

    check_device(cfg.device)
    if cfg.out:
        check_out(cfg.out, kind="run-config", inputs=(cfg.trace, cfg.calibration), force=cfg.force, file=True)
        if cfg.plot:  # beside --out: never --out itself, nor a file or folder that is not a moeflow plot
            if plot_path(cfg.out).resolve() == Path(cfg.out).resolve():
                raise ConfigError(f"--out {cfg.out} would be replaced by its own plot; name the run configuration .json")
            try:
                check_out(
                    plot_path(cfg.out), kind="plot", inputs=(cfg.trace, cfg.calibration), force=cfg.force, file=True,
                    flag="the plot",
                )  # fmt: skip
            except ConfigError as e:  # its name follows --out's
                raise ConfigError(f"{e} (its name follows --out's; or pass --no-plot)") from None
    tr = Trace(cfg.trace)
    spec = tr.spec
    capacity = budget_slots(cfg.budget, spec)
    for s in cfg.s_values or ():
        check_step_size(s, spec.num_moe_layers, f"the trace's model ({cfg.trace})")
    model = None
    if cfg.model is not None:  # the trace must be of --model: said before any calibration is compared with either
        from ..models import load_routing_model

        model = load_routing_model(cfg.model)
        tr.check_model(model)
    cal, cal_path, link, run_link = read_calibration(cfg, tr)
    from ..runtime.link import parse_link

    _, gbps, latency_s = parse_link(link)
    from ..tune.search import EVICTIONS, PREFETCHES, S_VALUES, CostModel, Evaluator, search, space, uses_s

    cost = CostModel(
        gbps=float(gbps),
        latency_s=float(latency_s),
        expert_bytes=int(spec.expert_bytes),
        layer_time_s=float(cal["layer_time_s"]),
        num_moe_layers=spec.num_moe_layers,
        calibration=cal,
    )
    cost.time_model().per_layer(spec.num_moe_layers)  # a per-layer time model of another layer count: refused here
    prefetches = cfg.prefetches or PREFETCHES
    routered = [p for p in prefetches if _routered(p)]
    notes: list[str] = []
    if routered and not tr.record_hidden:
        if cfg.prefetches:
            raise ConfigError(
                f"--prefetch {routered[0]} needs router inputs: re-run `moeflow trace --record-hidden` ({cfg.trace} has none)"
            )
        prefetches = tuple(p for p in prefetches if p not in routered)
        notes.append(f"{cfg.trace} has no router inputs (trace --record-hidden): pregate not searched")
    if not cost.engine_time:
        notes.append(
            f"calibration {cal_path} has no engine_time: TPOT is predicted from its compute per token; "
            "re-run `moeflow calibrate` for the per-layer time model `moeflow simulate --calibrated-time` uses"
        )
    else:
        measured = (cal["engine_time"].get("predict_s") or {}).keys()
        unmeasured = sorted({n for p in prefetches if (n := policy_args(p)[0]) != "none" and n not in measured})
        if unmeasured:
            notes.append(f"calibration {cal_path} has no predictor time for {', '.join(unmeasured)}: counted as 0")
    import torch

    device_type = torch.device(cfg.device).type
    misses = _misses(device_type, cal, cal_path, notes)
    hi = max(1, spec.num_moe_layers - 1)
    cal_s = cal.get("initial_s")
    cands = space(
        spec.num_moe_layers,
        evictions=cfg.evictions or EVICTIONS,
        prefetches=prefetches,
        s_values=cfg.s_values or S_VALUES,
        calibration_s=min(int(cal_s), hi) if isinstance(cal_s, int) and cal_s >= 1 else None,
        adaptive=cfg.adaptive,
        misses=misses,
        device_type=device_type,
    )
    predict, model_path = None, cfg.model
    if any(_routered(c.prefetch) for c in cands):
        from ..models import default_model_path, load_routing_model
        from ..moe import get_adapter
        from .simulate import _router_predictor

        model_path = cfg.model or tr.model_folder() or default_model_path()
        if model is None:
            model = load_routing_model(model_path)
            tr.check_model(model)
        predict = _router_predictor(get_adapter(model))
    model_path = model_path or tr.model_folder() or str(tr.meta.get("model", ""))
    from ..progress import progress
    from ..sim.access import from_trace

    acc = from_trace(tr, max_prompts=cfg.max_prompts, with_router_input=predict is not None)
    if not any(p.phase == 1 for p in acc.passes):
        raise ConfigError(f"{cfg.trace} has no decode passes; trace with --max-new-tokens >= 2")
    ev = Evaluator(acc, capacity, cost, predict, cal, spec.num_layers)
    fixed = [c.s for c in cands if c.s is not None and uses_s(c.prefetch)]
    ev.table_s = ev.max_s if any(c.adaptive for c in cands) else max(fixed, default=1)
    from ..tune.search import rounds

    plan = [(ev.prompts, len(cands))] if cfg.exhaustive else rounds(len(cands), ev.prompts)
    with progress("tune", enabled=cfg.progress) as prog:
        task = prog.add_task("replaying", total=sum(n for _, n in plan) + 1, unit="replays")
        bound = ev.bound()
        prog.advance(task)
        ranked, pruned, plan = search(ev, cands, exhaustive=cfg.exhaustive, on_replay=lambda: prog.advance(task))
    for r in (*ranked, *pruned):
        # the bound counts every miss as a copy: a host-computed miss (miss cpu) copies nothing, so it has none
        r["ratio_to_bound"] = None if r["miss"] != "fetch" else r["predicted_tpot_s"] / bound["bound_tpot_s"]
    for i, r in enumerate(ranked):
        r["rank"] = i + 1
    best = ranked[0]
    res: dict[str, Any] = {
        "trace": cfg.trace,
        "model": model_path,
        "budget": cfg.budget,
        "capacity": capacity,
        "total_experts": spec.total_experts,
        "link": link,  # the modelled link
        "run_link": run_link,  # the `moeflow run --link` of the configuration
        "calibration": cal_path,
        "cost_model": cost.describe(),
        "time_model": "calibration engine_time" if cost.engine_time else "calibration compute_per_token_s",
        "candidates": len(cands),
        "prompts": ev.prompts,
        "rounds": [{"prompts": p, "candidates": n} for p, n in plan],
        **bound,
        "best": best,
        "ranked": ranked,
        "pruned": pruned,
        "notes": notes,
        "out": None,
        "plot": None,
    }
    if cfg.out:
        from ..tune.config import run_config, write_run_config

        options = {
            "capacity": str(capacity),
            **{k: best[k] for k in ("eviction", "prefetch", "lookahead", "adaptive_s", "miss")},
            "link": run_link,
            "calibration": str(Path(cal_path).resolve()),
        }
        tuned = {
            "trace": str(Path(cfg.trace).resolve()),
            "budget": cfg.budget,
            "link_model": link,
            **{k: best[k] for k in ("label", "predicted_tpot_s", "hit_rate", "bytes_per_token", "ratio_to_bound")},
            "bound_tpot_s": bound["bound_tpot_s"],
        }
        write_run_config(cfg.out, run_config(str(Path(model_path).resolve()), tr.fingerprint, options, tuned))
        res["out"] = cfg.out
        if cfg.plot:
            from ..tune.plot import plot_ranking

            res["plot"] = str(
                plot_ranking(ranked, bound["bound_tpot_s"], plot_path(cfg.out), title=f"{Path(cfg.trace).name}: C={capacity}")
            )
    res["seconds"] = time.perf_counter() - t_start
    return res


def _routered(prefetch: str) -> bool:
    """Whether prefetch policy `prefetch` reads later layers' routers (pregate: the model is loaded)."""
    from ..policies import PREFETCH
    from ..policies.parse import policy_args

    cls = PREFETCH.get(policy_args(prefetch)[0])
    return cls is not None and bool(cls.needs_router_input)
