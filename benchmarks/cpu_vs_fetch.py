"""CPU compute vs fetch on a miss: where running an expert on the host beats copying it.

Two measurements on the default model (CPU device, so the host store and the "device" share one CPU; the
emulated link supplies the copy cost):

1. the host side of the cost model, measured: one expert of the first MoE layer run on the host from the
   host store's row for T tokens (T = 1, 4, 16, 64; `OffloadEngine.time_host_expert`), beside the copy
   time of one expert row on each emulated link (latency + bytes / bandwidth). The analytic crossover
   bandwidth for T tokens is bytes / (host(T) - latency): below it `cpu` is cheaper than a copy;
2. TPOT of `--miss fetch`, `--miss cpu` and `--miss auto` side by side at each bandwidth of `--gbps` (same
   prompts, greedy, equal lengths), all in one process with the model loaded once: one untimed warm-up per
   policy, then `--rounds` rounds; in each round every bandwidth runs the policies back to back, each on a
   fresh engine, in an order rotated per round and bandwidth (fetch-cpu-auto, cpu-auto-fetch, ...) so the
   drift of a shared machine falls on all of them alike. `--pinned` adds `auto` pinned to fetch and to cpu
   (priors that force one side, calibrating as usual: the same choices as that policy), and their TPOT over
   that policy's: auto's own overhead, apart from its choices (`pinned_over_policy`). Every decode step
   replays the same tokens in every round, so a configuration's TPOT is the mean over its decode steps of
   each step's median round (`floor`: its fastest round; `runs`: the median of the runs' own TPOTs);
   `spread` is the slowest run's TPOT over the fastest's. Decode passes route 1 token per call, so the
   relevant host time is host(1). The measured crossover is where TPOT(cpu) / TPOT(fetch) crosses 1
   (log-interpolated between the two bandwidths that bracket it). `auto / best` is auto's TPOT over the
   faster of fetch and cpu, from the per-step medians above. `side`: the same ratio measured side by side,
   auto / min(fetch, cpu) = the larger of auto / fetch and auto / cpu, each the median over rounds of the ratio
   of two runs back to back in one round (a shared machine's drift over a run of minutes, which moves every
   policy of a round alike, cancels in each ratio; the per-step medians take each policy's rounds apart and
   mix fast and slow rounds); its largest value over the bandwidths is `auto_vs_best_max` (target <= 1.05).
   `paired`: per round, auto's TPOT over the faster of the fetch and cpu runs back to back with it, the median
   round (`auto_over_best_paired_max`; the minimum of two noisy runs, so biased above `side` when fetch and cpu
   are close). Host experts run on the engine's host worker beside the device's work;
   with `cpu` at this capacity nothing ever enters the cache, so every call is all-host: on a CPU device such a
   call either splits its host experts between the worker and the calling thread or computes them all on the
   calling thread, whichever its `SplitChoice` measures faster (`split c/a`: the share of cpu's / auto's all-host
   calls split; `--host-split on|off` forces it, to measure what splitting gains on the machine at hand); the
   overlap per bandwidth: host busy seconds per token and the part of them
   hidden behind the device (busy - the experts calls' wait for the host), and its share
   (`RunMetrics.host_hidden_share`). Per miss, the measured waits (fetch: the compute's wait per demand
   load; cpu: the wait per host expert) beside `auto`'s cost model at the end of its run (cost_cpu of a
   1-token miss with its later hits, cost_fetch, reuse). `cpu` never copies, so its TPOT does not depend on
   the bandwidth: the spread of its TPOTs over the bandwidths (`cpu_tpot_spread`, max / min) is the run's
   noise floor, against which to read `auto / best`; the 1-min load average after each round is printed.

Default: capacity 25%, eviction lru, no prefetch (every miss is a demand miss, the case the miss policy
decides; `--prefetch pregate` for the prefetching engine). With `cpu` a missing expert never enters the
cache (it is computed where it lives), so at a given capacity cpu also gives up the hits a fetch would
have earned later: the measured crossover includes that effect, the analytic one does not.
Every run is checked token-identical to `fetch` (cpu and auto are exact on a CPU device; on CUDA a host expert
computes on the CPU, whose rounding differs from the GPU's, so there `token_identical` can be false and cpu/auto are
lossy). `--device cuda`: the model on the GPU and the real CUDA link (pinned host rows, side streams), whose
bandwidth, measured on one expert row, is the single bandwidth of the sweep.

Prints three tables (four with `--pinned`), then one JSON line.

    .venv/bin/python benchmarks/cpu_vs_fetch.py --threads 1
    .venv/bin/python benchmarks/cpu_vs_fetch.py --gbps 0.1,1,4 --rounds 3 --limit 2   # quicker
    .venv/bin/python benchmarks/cpu_vs_fetch.py --gbps 0.1,32 --pinned   # auto's overhead at the two ends
    .venv/bin/python benchmarks/cpu_vs_fetch.py --device cuda --rounds 3   # on a GPU, over its real link
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

import torch
from rich.console import Console

from moeflow.data.prompts import load_prompts
from moeflow.models import default_model_path, load_model
from moeflow.moe import get_adapter
from moeflow.policies.parse import parse_capacity
from moeflow.runtime.generate import PassClock, build_engine, generate_one
from moeflow.runtime.link import CudaLink, EmulatedLink, Link
from moeflow.runtime.metrics import RunMetrics
from moeflow.runtime.timing import settle_heap
from moeflow.tables import FitTable

POLICIES = ("fetch", "cpu", "auto")
# `--pinned`: auto with priors that force one side (host time 1 s and the device's free: always fetch; host time 0
# and a 1 s copy: always cpu), calibrating as usual, so it makes the same choices as the policy it is pinned to and
# only its overhead differs
PINNED = {
    "auto=fetch": ("auto", {"host_s": 1.0, "per_token_s": 0.0, "device_s": 0.0}),
    "auto=cpu": ("auto", {"host_s": 0.0, "per_token_s": 0.0, "copy_s": 1.0}),
}
HOST_TOKENS = (1, 4, 16, 64)


def crossover(points: list[tuple[float, float]]) -> float | None:
    """The bandwidth where ratio (cpu / fetch TPOT) first crosses 1 going up in bandwidth, log-interpolated;
    None when it never does within the sweep. `points`: (gbps, ratio), sorted by gbps."""
    for (b0, r0), (b1, r1) in zip(points, points[1:]):
        if r0 <= 1.0 < r1 or r0 < 1.0 <= r1:
            x0, x1, y0, y1 = math.log(b0), math.log(b1), math.log(r0), math.log(r1)
            return math.exp(x0 + (0.0 - y0) * (x1 - x0) / (y1 - y0)) if y1 != y0 else b0
    return None


def run_one(model, prompts, engine, new_tokens: int, label: str) -> tuple[RunMetrics, list[torch.Tensor], list[float]]:
    """Every prompt on `engine`: (metrics, each prompt's new tokens, the seconds of each decode step, prompt by prompt)."""
    ms, outs, steps = [], [], []
    for ids in prompts:
        clock = PassClock(model)  # the end of every forward pass
        try:
            new, m = generate_one(model, ids, engine, max_new_tokens=new_tokens, min_new_tokens=new_tokens, label=label)
        finally:
            clock.remove()
        ms.append(m)
        outs.append(new)
        steps += [b - a for a, b in zip(clock.ends, clock.ends[1:])]  # decode steps (the first pass is the prefill)
    return RunMetrics.total(ms, label), outs, steps


def rotation(rnd: int, i: int, pols: tuple[str, ...] = POLICIES) -> tuple[str, ...]:
    """The policies' order for turn `rnd` at the `i`-th bandwidth: `pols` rotated by rnd + i, so each policy
    runs first, second and last equally often and the machine's drift falls on all of them alike."""
    k = (rnd + i) % len(pols)
    return pols[k:] + pols[:k]


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def side_by_side(mine: list[float], *others: list[float]) -> float:
    """My TPOT over the fastest of `others`, measured side by side: round r's runs (`mine[r]`, `other[r]`) ran
    back to back, so a drift of the machine between rounds moves both alike and cancels in their ratio; per
    other, the median round's ratio; over the others, the largest (mine / min(others) = max of mine / other)."""
    return max(median([m / o for m, o in zip(mine, other, strict=True)]) for other in others)


def measure(eng, m: RunMetrics, pol: str) -> dict[str, Any]:
    """One run's per-token figures: misses, the overlap (host busy / waited / hidden seconds) and the measured
    per-miss costs (link wait per demand load; host wait per host expert); for auto its model's estimates."""
    dec = dict(getattr(eng.miss, "decisions", {}) or {})
    host_n = eng.miss_counts.get("cpu", 0)
    c = m.counters
    out = {
        "tpot_s": m.tpot_s or math.nan,
        "host_experts": host_n,
        "demand_loads": c.demand_loads,
        "host_busy_s": m.host_s,
        "host_wait_s": m.host_wait_s,
        "host_hidden_s": max(0.0, m.host_s - m.host_wait_s),
        "host_hidden_share": m.host_hidden_share,
        "fetch_wait_per_miss_s": c.stall_s / c.demand_loads if c.demand_loads else None,
        "host_wait_per_miss_s": m.host_wait_s / host_n if host_n else None,
        "auto_cpu_share": (dec.get("cpu", 0) / max(1, sum(dec.values()))) if pol == "auto" else None,
    }
    host = eng.host
    if host is not None and eng.device.type == "cpu":  # all-host calls split with the worker / all of them
        used = host.split.used
        out["split_share"] = used[True] / (used[True] + used[False]) if used[True] + used[False] else None
    if pol == "auto":
        cost_cpu, cost_fetch = eng.miss.costs(1)
        out.update(model_cpu_s=cost_cpu, model_fetch_s=cost_fetch, model_reuse=eng.miss.reuse)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=default_model_path(), help="model directory (default %(default)s)")
    ap.add_argument(
        "--gbps", default="0.1,0.3,0.6,1,4,32", help="emulated link bandwidths, comma list (GB/s; default %(default)s)"
    )
    ap.add_argument("--latency-us", type=float, default=10.0, help="emulated link latency per copy (us; default %(default)s)")
    ap.add_argument(
        "--capacity", default="25%", help="device expert slots: N experts, P%% of routed experts or a size (default %(default)s)"
    )
    ap.add_argument("--eviction", default="lru", help="cache eviction policy (default %(default)s)")
    ap.add_argument("--prefetch", default="none", help="prefetch policy; none: every miss is a demand miss (default %(default)s)")
    ap.add_argument("--prompts", default="alpaca", help="prompt set name or file (default %(default)s)")
    ap.add_argument("--limit", type=int, default=3, help="prompts per run (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=16, help="new tokens per prompt (default %(default)s)")
    ap.add_argument(
        "--max-prompt-tokens", type=int, default=32, help="prompt truncated to this many tokens (default %(default)s)"
    )
    ap.add_argument(
        "--rounds", type=int, default=11,
        help="rounds (default %(default)s); each ratio is the median round: where two policies make the same choices,"
        " their ratio is noise around 1 whose spread shrinks with the rounds",
    )  # fmt: skip
    ap.add_argument(
        "--pinned", action="store_true",
        help="also run auto pinned to fetch and to cpu (same choices as the policy; only auto's overhead differs) (default off)",
    )  # fmt: skip
    ap.add_argument(
        "--host-split", choices=("measured", "on", "off"), default="measured",
        help="a CPU device's all-host calls: split with the host worker when measured faster, always (on), never (off)"
        " (default %(default)s)",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default %(default)s)")
    ap.add_argument(
        "--device", default="cpu",
        help="cpu (default): emulated links at --gbps; cuda: the model on the GPU and the real CUDA link, whose "
        "measured GB/s (one expert row, pinned host -> device) is the one bandwidth (--gbps ignored)",
    )  # fmt: skip
    ap.add_argument(
        "--data-dir", default=None, help="data directory for prompt set names (default: $MOEFLOW_DATA or ../shared/data)"
    )
    args = ap.parse_args(argv)
    if args.host_split != "measured" and args.threads > 1 and not args.device.startswith("cuda"):
        ap.error("--host-split needs --threads 1 on a CPU device: at several threads no host worker runs (host experts "
                 "run on the calling thread, at the user's count: runtime.host_worker.worker_is_exact)")  # fmt: skip

    torch.set_num_threads(args.threads)
    con = Console(stderr=True)
    gbps = sorted(float(x) for x in args.gbps.split(",") if x.strip())
    lat = args.latency_us * 1e-6
    cuda = args.device.startswith("cuda")
    model, tok = load_model(args.model, device=args.device, experts_implementation="grouped_mm")
    settle_heap()  # as `moeflow run`: no full gc collection over the model's objects mid-step
    spec = get_adapter(model).spec
    capacity = parse_capacity(args.capacity, total_experts=spec.total_experts, expert_bytes=spec.expert_bytes)
    prompts = [
        tok(p.text, return_tensors="pt").input_ids[:, : args.max_prompt_tokens]
        for p in load_prompts(args.prompts, data_dir=args.data_dir, limit=args.limit)
    ]

    def link(b: float) -> Link:
        return CudaLink(torch.device(args.device)) if cuda else EmulatedLink(b, lat)

    def engine(b: float, pol: str):
        miss, opts = PINNED.get(pol, (pol, None))
        eng = build_engine(
            model, mode="offload", link=link(b), capacity=capacity, eviction=args.eviction,
            prefetch=args.prefetch, miss=miss, miss_opts=opts,
        )  # fmt: skip
        assert eng is not None
        return eng

    forced = {"measured": None, "on": True, "off": False}[args.host_split]

    def attached(eng):
        if eng.host is not None:
            eng.host.split.forced = forced
        return eng

    # 1. host compute of one expert for T tokens vs one copy
    probe = build_engine(model, mode="offload", link=link(gbps[0]), capacity=capacity, eviction=args.eviction)
    assert probe is not None
    with probe:
        nbytes = probe.store.expert_bytes
        host = {t: min(probe.time_host_expert(t) for _ in range(3)) for t in HOST_TOKENS}
        if cuda:  # the real link's bandwidth for one expert row; latency taken as 0 (it is inside the measured copy)
            gbps, lat = [nbytes / min(probe.time_row_copy() for _ in range(5)) / 1e9], 0.0
    analytic = {t: (nbytes / (h - lat) / 1e9 if h > lat else None) for t, h in host.items()}  # GB/s
    t1 = FitTable(
        key=1,
        title=f"host compute of one expert ({nbytes / 1e6:.3f} MB row) vs one copy over the "
        f"{'CUDA' if cuda else 'emulated'} link",
    )
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
    Console().print(t1)

    # 2. TPOT side by side: one untimed warm-up per policy, then `rounds` rounds; in each round every bandwidth
    # runs the policies back to back in a rotated order, each on a fresh engine (same prompts, greedy)
    pols = POLICIES + (tuple(PINNED) if args.pinned else ())
    for pol in pols:
        with engine(gbps[0], pol) as warm:
            generate_one(model, prompts[0], warm, max_new_tokens=4, min_new_tokens=4)
    runs: dict[tuple[float, str], list[dict[str, Any]]] = {(b, p): [] for b in gbps for p in pols}
    ref_out: dict[float, list[torch.Tensor]] = {}
    other_out: dict[tuple[float, str], list[torch.Tensor]] = {}
    loads: list[float] = []
    for rnd in range(args.rounds):
        for i, b in enumerate(gbps):
            for pol in rotation(rnd, i, pols):
                label = f"{pol} @ {b:g} GB/s"
                with engine(b, pol) as eng:
                    m, outs, steps = run_one(model, prompts, attached(eng), args.new_tokens, label)
                    runs[(b, pol)].append({**measure(eng, m, pol), "steps": steps})
                if pol == "fetch":
                    ref_out.setdefault(b, outs)
                else:
                    other_out.setdefault((b, pol), outs)
                con.print(f"[dim]round {rnd + 1}/{args.rounds} {label}: TPOT {1e3 * (m.tpot_s or 0):.2f} ms[/]")
        loads.append(os.getloadavg()[0])
    exact = all(all(torch.equal(x, y) for x, y in zip(outs, ref_out[b])) for (b, _p), outs in other_out.items())

    def step_tpot(b: float, pol: str, stat) -> float:
        """Mean over decode steps of `stat` (median / min) of each step's seconds across the rounds: each step
        replays the same tokens every round, so a step slowed by another process in one round is outvoted."""
        per_round = [r["steps"] for r in runs[(b, pol)]]
        n = min(len(x) for x in per_round)
        return sum(stat([x[j] for x in per_round]) for j in range(n)) / max(1, n)

    def med(b: float, pol: str, key: str) -> float | None:
        xs = [r[key] for r in runs[(b, pol)] if r.get(key) is not None]
        return median(xs) if xs else None

    t2 = FitTable(
        key=1,
        title=f"TPOT, {spec.arch} C={capacity} ({args.capacity}), {args.eviction}+{args.prefetch}, {args.rounds} rounds: each "
        "decode step's median round (floor: its fastest round; runs: the median run's TPOT; spread: slowest / fastest run)",
    )
    cols = (
        "GB/s", "fetch ms", "cpu ms", "auto ms", "run spread f/c/a", "cpu/fetch", "auto/best", "side", "floor", "runs", "paired",
        "auto→cpu", "split c/a",
    )  # fmt: skip
    for c in cols:
        t2.add_column(c, justify="right")
    t3 = FitTable(
        key=1,
        title="per miss, ms: measured wait (fetch: link wait per demand load; cpu: host wait per host expert) vs "
        "auto's model at 1 token (cost_cpu with later hits, cost_fetch); overlap, ms per token: host busy / hidden",
    )
    for c in (
        "GB/s",
        "fetch wait",
        "cpu wait",
        "auto model cpu",
        "auto model fetch",
        "reuse",
        "cpu busy/hid",
        "auto busy/hid",
        "cpu hid",
        "auto hid",
    ):
        t3.add_column(c, justify="right")
    rows, ratio_pts = [], []
    ntok = max(1, args.limit * max(0, args.new_tokens - 1))  # decode tokens per run
    for b in gbps:
        f, c, a = (step_tpot(b, p, median) for p in POLICIES)  # TPOT: the median round of every decode step
        floor = {p: step_tpot(b, p, min) for p in POLICIES}  # ... its fastest round
        run_med = {p: med(b, p, "tpot_s") or math.nan for p in POLICIES}  # the median of the runs' TPOTs
        spreads = [max(x["tpot_s"] for x in runs[(b, p)]) / min(x["tpot_s"] for x in runs[(b, p)]) for p in POLICIES]
        r, ab = c / f, a / min(f, c)
        ab_floor = floor["auto"] / min(floor["fetch"], floor["cpu"])
        ab_runs = run_med["auto"] / min(run_med["fetch"], run_med["cpu"])
        # paired: per round, auto's TPOT over the faster of the two runs back to back with it; the median round
        ab_paired = median(
            [ra["tpot_s"] / min(rf["tpot_s"], rc["tpot_s"]) for rf, rc, ra in zip(*(runs[(b, p)] for p in POLICIES))]
        )
        # side by side: auto over each of fetch and cpu, a ratio per round of runs back to back (the drift of a
        # shared machine cancels in each), the median round; auto / min(fetch, cpu) = the larger of the two
        ab_side = side_by_side(
            [x["tpot_s"] for x in runs[(b, "auto")]], *([x["tpot_s"] for x in runs[(b, p)]] for p in ("fetch", "cpu"))
        )
        ratio_pts.append((b, r))
        share = med(b, "auto", "auto_cpu_share")
        row = {
            "gbps": b,
            "tpot_fetch_s": f,
            "tpot_cpu_s": c,
            "tpot_auto_s": a,
            "tpot_floor_s": floor,
            "tpot_run_median_s": run_med,
            "tpot_spread": dict(zip(POLICIES, spreads)),
            "tpot_rounds": {p: [x["tpot_s"] for x in runs[(b, p)]] for p in POLICIES},
            "cpu_over_fetch": r,
            "auto_over_best": ab,
            "auto_over_best_floor": ab_floor,
            "auto_over_best_run_median": ab_runs,
            "auto_over_best_paired": ab_paired,
            "auto_over_best_side_by_side": ab_side,
            "auto_cpu_share": share,
            "cpu_split_share": med(b, "cpu", "split_share"),
            "auto_split_share": med(b, "auto", "split_share"),
            "cpu_host_hidden_share": med(b, "cpu", "host_hidden_share"),
            "auto_host_hidden_share": med(b, "auto", "host_hidden_share"),
            "fetch_wait_per_miss_s": med(b, "fetch", "fetch_wait_per_miss_s"),
            "cpu_wait_per_miss_s": med(b, "cpu", "host_wait_per_miss_s"),
            "auto_model_cpu_s": med(b, "auto", "model_cpu_s"),
            "auto_model_fetch_s": med(b, "auto", "model_fetch_s"),
            "auto_model_reuse": med(b, "auto", "model_reuse"),
        }
        for p in ("cpu", "auto"):  # overlap, seconds per decode token of a run (prefill included in the sum)
            row[f"{p}_host_busy_s_per_token"] = (med(b, p, "host_busy_s") or 0.0) / ntok
            row[f"{p}_host_hidden_s_per_token"] = (med(b, p, "host_hidden_s") or 0.0) / ntok
        if args.pinned:  # auto's own overhead: the same choices as the policy it is pinned to
            row["pinned_over_policy"] = {
                q: {st: step_tpot(b, q, fn) / step_tpot(b, base, fn) for st, fn in (("median", median), ("floor", min))}
                for q, base in (("auto=fetch", "fetch"), ("auto=cpu", "cpu"))
            }
        rows.append(row)
        t2.add_row(
            f"{b:g}", f"{f * 1e3:.2f}", f"{c * 1e3:.2f}", f"{a * 1e3:.2f}", "/".join(f"{s:.2f}" for s in spreads),
            f"{r:.2f}", f"{ab:.2f}", f"{ab_side:.2f}", f"{ab_floor:.2f}", f"{ab_runs:.2f}", f"{ab_paired:.2f}",
            "-" if share is None else f"{share:.0%}",
            "/".join("-" if row[f"{p}_split_share"] is None else f"{row[f'{p}_split_share']:.0%}" for p in ("cpu", "auto")),
        )  # fmt: skip

        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x * 1e3:.3f}"

        def pct(x: float | None) -> str:
            return "-" if x is None else f"{x:.0%}"

        t3.add_row(
            f"{b:g}", ms(row["fetch_wait_per_miss_s"]), ms(row["cpu_wait_per_miss_s"]), ms(row["auto_model_cpu_s"]),
            ms(row["auto_model_fetch_s"]), "-" if row["auto_model_reuse"] is None else f"{row['auto_model_reuse']:.2f}",
            f"{ms(row['cpu_host_busy_s_per_token'])}/{ms(row['cpu_host_hidden_s_per_token'])}",
            f"{ms(row['auto_host_busy_s_per_token'])}/{ms(row['auto_host_hidden_s_per_token'])}",
            pct(row["cpu_host_hidden_share"]), pct(row["auto_host_hidden_share"]),
        )  # fmt: skip
    Console().print(t2)
    Console().print(t3)
    if args.pinned:
        t4 = FitTable(
            key=1, title="auto pinned to one side / that policy, TPOT (the same choices; the difference is auto's overhead)"
        )
        for c in ("GB/s", "auto=fetch / fetch", "floor", "auto=cpu / cpu", "floor"):
            t4.add_column(c, justify="right")
        for row in rows:
            pin = row["pinned_over_policy"]
            cells = [f"{pin[q][st]:.3f}" for q in ("auto=fetch", "auto=cpu") for st in ("median", "floor")]
            t4.add_row(f"{row['gbps']:g}", *cells)
        Console().print(t4)
    cpu_tpots = [r["tpot_cpu_s"] for r in rows]
    spread = max(cpu_tpots) / min(cpu_tpots)
    con.print(
        f"cpu TPOT spread over the bandwidths (noise floor; cpu never copies): {spread:.2f}x; "
        f"1-min load average after each round: {', '.join(f'{x:.1f}' for x in loads)}"
    )
    measured = crossover(ratio_pts)
    final = {
        "benchmark": "cpu_vs_fetch",
        "model": args.model,
        "device": args.device,
        "link": "cuda" if cuda else "emulated",
        "capacity": capacity,
        "eviction": args.eviction,
        "prefetch": args.prefetch,
        "latency_us": args.latency_us,
        "rounds": args.rounds,
        "host_split": args.host_split,
        "expert_bytes": nbytes,
        "host_s": {str(t): h for t, h in host.items()},
        "analytic_crossover_gbps": {str(t): a for t, a in analytic.items()},
        "measured_crossover_gbps": measured,
        "cpu_wins_below_gbps": measured,
        "auto_over_best_max": max(r["auto_over_best"] for r in rows),
        "auto_over_best_floor_max": max(r["auto_over_best_floor"] for r in rows),
        "auto_over_best_run_median_max": max(r["auto_over_best_run_median"] for r in rows),
        "auto_over_best_paired_max": max(r["auto_over_best_paired"] for r in rows),
        "auto_over_best_side_by_side_max": max(r["auto_over_best_side_by_side"] for r in rows),
        "pinned_over_policy_max": (
            {q: max(r["pinned_over_policy"][q]["median"] for r in rows) for q in PINNED} if args.pinned else None
        ),
        "token_identical": exact,
        "cpu_tpot_spread": spread,
        "load_average": loads,
        "rows": rows,
        "auto_vs_best_max": max(r["auto_over_best_side_by_side"] for r in rows),  # the figure scripts read: last
    }
    sys.stdout.write(json.dumps(final) + "\n")
    return final


if __name__ == "__main__":
    main()
