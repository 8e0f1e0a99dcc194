"""Simulator fidelity: does the modelled link predict `moeflow run`'s TPOT?

Traces the prompts once (`moeflow trace --record-hidden --hidden-dtype float32`: the routing `moeflow run` will
take, greedy), calibrates (`moeflow calibrate --link-gbps/--link-latency-us` of `--link`, so the
calibration holds the engine's host times, `engine_time`, and the emulated link's, `link_timing`: see
`--repeats`; `--prompt-tokens` the traced prompts' mean length, `--decode-steps` `--max-new-tokens` per round,
`--engine-rounds` interleaved rounds), then for
every configuration eviction (`--eviction`) x capacity (`--capacity`) x prefetch (`none`, and `pregate` at each
S of `--lookahead`) x miss (`--miss`: fetch, and cpu, the host computing a miss) measures TPOT with
`moeflow run --link emulated:...` (moeflow.stages.run.main, the same
calibration) and predicts it with `moeflow simulate --link emulated:...` on the trace, twice:
- `baseline`: `--layer-time-us` = the calibration's `layer_time_s` (T_l, the stock decoder layer) and nothing else;
- `calibrated`: `--calibrated-time` (`moeflow.sim.timemodel.TimeModel.from_calibration`: per MoE layer
  attention, router hook, prefetch proposal, the experts call before and after its wait, the rest of the pass; the
  engine's host time per demand and per prefetch copy, and the rest of a pass's per demand copy; the link's wake
  lateness).
`--repeats N` calibrates and runs the whole `moeflow run` sweep N times, each sweep right after its own
calibration (on a shared machine both then see the load of the same minutes), predicts each sweep with its own
calibration, and keeps each configuration's median TPOT, measured and predicted.
Each row also says whether the run's decode hits equal the simulator's (`same_hits`: the same accesses).

Prints the table, writes `--out-dir`/sim_fidelity.json, and ends with one JSON line: `tpot_mean_abs_error` (mean
of |predicted - measured| / measured, a fraction) and `spearman` (rank correlation over the configurations,
scipy.stats.spearmanr) of the calibrated model, and `baseline` with the same two figures for T_l alone;
`steady` the same figures over the configurations whose measured TPOT moved little between repeats (spread =
(max - min) / median <= `--steady`: on a loaded machine a TPOT moves by +-20-40%), `miss_host_s` (each
calibration's host seconds per demand copy beyond the router hook), `host_miss_s` (per host-computed expert),
`by_miss` (the calibrated figures per miss policy; the baseline covers the fetch rows only: T_l has no host term),
and `load_average` (the machine's 1/5/15-minute load at the start and the end).

    .venv/bin/python benchmarks/sim_fidelity.py --threads 1
    .venv/bin/python benchmarks/sim_fidelity.py --model models/olmoe-deep --limit 2 --repeats 3 --threads 1
    .venv/bin/python benchmarks/sim_fidelity.py --model models/olmoe-mini --limit 2 --repeats 3 --threads 1 --miss fetch,cpu
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from moeflow.tables import FitTable


def mean_abs_error(pred: list[float], meas: list[float]) -> float:
    """Mean of |predicted - measured| / measured (a fraction)."""
    return statistics.fmean(abs(p - m) / m for p, m in zip(pred, meas))


def spearman(pred: list[float], meas: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(pred, meas).statistic)


def trace(args: argparse.Namespace, out: Path) -> None:
    from moeflow.stages.trace import TraceConfig
    from moeflow.stages.trace import main as trace_main

    cfg = TraceConfig(
        model=args.model,
        prompts=args.prompts,
        out=str(out),
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        record_hidden=True,
        hidden_dtype="float32",  # exact router inputs: pregate replays the run's proposals
        batch_size=1,  # each prompt alone: the routing `moeflow run` sees (batched rounding can differ)
        data_dir=args.data_dir,
        threads=args.threads,
        progress=False,
    )
    trace_main(cfg, console=Console(file=io.StringIO()))


def prompt_tokens(trace_dir: Path) -> int:
    """The traced prompts' mean length (their prefill passes' tokens): the KV length the runs decode from."""
    from moeflow.sim.access import from_trace
    from moeflow.trace import Trace

    lens = [p.tokens for p in from_trace(Trace(str(trace_dir))).passes if p.phase == 0]
    return max(1, round(statistics.fmean(lens))) if lens else 16


def calibrate(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from moeflow.runtime.link import parse_link
    from moeflow.stages.calibrate import CalibrateConfig
    from moeflow.stages.calibrate import main as calibrate_main

    _, gbps, lat = parse_link(args.link)
    cfg = CalibrateConfig(
        model=args.model,
        link_gbps=gbps,
        link_latency_s=lat,
        decode_steps=args.decode_steps,
        prompt_tokens=args.prompt_tokens,
        engine_rounds=args.engine_rounds,
        out=str(out),
        progress=False,
        threads=args.threads,
    )
    return calibrate_main(cfg)


def measure(
    args: argparse.Namespace, cal: Path, lookaheads: list[int], got: dict[tuple[int, str, str, int, str], dict[str, Any]]
) -> None:
    """One `moeflow run` sweep with calibration `cal`, added to `got`: (capacity experts, eviction, prefetch, S, miss)
    -> {"tpots", "stalls": one per sweep, "hits", "accesses"}."""
    from moeflow.stages.run import main as run_main
    from moeflow.stages.run_config import RunConfig

    for miss, s in [(m, s) for m in args.miss for s in lookaheads]:
        cfg = RunConfig(
            model=args.model,
            prompts=args.prompts,
            data_dir=args.data_dir,
            limit=args.limit,
            max_new_tokens=args.max_new_tokens,
            capacities=tuple(args.capacity),
            evictions=tuple(args.eviction),
            prefetches=("none", "pregate") if s == lookaheads[0] else ("pregate",),
            link=args.link,
            lookahead=s,
            calibration=str(cal),
            threads=args.threads,
            sweep=True,
            miss=miss,
        )
        for r in run_main(cfg, console=Console(file=io.StringIO())):
            key = (int(r["capacity_experts"]), r["eviction"], r["prefetch"], s if r["prefetch"] != "none" else 0, miss)
            m = r["metrics"]
            row = got.setdefault(key, {"tpots": []})
            row["tpots"].append(m["tpot_s"])
            row["hits"], row["accesses"] = m["decode_counters"]["hits"], m["decode_counters"]["accesses"]
            row.setdefault("stalls", []).append(m["decode_counters"]["stall_s"] / max(1, m["decode_passes"]))


def predict(
    args: argparse.Namespace, trace_dir: Path, cal: Path, cal_rec: dict[str, Any], lookaheads: list[int], calibrated: bool
) -> dict[tuple[int, str, str, int], dict[str, Any]]:
    """(capacity experts, eviction, prefetch, S, miss) -> the simulator's row (`predicted_tpot_s`, `decode_counters`)."""
    from moeflow.stages.simulate import SimulateConfig
    from moeflow.stages.simulate import main as simulate_main

    got = {}
    for s in lookaheads:
        cfg = SimulateConfig(
            trace=str(trace_dir),
            capacities=tuple(args.capacity),
            evictions=tuple(args.eviction),
            prefetches=("none", "pregate") if s == lookaheads[0] else ("pregate",),
            lookahead=s,
            model=args.model,
            calibration=str(cal),
            belady=False,
            progress=False,
            link=args.link,
            layer_time_us=0.0 if calibrated else cal_rec["layer_time_s"] * 1e6,
            calibrated_time=calibrated,
            misses=tuple(args.miss) if calibrated else ("fetch",),  # the baseline (T_l only) has no host term
        )
        for r in simulate_main(cfg)["rows"]:
            got[(int(r["capacity"]), r["eviction"], r["prefetch"], s if r["prefetch"] != "none" else 0, r["miss"])] = r
    return got


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from moeflow.models import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=default_model_path(), help="model directory (default %(default)s)")
    ap.add_argument("--link", default="emulated:0.1,20", help="emulated:GBPS[,LATENCY_US] (GB/s, us; default %(default)s)")
    ap.add_argument("--prompts", default="alpaca", help="prompt set name or file (default %(default)s)")
    ap.add_argument("--limit", type=int, default=4, help="prompts (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="new tokens per prompt, traced and run (default %(default)s)")
    ap.add_argument(
        "--capacity",
        default="10%,25%,50%",
        help="device expert slots, comma list: N experts, P%% of routed experts or a size (default %(default)s)",
    )
    ap.add_argument("--eviction", default="lru,least-stale", help="eviction policies, comma list (default %(default)s)")
    ap.add_argument(
        "--miss",
        default="fetch",
        help="miss policies, comma list: fetch, cpu (the host computes a miss; its time is the calibration's "
        "host_miss_s) (default %(default)s)",
    )
    ap.add_argument(
        "--lookahead",
        default="1,2",
        help="step sizes S for pregate, comma list (MoE layers ahead; none runs once) (default %(default)s)",
    )
    ap.add_argument(
        "--repeats", type=int, default=2, help="moeflow run sweeps (default %(default)s); each configuration's median TPOT"
    )
    ap.add_argument(
        "--steady",
        type=float,
        default=0.2,
        help="`steady` figures: configurations whose TPOT spread (max - min) / median is at most this,"
        " a fraction (default %(default)s)",
    )
    ap.add_argument(
        "--decode-steps", type=int, default=None, help="decode steps moeflow calibrate times per round (default --max-new-tokens)"
    )
    ap.add_argument("--engine-rounds", type=int, default=3, help="moeflow calibrate --engine-rounds (default %(default)s)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: moeflow's rule, $MOEFLOW_THREADS, $OMP_NUM_THREADS, calibrated or by model size)",
    )
    ap.add_argument(
        "--data-dir", default=None, help="data directory for prompt set names (default: $MOEFLOW_DATA or ../shared/data)"
    )
    ap.add_argument(
        "--out-dir", default="benchmarks/results/sim_fidelity", help="folder for sim_fidelity.json (default %(default)s)"
    )
    args = ap.parse_args(argv)
    args.decode_steps = args.decode_steps or args.max_new_tokens
    args.capacity = [c.strip() for c in args.capacity.split(",") if c.strip()]
    args.eviction = [e.strip() for e in args.eviction.split(",") if e.strip()]
    args.miss = [m.strip() for m in args.miss.split(",") if m.strip()]
    from moeflow.sim.simulator import EXACT_MISSES

    if not set(args.miss) <= set(EXACT_MISSES):
        ap.error("--miss takes fetch and cpu (the miss policies the simulator replays)")
    lookaheads = sorted({int(s) for s in args.lookahead.split(",") if s.strip()})
    if not args.link.startswith("emulated:") or args.repeats < 1 or not lookaheads or min(lookaheads) < 1:
        ap.error("--link must be emulated:GBPS[,LATENCY_US]; --repeats and every --lookahead >= 1")
    say = Console(stderr=True).print
    load = {"start": list(os.getloadavg())}
    with tempfile.TemporaryDirectory(prefix="sim_fidelity-") as tmp:
        work = Path(tmp)
        say("[dim]tracing ...[/]")
        trace(args, work / "trace")
        args.prompt_tokens = prompt_tokens(work / "trace")  # calibrate decodes from the runs' KV length
        meas: dict[tuple[int, str, str, int, str], dict[str, Any]] = {}
        preds: list[tuple[dict[str, Any], dict[str, Any]]] = []
        cal_recs = []
        for i in range(args.repeats):  # each sweep after its own calibration: both see the load of the same minutes
            cal = work / f"calibration-{i}.json"
            say(f"[dim]repeat {i + 1}/{args.repeats}: calibrating ...[/]")
            cal_recs.append(calibrate(args, cal))
            say(f"[dim]repeat {i + 1}/{args.repeats}: moeflow run ...[/]")
            measure(args, cal, lookaheads, meas)
            say(f"[dim]repeat {i + 1}/{args.repeats}: moeflow simulate ...[/]")
            preds.append(
                (
                    predict(args, work / "trace", cal, cal_recs[-1], lookaheads, calibrated=False),
                    predict(args, work / "trace", cal, cal_recs[-1], lookaheads, calibrated=True),
                )
            )
    load["end"] = list(os.getloadavg())
    rows = []
    for key in sorted(meas, key=lambda k: (k[4] != "fetch", k[0], k[1], k[2], k[3])):
        c, ev, pf, s, miss = key
        base = key if miss == "fetch" else None  # T_l alone models no host-computed miss
        m, f = meas[key], preds[0][1][key]
        m["tpot_s"], m["stall_s"] = statistics.median(m["tpots"]), statistics.median(m["stalls"])
        pred_tpots = [p[1][key]["predicted_tpot_s"] for p in preds]
        pred_stalls = [
            p[1][key]["stall_s"] * p[1][key]["predicted_tpot_s"] / p[1][key]["time_s"] if p[1][key]["time_s"] else 0.0
            for p in preds
        ]
        rows.append(
            {
                "capacity": c,
                "eviction": ev,
                "prefetch": pf,
                "lookahead": s or None,
                "miss": miss,
                "measured_tpot_s": m["tpot_s"],
                "measured_tpots": m["tpots"],
                "spread": (max(m["tpots"]) - min(m["tpots"])) / m["tpot_s"],
                "baseline_tpot_s": statistics.median(p[0][base]["predicted_tpot_s"] for p in preds) if base else None,
                "predicted_tpot_s": statistics.median(pred_tpots),
                "predicted_tpots": pred_tpots,
                "measured_hit_rate": m["hits"] / m["accesses"] if m["accesses"] else None,
                "simulated_hit_rate": f["hit_rate"],
                "same_hits": m["hits"] == f["decode_counters"]["hits"] and m["accesses"] == f["decode_counters"]["accesses"],
                "measured_stall_per_token_s": m["stall_s"],
                "predicted_stall_per_token_s": statistics.median(pred_stalls),
            }
        )
    steady_rows = [r for r in rows if r["spread"] <= args.steady]

    def fit(pairs: list[tuple[float, float]]) -> dict[str, float] | None:
        pred, measured = [p for p, _ in pairs], [m for _, m in pairs]
        return (
            {"tpot_mean_abs_error": mean_abs_error(pred, measured), "spearman": spearman(pred, measured)}
            if len(pairs) > 1
            else None
        )

    def figures_of(rs: list[dict[str, Any]]) -> dict[str, Any]:
        """calibrated over every row; baseline (T_l alone) over the fetch rows, the only ones it models."""
        return {
            "calibrated": fit([(r["predicted_tpot_s"], r["measured_tpot_s"]) for r in rs]),
            "baseline": fit([(r["baseline_tpot_s"], r["measured_tpot_s"]) for r in rs if r["baseline_tpot_s"] is not None]),
        }

    figures = figures_of(rows)
    by_miss = {m: fit([(r["predicted_tpot_s"], r["measured_tpot_s"]) for r in rows if r["miss"] == m]) for m in args.miss}
    steady = {"max_spread": args.steady, "configurations": len(steady_rows), **figures_of(steady_rows)}
    t = FitTable(
        key=2,
        title=f"sim fidelity — {Path(args.model).name}, {args.link}, {args.limit} prompts x {args.max_new_tokens} tokens",
        caption="TPOT ms: measured by moeflow run (median of --repeats; spread: (max - min) / median), predicted by "
        "moeflow simulate with T_l only "
        "(baseline) and with --calibrated-time; hit, sim hit: decode hit rate of the run and the simulator (a victim is "
        "never a slot still loading, so timing moves them apart); stall, pred stall: ms per decode token waiting for "
        "copies, measured and predicted (calibrated)",
    )
    for col in (
        "C",
        "policies",
        "S",
        "hit",
        "sim hit",
        "measured",
        "spread %",
        "baseline",
        "calibrated",
        "err %",
        "stall",
        "pred stall",
    ):
        t.add_column(col, justify="left" if col == "policies" else "right")
    for r in rows:
        t.add_row(
            str(r["capacity"]),
            f"{r['eviction']}+{r['prefetch']}" + (f" miss={r['miss']}" if r["miss"] != "fetch" else ""),
            str(r["lookahead"] or "-"),
            f"{r['measured_hit_rate']:.3f}" if r["measured_hit_rate"] is not None else "-",
            f"{r['simulated_hit_rate']:.3f}",
            f"{r['measured_tpot_s'] * 1e3:.2f}",
            f"{100 * r['spread']:.0f}",
            f"{r['baseline_tpot_s'] * 1e3:.2f}" if r["baseline_tpot_s"] is not None else "-",
            f"{r['predicted_tpot_s'] * 1e3:.2f}",
            f"{100 * (r['predicted_tpot_s'] / r['measured_tpot_s'] - 1):+.1f}",
            f"{r['measured_stall_per_token_s'] * 1e3:.2f}",
            f"{r['predicted_stall_per_token_s'] * 1e3:.2f}",
        )
    Console().print(t)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cal_keep = [
        {k: c.get(k) for k in ("layer_time_s", "engine_time", "link_timing", "initial_s", "best_threads", "load_average")}
        for c in cal_recs
    ]
    (out / "sim_fidelity.json").write_text(
        json.dumps(
            {"args": vars(args), "calibration": cal_keep, "figures": figures, "steady": steady, "load": load, "rows": rows},
            indent=1,
            default=str,
        )
    )
    final = {
        "benchmark": "sim_fidelity",
        "model": args.model,
        "link": args.link,
        "configurations": len(rows),
        "same_hits": sum(r["same_hits"] for r in rows),
        **figures["calibrated"],
        "baseline": figures["baseline"],
        "by_miss": by_miss,
        "steady": steady,
        "miss_host_s": [(c.get("link_timing") or {}).get("miss_host_s") for c in cal_recs],  # per calibration
        "host_miss_s": [(c.get("link_timing") or {}).get("host_miss_s") for c in cal_recs],  # miss cpu: per calibration
        "load_average": load,
        "table": str(out / "sim_fidelity.json"),
    }
    sys.stdout.write(json.dumps(final) + "\n")
    return final


if __name__ == "__main__":
    main()
