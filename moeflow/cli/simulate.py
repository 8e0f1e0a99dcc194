"""`moeflow simulate`: flags -> SimulateConfig -> moeflow.stages.simulate.main."""

from __future__ import annotations

from typing import Any

import typer

from ..registry import DEFAULT_EVICTION, host_miss
from .app import app
from .common import (
    alias,
    capacity_option,
    eviction_option,
    hidden_alias,
    hit_rate_cell,
    json_option,
    limit_option,
    lookahead_option,
    no_progress_option,
    policy_opt_option,
    prefetch_option,
    print_json,
    traced_model_option,
)


def table(res: dict[str, Any]) -> Any:
    """The result rows as a table readable at 80 columns (`moeflow.tables.FitTable`); all fields: --json."""
    from ..tables import FitTable

    stall = str(res["link"]) != "instant" or any(r["stall_s"] for r in res["rows"])
    tpot = any(r.get("predicted_tpot_s") for r in res["rows"])
    t = FitTable(
        f"{res['trace']}: {res['passes']} {res['phase']} passes ({res['replayed_passes']} replayed), "
        f"{res['tokens']} tokens, {res['working_set']:.1f} experts needed per pass of {res['total_experts']}; "
        f"link {res['link']}; S={res.get('lookahead', 1)}"
        + (f" ({res['lookahead_source']})" if res.get("lookahead_source") else "")
        + f"; {res['accesses_per_s'] / 1e6:.2f} M accesses/s",
        key=2,
        caption="C: cache capacity in experts; policies: eviction+prefetch; coll. misses: experts evicted earlier in "
        "the same pass; xfers /tok: copies per token; pf prec / recall: prefetch precision (-: nothing prefetched) and recall"
        + ("; stall s: seconds waiting for copies on the modelled link" if stall else "; link instant: no stall")
        + (f"; TPOT ms: predicted time per decode pass ({res.get('time_model')})" if tpot else "")
        + (
            "; miss=cpu: the host computes a missing expert, which is not a cache access (--json host_misses)"
            if any(host_miss(r) for r in res["rows"])
            else ""
        ),
    )
    cols = ["C", "policies", "hit rate", "coll. misses", "xfers /tok", "pf prec", "pf recall"]
    cols += (["stall s"] if stall else []) + (["TPOT ms"] if tpot else [])
    for c in cols:
        t.add_column(c, justify="right" if c == "C" else None)
    for r in res["rows"]:
        t.add_row(
            str(r["capacity"]),
            f"{r['eviction']}+{r['prefetch']}" + (f" miss={r['miss']}" if host_miss(r) else ""),
            hit_rate_cell(r),
            str(r["collisions"]),
            f"{r['loads_per_token']:.2f}",
            f"{r['prefetch_precision']:.2f}" if r["prefetch_loads"] else "-",  # nothing prefetched: as `moeflow run`
            f"{r['prefetch_recall']:.2f}",
            *([f"{r['stall_s']:.3f}"] if stall else []),
            *([f"{r['predicted_tpot_s'] * 1e3:.3f}" if r.get("predicted_tpot_s") is not None else "-"] if tpot else []),
        )
    return t


def render(res: dict[str, Any]) -> None:
    from rich.console import Console

    Console().print(table(res))


@app.command("simulate")
def simulate_cmd(
    trace: str = typer.Option(
        ..., "--trace", "-t", help="Trace folder written by `moeflow trace` (with --record-hidden for --prefetch pregate)."
    ),
    capacity: list[str] | None = capacity_option("25%, as `moeflow run`"),
    eviction: list[str] | None = eviction_option(DEFAULT_EVICTION),
    eviction_opt: list[str] | None = policy_opt_option("eviction"),
    prefetch: list[str] | None = prefetch_option(
        "pregate, as `moeflow run` (none for a trace without --record-hidden: pregate replays the traced router inputs)",
        learned=False,
    ),
    prefetch_opt: list[str] | None = policy_opt_option("prefetch"),
    prefetch_p: list[str] | None = hidden_alias("-p"),
    lookahead: int | None = lookahead_option(
        None, " (default, as `moeflow run` on the CPU: the S of the calibration for this --link, else 1)"
    ),
    calibration: str | None = typer.Option(
        None,
        "--calibration",
        help="Calibration JSON giving S (default: calibration/cpu.json, or cpu-emulated-<X>gbps.json for an "
        "emulated --link, as `moeflow calibrate` names them).",
    ),
    phase: str = typer.Option("decode", "--phase", help="decode, prefill or all passes of the trace."),
    limit: int | None = limit_option("prompts of the trace (the first ones)"),
    max_prompts: int | None = hidden_alias("--max-prompts"),
    model: str | None = traced_model_option(),
    no_belady: bool = typer.Option(False, "--no-belady", help="Skip Belady's MIN (the demand-paging optimum)."),
    link: str = typer.Option(
        "instant",
        "--link",
        help="instant: copies complete at once (`moeflow run`'s --link direct, its default on the CPU), or "
        "emulated:GBPS[,LATENCY_US] (EmulatedLink's FIFO schedule on a virtual clock).",
    ),
    layer_time_us: float = typer.Option(
        0.0,
        "--layer-time-us",
        help="Compute per MoE layer per pass on the link's virtual clock (microseconds; default 0: only stalls advance it).",
    ),
    calibrated_time: bool = typer.Option(
        False,
        "--calibrated-time",
        help="Advance the link's clock by the calibration's measured host times (per MoE layer: attention, router "
        "hook, prefetch proposal, experts call before and after its wait; per pass: the rest; on an emulated link: "
        "the engine's time per demand and per prefetch copy, a stalled wait's lateness) and predict TPOT "
        "(`predicted_tpot_s`). Needs a calibration from `moeflow calibrate` of this "
        "moeflow version (--calibration, else the default file for --link).",
    ),
    miss: list[str] | None = typer.Option(
        None,
        "--miss",
        help="Miss policies to replay, comma-separated or repeated: fetch (copy the missing expert; default) and cpu "
        "(the host computes it, as `moeflow run --miss cpu`; its time on a modelled link needs a calibration from a "
        "CPU device, which measures host_miss_s). On a CPU device `run --miss auto` sends every miss to the host, as cpu.",
    ),
    no_progress: bool = no_progress_option(),
    as_json: bool = json_option(),
) -> None:
    """Replay a routing trace through the runtime's expert cache (no weights): hit rate, collision misses, transfers
    per token; `--json` rows carry `decode_counters` with the fields of `moeflow run --json`. The defaults are
    `moeflow run`'s; the model (--model; default: the one the trace was made with, where its folder exists) is
    loaded only for pregate, whose routers it applies."""
    from ..policies.parse import parse_opts, split_list
    from ..stages.simulate import SimulateConfig, main

    cfg = SimulateConfig(
        trace=trace,
        capacities=split_list(capacity, "--capacity") or ("25%",),
        evictions=split_list(eviction, "--eviction") or (DEFAULT_EVICTION,),
        prefetches=split_list(alias(prefetch, prefetch_p, "--prefetch/-f", "-p"), "--prefetch") or None,
        eviction_opts=parse_opts(eviction_opt or ()),
        prefetch_opts=parse_opts(prefetch_opt or ()),
        lookahead=lookahead,
        calibration=calibration,
        phase=phase,
        max_prompts=alias(limit, max_prompts, "--limit/-n", "--max-prompts"),
        model=model,  # None: the trace's, else the default (as tune)
        belady=not no_belady,
        progress=not no_progress and not as_json,
        link=link,
        layer_time_us=layer_time_us,
        calibrated_time=calibrated_time,
        misses=split_list(miss, "--miss") or ("fetch",),
    )
    res = main(cfg)
    if as_json:
        print_json(res)
    else:
        render(res)
