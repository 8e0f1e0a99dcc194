"""Simulator replay speed: accesses per second of the compiled replay against the Python mechanism, per eviction
policy x prefetch policy, on a recorded trace (one core).

    .venv/bin/moeflow trace --prompts gsm8k --limit 30 --record-hidden --threads 1 --out /tmp/h8/trace
    .venv/bin/python benchmarks/sim_speed.py --model models/olmoe-deep --trace /tmp/h8/trace [--capacity 25%] \\
        [--repeat N | --accesses 8e6] [--python-repeat 1] [--python-passes N] [--prefetch none --prefetch pregate]

The compiled replay (`simulate(..., compiled=True)`: one kernel call over the whole stream) runs on the trace
replicated `--repeat` times (its passes concatenated; default: enough copies for `--accesses`), so that each
timing lasts about a second; the Python
mechanism (`compiled=False`, the cache call by call: the reference) on `--python-repeat` copies of the trace's
first `--python-passes` passes (default all), in the same run; both on the same passes give the same counters
(checked here: the compiled replay of those passes against the Python one). Pre-gate proposals are
computed once per trace (batched router calls) and are not part of a replay's time (`prepare` column).
Speeds are replayed accesses (every pass) per second of the replay, wall clock (`accesses_per_s` of
`moeflow simulate --json`) and CPU time of this process (steadier on a shared machine). The numba kernels
are compiled (or loaded from their cache) before the first timing; that time is reported too.

Prints a table and, last, one JSON line. Not a test: no assertions.

Measured (olmoe-deep, a held-out GSM8K trace: `moeflow trace --prompts gsm8k --limit 30 --record-hidden
--threads 1`, 2,787 tokens; capacity 25% = 96, x145 = 8.0 M accesses; `--evictions
lru,lfu,least-stale,belady-approx,belady --python-passes 10`, OMP_NUM_THREADS=1, a quiet 2-core machine (load
1.0: the benchmark itself), new / base 67d1740 / new one after the other; M accesses per CPU second, prefetch
none / pregate), before -> after inlining the policy dispatchers, the mechanism's steps and the list helpers
into the kernels (`cachecore_layout._inline`): lru 13.4 / 8.9 -> 21.0-21.3 / 14.2-14.4, lfu 9.3 / 5.5 ->
12.7-12.8 / 6.9-7.0, least-stale 10.4 / 6.9 -> 16.3-16.6 / 10.2-10.5, belady 8.5 / 6.1 -> 9.7-9.9 / 7.2-7.5,
belady-approx 3.2 / 1.9 -> 3.7-3.8 / 2.2; same counters as the Python mechanism in every row. Then, with the
state arrays indexed through unsigned casts (`cachecore_layout._u`: numba emits no negative-index wraparound for
them) in the mechanism, the dispatchers, the eviction structures and belady-approx (base 2cf692b / new / new /
base, `--trace` a 2,787-token GSM8K trace, load 1.7-2.8: two other jobs on the 2 cores): lru 21.0-22.0 / 14.5-14.9 ->
30.1-31.7 / 19.4, lfu 12.8-13.2 / 7.0-7.2 -> 17.6-18.1 / 9.3-9.4, least-stale 16.4 / 10.4-10.5 -> 23.1-24.2 / 13.4-14.1,
belady 9.8-10.1 / 7.1-7.2 -> 12.4-12.7 / 9.3-9.6, belady-approx 3.7-3.8 / 2.2 -> 5.1 / 3.1 (pregate still below the 5 M
target: its victim search, `_ba_layers` (now `cachecore_bav`), is about 65% of that replay); same counters in every row.
Then belady-approx's layer bounds count candidates only (pinned and just-issued slots leave them until they are
candidates again), a key's old fields leave them before its new ones join, and its least calibrated probability
is kept, not recomputed per search (`cachecore_bav`): a pregate victim search scans 1.06 layers / 12.1 slots
instead of 1.94 / 26.2 (`--evictions belady-approx,lru --python-passes 10`, base b219ca1 / new 2d252bd / base /
new, load 1.0-1.5: another job on one core): belady-approx 5.0-5.2 / 3.0 -> 5.5-5.7 / 3.6-3.7 (pregate still
below 5 M; perf at 3205546: the search ~58% of that replay, its slot loop ~55% of the search, the per-layer
bounds ~25%), lru (the load reference, same code) 28.9-31.8 / 18.8-19.9 base, 21.6-28.2 / 16.4-18.5 beside new
(noisy: 30-32.5 / 19-21 in interleaved runs of the bench's replay); same counters in every row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from moeflow.models import load_model  # noqa: E402
from moeflow.moe import get_adapter  # noqa: E402
from moeflow.policies.parse import parse_capacity  # noqa: E402
from moeflow.sim import AccessTrace, from_trace, simulate  # noqa: E402
from moeflow.sim.belady import Belady  # noqa: E402
from moeflow.tables import FitTable  # noqa: E402
from moeflow.trace import Trace  # noqa: E402

EVICTIONS = ("lru", "lfu", "least-stale", "belady-approx", "belady", "next-use")
COMPARED = ("hits", "misses", "collisions", "loads", "prefetch_loads", "evictions", "proposed_accesses", "max_resident")


def router_predictor(model: Any):
    """`predict_logits(layer, x)`: the layer's own router on x in the router's dtype (as `moeflow simulate`)."""
    ad = get_adapter(model)

    def predict(layer: int, x: torch.Tensor) -> torch.Tensor:
        w = ad.router_weight(layer)
        with torch.no_grad():
            return ad.router_logits(layer, x.to(w.dtype))

    return predict


def replicate(acc: AccessTrace, n: int) -> AccessTrace:
    return AccessTrace(acc.moe_layers, acc.num_experts, acc.top_k, acc.passes * n, acc.expert_bytes)


def run(acc: AccessTrace, capacity: int, ev: str, pf: str, predict: Any, compiled: bool) -> Any:
    policy = Belady(acc) if ev == "belady" else ev
    return simulate(acc, capacity, policy, pf, predict_logits=predict, compiled=compiled, count_phase=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/olmoe-deep", help="checkpoint whose routers pre-gate (default %(default)s)")
    ap.add_argument("--trace", required=True, help="folder written by `moeflow trace --record-hidden`")
    ap.add_argument("--capacity", default="25%", help="experts, or percent of all routed experts (default %(default)s)")
    ap.add_argument("--evictions", default=",".join(EVICTIONS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--prefetch", action="append", help="none and/or pregate (repeatable; default both)")
    ap.add_argument("--repeat", type=int, default=0, help="trace copies the compiled replay runs (default: --accesses)")
    ap.add_argument("--accesses", type=float, default=8e6, help="accesses the copies reach at least (default %(default)g)")
    ap.add_argument("--python-repeat", type=int, default=1, help="trace copies the Python replay runs (default %(default)s)")
    ap.add_argument("--python-passes", type=int, default=0, help="passes of the trace the Python replay runs (default: all)")
    ap.add_argument("--best-of", type=int, default=3, help="timings per compiled row, the fastest kept (default %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core
    prefetches = args.prefetch or ["none", "pregate"]
    pregate = any(p != "none" for p in prefetches)
    tr = Trace(args.trace)
    acc = from_trace(tr, with_router_input=pregate)
    predict = None
    if pregate:
        model, _ = load_model(args.model)
        tr.check_model(model)
        predict = router_predictor(model)
    capacity = parse_capacity(args.capacity, total_experts=len(acc.moe_layers) * acc.num_experts, expert_bytes=None)
    one = sum(len(s.needed()) for p in acc.passes for s in p.steps)
    args.repeat = args.repeat or max(1, -(-int(args.accesses) // max(1, one)))
    head = AccessTrace(acc.moe_layers, acc.num_experts, acc.top_k, acc.passes[: args.python_passes or None], acc.expert_bytes)
    fast_acc, py_acc = replicate(acc, args.repeat), replicate(head, args.python_repeat)
    t0 = time.perf_counter()
    simulate(replicate(acc, 1), capacity, "lru", compiled=True)  # compile the kernels, or load them from numba's cache
    first_call_s = time.perf_counter() - t0
    rows = []
    for pf in prefetches:
        for ev in (e.strip() for e in args.evictions.split(",") if e.strip()):
            runs = [run(fast_acc, capacity, ev, pf, predict, True) for _ in range(args.best_of)]
            fast = min(runs, key=lambda s: s.cpu_s)
            py = run(py_acc, capacity, ev, pf, predict, False)
            check = run(py_acc, capacity, ev, pf, predict, True)
            same = all(getattr(check, f) == getattr(py, f) for f in COMPARED)
            rows.append(
                {
                    "eviction": ev,
                    "prefetch": pf,
                    "capacity": capacity,
                    "accesses": fast.replayed_accesses,
                    "seconds": fast.seconds,
                    "cpu_s": fast.cpu_s,
                    "prepare_s": runs[0].prepare_s,  # the first replay of the copies prepares (later ones reuse it)
                    "accesses_per_s": fast.accesses_per_s,
                    "accesses_per_cpu_s": fast.replayed_accesses / fast.cpu_s if fast.cpu_s > 0 else 0.0,
                    "python_accesses": py.replayed_accesses,
                    "python_seconds": py.seconds,
                    "python_accesses_per_s": py.accesses_per_s,
                    "python_accesses_per_cpu_s": py.replayed_accesses / py.cpu_s if py.cpu_s > 0 else 0.0,
                    "same_counters": same,
                }
            )
            r = rows[-1]
            r["speedup"] = r["accesses_per_cpu_s"] / r["python_accesses_per_cpu_s"] if r["python_accesses_per_cpu_s"] else 0.0
    table = FitTable(key=2, title=f"replay speed, {args.trace}, capacity {capacity} ({args.capacity}), compiled x{args.repeat}")
    for col in ("eviction", "prefetch", "accesses", "seconds", "M acc/s", "M acc/cpu-s", "Python M acc/s", "speed-up", "same"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["eviction"],
            r["prefetch"],
            f"{r['accesses']:,}",
            f"{r['seconds']:.3f}",
            f"{r['accesses_per_s'] / 1e6:.2f}",
            f"{r['accesses_per_cpu_s'] / 1e6:.2f}",
            f"{r['python_accesses_per_s'] / 1e6:.3f}",
            f"{r['speedup']:.0f}x",
            "yes" if r["same_counters"] else "NO",
        )
    console = Console()
    console.print(table)
    console.print(
        f"compiled kernels ready in {first_call_s:.1f} s (first call: compile, or load numba's cache); "
        f"speed-up: compiled / Python, CPU-time rates; preparing the stream and the proposals once per trace: "
        f"{max(r['prepare_s'] for r in rows):.2f} s"
    )
    print(json.dumps({"trace": args.trace, "repeat": args.repeat, "first_call_s": first_call_s, "rows": rows}))


if __name__ == "__main__":
    main()
