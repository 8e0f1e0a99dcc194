"""Offloaded decode speed in a bandwidth-bound regime: every eviction policy with `pregate` prefetch,
against `on-demand` loading, the resident model and the physical bound, measured side by side in one run.

1. resident runs (stock model; the fastest of `--resident-runs`, default 2): TPOT and per-decoder-layer decode
   compute compute_l (forward hooks);
2. the emulated link's bandwidth is set so that on-demand copies are `--copy-share` of on-demand TPOT
   (default 0.85, the Speculating Experts regime): a bandwidth-bound regime;
3. on-demand, then offload with every registered eviction policy + pregate (and lru + none) at
   `--capacity`, all on that link, same prompts, greedy, equal lengths;
4. bound per decode token = other_s + sum over MoE layers of max(compute_l, bytes that must move for
   layer l / bandwidth), with the bytes each run actually moved for layer l per decode token
   (`bound`), and with on-demand traffic (`bound_od`: the best any perfect overlap of demand traffic gives);
5. the physical bound `bound_min` = max(resident TPOT, Belady-minimum transfers per decode token x (latency +
   expert bytes / bandwidth)), Belady's MIN replayed by the simulator (`moeflow.sim.belady`) on the run's own
   routing (recorded greedily from the resident model: the offloaded runs are token-identical, so their
   accesses are the same). The final JSON line carries `bound_ratio` (best TPOT / bound_min),
   `transfers_vs_belady` (the best run's decode transfers per token / Belady's), `transfers_vs_oracle` (the
   same over the pass oracle's, `moeflow.sim.oracle`: next-use knowing the rest of the current pass exactly,
   replayed like Belady; `oracle_next_transfers_per_token`: knowing the next pass too), `predictor_share`
   (the best prefetching run's `propose` time per decode token / its TPOT) and, with `--adaptive-s`,
   lru+pregate at fixed S = 1..3 and adaptive S (`adaptive_vs_best_fixed`).

`--miss` runs every eviction x prefetch with each exact miss policy listed (default `fetch`, `moeflow run`'s
default; `--miss fetch,auto` adds host compute; rows of a miss other than fetch are labelled `ev+pf miss=NAME`):
`auto` computes a missed expert on the host when that costs less than copying it (exact on a CPU device, lossy on
CUDA). The best run (`best_run`, `bound_ratio`, `transfers_vs_belady`, ...) is the fastest exact
one; `best_fetch_run` / `bound_ratio_fetch` the fastest exact one with `fetch`, and `best_by_miss` the fastest
exact run per miss policy. A host-computed miss moves nothing, so with `cpu` / `auto` transfers can fall below
Belady's MIN (which counts every miss as a copy) and TPOT below Belady x copy time.

`--policies` and `--prefetch` choose the evictions and the prefetch policies run with each (default: every
registered eviction with `pregate`); options follow a colon, separated by `;` (`next-use:decay=0.8`).

Every `pregate` run goes through the traffic-aware prefetch gate (`PrefetchGate`, default on); the row
`lru+pregate (gate=off)` is the same prefetcher with `--prefetch-opt gate=off,cancel=off` (every proposal
issued, no stale cancellation), side by side with `lru+none` and `on-demand`.

    .venv/bin/python benchmarks/offload.py --model models/olmoe-mini
    .venv/bin/python benchmarks/offload.py --model DIR --device cuda --link cuda   # the real PCIe link
    .venv/bin/python benchmarks/offload.py --shape olmoe-1b-7b-shape --device cuda --link cuda   # built in memory

`--device cuda --link cuda`: copies on the CUDA side stream (`CudaLink`), bandwidth = pinned host->device
copies of one expert row measured here (or `--gbps`), no emulation. Every configuration gets an untimed
warm-up generation on an engine of its own first; the resident reference uses the faster stock experts
implementation (batched_mm / grouped_mm, measured; exactness is checked against grouped_mm).
Hit rate, prefetch precision/recall, transfers per token and collision misses are over decode passes.
Per MoE layer per decode step: the engine's host synchronizations (`engine.host_syncs`), and from
torch.profiler (`benchmarks/_profile.py`, one extra profiled generation per configuration) kernel
launches on CUDA, top-level aten ops on CPU. `--host-profile N` prints to stderr, for the resident model and
each engine configuration, the N functions with the most own host time (cProfile) in one generation: on a GPU,
the time a device synchronization waits shows under the call that synchronizes.
Prints a rich table, then one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from _profile import engine_syncs_per_decode_layer, h2d_gbps, host_profile, profile_counts  # benchmarks/_profile.py
from engine_overhead import SHAPES, model_and_tokenizer  # benchmarks/engine_overhead.py: --shape's random models
from rich.console import Console

from moeflow.calibrate import copy_share_bandwidth
from moeflow.data.prompts import load_prompts
from moeflow.moe import get_adapter
from moeflow.policies import EVICTION
from moeflow.policies.parse import parse_capacity, parse_policy
from moeflow.runtime.generate import build_engine, fastest_experts_impl, generate_one
from moeflow.runtime.link import CudaLink, EmulatedLink
from moeflow.runtime.metrics import RunMetrics
from moeflow.runtime.store import ExpertLayout
from moeflow.runtime.timing import settle_heap
from moeflow.tables import FitTable

REPO = Path(__file__).resolve().parent.parent


def layer_timer(adapter, cuda: bool = False):
    """Forward hooks on every decoder layer: seconds per layer, per forward pass (synchronized on CUDA)."""
    passes: list[dict[int, float]] = []
    t0: dict[int, float] = {}
    handles = []

    def pre(i):
        def f(m, a):
            if i == 0:
                passes.append({})
            if cuda:
                torch.cuda.synchronize()
            t0[i] = time.perf_counter()

        return f

    def post(i):
        def f(m, a, o):
            if cuda:
                torch.cuda.synchronize()
            passes[-1][i] = time.perf_counter() - t0[i]

        return f

    for i, layer in enumerate(adapter.layers):
        handles.append(layer.register_forward_pre_hook(pre(i)))
        handles.append(layer.register_forward_hook(post(i)))
    return passes, handles


def timed_propose(policy) -> dict[str, float]:
    """Wrap `policy.propose` with a timer (every prefetch policy's predictor cost, in seconds)."""
    acc = {"s": 0.0, "calls": 0}
    if policy is None or getattr(policy, "name", "none") == "none":
        return acc
    inner = policy.propose

    def propose(ctx):
        t0 = time.perf_counter()
        try:
            return inner(ctx)
        finally:
            acc["s"] += time.perf_counter() - t0
            acc["calls"] += 1

    policy.propose = propose
    return acc


def run_prompts(model, prompts, engine, args, label, new_tokens=None):
    new_tokens = new_tokens or args.new_tokens
    per_layer_loads: list[dict[int, int]] = []
    obs = lambda st: per_layer_loads.append(st.loads_by_layer)  # noqa: E731
    if engine is not None:
        engine.observers.append(obs)
    ms = []
    outs = []
    try:
        for ids in prompts:
            new, m = generate_one(model, ids, engine, max_new_tokens=new_tokens, min_new_tokens=new_tokens, label=label)
            ms.append(m)
            outs.append(new)
    finally:
        if engine is not None:
            engine.observers.remove(obs)
    # decode passes only: drop each prompt's first pass (prefill)
    decode_loads = [d for i, d in enumerate(per_layer_loads) if i % new_tokens != 0]
    return RunMetrics.total(ms, label), outs, decode_loads


def _one(model, ids, engine, args) -> None:
    """One greedy generation of `--profile-tokens` tokens (`--host-profile`)."""
    generate_one(model, ids, engine, max_new_tokens=args.profile_tokens, min_new_tokens=args.profile_tokens)


def run_plan(misses, evictions, prefetches, adaptive_layers=None) -> list[tuple]:
    """The runs, in order, as (mode, eviction, prefetch, prefetch options, lookahead, adaptive, miss): on-demand,
    every miss x prefetch x eviction, then the comparison rows `lru+pregate (gate=off)` and `lru+none` once each
    (not again when the user's runs have them), and with `adaptive_layers` (the model's MoE layers) lru+pregate at
    S = 2, 3 and adaptive."""
    off = {"gate": "off", "cancel": "off"}
    plan = [("on-demand", None, None, None, 1, False, "fetch")]
    plan += [("offload", ev, pf, None, 1, False, ms) for ms in misses for pf in prefetches for ev in evictions]
    for extra in (("offload", "lru", "pregate", off, 1, False, "fetch"), ("offload", "lru", "none", None, 1, False, "fetch")):
        if extra not in plan:
            plan.append(extra)
    if adaptive_layers is not None:
        plan += [("offload", "lru", "pregate", None, s, False, "fetch") for s in (2, 3) if s < adaptive_layers]
        plan += [("offload", "lru", "pregate", None, 1, True, "fetch")]
    return plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (this or --shape is required)")
    ap.add_argument(
        "--shape",
        default=None,
        choices=tuple(SHAPES),
        help="instead of --model: a random-weight OLMoE shape built in memory (engine_overhead.py's)",
    )
    ap.add_argument(
        "--tokenizer", default=str(REPO / "models" / "olmoe-mini"), help="tokenizer folder with --shape (default: olmoe-mini's)"
    )
    ap.add_argument(
        "--prompts", default="gsm8k", help="prompt file or set name (moeflow.data.load_prompts) (default %(default)s)"
    )
    ap.add_argument("--limit", type=int, default=3, help="prompts per run (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=24, help="new tokens per prompt (default %(default)s)")
    ap.add_argument(
        "--max-prompt-tokens", type=int, default=48, help="prompt truncated to this many tokens (default %(default)s)"
    )
    ap.add_argument(
        "--capacity", default="25%", help="cache capacity: N experts, P%% of routed experts or a size (default %(default)s)"
    )
    ap.add_argument(
        "--copy-share",
        type=float,
        default=0.85,
        help="on-demand copy share of TPOT to emulate, a fraction; sets the emulated bandwidth (default %(default)s)",
    )
    ap.add_argument(
        "--gbps",
        type=float,
        default=None,
        help="link bandwidth (GB/s; overrides --copy-share; default: from --copy-share, or measured with --link cuda)",
    )
    ap.add_argument("--latency-us", type=float, default=0.0, help="emulated link latency per copy (us; default %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default %(default)s)")
    ap.add_argument(
        "--resident-runs", type=int, default=2, help="resident runs; the fastest TPOT is the reference (default %(default)s)"
    )
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument(
        "--dtype", default="auto", help="model dtype; auto: float32 on CPU, the checkpoint's on CUDA (default %(default)s)"
    )
    ap.add_argument(
        "--link", default="emulated", choices=("emulated", "cuda"), help="emulated (default: bandwidth-bound regime) or cuda"
    )
    ap.add_argument(
        "--profile-tokens",
        type=int,
        default=6,
        help="new tokens of the profiled generation per configuration (default %(default)s)",
    )
    ap.add_argument(
        "--policies", default=None, help="comma list of evictions, name or name:key=value;... (default: all registered)"
    )
    ap.add_argument(
        "--prefetch",
        default="pregate",
        help="comma list of prefetch policies (name or name:key=value;...) run with every eviction (default pregate)",
    )
    ap.add_argument(
        "--miss",
        default=None,
        help="comma list of exact miss policies run with every eviction x prefetch (default fetch; e.g. fetch,auto)",
    )
    ap.add_argument("--adaptive-s", action="store_true", help="add lru+pregate at fixed S=1..3 and adaptive S (default off)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled generations (faster; default: profiled)")
    ap.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="print to stderr the N functions with the most own host time (cProfile) in one generation of "
        "--profile-tokens tokens, resident and each engine configuration (default 0: none)",
    )
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    con = Console()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.link == "cuda" and not cuda:
        ap.error("--link cuda needs --device cuda")
    if (args.model is None) == (args.shape is None):
        ap.error("give --model DIR or --shape NAME (one of them)")
    model, tok, model_name = model_and_tokenizer(args.model, args.shape, args.tokenizer, args.device, args.dtype)
    settle_heap()  # as `moeflow run`: no full gc collection over the model's objects mid-step
    ad = get_adapter(model)
    spec = ad.spec
    prompts = [
        tok(p.text, return_tensors="pt").input_ids[:, : args.max_prompt_tokens]
        for p in load_prompts(args.prompts, limit=args.limit)
    ]
    if args.shape:  # a random shape's vocabulary may be smaller than its tokenizer's: the ids folded into it
        prompts = [ids % model.config.vocab_size for ids in prompts]
    layout = ExpertLayout.of({n: p.detach() for n, p in ad.per_expert_params(spec.moe_layers[0]).items()})
    eb = layout.row_bytes

    # 1. resident: the cheaper stock experts implementation for these generations (measured), TPOT, per-layer decode compute
    probe = fastest_experts_impl(model, prompts[0], new_tokens=args.new_tokens)
    impl, impl_s = probe.name, probe.decode_s
    run_prompts(model, prompts[:1], None, args, "warm-up", new_tokens=4)
    # the fastest of `--resident-runs` runs: one slow phase of the machine (on a GPU a resident decode step was seen to
    # take 5 ms and then 37 ms for a second in one process) must not set the bound every engine run is measured by
    res_runs = [run_prompts(model, prompts, None, args, f"resident [{impl}]") for _ in range(max(1, args.resident_runs))]
    resident, res_out, _ = min(res_runs, key=lambda r: r[0].tpot_s or math.inf)
    model.set_experts_implementation("grouped_mm")  # the engines' (bit-exact) reference
    ref_out = res_out if impl == "grouped_mm" else run_prompts(model, prompts, None, args, "reference")[1]
    passes, handles = layer_timer(ad, cuda)
    run_prompts(model, prompts, None, args, "layer times")
    for h in handles:
        h.remove()
    resident_counts = (
        {"aten_ops": float("nan"), "kernel_launches": float("nan")}
        if args.no_profile
        else profile_counts(model, ad, prompts[0], None, args.profile_tokens, cuda)
    )
    if args.host_profile:
        one = functools.partial(_one, model, prompts[0], None, args)
        host_profile(f"resident, {args.profile_tokens} new tokens", one, args.host_profile)
    decode_passes = [p for i, p in enumerate(passes) if i % args.new_tokens != 0]
    compute_l = {i: statistics.mean(p[i] for p in decode_passes) for i in range(spec.num_layers)}
    layers_s = sum(compute_l.values())
    other_s = max(0.0, resident.tpot_s - layers_s)

    # 2. the regime
    od_bytes_per_token = spec.num_moe_layers * spec.top_k * eb
    if args.link == "cuda":
        bw = args.gbps * 1e9 if args.gbps else h2d_gbps(eb, device) * 1e9
    else:
        bw = args.gbps * 1e9 if args.gbps else copy_share_bandwidth(od_bytes_per_token, resident.tpot_s, args.copy_share)
    lat = args.latency_us * 1e-6
    capacity = parse_capacity(args.capacity, total_experts=spec.total_experts, expert_bytes=eb)
    con.print(
        f"[bold]{spec.arch}[/] {spec.num_moe_layers} MoE layers x {spec.num_experts} experts top-{spec.top_k}, "
        f"expert {eb / 1e3:.1f} KB; resident TPOT {resident.tpot_s * 1e3:.2f} ms; "
        f"link {args.link} {bw / 1e9:.4g} GB/s + {args.latency_us:g} us: on-demand copy "
        f"{od_bytes_per_token / bw * 1e3:.2f} ms/token"
        + (f" = {args.copy_share:.2f} of on-demand TPOT (bandwidth-bound)" if args.link == "emulated" and not args.gbps else "")
        + f"; cache C={capacity} ({100 * capacity / spec.total_experts:.0f}%); resident experts: {impl} "
        f"({', '.join(f'{k} {probe.prefill_s[k] * 1e3:.1f} ms prefill + {v * 1e3:.2f} ms/pass' for k, v in impl_s.items())})"
    )

    def bound(loads_per_pass: list[dict[int, int]]) -> float:
        """other + sum_l max(compute_l, moved_l / bw), averaged over decode passes."""
        tot = []
        for lp in loads_per_pass:
            b = other_s + sum(compute_l[l] for l in range(spec.num_layers) if l not in spec.moe_layers)
            for l in spec.moe_layers:
                n = lp.get(l, 0)
                b += max(compute_l[l], n * (lat + eb / bw))
            tot.append(b)
        return statistics.mean(tot) if tot else float("nan")

    od_bound = bound([{l: spec.top_k for l in spec.moe_layers}])

    # Belady's MIN on this run's routing (greedy, same prompts and lengths): decode transfers per token
    from moeflow.sim import belady
    from moeflow.sim.access import record_generate

    acc = record_generate(model, prompts, max_new_tokens=args.new_tokens, do_sample=False, keep_router_input=False)
    acc.expert_bytes = eb
    bel = belady(acc, capacity, count_phase=1)
    belady_tpt = bel.loads_per_token
    from moeflow.sim.oracle import pass_oracle

    oracle_tpt = pass_oracle(acc, capacity, count_phase=1).loads_per_token
    oracle_next_tpt = pass_oracle(acc, capacity, lookahead_passes=1, count_phase=1).loads_per_token
    bound_min = max(resident.tpot_s, belady_tpt * (lat + eb / bw))

    # 3. runs: (mode, eviction, prefetch, prefetch options, lookahead, adaptive, miss)
    misses = [m.strip() for m in (args.miss or "fetch").split(",") if m.strip()]
    evictions = [e.strip().replace(";", ",") for e in args.policies.split(",")] if args.policies else sorted(EVICTION)
    prefetches = [p.strip().replace(";", ",") for p in args.prefetch.split(",") if p.strip()]
    plan = run_plan(misses, evictions, prefetches, spec.num_moe_layers if args.adaptive_s else None)
    rows = []

    def make_engine(mode, ev, pf, opts, s, miss):
        link = CudaLink(device) if args.link == "cuda" else EmulatedLink(bw / 1e9, lat)
        ev_name, ev_opts = parse_policy(ev or "lru")  # `name:key=value,...`
        pf_name, pf_opts = parse_policy(pf or "none")
        return build_engine(
            model,
            mode=mode,
            link=link,
            capacity=capacity,
            eviction=ev_name,
            eviction_opts=ev_opts,
            prefetch=pf_name,
            prefetch_opts={**pf_opts, **(opts or {})},
            lookahead=s,
            miss=miss,
        )

    def attach_adaptive(eng):
        from moeflow.runtime.adaptive_s import StepSizeController

        return StepSizeController(initial_s=1, max_s=spec.num_moe_layers - 1, num_layers=spec.num_layers).attach(eng)

    for mode, ev, pf, opts, s, adaptive, miss in plan:
        label = mode if mode == "on-demand" else f"{ev}+{pf}"
        if miss != "fetch":
            label += f" miss={miss}"
        if opts:
            label += " (gate=off)"
        if args.adaptive_s and pf == "pregate" and ev == "lru" and not opts:
            label += " adaptive S" if adaptive else f" S={s}"
        with con.status(label):
            with make_engine(mode, ev, pf, opts, s, miss) as weng:  # untimed warm-up on an engine of its own
                detach = attach_adaptive(weng) if adaptive else None
                run_prompts(model, prompts[:1], weng, args, "warm-up", new_tokens=4)
                if detach:
                    detach()
            with make_engine(mode, ev, pf, opts, s, miss) as eng:
                detach = attach_adaptive(eng) if adaptive else None
                pred = timed_propose(eng.prefetcher)
                timed = functools.partial(run_prompts, model, prompts, eng, args, label)
                (m, outs, loads), syncs = engine_syncs_per_decode_layer(eng, timed)
                pred_per_token = pred["s"] / max(1, len(prompts) * args.new_tokens)
                host_per_token = eng.miss_counts.get("cpu", 0) / max(1, len(prompts) * args.new_tokens)  # prefill incl.
                if detach:
                    detach()
                counts = (
                    {}
                    if args.no_profile
                    else profile_counts(model, ad, prompts[0], eng, args.profile_tokens, cuda)  # after the timed run
                )
                if args.host_profile:  # after the timed run (and with adaptive S detached, as the profiled counts)
                    one = functools.partial(_one, model, prompts[0], eng, args)
                    host_profile(f"{label}, {args.profile_tokens} new tokens", one, args.host_profile)
        counts["engine_host_syncs"] = syncs  # of the timed run
        counts["predictor_s_per_token"] = pred_per_token
        exact = all(torch.equal(a, b) for a, b in zip(outs, ref_out))
        counts["host_misses_per_token"] = host_per_token
        rows.append((m, bound(loads), exact, counts, miss))

    od_tpot = rows[0][0].tpot_s
    t = FitTable(key=1, title=f"offloaded decode, bandwidth-bound ({bw / 1e9:.4g} GB/s), C={capacity}")
    for c in (
        "run",
        "TPOT ms",
        "x resident",
        "on-demand / run",
        "run / bound",
        "run / bound_od",
        "stall %",
        "dec hit",
        "prec",
        "recall",
        "xfer/tok",
        "/ MIN",
        "/ oracle",
        "collis.",
        "syncs/layer",
        "launches/layer" if cuda else "aten ops/layer",
        "exact",
    ):
        t.add_column(c, justify="left" if c == "run" else "right")
    ops_key = "kernel_launches" if cuda else "aten_ops"
    t.add_row(
        resident.label,
        f"{resident.tpot_s * 1e3:.2f}",
        "1.00",
        *("-", "-", "-", "0.0", "-", "-", "-", "0", "-", "-", "-"),
        f"{resident_counts.get('host_syncs', 0.0):.2f}" if cuda else "0",
        f"{resident_counts[ops_key]:.1f}",
        "ref" if impl == "grouped_mm" else "-",
    )
    result = {
        "model": model_name,
        "arch": spec.arch,
        "capacity": capacity,
        "gbps": bw / 1e9,
        "latency_us": args.latency_us,
        "copy_share": None if args.gbps else args.copy_share,
        "device": args.device,
        "link": args.link,
        "resident_experts_impl": impl,
        "resident_impl_probe_s": impl_s,
        "resident_impl_probe_prefill_s": probe.prefill_s,
        "resident_tpot_s": resident.tpot_s,
        "resident_tpot_runs_s": [r[0].tpot_s for r in res_runs],
        "resident_per_moe_layer_per_decode_step": resident_counts,
        "compute_layers_s": layers_s,
        "other_s": other_s,
        "bound_on_demand_traffic_s": od_bound,
        "belady_transfers_per_token": belady_tpt,
        "oracle_transfers_per_token": oracle_tpt,
        "oracle_next_transfers_per_token": oracle_next_tpt,
        "bound_min_s": bound_min,
        "runs": [],
    }

    def f(v, s=".3f"):
        return "-" if v is None else format(v, s)

    for m, b, exact, counts, miss in rows:
        t.add_row(
            m.label,
            f"{m.tpot_s * 1e3:.2f}",
            f"{m.tpot_s / resident.tpot_s:.2f}",
            f"{od_tpot / m.tpot_s:.2f}",
            f"{m.tpot_s / b:.2f}",
            f"{m.tpot_s / od_bound:.2f}",
            f"{m.stall_share * 100:.1f}",
            f(m.decode_hit_rate),
            f(m.decode_prefetch_precision),
            f(m.decode_prefetch_recall),
            f(m.transfers_per_token, ".2f"),
            f((m.transfers_per_token or 0.0) / belady_tpt if belady_tpt else None, ".2f"),
            f((m.transfers_per_token or 0.0) / oracle_tpt if oracle_tpt else None, ".2f"),
            str(m.decode_counters.collision_misses),
            f(counts["engine_host_syncs"], ".2f"),
            f(counts.get(ops_key), ".1f"),
            "yes" if exact else "NO",
        )
        c = m.decode_counters
        result["runs"].append(
            {
                "run": m.label,
                "miss": miss,
                "tpot_s": m.tpot_s,
                "ttft_s": m.ttft_s,
                "bound_s": b,
                "tpot_over_bound": m.tpot_s / b,
                "on_demand_speedup": od_tpot / m.tpot_s,
                "x_resident": m.tpot_s / resident.tpot_s,
                "stall_share": m.stall_share,
                "decode_hit_rate": m.decode_hit_rate,
                "prefetch_precision": m.decode_prefetch_precision,
                "prefetch_recall": m.decode_prefetch_recall,
                "transfers_per_token": m.transfers_per_token,
                "collision_misses_decode": m.decode_counters.collision_misses,
                "prefetch_issued_decode": c.prefetch_issued,
                "prefetch_refused_decode": c.prefetch_refused,
                "prefetch_cancelled_decode": c.prefetch_cancelled,
                "tpot_over_bound_min": m.tpot_s / bound_min,
                "transfers_vs_belady": (m.transfers_per_token or 0.0) / belady_tpt if belady_tpt else None,
                "transfers_vs_oracle": (m.transfers_per_token or 0.0) / oracle_tpt if oracle_tpt else None,
                "predictor_share": counts["predictor_s_per_token"] / m.tpot_s,
                "exact": exact,
                "host_misses_per_token": counts["host_misses_per_token"],
                "per_moe_layer_per_decode_step": counts,
            }
        )
    con.print(t)
    con.print(
        f"bound_od (on-demand traffic, perfect overlap) = {od_bound * 1e3:.2f} ms/token; compute of all "
        f"layers {layers_s * 1e3:.2f} ms + other {other_s * 1e3:.2f} ms"
    )
    runs = result["runs"]
    exact_runs = [r for r in runs if r["exact"]] or runs
    best = min(exact_runs, key=lambda r: r["tpot_s"])
    best_fetch = min((r for r in exact_runs if r["miss"] == "fetch"), key=lambda r: r["tpot_s"], default=None)
    best_by_miss = {
        ms: min((r for r in exact_runs if r["miss"] == ms), key=lambda r: r["tpot_s"])["run"]
        for ms in dict.fromkeys(r["miss"] for r in exact_runs)
    }
    prefetching = [r for r in runs if "+none" not in r["run"] and r["run"] != "on-demand"]
    best_pf = min(prefetching, key=lambda r: r["tpot_s"]) if prefetching else None
    by = {r["run"]: r for r in runs}

    def ratio(a, b):
        return a["tpot_s"] / b["tpot_s"] if a and b else None

    fixed = [r for r in runs if " S=" in r["run"]]
    ada = [r for r in runs if r["run"].endswith("adaptive S")]
    result.update(
        best_run=best["run"],
        bound_ratio=best["tpot_s"] / bound_min,
        best_fetch_run=best_fetch["run"] if best_fetch else None,
        bound_ratio_fetch=best_fetch["tpot_s"] / bound_min if best_fetch else None,
        transfers_vs_belady_fetch=best_fetch["transfers_vs_belady"] if best_fetch else None,
        best_by_miss=best_by_miss,
        transfers_vs_belady=best["transfers_vs_belady"],
        transfers_vs_oracle=best["transfers_vs_oracle"],
        oracle_vs_belady=oracle_tpt / belady_tpt if belady_tpt else None,
        oracle_next_vs_belady=oracle_next_tpt / belady_tpt if belady_tpt else None,
        transfers_vs_belady_min_over_runs=min(
            (r["transfers_vs_belady"] for r in runs if r["run"] != "on-demand" and r["transfers_vs_belady"]), default=None
        ),
        predictor_share=best_pf["predictor_share"] if best_pf else None,
        gated_vs_none=ratio(by.get("lru+pregate") or by.get("lru+pregate S=1"), by.get("lru+none")),
        ungated_vs_none=ratio(by.get("lru+pregate (gate=off)"), by.get("lru+none")),
        adaptive_vs_best_fixed=(ada[0]["tpot_s"] / min(r["tpot_s"] for r in fixed)) if ada and fixed else None,
    )
    con.print(
        f"bound_min = max(resident {resident.tpot_s * 1e3:.2f} ms, Belady {belady_tpt:.2f} transfers/token x "
        f"{(lat + eb / bw) * 1e3:.3f} ms) = {bound_min * 1e3:.2f} ms; best {best['run']}: bound_ratio "
        f"{result['bound_ratio']:.2f}, transfers_vs_belady {best['transfers_vs_belady']:.2f}, transfers_vs_oracle "
        f"{best['transfers_vs_oracle']:.2f}; the pass oracle moves {oracle_tpt:.2f} transfers/token "
        f"({f(result['oracle_vs_belady'], '.2f')}x Belady), knowing the next pass too {oracle_next_tpt:.2f} "
        f"({f(result['oracle_next_vs_belady'], '.2f')}x)"
    )
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
