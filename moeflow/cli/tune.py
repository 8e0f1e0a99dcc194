"""`moeflow tune`: flags -> TuneConfig -> moeflow.stages.tune.main."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape

from ..registry import host_miss
from .app import app
from .common import (
    device_option,
    force_option,
    hit_rate_cell,
    json_option,
    limit_option,
    no_progress_option,
    off_switch,
    on_switch,
    print_json,
    switched,
    traced_model_option,
)

TOP = 15  # rows of the printed ranking (--json: all)


def table(res: dict[str, Any]) -> Any:
    """The ranking at 80 columns (`moeflow.tables.FitTable`); every row and field: --json."""
    from ..tables import FitTable

    t = FitTable(
        f"{res['trace']}: C={res['capacity']} of {res['total_experts']} experts (--budget {res['budget']}); "
        f"{res['cost_model']}; {res['candidates']} configurations, "
        + ", ".join(f"{r['candidates']} on {r['prompts']} prompts" for r in res["rounds"])
        + f"; bound {res['bound_tpot_s'] * 1e3:.2f} ms/token; {res['seconds']:.1f} s",
        key=2,
        caption="predicted on the whole trace, best first (the others were pruned on shorter prefixes: --json "
        "`pruned`); TPOT ms: predicted decode time per token; MB/tok: bytes copied per token; x bound: TPOT / bound"
        + (
            " (-: miss=cpu computes a miss on the host, copying nothing, so the bound of copies does not hold; its "
            "hit rate counts the cache's accesses, which host-computed experts are not)"
            if any(host_miss(r) for r in res["ranked"][:TOP])
            else ""
        ),
    )
    for c in ("#", "configuration", "TPOT ms", "hit rate", "MB/tok", "x bound"):
        t.add_column(c, justify="right" if c == "#" else None)
    for r in res["ranked"][:TOP]:
        t.add_row(
            str(r["rank"]),
            r["label"],
            f"{r['predicted_tpot_s'] * 1e3:.2f}",
            hit_rate_cell(r),
            f"{r['bytes_per_token'] / 1e6:.2f}",
            f"{r['ratio_to_bound']:.2f}" if r["ratio_to_bound"] is not None else "-",
        )
    return t


def render(res: dict[str, Any]) -> None:
    from rich.console import Console

    con = Console()
    con.print(table(res))
    for n in res["notes"]:
        con.print(f"[yellow]{escape(n)}[/]")
    if res["out"]:
        out = escape(str(res["out"]))  # a path is text, not markup
        con.print(f"run configuration: {out} (`moeflow run --config {out} --prompts ...`)")
    if res["plot"]:
        con.print(f"plot: {escape(str(res['plot']))}")


@app.command("tune")
def tune_cmd(
    trace: str = typer.Option(
        ..., "--trace", "-t", help="Trace folder written by `moeflow trace` (with --record-hidden to search pregate)."
    ),
    budget: str = typer.Option(
        "25%",
        "--budget",
        help="Device memory for experts: N experts (96), P% of all routed experts (25%), or a size (64MB, 1.5GiB); "
        "at least top-k experts.",
    ),
    calibration: str | None = typer.Option(
        None,
        "--calibration",
        help="Calibration JSON of this device: the time model (its engine_time, as `simulate --calibrated-time`; "
        "else its compute per token), link bandwidth and latency (default: the file `moeflow run` reads for --device "
        "and --link, as `moeflow calibrate` names it; without --link, calibration/<device>.json, else the one "
        "calibration/<device>-emulated-<X>gbps.json there).",
    ),
    link: str | None = typer.Option(
        None,
        "--link",
        help="The link to tune for: emulated:GBPS or emulated:GBPS,US (US: latency in microseconds). Default: the "
        "calibration's measured bandwidth and latency, and the calibration's link in the written configuration.",
    ),
    device: str = device_option(),
    model: str | None = traced_model_option(),
    out: str | None = typer.Option(
        None,
        "--out",
        "-o",
        help="Run configuration file (JSON) for `moeflow run --config`; the plot is written beside it (<name>.png).",
    ),
    force: bool = force_option("run configuration"),
    eviction: list[str] | None = typer.Option(
        None,
        "--eviction",
        "-e",
        help="Eviction policies to search (repeat or comma list). Default next-use, lru, lfu, least-stale.",
    ),
    prefetch: list[str] | None = typer.Option(
        None,
        "--prefetch",
        "-f",
        help="Prefetch policies to search, among those the simulator replays: none, pregate, pregate:overfetch=X, "
        "pregate:mass=P, all-next-layer (the learned ones need the running model). Default none, pregate.",
    ),
    lookahead: list[int] | None = typer.Option(
        None,
        "--lookahead",
        "-S",
        help="Fixed step sizes S to search for prefetch policies that follow S (repeat). Default 1, 2, 4, 8 and the "
        "calibration's S, those below the MoE layers.",
    ),
    no_adaptive: bool = off_switch("adaptive", "Leave the adaptive S out of the search (searched by default)."),
    _adaptive: bool = on_switch("adaptive"),
    exhaustive: bool = typer.Option(
        False,
        "--exhaustive",
        help="Replay every configuration on the whole trace (default: successive halving over prompt prefixes).",
    ),
    limit: int | None = limit_option("prompts of the trace (the first ones)"),
    no_plot: bool = off_switch("plot", "Write no plot beside --out (one is written by default)."),
    _plot: bool = on_switch("plot"),
    no_progress: bool = no_progress_option(),
    as_json: bool = json_option(),
) -> None:
    """Search the exact configurations the simulator replays (eviction x prefetch x step size S, fixed and adaptive,
    x miss fetch, and cpu on a CPU device whose calibration timed it) at one memory budget, rank them by predicted
    TPOT, and write the best as a run configuration for `moeflow run --config FILE` (flags given to run still win)."""
    from ..policies.parse import split_list
    from ..stages.tune import TuneConfig, main

    cfg = TuneConfig(
        trace=trace,
        budget=budget,
        calibration=calibration,
        link=link,
        device=device,
        model=model,
        out=out,
        force=force,
        evictions=split_list(eviction, "--eviction") or None,
        prefetches=split_list(prefetch, "--prefetch") or None,
        s_values=tuple(lookahead) if lookahead else None,
        adaptive=switched("adaptive", no_adaptive, _adaptive),
        exhaustive=exhaustive,
        max_prompts=limit,
        plot=switched("plot", no_plot, _plot),
        progress=not no_progress and not as_json,
    )
    res = main(cfg)
    if as_json:
        print_json(res)
    else:
        render(res)
