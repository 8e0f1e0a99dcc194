"""CPU compute vs fetch on a miss: where running an expert on the host beats copying it.

Two measurements on the default model (CPU device, so the host store and the "device" share one CPU; the
emulated link supplies the copy cost):

1. the host side of the cost model, measured: one expert of the first MoE layer run on the host from the
   host store's row for T tokens (T = 1, 4, 16, 64; `OffloadEngine.time_host_expert`), beside the copy
   time of one expert row on each emulated link (latency + bytes / bandwidth). The analytic crossover
   bandwidth for T tokens is bytes / (host(T) - latency): below it `cpu` is cheaper than a copy;
2. TPOT of `--miss fetch`, `--miss cpu` and `--miss auto` side by side at each bandwidth of `--gbps`
   (same prompts, greedy, equal lengths, each configuration after an untimed warm-up on an engine of its
   own; `--rounds` rounds over every configuration, the fastest TPOT of each kept, to damp the noise of a
   shared machine). Decode passes route 1 token per call, so the relevant host time is host(1).
   The measured crossover is where TPOT(cpu) / TPOT(fetch) crosses 1 (log-interpolated between the two
   bandwidths that bracket it). `auto / best` is auto's TPOT over the faster of fetch and cpu; its largest
   value over the bandwidths is `auto_vs_best_max` (target <= 1.05). Host experts run on the engine's host
   worker beside the device's work: `cpu hid` / `auto hid` are the shares of host time hidden behind it
   (1 - host wait / host time, `RunMetrics.host_hidden_share`). `cpu` never copies, so its TPOT does not
   depend on the bandwidth: the spread of its TPOTs over the bandwidths (`cpu_tpot_spread`, max / min) is the
   run's noise floor, against which to read `auto / best`.

Default: capacity 25%, eviction lru, no prefetch (every miss is a demand miss, the case the miss policy
decides; `--prefetch pregate` for the prefetching engine). With `cpu` a missing expert never enters the
cache (it is computed where it lives), so at a given capacity cpu also gives up the hits a fetch would
have earned later: the measured crossover includes that effect, the analytic one does not.
Every run is checked token-identical to `fetch` (cpu and auto are exact on a CPU device).

Prints two tables, then one JSON line.

    .venv/bin/python benchmarks/cpu_vs_fetch.py --threads 1
    .venv/bin/python benchmarks/cpu_vs_fetch.py --gbps 0.1,1,4 --rounds 1 --limit 2   # quicker
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from moeflow.data.prompts import load_prompts
from moeflow.models import default_model_path, load_model
from moeflow.moe import get_adapter
from moeflow.policies.parse import parse_capacity
from moeflow.runtime.generate import build_engine, generate_one
from moeflow.runtime.link import EmulatedLink
from moeflow.runtime.metrics import RunMetrics

POLICIES = ("fetch", "cpu", "auto")
HOST_TOKENS = (1, 4, 16, 64)


def crossover(points: list[tuple[float, float]]) -> float | None:
    """The bandwidth where ratio (cpu / fetch TPOT) first crosses 1 going up in bandwidth, log-interpolated;
    None when it never does within the sweep. `points`: (gbps, ratio), sorted by gbps."""
    for (b0, r0), (b1, r1) in zip(points, points[1:]):
        if r0 <= 1.0 < r1 or r0 < 1.0 <= r1:
            x0, x1, y0, y1 = math.log(b0), math.log(b1), math.log(r0), math.log(r1)
            return math.exp(x0 + (0.0 - y0) * (x1 - x0) / (y1 - y0)) if y1 != y0 else b0
    return None


def run_one(model, prompts, engine, new_tokens: int, label: str) -> tuple[RunMetrics, list[torch.Tensor]]:
    ms, outs = [], []
    for ids in prompts:
        new, m = generate_one(model, ids, engine, max_new_tokens=new_tokens, min_new_tokens=new_tokens, label=label)
        ms.append(m)
        outs.append(new)
    return RunMetrics.total(ms, label), outs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--gbps", default="0.1,0.3,1,4,32", help="emulated link bandwidths (GB/s)")
    ap.add_argument("--latency-us", type=float, default=10.0)
    ap.add_argument("--capacity", default="25%")
    ap.add_argument("--eviction", default="lru")
    ap.add_argument("--prefetch", default="none")
    ap.add_argument("--prompts", default="alpaca")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--max-prompt-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="rounds over every configuration; fastest TPOT kept")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    con = Console(width=150, stderr=True)
    gbps = sorted(float(x) for x in args.gbps.split(",") if x.strip())
    lat = args.latency_us * 1e-6
    model, tok = load_model(args.model, device="cpu", experts_implementation="grouped_mm")
    spec = get_adapter(model).spec
    capacity = parse_capacity(args.capacity, total_experts=spec.total_experts, expert_bytes=spec.expert_bytes)
    prompts = [
        tok(p.text, return_tensors="pt").input_ids[:, : args.max_prompt_tokens]
        for p in load_prompts(args.prompts, data_dir=args.data_dir, limit=args.limit)
    ]

    # 1. host compute of one expert for T tokens vs one copy
    probe = build_engine(model, mode="offload", link=EmulatedLink(gbps[0], lat), capacity=capacity, eviction=args.eviction)
    assert probe is not None
    with probe:
        nbytes = probe.store.expert_bytes
        host = {t: min(probe.time_host_expert(t) for _ in range(3)) for t in HOST_TOKENS}
    analytic = {t: (nbytes / (h - lat) / 1e9 if h > lat else None) for t, h in host.items()}  # GB/s
    t1 = Table(title=f"host compute of one expert ({nbytes / 1e6:.3f} MB row) vs one copy over the emulated link")
    t1.add_column("tokens / call", justify="right")
    t1.add_column("host ms", justify="right")
    for b in gbps:
        t1.add_column(f"copy {b:g} GB/s", justify="right")
    t1.add_column("crossover GB/s", justify="right")
    for t, h in host.items():
        cells = []
        for b in gbps:
            c = lat + nbytes / (b * 1e9)
            cells.append(f"{c * 1e3:.3f} ({'cpu' if h < c else 'fetch'})")
        a = analytic[t]
        t1.add_row(str(t), f"{h * 1e3:.3f}", *cells, "-" if a is None else f"{a:.2f}")
    Console(width=200).print(t1)

    # 2. TPOT side by side, `rounds` rounds over every (bandwidth, policy)
    best: dict[tuple[float, str], RunMetrics] = {}
    info: dict[tuple[float, str], dict[str, Any]] = {}
    ref_out: dict[float, list[torch.Tensor]] = {}
    exact = True
    for rnd in range(args.rounds):
        for b in gbps:
            for pol in POLICIES:
                label = f"{pol} @ {b:g} GB/s"
                warm = build_engine(
                    model, mode="offload", link=EmulatedLink(b, lat), capacity=capacity, eviction=args.eviction,
                    prefetch=args.prefetch, miss=pol,
                )  # fmt: skip
                assert warm is not None
                with warm:
                    generate_one(model, prompts[0], warm, max_new_tokens=4, min_new_tokens=4)
                eng = build_engine(
                    model, mode="offload", link=EmulatedLink(b, lat), capacity=capacity, eviction=args.eviction,
                    prefetch=args.prefetch, miss=pol,
                )  # fmt: skip
                assert eng is not None
                with eng:
                    m, outs = run_one(model, prompts, eng, args.new_tokens, label)
                    dec = dict(getattr(eng.miss, "decisions", {}) or {})
                    info_now = {
                        "host_calls": eng.miss_counts.get("cpu", 0),
                        "host_s": eng.host_s,
                        "host_hidden_share": m.host_hidden_share,
                        "auto_cpu_share": (dec.get("cpu", 0) / max(1, sum(dec.values()))) if pol == "auto" else None,
                    }
                if pol == "fetch":
                    ref_out.setdefault(b, outs)
                elif b in ref_out:
                    exact = exact and all(torch.equal(x, y) for x, y in zip(outs, ref_out[b]))
                key = (b, pol)
                if key not in best or (m.tpot_s or math.inf) < (best[key].tpot_s or math.inf):
                    best[key], info[key] = m, info_now
                con.print(f"[dim]round {rnd + 1}/{args.rounds} {label}: TPOT {1e3 * (m.tpot_s or 0):.2f} ms[/]")

    t2 = Table(
        title=f"TPOT, {spec.arch} C={capacity} ({args.capacity}), {args.eviction}+{args.prefetch}, fastest of {args.rounds}"
    )
    cols = ("GB/s", "fetch ms", "cpu ms", "auto ms", "cpu/fetch", "auto/best", "auto→cpu", "cpu hid", "auto hid", "fetch MB/tok")
    for c in cols:
        t2.add_column(c, justify="right")
    rows, ratio_pts = [], []
    for b in gbps:
        f, c, a = (best[(b, p)].tpot_s or math.nan for p in POLICIES)
        r, ab = c / f, a / min(f, c)
        ratio_pts.append((b, r))
        share = info[(b, "auto")]["auto_cpu_share"]
        hid_c, hid_a = info[(b, "cpu")]["host_hidden_share"], info[(b, "auto")]["host_hidden_share"]
        fbytes = best[(b, "fetch")].bytes_per_token or 0.0
        t2.add_row(
            f"{b:g}", f"{f * 1e3:.2f}", f"{c * 1e3:.2f}", f"{a * 1e3:.2f}", f"{r:.2f}", f"{ab:.2f}",
            "-" if share is None else f"{share:.0%}", "-" if hid_c is None else f"{hid_c:.0%}",
            "-" if hid_a is None else f"{hid_a:.0%}", f"{fbytes / 1e6:.2f}",
        )  # fmt: skip
        rows.append(
            {
                "gbps": b,
                "tpot_fetch_s": f,
                "tpot_cpu_s": c,
                "tpot_auto_s": a,
                "cpu_over_fetch": r,
                "auto_over_best": ab,
                "auto_cpu_share": share,
                "cpu_host_hidden_share": hid_c,
                "auto_host_hidden_share": hid_a,
                "fetch_bytes_per_token": fbytes,
            }
        )
    Console(width=200).print(t2)
    cpu_tpots = [r["tpot_cpu_s"] for r in rows]
    spread = max(cpu_tpots) / min(cpu_tpots)
    con.print(f"cpu TPOT spread over the bandwidths (noise floor; cpu never copies): {spread:.2f}x")
    measured = crossover(ratio_pts)
    final = {
        "benchmark": "cpu_vs_fetch",
        "model": args.model,
        "capacity": capacity,
        "eviction": args.eviction,
        "prefetch": args.prefetch,
        "latency_us": args.latency_us,
        "expert_bytes": nbytes,
        "host_s": {str(t): h for t, h in host.items()},
        "analytic_crossover_gbps": {str(t): a for t, a in analytic.items()},
        "measured_crossover_gbps": measured,
        "cpu_wins_below_gbps": measured,
        "auto_over_best_max": max(r["auto_over_best"] for r in rows),
        "token_identical": exact,
        "cpu_tpot_spread": spread,
        "rows": rows,
        "auto_vs_best_max": max(r["auto_over_best"] for r in rows),  # the figure scripts read: last
    }
    sys.stdout.write(json.dumps(final) + "\n")
    return final


if __name__ == "__main__":
    main()
