"""Does `moeflow tune` pick a configuration that measures as fast as the best of a measured sweep?

    .venv/bin/python benchmarks/tune.py --calibration /tmp/qs/art/cal.json --gbps 0.03 --limit 3 \\
        --max-new-tokens 16 --work /tmp/tune-bench [--trace DIR] [--budget 25%] [--rounds 3]

1. a greedy `moeflow trace --record-hidden` of the prompts the runs decode (or `--trace`);
2. `moeflow tune` on it (`--exhaustive`) over the sweep's space, writing a run configuration;
3. a measured sweep with `moeflow run` on the emulated link `--gbps` over the same space (eviction x prefetch x
   S fixed and adaptive x the miss policies tune searched: fetch, and cpu where the calibration measured the host's
   time per expert), the same prompts and token counts (`--min-new-tokens` = `--max-new-tokens`:
   every run decodes as many tokens), each run after an untimed warm-up, one thread;
4. tune's pick measured again with `moeflow run --config FILE`.
Noise: the sweep's runs (one `moeflow run --sweep` per prefetch and S, and the `--config` run) are interleaved
round-robin over `--rounds` rounds (each round starts one run later), and every configuration keeps the median
of its rounds' TPOTs (`min` too); `spread` = (max - min) / median of a configuration's rounds.
tuned_vs_best = the pick's median TPOT via --config / the best median TPOT of the sweep (the pick is one of the
sweep's configurations, so also its median within the sweep: `tuned_in_sweep_vs_best`; `tuned_vs_best_min`
compares the minima). The space is a subset of tune's default (`--evictions`, `--prefetches`, `--s-values`),
stated in the output. Each round costs one `moeflow run` per prefetch and S (each decoding every prompt with
every eviction policy) plus one for the pick: 6 runs with the defaults, about 8 minutes per round on the shared
2-core development machine (`--rounds 2`, `--limit 2` or fewer `--max-new-tokens` for a quicker look).

Prints a table and, last, one JSON line ending with `tuned_vs_best`. Not a test: no assertions. A run's
output is kept under `--work` and reused by a later invocation with the same command (and round).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MOEFLOW = [sys.executable, "-m", "moeflow"]


def sh(args: list[str], keep: Path | None = None) -> str:
    """Run `moeflow ARGS`; its stdout (stderr passes through). `keep`: a file holding that stdout from an earlier
    run of the same command (reused), else written."""
    if keep is not None and keep.is_file() and keep.with_suffix(".args").is_file():
        if json.loads(keep.with_suffix(".args").read_text()) == args:
            return keep.read_text()
    t0 = time.perf_counter()
    r = subprocess.run([*MOEFLOW, *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
    if r.returncode:
        raise SystemExit(f"moeflow {' '.join(args)} failed ({r.returncode})")
    print(f"[{time.perf_counter() - t0:.0f} s] moeflow {' '.join(args[:3])} ...", file=sys.stderr)
    if keep is not None:
        keep.write_text(r.stdout)
        keep.with_suffix(".args").write_text(json.dumps(args))
    return r.stdout


def last_json(out: str) -> Any:
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "olmoe-deep"), help="model directory (default %(default)s)")
    ap.add_argument(
        "--calibration", required=True, help="calibration file: `moeflow calibrate --link-gbps GBPS` of this machine (required)"
    )
    ap.add_argument("--gbps", type=float, default=0.03, help="the emulated link's bandwidth (GB/s; default %(default)s)")
    ap.add_argument("--prompts", default="sharegpt", help="prompt set name or file (default %(default)s)")
    ap.add_argument("--limit", type=int, default=3, help="prompts traced and decoded by every run (default %(default)s)")
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=16,
        help="new tokens per prompt, also the runs' --min-new-tokens (default %(default)s)",
    )
    ap.add_argument(
        "--budget",
        default="25%",
        help="tune's device memory for experts: N experts, P%% of routed experts or a size (default %(default)s)",
    )
    ap.add_argument("--evictions", default="lru,lfu", help="eviction policies of the space, comma list (default %(default)s)")
    ap.add_argument(
        "--prefetches", default="none,pregate", help="prefetch policies of the space, comma list (default %(default)s)"
    )
    ap.add_argument(
        "--s-values",
        default="1,2",
        help="fixed prefetch step sizes S of the space (MoE layers ahead), comma list;"
        " adaptive S is swept too (default %(default)s)",
    )
    ap.add_argument(
        "--trace", default=None, help="trace folder of these prompts with hidden states (default: traced here into --work)"
    )
    ap.add_argument(
        "--work",
        default="/tmp/tune-bench",
        help="work folder; outputs kept and reused by a rerun of the same command (default %(default)s)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per moeflow command (default %(default)s)")
    ap.add_argument(
        "--rounds", type=int, default=3, help="measurements of every configuration, interleaved round-robin (default %(default)s)"
    )
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    common = ["--model", a.model, "--prompts", a.prompts, "--limit", str(a.limit), "--max-new-tokens", str(a.max_new_tokens)]
    trace = a.trace or str(work / "trace")
    if not a.trace:
        sh(["trace", *common, "--record-hidden", "--batch-size", "1", "--threads", str(a.threads), "--out", trace, "--json"])

    link = f"emulated:{a.gbps:g}"
    s_values = [int(s) for s in a.s_values.split(",")]
    t0 = time.perf_counter()
    cfg_file = work / "tuned.json"
    cfg_file.with_suffix(".png").unlink(missing_ok=True)  # this folder's own plot (one from before plots were marked too)
    tune_args = ["tune", "-t", trace, "--model", a.model, "--calibration", a.calibration, "--link", link]
    tune_args += ["--budget", a.budget, "-e", a.evictions, "-f", a.prefetches, "--exhaustive", "--out", str(cfg_file)]
    tune_args += [x for s in s_values for x in ("-S", str(s))] + ["--force", "--json"]
    tuned = last_json(sh(tune_args))
    tune_s = time.perf_counter() - t0
    pick = tuned["best"]
    cap = str(tuned["capacity"])

    run = ["run", *common, "--min-new-tokens", str(a.max_new_tokens), "--link", link, "--calibration", a.calibration]
    run += ["--threads", str(a.threads), "-c", cap, "--json"]
    # one measurement job per prefetch set and S (a `run --sweep` over the evictions), and tune's pick via --config
    jobs: list[tuple[str, list[str], int | None, bool, str]] = []
    prefetches = a.prefetches.split(",")
    misses = sorted({r["miss"] for r in tuned["ranked"]})  # tune's miss dimension (cpu: a CPU calibration with it)
    for m in misses:
        sfx, mrun = ("" if m == "fetch" else f"-{m}"), [*run, "--miss", m]
        if "none" in prefetches:
            jobs.append((f"none{sfx}", [*mrun, "--sweep", "-e", a.evictions, "-f", "none"], None, False, m))
        pf = [p for p in prefetches if p != "none"]
        if pf:
            for s in sorted({r["lookahead"] for r in tuned["ranked"] if r["lookahead"] is not None}):  # with the calibration's S
                args = [*mrun, "--sweep", "-e", a.evictions, "-f", ",".join(pf), "-S", str(s)]
                jobs.append((f"S{s}{sfx}", args, s, False, m))
            jobs.append(
                (f"adaptive{sfx}", [*mrun, "--sweep", "-e", a.evictions, "-f", ",".join(pf), "--adaptive-s"], None, True, m)
            )
    conf = ["run", *common, "--min-new-tokens", str(a.max_new_tokens), "--threads", str(a.threads)]
    jobs.append(("config", [*conf, "--config", str(cfg_file), "--json"], None, False, ""))

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        s = r["lookahead"] if r["prefetch"] != "none" else None
        return (r["eviction"], r["prefetch"], s, bool(r["adaptive_s"]), r.get("miss", "fetch"))

    tpots: dict[tuple[Any, ...], list[float]] = {}
    pick_tpots: list[float] = []
    for rnd in range(a.rounds):
        for i in range(len(jobs)):
            name, args, s, adaptive, m = jobs[(i + rnd) % len(jobs)]  # round-robin, each round one job later
            res = last_json(sh(args, keep=work / f"{name}-r{rnd}.out"))
            if name == "config":
                pick_tpots.append(res["runs"][0]["metrics"]["tpot_s"])
                continue
            for r in res["runs"]:
                row = {"eviction": r["eviction"], "prefetch": r["prefetch"], "lookahead": s, "adaptive_s": adaptive, "miss": m}
                tpots.setdefault(key(row), []).append(r["metrics"]["tpot_s"])

    def summary(ts: list[float]) -> dict[str, float]:
        med = statistics.median(ts)
        return {"median": med, "min": min(ts), "max": max(ts), "spread": (max(ts) - min(ts)) / med}

    rows = {k: summary(ts) for k, ts in tpots.items()}
    pick_key = key(pick)
    pred = {key(r): r["predicted_tpot_s"] for r in tuned["ranked"]}
    best = min(rows, key=lambda k: rows[k]["median"])
    best_min = min(rows, key=lambda k: rows[k]["min"])
    pick_row = summary(pick_tpots)
    print(f"{'configuration':40} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'spread':>7} {'predicted ms':>13}")
    for k in sorted(rows, key=lambda k: rows[k]["median"]):
        r, p = rows[k], pred.get(k)
        ev, pf_, s, ad, m = k
        label = f"{ev}+{pf_}" + (" S=adaptive" if ad else f" S={s}" if s else "") + (f" miss={m}" if m != "fetch" else "")
        mark = " <- tune's pick" if k == pick_key else ""
        print(
            f"{label:40} {r['median'] * 1e3:10.2f} {r['min'] * 1e3:8.2f} {r['max'] * 1e3:8.2f} {r['spread']:7.1%} "
            f"{p * 1e3 if p else float('nan'):13.2f}{mark}"
        )
    print(
        f"tune's pick {pick['label']} via --config: median {pick_row['median'] * 1e3:.2f} ms (spread {pick_row['spread']:.1%}); "
        f"best median of the sweep {rows[best]['median'] * 1e3:.2f} ms; {a.rounds} rounds"
    )
    spreads = [r["spread"] for r in rows.values()]
    out = {
        "pick": pick["label"],
        "pick_tpot_s": pick_row["median"],
        "pick_spread": pick_row["spread"],
        "best": best,
        "best_tpot_s": rows[best]["median"],
        "rounds": a.rounds,
        "spread_median": statistics.median(spreads),
        "spread_max": max(spreads),
        "sweep_configs": len(rows),
        "tune_s": tune_s,
        "space": {"evictions": a.evictions, "prefetches": a.prefetches, "s_values": s_values, "adaptive": True, "misses": misses},
        "link": link,
        "capacity": tuned["capacity"],
        "prompts": a.limit,
        "max_new_tokens": a.max_new_tokens,
        "tuned_in_sweep_vs_best": rows[pick_key]["median"] / rows[best]["median"] if pick_key in rows else None,
        "tuned_vs_best_min": pick_row["min"] / rows[best_min]["min"],
        "tuned_vs_best": pick_row["median"] / rows[best]["median"],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
