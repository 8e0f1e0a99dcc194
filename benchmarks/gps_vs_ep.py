"""MoE-GPS's predicted ranking of expert placements vs `moeflow ep`'s measured one, N = 2 and 4 gloo ranks on CPU.

One trace of `--model` (default models/olmoe-mini; alpaca prompts, prefill + 1 token; recorded here if missing,
command printed).
Its last `--heldout` prompts are held out; the rest is the train split. Per N and strategy a placement is
built through `moeflow.gps.simulator` and written in the `moeflow ep` placement format:

- none: no prediction, `static_placement` (E/N contiguous experts, = ep's `contiguous`);
- distribution: distribution-only, `replicate_and_pack` of the train split's MLE p̂ (`gps.predictors.mle`),
  ceil(E/N) + 1 slots per rank and the simulator's roofline ridge as the minimum share per replica;
- oracle: `replicate_and_pack` of the held-out prompts' own expert counts. The simulator's token-to-expert
  strategy has no static placement (it repacks per batch from the predicted ids and skips the dispatch of
  correctly predicted assignments, which ep does not execute), so this is its best case placement only.

Then `moeflow ep` (gloo, spawned ranks, batch 1, `--max-new-tokens 1`: prefill) runs every placement
twice on the held-out prompts (min of the two timings), and the simulator's `ep_layer` predicts, from the
trace's held-out routing, the per-layer FFN + dispatch + combine time of each placement with this
machine's roofline (`measure_this_machine`) and a gloo link measured here (all_to_all_single latency and
bandwidth, `Interconnect`). Measured: ep's dispatch + compute + combine per MoE layer (slowest rank, summed
over calls; the all-gather is outside the simulator's FFN). Rankings are compared by Kendall tau.

    .venv/bin/python benchmarks/gps_vs_ep.py [--model models/olmoe-mini] [--trace DIR] [--prompts 48] [--heldout 12]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "olmoe-mini"  # the default --model


def _a2a_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    res = {}
    for per_peer in SIZES:  # floats per destination
        x = torch.zeros(per_peer * world)
        y = torch.empty_like(x)
        for _ in range(3):
            dist.all_to_all_single(y, x)
        times = []
        for _ in range(15):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(y, x)
            times.append(time.perf_counter() - t0)
        res[per_peer] = float(np.median(times))  # the median resists the other jobs on a shared machine
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


SIZES = (16, 1 << 14, 1 << 17, 1 << 19)  # floats per destination of the measured all_to_all calls


def measure_gloo(world: int) -> tuple[float, float]:
    """(latency s, bytes/s per rank per direction) of gloo all_to_all_single between `world` local processes."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "a2a.json")
        mp.start_processes(_a2a_worker, args=(world, f"tcp://127.0.0.1:{port}", out), nprocs=world, start_method="spawn")
        r = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    # least-squares t = latency + bytes / bandwidth over the sizes (bytes each rank sends to its peers)
    sent = np.array([(world - 1) * n * 4 for n in SIZES], dtype=float)
    slope, _ = np.polyfit(sent, np.array([r[n] for n in SIZES]), 1)
    if slope <= 0:
        raise SystemExit(
            f"gloo all_to_all between {world} processes: time did not grow with size ({r}); the machine is too busy "
            "to measure the link, run again on a quieter machine"
        )
    return r[SIZES[0]], 1.0 / float(slope)  # latency: the 64-byte call's time


def ensure_trace(trace: Path, n: int, model: Path) -> None:
    if (trace / "meta.json").is_file():
        print(f"trace: {trace} (exists)")
        return
    cmd = [str(ROOT / ".venv/bin/moeflow"), "trace", "-m", str(model), "-p", "alpaca", "--limit", str(n)]
    cmd += ["--max-new-tokens", "1", "--threads", str(os.cpu_count() or 1), "--out", str(trace)]
    print("recording the trace:", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def kendall_tau(a: list[float], b: list[float]) -> float:
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += int(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]))
    return s / (n * (n - 1) / 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default=str(MODEL),
        help="MoE checkpoint folder traced and run by `moeflow ep` (default %(default)s)",
    )
    ap.add_argument(
        "--trace",
        default=None,
        help="trace folder of --model on alpaca, recorded here if missing (default /tmp/gps_vs_ep/trace-MODEL-alpaca)",
    )
    ap.add_argument("--prompts", type=int, default=48, help="alpaca prompts traced, held-out ones included (default %(default)s)")
    ap.add_argument(
        "--heldout",
        type=int,
        default=12,
        help="last prompts held out: run by ep and predicted; the rest train (default %(default)s)",
    )
    ap.add_argument("--worlds", default="2,4", help="gloo rank counts N, comma list (default %(default)s)")
    ap.add_argument("--out", default="/tmp/gps_vs_ep", help="folder for the placement files (default %(default)s)")
    args = ap.parse_args()

    from moeflow.data.prompts import load_prompts
    from moeflow.ep.placement import parse_placement
    from moeflow.gps.predictors import mle
    from moeflow.gps.simulator import (
        Interconnect,
        Shape,
        System,
        ep_layer,
        measure_this_machine,
        replica_table,
        replicate_and_pack,
        spread,
        static_placement,
    )
    from moeflow.stages.ep import EPConfig, launch
    from moeflow.stages.run_config import RunConfig
    from moeflow.trace import Trace

    t_start = time.time()
    model = Path(args.model)
    trace = Path(args.trace or f"/tmp/gps_vs_ep/trace-{model.name}-alpaca")
    ensure_trace(trace, args.prompts, model)
    cfg = json.loads((model / "config.json").read_text())
    heads = int(cfg.get("num_attention_heads", 4))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    tr = Trace(trace)
    spec = tr.spec
    E, k, layers = spec.num_experts, spec.top_k, list(spec.moe_layers)
    prompts = load_prompts("alpaca", limit=args.prompts)
    traced = {pid: i for i, pid in enumerate(tr.prompt_ids)}
    held = [p for p in prompts[-args.heldout :] if p.id in traced]
    rows = tr.mask("prefill")
    pidx = tr.tokens()["prompt_id"]
    held_idx = {traced[p.id] for p in held}
    train_rows = rows & ~np.isin(pidx, list(held_idx))
    per_prompt = [np.flatnonzero(rows & (pidx == traced[p.id])) for p in held]  # in ep's prompt order
    ids_of = {l: np.asarray(tr.layer(l, ("topk_ids",))["topk_ids"]).astype(np.int64) for l in layers}
    print(f"{len(tr.prompt_ids)} traced prompts, train {int(train_rows.sum())} prefill tokens, held out {len(held)} prompts")

    gpu = measure_this_machine()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"trace": str(trace), "gpu": vars(gpu) if hasattr(gpu, "__dict__") else str(gpu), "worlds": {}}
    names = ("none", "distribution", "oracle")
    for N in [int(x) for x in args.worlds.split(",")]:
        lat, bw = measure_gloo(N)
        link = Interconnect(f"gloo loopback, {N} ranks (measured)", bw, lat)
        shape = Shape(f"{model.name} fp32", spec.hidden_size, spec.expert_intermediate_size, heads, kv_heads, E, k, 4)
        sysm = System(N, gpu, link, shape, 1)
        slots = math.ceil(E / N) + 1
        ridge = gpu.flops / gpu.hbm * shape.dtype_bytes / 2
        mean_assign = float(np.mean([len(r) for r in per_prompt])) * k
        plans: dict[str, dict[int, list[list[int]]]] = {"none": {}, "distribution": {}, "oracle": {}}
        for l in layers:
            plans["none"][l] = static_placement(E, N)
            p_hat = mle(ids_of[l][train_rows], E)
            plans["distribution"][l] = replicate_and_pack(p_hat * mean_assign, N, slots, ridge)
            cnt = np.bincount(ids_of[l][np.concatenate(per_prompt)].reshape(-1), minlength=E) / len(per_prompt)
            plans["oracle"][l] = replicate_and_pack(cnt.astype(float), N, slots, ridge)
        files, pred = [], {}
        for s in names:
            obj = {str(l): {str(e): rs for e, rs in enumerate(replica_table(plans[s][l], E))} for l in layers}
            f = out_dir / f"{s}-n{N}.json"
            f.write_text(json.dumps(obj))
            files.append(str(f))
            placement = parse_placement(obj, layers, E, N)
            t, rows_sim, rows_ep = 0.0, np.zeros(N), np.zeros(N)
            for l in layers:
                reps = replica_table(plans[s][l], E)
                for r in per_prompt:
                    ids = ids_of[l][r]
                    gpu_of = spread(ids.reshape(-1), reps).reshape(ids.shape)
                    ffn, comm = ep_layer(ids, gpu_of, np.zeros(ids.shape, bool), sysm)
                    t += ffn + comm
                    rows_sim += np.bincount(gpu_of.reshape(-1), minlength=N)
                    owner = np.asarray(placement.assign(l, np.bincount(ids.reshape(-1), minlength=E).tolist()))
                    rows_ep += np.bincount(owner[ids.reshape(-1)], minlength=N)
            pred[s] = {
                "ms_per_layer": t / len(layers) * 1e3,
                "duplicated": placement.duplicated(),
                "imbalance_sim": float(rows_sim.max() / rows_sim.mean()),
                "imbalance_ep_rule": float(rows_ep.max() / rows_ep.mean()),
            }
        rc = RunConfig(
            model=str(model),
            prompt=[p.text for p in held],
            max_new_tokens=1,
            batch_size=1,
            threads=max(1, (os.cpu_count() or 1) // N),
        )
        cmd = f"moeflow ep -m {model} -p <{len(held)} held-out prompts> --max-new-tokens 1 --world-size {N} "
        cmd += " ".join(f"--placement {f}" for f in files + files)
        print(f"\nN={N}: gloo all_to_all latency {lat * 1e6:.0f} µs, {bw / 1e9:.2f} GB/s; running: {cmd}", flush=True)
        res = launch(EPConfig(run=rc, world_size=N, placements=tuple(files + files), backend="gloo"))
        assert res is not None
        meas: dict[str, dict[str, Any]] = {}
        for i, run in enumerate(res["runs"]):
            s = names[i % len(names)]
            ms = (run["dispatch_s"] + run["compute_s"] + run["combine_s"]) / len(layers) * 1e3
            m = meas.setdefault(s, {"ms_per_layer": math.inf})
            m["ms_per_layer"] = min(m["ms_per_layer"], ms)
            m["runs_ms"] = [*m.get("runs_ms", []), ms]
            m["imbalance"] = run["imbalance"]
            m["busiest_rank_rows"] = run["busiest_rank_rows"]
            m["dispatch_ms"] = run["dispatch_s"] / len(layers) * 1e3
            m["compute_ms"] = run["compute_s"] / len(layers) * 1e3
            m["combine_ms"] = run["combine_s"] / len(layers) * 1e3
        p_t = [pred[s]["ms_per_layer"] for s in names]
        m_t = [meas[s]["ms_per_layer"] for s in names]
        tau = kendall_tau(p_t, m_t)
        rank_p = sorted(names, key=lambda s: pred[s]["ms_per_layer"])
        rank_m = sorted(names, key=lambda s: meas[s]["ms_per_layer"])
        print(f"N={N}: identical to one process: {res['identical_to_single_process']}")
        hdr = f"{'strategy':<13}{'dup':>4} | {'pred ms/layer':>13}{'pred imb':>9}{'(ep rule)':>10} | {'meas ms/layer':>13}"
        print(hdr + f"{'disp':>7}{'comp':>7}{'comb':>7}{'meas imb':>9}")
        for s in names:
            p, m = pred[s], meas[s]
            left = f"{s:<13}{p['duplicated']:>4} | {p['ms_per_layer']:>13.3f}{p['imbalance_sim']:>9.3f}"
            right = f"{m['ms_per_layer']:>13.3f}{m['dispatch_ms']:>7.2f}{m['compute_ms']:>7.2f}{m['combine_ms']:>7.2f}"
            print(f"{left}{p['imbalance_ep_rule']:>10.3f} | {right}{m['imbalance']:>9.3f}")
        print(f"ranking predicted: {' < '.join(rank_p)}   measured: {' < '.join(rank_m)}   Kendall tau {tau:+.2f}")
        result["worlds"][str(N)] = {
            "link": {"latency_s": lat, "bytes_per_s": bw},
            "identical_to_single_process": res["identical_to_single_process"],
            "predicted": pred,
            "measured": meas,
            "ranking_predicted": rank_p,
            "ranking_measured": rank_m,
            "kendall_tau": tau,
            "order_equal": rank_p == rank_m,
        }
    result["wall_s"] = time.time() - t_start
    sys.stdout.write(json.dumps(result, default=str) + "\n")


if __name__ == "__main__":
    main()
