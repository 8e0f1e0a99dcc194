"""Fidelity: what each lossy policy costs in quality against what it gains in speed (SpecMD Fig. 7's kind).

Sweeps, on the default model over the emulated link, at 5% and 25% capacity (`--capacity`):
- every miss policy registered (`fetch` and, when they exist, drop, substitute, fetch-lowest-bit,
  fetch-priority, cascade, cpu, auto), with standard routing; a policy that takes a `bits` option is swept
  over the precisions (8, 4, 2 bits); a name not registered yet is SKIPPED and printed;
- `cache-aware` routing at lambda in {0, 0.1, 0.3, 0.5, 1.0} and `hit-first` (when registered), with fetch;
- `--speculative` with `router-pf` when `--predictors DIR` is given.
Every configuration runs through `moeflow quality` (moeflow.stages.quality.main: perplexity scored token by token
under the engine, greedy agreement, TPOT and bytes per token of the same run, vs resident). Quality change
and speed change are taken relative to `fetch` at the same capacity.

Every perplexity change comes with its 95% interval (`dppl_ci95` vs resident, `vs_fetch_ppl_ci95` vs fetch:
a paired bootstrap over blocks of scored tokens, `moeflow.quality.measure.dppl_interval`) and says whether it
is within noise (the interval holds 0).

Writes `--out-dir`/fidelity.json (every row), fidelity.png (perplexity change vs TPOT gain relative to fetch,
one marker per configuration with its interval, exact ones hollow) and prints the table, then one JSON line
naming the recommended configuration: the fastest lossy one whose perplexity loss is <= `--max-ppl-loss` % (1)
at the top of its 95% interval (not only at its point estimate: a loss the sample cannot bound is no reason to
recommend) and that is faster than the best exact configuration at its capacity, with `ppl_delta_pct` and
`dppl_ci95` (vs resident = vs fetch, which is exact) and `tpot_gain_pct` (vs the best exact configuration at the
same capacity), or `"recommended": null`.

    .venv/bin/python benchmarks/fidelity.py --threads 1
    .venv/bin/python benchmarks/fidelity.py --model DIR --device cuda --link cuda --predictors artifacts/olmoe-mini/predictors
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from moeflow.models import default_model_path
from moeflow.policies import MISS, ROUTING
from moeflow.quality.measure import dppl_cell, dppl_interval, within_noise
from moeflow.stages.quality import main as quality_main
from moeflow.stages.quality_config import QualityConfig
from moeflow.stages.run_config import RunConfig
from moeflow.tables import FitTable

MISS_POLICIES = ("fetch", "drop", "substitute", "fetch-lowest-bit", "fetch-priority", "cascade", "cpu", "auto")
LAMBDAS = (0.0, 0.1, 0.3, 0.5, 1.0)
BITS = (8, 4, 2)


def takes(registry: Any, name: str, option: str) -> bool:
    try:
        return option in inspect.signature(registry[name]).parameters
    except (TypeError, ValueError):
        return False


def configurations(
    lambdas: tuple[float, ...], say: Any, only_misses: tuple[str, ...] | None = None, hit_first: bool = True
) -> tuple[list[str], list[str]]:
    """(miss policies with standard routing, routing policies with fetch), skipping what is not registered.

    `only_misses` (`--misses`): exactly these miss specs (`name[:key=value]`, checked against the registry) instead of
    every registered policy and precision; `hit_first=False` (`--no-hit-first`) leaves hit-first out."""
    misses: list[str] = []
    if only_misses is not None:
        for spec in only_misses:
            if spec.partition(":")[0] not in MISS:
                say(f"SKIP miss {spec}: not registered")
            else:
                misses.append(spec)
    for name in MISS_POLICIES if only_misses is None else ():
        if name not in MISS:
            say(f"SKIP miss {name}: not registered yet")
        elif takes(MISS, name, "bits"):
            misses += [f"{name}:bits={b}" for b in BITS]
        else:
            misses.append(name)
    routings: list[str] = []
    if not lambdas:
        pass
    elif "cache-aware" in ROUTING:
        key = next((k for k in ("lambda_", "lam", "lambda", "lmbda") if takes(ROUTING, "cache-aware", k)), "lambda")
        routings += [f"cache-aware:{key}={lam}" for lam in lambdas]
    else:
        say("SKIP routing cache-aware (lambda sweep): not registered yet")
    if not hit_first:
        pass
    elif "hit-first" in ROUTING:
        routings.append("hit-first")
    else:
        say("SKIP routing hit-first: not registered yet")
    return misses, routings


def relative(rows: list[dict[str, Any]]) -> None:
    """Per capacity: ppl change and TPOT gain vs fetch, TPOT gain vs the best exact configuration."""
    for cap in {r["capacity"] for r in rows}:
        same = [r for r in rows if r["capacity"] == cap]
        fetch = next((r for r in same if r["miss"] == "fetch" and r["routing"] == "standard" and not r["speculative"]), None)
        exact_tpots = [r["tpot_s"] for r in same if not r["lossy"] and r["tpot_s"]]
        best_exact = min(exact_tpots) if exact_tpots else None
        for r in same:
            r["vs_fetch_ppl_pct"] = (
                100 * (r["ppl"] / fetch["ppl"] - 1) if fetch and r["ppl"] is not None and fetch["ppl"] else None
            )
            ci = None
            if r["vs_fetch_ppl_pct"] is not None and fetch and r.get("token_nll") and fetch.get("token_nll"):
                ci = dppl_interval(r["token_nll"], fetch["token_nll"])
            r["vs_fetch_ppl_ci95"] = list(ci) if ci is not None else None
            r["vs_fetch_ppl_within_noise"] = within_noise(ci)
            r["vs_fetch_tpot_gain_pct"] = (
                100 * (1 - r["tpot_s"] / fetch["tpot_s"]) if fetch and r["tpot_s"] and fetch["tpot_s"] else None
            )
            r["tpot_gain_pct"] = 100 * (1 - r["tpot_s"] / best_exact) if best_exact and r["tpot_s"] else None


def loss_bound(r: dict[str, Any]) -> float | None:
    """The most perplexity a row may lose vs resident at 95% confidence (its interval's top), else None."""
    ci = r.get("dppl_ci95")
    return ci[1] if ci is not None else None


def recommend(rows: list[dict[str, Any]], max_loss: float) -> dict[str, Any] | None:
    """The fastest lossy row whose loss is <= `max_loss` % at the top of its interval (a point estimate inside
    the noise bounds nothing) and that is faster than the best exact configuration at its capacity."""
    ok = [
        r for r in rows if r["lossy"] and (b := loss_bound(r)) is not None and b <= max_loss and (r["tpot_gain_pct"] or 0) > 0
    ]  # a lossy configuration no faster than the best exact one is never worth recommending
    return max(ok, key=lambda r: r["tpot_gain_pct"]) if ok else None


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    markers = {}
    for r in rows:
        x, y = r.get("vs_fetch_tpot_gain_pct"), r.get("vs_fetch_ppl_pct")
        if x is None or y is None:
            continue
        m = markers.setdefault(r["capacity"], "os^Dv"[len(markers) % 5])
        ci = r.get("vs_fetch_ppl_ci95")
        if ci is not None:  # the 95% interval of the perplexity change
            ax.errorbar(x, y, yerr=[[max(0.0, y - ci[0])], [max(0.0, ci[1] - y)]], color="grey", lw=0.8, capsize=2)
        ax.scatter(x, y, marker=m, facecolors="none" if not r["lossy"] else None, edgecolors="k", s=40)
        ax.annotate(r["config"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    for cap, m in markers.items():
        ax.scatter([], [], marker=m, color="k", label=f"capacity {cap}")
    ax.axhline(0, color="grey", lw=0.5)
    ax.axvline(0, color="grey", lw=0.5)
    ax.set_xlabel("TPOT gain vs fetch (%)  (faster →)")
    ax.set_ylabel("perplexity change vs fetch (%, 95% interval)  (worse ↑)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=default_model_path(), help="model directory (default %(default)s)")
    ap.add_argument(
        "--link",
        default="emulated:2,10",
        help="transfer link: emulated:GBPS[,LATENCY_US] (GB/s, us), direct or cuda (default %(default)s)",
    )
    ap.add_argument("--device", default="cpu", help="torch device: cpu or cuda (default %(default)s)")
    ap.add_argument(
        "--capacity",
        default="5%,25%",
        help="device expert slots, comma list: N experts, P%% of routed experts or a size (default %(default)s)",
    )
    ap.add_argument(
        "--lambdas", default=",".join(map(str, LAMBDAS)), help="cache-aware routing lambdas, comma list (default %(default)s)"
    )
    ap.add_argument("--prefetch", default="pregate", help="prefetch policy of every configuration (default %(default)s)")
    ap.add_argument("--eviction", default="lru", help="eviction policy of every configuration (default %(default)s)")
    ap.add_argument("--predictors", default=None, help="predictor folder: adds router-pf --speculative (default: none, not run)")
    ap.add_argument("--prompts", default="alpaca", help="prompt set name or file (default %(default)s)")
    ap.add_argument("--limit", type=int, default=4, help="prompts of --prompts (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt, also the min (default %(default)s)")
    ap.add_argument("--ppl-tokens", type=int, default=256, help="scored tokens per perplexity window (default %(default)s)")
    ap.add_argument("--ppl-windows", type=int, default=2, help="perplexity windows; 0: no perplexity (default %(default)s)")
    ap.add_argument(
        "--task", default="none", choices=("mmlu", "gsm8k", "none"), help="task accuracy measured too (default %(default)s)"
    )
    ap.add_argument("--task-limit", type=int, default=40, help="questions of --task (default %(default)s)")
    ap.add_argument(
        "--max-ppl-loss",
        type=float,
        default=1.0,
        help="largest perplexity loss recommended, at the top of its 95%% interval (percent; default %(default)s)",
    )
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
        "--out-dir", default="benchmarks/results/fidelity", help="folder for fidelity.json and fidelity.png (default %(default)s)"
    )
    ap.add_argument(
        "--misses",
        default=None,
        help="comma list of miss specs (name[:key=value]) instead of every registered one (default: every registered one)",
    )
    ap.add_argument(
        "--no-hit-first",
        action="store_true",
        help="leave the hit-first routing configuration out (default: included when registered)",
    )
    ap.add_argument(
        "--lookahead", type=int, default=None, help="prefetch step size S (MoE layers ahead; default: as moeflow quality)"
    )
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    say = lambda s: console.print(f"[yellow]{s}[/]")  # noqa: E731
    caps = tuple(c.strip() for c in args.capacity.split(",") if c.strip())
    only = tuple(m.strip() for m in args.misses.split(",") if m.strip()) if args.misses is not None else None
    lambdas = tuple(float(x) for x in args.lambdas.split(",") if x.strip())
    misses, routings = configurations(lambdas, say, only, hit_first=not args.no_hit_first)
    base = RunConfig(
        model=args.model,
        prompts=args.prompts,
        data_dir=args.data_dir,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.max_new_tokens,
        capacities=caps,
        evictions=(args.eviction,),
        prefetches=(args.prefetch,),
        link=args.link,
        lookahead=args.lookahead,
        device=args.device,
        threads=args.threads,
        sweep=True,
    )
    q = dict(ppl_tokens=args.ppl_tokens, ppl_windows=args.ppl_windows, task=args.task, task_limit=args.task_limit)
    groups = [QualityConfig(run=base, misses=tuple(misses), routings=("standard",), **q)]  # type: ignore[arg-type]
    if routings:
        groups.append(QualityConfig(run=base, misses=("fetch",), routings=tuple(routings), **q))  # type: ignore[arg-type]
    if args.predictors:
        spec_run = dataclasses.replace(
            base, prefetches=("router-pf",), prefetch_opts=(("predictors", args.predictors),), speculative=True
        )
        groups.append(QualityConfig(run=spec_run, **q))  # type: ignore[arg-type]
    else:
        say("SKIP --speculative: no --predictors DIR")
    rows: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    for g in groups:
        rep = quality_main(g, console=console)
        for r in rep["runs"]:
            if r["mode"] != "offload":
                continue
            key = (r["capacity"], r["miss"], r["routing"], r["speculative"], r["prefetch"])
            if key in seen:
                continue
            seen.add(key)
            parts = [r["miss"] if r["miss"] != "fetch" or r["routing"] == "standard" else None]
            parts += [r["routing"] if r["routing"] != "standard" else None, "speculative" if r["speculative"] else None]
            config = " ".join(x for x in parts if x)
            rows.append({"config": config, **{k: r[k] for k in ROW_KEYS}, "tpot_s": r["tpot_s"], "token_nll": r["ppl_token_nll"]})
    relative(rows)
    for r in rows:
        del r["token_nll"]  # per-token NLLs: the intervals are computed
    rec = recommend(rows, args.max_ppl_loss)
    t = FitTable(
        key=2,
        title=f"fidelity — {Path(args.model).name}, {args.link} (quality vs speed, relative to fetch)",
        caption="ppl Δ%: vs resident [95% interval, paired bootstrap over blocks of scored tokens]; within noise: the "
        f"interval holds 0. Recommended only with a loss <= {args.max_ppl_loss:g}% at the interval's top",
    )
    for c in ("capacity", "config", "exact", "ppl Δ% vs resident", "agree", "TPOT ms", "TPOT gain % vs fetch", "bytes/tok"):
        t.add_column(c, justify="left" if c in ("capacity", "config", "exact") else "right")
    for r in rows:
        t.add_row(
            r["capacity"],
            r["config"],
            Text("LOSSY", style="bold red") if r["lossy"] else "exact",
            dppl_cell(r["ppl_delta_pct"], r["dppl_ci95"]),
            f"{r['agreement']:.3f}" if r["agreement"] is not None else "-",
            f"{r['tpot_s'] * 1e3:.2f}" if r["tpot_s"] else "-",
            f"{r['vs_fetch_tpot_gain_pct']:+.1f}" if r["vs_fetch_tpot_gain_pct"] is not None else "-",
            f"{r['bytes_per_token']:.0f}" if r["bytes_per_token"] is not None else "-",
        )
    Console().print(t)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1, default=str))
    plot(rows, out / "fidelity.png", f"{Path(args.model).name}, {args.link}: quality vs speed relative to fetch")
    final = {
        "benchmark": "fidelity",
        "model": args.model,
        "link": args.link,
        "configurations": len(rows),
        "table": str(out / "fidelity.json"),
        "plot": str(out / "fidelity.png"),
        "recommended": None if rec is None else {"capacity": rec["capacity"], "config": rec["config"]},
        "ppl_delta_pct": None if rec is None else rec["ppl_delta_pct"],
        "dppl_ci95": None if rec is None else rec["dppl_ci95"],
        "tpot_gain_pct": None if rec is None else rec["tpot_gain_pct"],
    }
    sys.stdout.write(json.dumps(final, default=str) + "\n")
    return final


ROW_KEYS = (
    "capacity",
    "capacity_experts",
    "miss",
    "routing",
    "speculative",
    "lossy",
    "ppl",
    "ppl_tokens",
    "ppl_delta_pct",
    "dppl_ci95",
    "dppl_within_noise",
    "agreement",
    "first_divergence",
    "tf_agreement",
    "task",
    "bytes_per_token",
)

if __name__ == "__main__":
    main()
