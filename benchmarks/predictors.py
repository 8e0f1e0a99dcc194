"""TPOT and stall of offloaded generation with each learned prefetcher, fixed and adaptive S, against
`pregate` and `on-demand`, side by side in one run on an emulated link; predictor time per decode step
as a share of TPOT. A rich table, then one JSON line.

    .venv/bin/python benchmarks/predictors.py --predictors artifacts/olmoe-mini/predictors \\
        [--model models/olmoe-mini] [--copy-share 0.85 | --gbps G] [--capacity 25%] [--prompts 6] [--new-tokens 24]

The link is emulated (a worker thread moving bytes at a set rate, so transfers overlap compute in wall
time). By default its bandwidth is chosen so that copies are `--copy-share` of TPOT under on-demand
loading, measured against the resident model in this run (Speculating Experts' A6000 regime is 0.85).
Prompts are the held-out prompts of the trace the predictors were trained on (their prompt tokens).

The final JSON line also carries the ratios against the bounds: `bound_ratio` (best TPOT / bound, bound = max(resident
TPOT, Belady-minimum transfers per decode token x expert bytes / bandwidth), Belady's MIN replayed by the
simulator on this run's own routing, recorded greedily from the resident model), `transfers_vs_belady` (the
best run's decode transfers per token / Belady's), `recall_at_k` (held-out recall@k by predictor and S from
the predictor folder's evaluation, decode tokens), `recall_at_k_runtime` (the same, scored with the run-time
path the policies run: `predictor.runner()`, every S of a source layer in one call), `predictor_share` (the best
learned run's predictor time per decode step on the model's thread / its TPOT, both over decode steps only),
`predictor_share_by_run` (that share for every learned run; the forest's rows add `worker_s_per_pass`, its worker
thread's time, off the model's thread), `predictor_share_all_passes_by_run` (the predictor time of every pass,
prefill included, spread over the decoded tokens / TPOT), `predictor_cpu_share_by_run` (the model thread's CPU time
in the predictor per decode step / TPOT: on a loaded machine the wall time also counts waits for a core)
and, with `--adaptive-s`, fixed S = 1..3 rows per policy next to adaptive S
(`adaptive_vs_best_fixed`: adaptive TPOT / best fixed TPOT, per policy). Every prefetcher goes through the
traffic-aware gate (`PrefetchGate`, default on; `--prefetch-opt gate=off` via `--gate off` here).

`--fixed-s 1,2,3,4,5` sets the fixed-S rows next to adaptive S (default 1..3; the step-size ablation of
ExpertFlow's Fig. 2). `--device cuda --link cuda` runs on the GPU with copies on the real link (CUDA side
stream, pinned rows; `gbps` in the JSON is then one pinned expert row's measured host->device bandwidth).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _profile import h2d_gbps  # noqa: E402  benchmarks/_profile.py (the script's folder is on sys.path)

from moeflow.models import default_model_path  # noqa: E402
from moeflow.runtime.timing import settle_heap  # noqa: E402


def heldout_prompts(pred_dir: Path, n: int) -> list[torch.Tensor]:
    from moeflow.predict.data import split_from_trace
    from moeflow.predict.io import read_predictor_meta

    meta = read_predictor_meta(pred_dir)
    cfg = meta["config"]
    _, held = split_from_trace(  # train's own split of the tokens it loaded (older folders: every token)
        meta["trace"]["path"], cfg.get("holdout", 0.2), cfg.get("seed", 0), max_tokens=cfg.get("max_tokens", 0)
    )
    out = []
    for pid in np.unique(held.prompt_id)[:n]:
        rows = np.flatnonzero((held.prompt_id == pid) & (held.phase == 0))
        rows = rows[np.argsort(held.position[rows])]
        out.append(torch.tensor([held.token_id[rows].tolist()]))
    return out


def run_one(
    model,
    prompts,
    *,
    mode,
    link_fn,
    capacity=0,
    prefetch="none",
    opts=None,
    lookahead=1,
    adaptive=False,
    calibration=None,
    new_tokens=24,
):
    from moeflow.runtime.adaptive_s import StepSizeController
    from moeflow.runtime.generate import build_engine, generate_one
    from moeflow.runtime.metrics import RunMetrics

    link = link_fn()
    eng = build_engine(
        model, mode=mode, link=link, capacity=capacity, eviction="lru", prefetch=prefetch, prefetch_opts=opts, lookahead=lookahead
    )
    pol = eng.prefetcher if eng is not None else None
    ctrl = None
    outs, ms = [], []
    try:
        with eng if eng is not None else _null():
            detach = lambda: None  # noqa: E731
            if adaptive and eng is not None:
                ctrl = StepSizeController.for_engine(  # as `moeflow run --adaptive-s`
                    eng,
                    num_moe_layers=eng.spec.num_moe_layers,
                    num_layers=eng.spec.num_layers,
                    calib=calibration,
                    lookahead=lookahead,
                )
                detach = ctrl.attach(eng)
            for p in prompts:
                new, m = generate_one(model, p, eng, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
                outs.append(new)
                ms.append(m)
            detach()
    finally:
        if eng is None:
            link.close()
    tot = RunMetrics.total(ms)
    res = {
        "tpot_s": tot.tpot_s,
        "stall_s_per_token": tot.decode_counters.stall_s / max(1, tot.decode_tokens),
        "hit_rate": tot.decode_counters.hits / max(1, tot.decode_counters.accesses),
        "loads_per_token": tot.decode_counters.loads / max(1, tot.decode_tokens),
        # propose() time on the model's thread (the critical path) over all forward passes, per pass
        "predict_s_per_pass": pol.predict_s / max(1, len(prompts) * new_tokens) if hasattr(pol, "predict_s") else 0.0,
        # the same in decode steps only, per decode step (what TPOT is measured over)
        "predict_s_per_step": (pol.predict_decode_s / max(1, pol.decode_passes) if hasattr(pol, "predict_decode_s") else 0.0),
        # its CPU time on the model's thread: under load the wall time above also counts waits for a core
        "predict_cpu_s_per_step": getattr(pol, "predict_decode_cpu_s", 0.0) / max(1, getattr(pol, "decode_passes", 0)),
        "final_s": ctrl.s if ctrl else lookahead,
        "s_changes": len(ctrl.history) - 1 if ctrl else 0,
    }
    if hasattr(pol, "runner"):  # the forest: its worker thread's time is off the model's thread
        res["forest_cache_hits"], res["forest_fallbacks"] = pol.runner.hits, pol.runner.fallbacks
        res["worker_s_per_pass"] = pol.runner.busy_s / max(1, len(prompts) * new_tokens)
    return outs, res


def runtime_recall(model, pred_dir: Path, names: list[str], rows_max: int = 4000) -> dict[str, dict[str, float]]:
    """Held-out recall@k by S of the run-time path (`predictor.runner()`: every S of a source layer in one
    call, what the policies run) on the decode tokens of the predictor folder's held-out prompts."""
    from moeflow.moe.sets import recall_at_k
    from moeflow.predict.data import batch_from_rows, split_from_trace, target_of
    from moeflow.predict.io import load_predictors, read_predictor_meta

    meta = read_predictor_meta(pred_dir)
    cfg = meta["config"]
    _, held = split_from_trace(  # train's own split of the tokens it loaded (older folders: every token)
        meta["trace"]["path"], cfg.get("holdout", 0.2), cfg.get("seed", 0), max_tokens=cfg.get("max_tokens", 0)
    )
    _, preds = load_predictors(pred_dir, model, names)
    ml, spec = held.spec.moe_layers, held.spec
    ctx = held.context(4)
    rows = np.flatnonzero(held.phase == 1)[:rows_max]
    out: dict[str, dict[str, float]] = {}
    for name, p in preds.items():
        if not hasattr(p, "runner"):
            continue
        run = p.runner()
        hits: dict[int, list[float]] = {}
        for src in ml[:-1]:
            steps = min(p.max_lookahead, len(ml) - 1 - ml.index(src))
            sc = run.scores(batch_from_rows(held, src, rows, ctx=ctx), steps)  # [S,T,E]
            for s in range(1, steps + 1):
                top = np.argsort(-sc[s - 1], -1, kind="stable")[:, : spec.top_k]
                hits.setdefault(s, []).append(recall_at_k(top, held.layers[target_of(spec, src, s)].topk_ids[rows]))
        out[name] = {str(s): float(np.mean(v)) for s, v in sorted(hits.items())}
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=default_model_path(), help="model directory (default %(default)s)")
    ap.add_argument(
        "--predictors", required=True, help="predictor folder of `moeflow train`; its held-out prompts are run (required)"
    )
    ap.add_argument(
        "--capacity", default="25%", help="device expert slots: N experts, P%% of routed experts or a size (default %(default)s)"
    )
    ap.add_argument(
        "--copy-share",
        type=float,
        default=0.85,
        help="on-demand copy share of TPOT to emulate, a fraction; sets the emulated bandwidth (default %(default)s)",
    )
    ap.add_argument(
        "--gbps", type=float, default=None, help="link bandwidth (GB/s; default: from --copy-share, or measured with --link cuda)"
    )
    ap.add_argument("--latency-us", type=float, default=10.0, help="emulated link latency per copy (us; default %(default)s)")
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts of the predictors' trace (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=24, help="new tokens per prompt (default %(default)s)")
    ap.add_argument(
        "--lookahead", type=int, default=1, help="step size S without --adaptive-s (MoE layers ahead; default %(default)s)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default %(default)s)")
    ap.add_argument(
        "--calibration", default=None, help="moeflow calibrate JSON for the adaptive controller's start (default: none)"
    )
    ap.add_argument(
        "--policies",
        default="router-pf,estimator,hybrid,forest",
        help="learned prefetchers, comma list; those not in the folder are skipped (default %(default)s)",
    )
    ap.add_argument("--adaptive-s", action="store_true", help="fixed S=1..3 rows per policy next to adaptive S (default off)")
    ap.add_argument(
        "--gate", default="on", choices=("on", "off"), help="the prefetch gate of every prefetcher (default %(default)s)"
    )
    ap.add_argument("--fixed-s", default=None, help="comma list of fixed S rows next to adaptive S (default 1,2,3)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--dtype", default="float32", help="model dtype (default %(default)s)")
    ap.add_argument(
        "--link", default="emulated", choices=("emulated", "cuda"), help="emulated (default) or cuda (needs --device cuda)"
    )
    a = ap.parse_args()
    device = torch.device(a.device)
    if a.link == "cuda" and device.type != "cuda":
        ap.error("--link cuda needs --device cuda")
    torch.set_num_threads(a.threads)
    from rich.console import Console

    from moeflow.calibrate import copy_share_bandwidth, load_calibration
    from moeflow.models import load_model
    from moeflow.moe import get_adapter
    from moeflow.policies.parse import parse_capacity
    from moeflow.predict.io import read_predictor_meta
    from moeflow.runtime.link import CudaLink, EmulatedLink
    from moeflow.tables import FitTable

    model, _ = load_model(a.model, dtype=a.dtype, device=a.device, experts_implementation="grouped_mm")
    settle_heap()  # as `moeflow run`: no full gc collection over the model's objects mid-step
    spec = get_adapter(model).spec
    have = read_predictor_meta(a.predictors)["predictors"]
    policies = [p for p in a.policies.split(",") if p in have]
    prompts = heldout_prompts(Path(a.predictors), a.prompts)
    cal = load_calibration(a.calibration, model) if a.calibration else None
    console = Console(stderr=True)
    # resident reference: tokens and compute per token
    ref, res_resident = run_one(model, prompts, mode="resident", link_fn=lambda: EmulatedLink(1.0), new_tokens=a.new_tokens)
    bytes_tok = spec.num_moe_layers * spec.top_k * spec.expert_bytes
    if a.link == "cuda":
        gbps = a.gbps or h2d_gbps(spec.expert_bytes, device)
        link_fn = lambda: CudaLink(device)  # noqa: E731
    else:
        gbps = a.gbps or copy_share_bandwidth(bytes_tok, res_resident["tpot_s"], a.copy_share) / 1e9
        link_fn = lambda: EmulatedLink(gbps, a.latency_us * 1e-6)  # noqa: E731
    cap = parse_capacity(a.capacity, total_experts=spec.total_experts, expert_bytes=spec.expert_bytes)
    rows: dict[str, dict] = {"resident": res_resident}
    exact: dict[str, bool] = {}
    t0 = time.perf_counter()
    gopt = {"gate": a.gate, "cancel": a.gate}
    wanted_s = [int(x) for x in a.fixed_s.split(",")] if a.fixed_s else [1, 2, 3]
    fixed_s = [s for s in wanted_s if 1 <= s < spec.num_moe_layers] if a.adaptive_s else [a.lookahead]
    plan = [("on-demand", dict(mode="on-demand")), ("none", dict(prefetch="none"))]
    plan += [(f"pregate S={s}", dict(prefetch="pregate", opts=dict(gopt), lookahead=s)) for s in fixed_s]
    for p in policies:
        popts = {"predictors": a.predictors, **gopt}
        plan += [(f"{p} S={s}", dict(prefetch=p, opts=dict(popts), lookahead=s)) for s in fixed_s]
        plan.append((f"{p} adaptive S", dict(prefetch=p, opts=dict(popts), adaptive=True)))
    plan.append(("pregate adaptive S", dict(prefetch="pregate", opts=dict(gopt), adaptive=True)))
    for label, kw in plan:
        console.print(f"[dim]{label} ...[/]")
        mode = kw.pop("mode", "offload")
        outs, r = run_one(
            model,
            prompts,
            mode=mode,
            link_fn=link_fn,
            capacity=cap,
            lookahead=kw.pop("lookahead", a.lookahead),
            calibration=cal,
            new_tokens=a.new_tokens,
            **kw,
        )
        exact[label] = all(torch.equal(x, y) for x, y in zip(outs, ref))
        rows[label] = r
    od = rows["on-demand"]["tpot_s"]
    pg = rows[f"pregate S={fixed_s[0]}"]["tpot_s"]
    # Belady's MIN on this run's routing (greedy, same prompts and lengths)
    from moeflow.sim import belady
    from moeflow.sim.access import record_generate

    acc = record_generate(model, prompts, max_new_tokens=a.new_tokens, do_sample=False, keep_router_input=False)
    belady_tpt = belady(acc, cap, count_phase=1).loads_per_token
    bound = max(res_resident["tpot_s"], belady_tpt * (a.latency_us * 1e-6 + spec.expert_bytes / (gbps * 1e9)))
    t = FitTable(
        key=1,
        title=f"{Path(a.model).name}: {a.link} link {gbps:.3f} GB/s (copy share {a.copy_share} on-demand), "
        f"capacity {cap}/{spec.total_experts} experts, {len(prompts)} held-out prompts x {a.new_tokens} tokens",
    )
    for c in (
        "run",
        "TPOT ms",
        "/on-demand",
        "/pregate",
        "stall ms/tok",
        "hit rate",
        "loads/tok",
        "pred ms/step",
        "pred share",
        "share all",
        "cpu share",
        "S end",
        "exact",
    ):
        t.add_column(c, justify="right")
    for label, r in rows.items():
        share = r["predict_s_per_step"] / r["tpot_s"] if r["tpot_s"] else 0.0
        share_all = r["predict_s_per_pass"] / r["tpot_s"] if r["tpot_s"] else 0.0
        r.update(tpot_vs_on_demand=r["tpot_s"] / od, tpot_vs_pregate=r["tpot_s"] / pg, predictor_share=share)
        r["predictor_share_all_passes"] = share_all
        r["predictor_cpu_share"] = r["predict_cpu_s_per_step"] / r["tpot_s"] if r["tpot_s"] else 0.0
        t.add_row(
            label,
            f"{1e3 * r['tpot_s']:.2f}",
            f"{r['tpot_vs_on_demand']:.3f}",
            f"{r['tpot_vs_pregate']:.3f}",
            f"{1e3 * r['stall_s_per_token']:.2f}",
            f"{r['hit_rate']:.3f}",
            f"{r['loads_per_token']:.1f}",
            f"{1e3 * r['predict_s_per_step']:.2f}",
            f"{share:.1%}",
            f"{share_all:.1%}",
            f"{r['predictor_cpu_share']:.1%}",
            str(r["final_s"]),
            "" if label == "resident" else ("yes" if exact[label] else "NO"),
        )
    Console().print(t)
    offl = {k: r for k, r in rows.items() if k != "resident"}
    best = min(offl, key=lambda k: offl[k]["tpot_s"])
    learned = [k for k in offl if k.split(" ")[0] in policies]
    best_l = min(learned, key=lambda k: offl[k]["tpot_s"]) if learned else None
    ada: dict[str, float] = {}
    for p in ["pregate", *policies]:
        fx = [offl[f"{p} S={s}"]["tpot_s"] for s in fixed_s if f"{p} S={s}" in offl]
        if fx and f"{p} adaptive S" in offl:
            ada[p] = offl[f"{p} adaptive S"]["tpot_s"] / min(fx)
    meta = read_predictor_meta(a.predictors)
    ev = meta.get("eval") or {}
    rt_recall = runtime_recall(model, Path(a.predictors), policies) if a.device == "cpu" else None
    ratios = {
        "belady_transfers_per_token": belady_tpt,
        "bound_s": bound,
        "best_run": best,
        "bound_ratio": offl[best]["tpot_s"] / bound,
        "transfers_vs_belady": offl[best]["loads_per_token"] / belady_tpt if belady_tpt else None,
        "recall_at_k": ev.get("decode_by_s") or ev.get("by_s"),
        "predictor_share": offl[best_l]["predictor_share"] if best_l else None,
        "predictor_share_by_run": {k: offl[k]["predictor_share"] for k in learned},
        "predictor_share_all_passes_by_run": {k: offl[k]["predictor_share_all_passes"] for k in learned},
        "predictor_cpu_share_by_run": {k: offl[k]["predictor_cpu_share"] for k in learned},
        "recall_at_k_runtime": rt_recall,
        "best_learned_run": best_l,
        "adaptive_vs_best_fixed": ada,
        "none_vs_best_prefetch": offl["none"]["tpot_s"] / offl[best]["tpot_s"],
    }
    console.print(
        f"bound = max(resident, Belady {belady_tpt:.2f} transfers/token) = {1e3 * bound:.2f} ms; best {best}: "
        f"bound_ratio {ratios['bound_ratio']:.2f}, transfers_vs_belady {ratios['transfers_vs_belady']:.2f}"
    )
    print(
        json.dumps(
            {
                "bench": "predictors",
                "model": a.model,
                "device": a.device,
                "link": a.link,
                "fixed_s": fixed_s,
                "gbps": gbps,
                "capacity": cap,
                "prompts": len(prompts),
                "new_tokens": a.new_tokens,
                "seconds": time.perf_counter() - t0,
                "runs": rows,
                "exact": exact,
                **ratios,
            },
            default=float,
        )
    )


if __name__ == "__main__":
    main()
