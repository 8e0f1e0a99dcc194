"""Does `moeflow tune` pick a configuration that measures as fast as the best of a measured sweep?

    .venv/bin/python benchmarks/tune.py --calibration /tmp/qs/art/cal.json --gbps 0.03 --limit 3 \\
        --max-new-tokens 16 --work /tmp/tune-bench [--trace DIR] [--budget 25%]

1. a greedy `moeflow trace --record-hidden` of the prompts the runs decode (or `--trace`);
2. `moeflow tune` on it (`--exhaustive`) over the sweep's space, writing a run configuration;
3. a measured sweep with `moeflow run` on the emulated link `--gbps` over the same space (eviction x prefetch x
   S fixed and adaptive, miss fetch), the same prompts and token counts (`--min-new-tokens` = `--max-new-tokens`:
   every run decodes as many tokens), each run after an untimed warm-up, one thread;
4. tune's pick measured again with `moeflow run --config FILE`.
tuned_vs_best = the pick's measured TPOT / the best measured TPOT of the sweep (the pick is one of the sweep's
configurations, so the ratio is also compared with the pick's TPOT within the sweep: `tuned_in_sweep_vs_best`).
The space is a subset of tune's default (`--evictions`, `--prefetches`, `--s-values`), stated in the output.

Prints a table and, last, one JSON line. Not a test: no assertions.
"""

from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--model", default=str(REPO / "models" / "olmoe-deep"))
    ap.add_argument("--calibration", required=True, help="`moeflow calibrate --link-gbps GBPS` of this machine")
    ap.add_argument("--gbps", type=float, default=0.03, help="the emulated link (GB/s)")
    ap.add_argument("--prompts", default="sharegpt")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--evictions", default="lru,lfu,least-stale")
    ap.add_argument("--prefetches", default="none,pregate")
    ap.add_argument("--s-values", default="1,2,4,8")
    ap.add_argument("--trace", default=None, help="a trace of these prompts (default: traced here)")
    ap.add_argument("--work", default="/tmp/tune-bench")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    common = ["--model", a.model, "--prompts", a.prompts, "--limit", str(a.limit), "--max-new-tokens", str(a.max_new_tokens)]
    trace = a.trace or str(work / "trace")
    if not a.trace:
        sh(["trace", *common, "--record-hidden", "--threads", str(a.threads), "--out", trace, "--json"])

    link = f"emulated:{a.gbps:g}"
    s_values = [int(s) for s in a.s_values.split(",")]
    t0 = time.perf_counter()
    cfg_file = work / "tuned.json"
    tune_args = ["tune", "-t", trace, "--model", a.model, "--calibration", a.calibration, "--link", link]
    tune_args += ["--budget", a.budget, "-e", a.evictions, "-f", a.prefetches, "--exhaustive", "--out", str(cfg_file)]
    tune_args += [x for s in s_values for x in ("-S", str(s))] + ["--force", "--json"]
    tuned = last_json(sh(tune_args))
    tune_s = time.perf_counter() - t0
    pick = tuned["best"]
    cap = str(tuned["capacity"])

    run = ["run", *common, "--min-new-tokens", str(a.max_new_tokens), "--link", link, "--calibration", a.calibration]
    run += ["--threads", str(a.threads), "-c", cap, "--json"]
    rows: list[dict[str, Any]] = []

    def measure(extra: list[str], s: int | None, adaptive: bool) -> None:
        res = last_json(sh([*run, "--sweep", "-e", a.evictions, *extra], keep=work / f"sweep-{len(rows)}.out"))
        for r in res["runs"]:
            rows.append(
                {
                    "eviction": r["eviction"],
                    "prefetch": r["prefetch"],
                    "lookahead": s,
                    "adaptive_s": adaptive,
                    "tpot_s": r["metrics"]["tpot_s"],
                    "hit_rate": r["metrics"].get("hit_rate"),
                }
            )

    prefetches = a.prefetches.split(",")
    if "none" in prefetches:
        measure(["-f", "none"], None, False)
    pf = [p for p in prefetches if p != "none"]
    if pf:
        for s in sorted({r["lookahead"] for r in tuned["ranked"] if r["lookahead"] is not None}):  # with the calibration's S
            measure(["-f", ",".join(pf), "-S", str(s)], s, False)
        measure(["-f", ",".join(pf), "--adaptive-s"], None, True)
    # tune's pick, measured through its run configuration
    conf = last_json(
        sh(
            [
                "run",
                *common,
                "--min-new-tokens",
                str(a.max_new_tokens),
                "--threads",
                str(a.threads),
                "--config",
                str(cfg_file),
                "--json",
            ]
        )
    )
    pick_tpot = conf["runs"][0]["metrics"]["tpot_s"]

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["eviction"], r["prefetch"], r["lookahead"] if r["prefetch"] != "none" else None, bool(r["adaptive_s"]))

    pred = {key(r): r["predicted_tpot_s"] for r in tuned["ranked"]}
    best = min(rows, key=lambda r: r["tpot_s"])
    in_sweep = next((r for r in rows if key(r) == key(pick)), None)
    print(f"{'configuration':40} {'measured ms':>12} {'predicted ms':>13}")
    for r in sorted(rows, key=lambda r: r["tpot_s"]):
        p = pred.get(key(r))
        mark = " <- tune's pick" if key(r) == key(pick) else ""
        label = f"{r['eviction']}+{r['prefetch']}" + (
            " S=adaptive" if r["adaptive_s"] else f" S={r['lookahead']}" if r["lookahead"] else ""
        )
        print(f"{label:40} {r['tpot_s'] * 1e3:12.2f} {p * 1e3 if p else float('nan'):13.2f}{mark}")
    print(f"tune's pick {pick['label']} via --config: {pick_tpot * 1e3:.2f} ms; best of the sweep {best['tpot_s'] * 1e3:.2f} ms")
    out = {
        "tuned_vs_best": pick_tpot / best["tpot_s"],
        "tuned_in_sweep_vs_best": in_sweep["tpot_s"] / best["tpot_s"] if in_sweep else None,
        "pick": pick["label"],
        "pick_tpot_s": pick_tpot,
        "best_tpot_s": best["tpot_s"],
        "best": key(best),
        "sweep_runs": len(rows),
        "tune_s": tune_s,
        "space": {"evictions": a.evictions, "prefetches": a.prefetches, "s_values": s_values, "adaptive": True, "miss": "fetch"},
        "link": link,
        "capacity": tuned["capacity"],
        "prompts": a.limit,
        "max_new_tokens": a.max_new_tokens,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
