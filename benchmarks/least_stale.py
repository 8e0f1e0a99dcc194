"""Least-Stale (SpecMD) vs LRU/FLD/score/LRU2 on a decode trace of the default model, with and without
next-layer pre-gate prefetch, at capacities of 5/10/25/50% of all experts, against Belady's MIN.

    .venv/bin/python benchmarks/least_stale.py [--model models/olmoe-mini] [--prompts 20] [--new-tokens 32]

Prints a rich table per capacity and, last, one JSON line with every row. Not a test: no assertions.
A tiny random model is used when the default model is absent (NOT a meaningful control: see
shared/notes/pilot-training-run.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402

from moeflow.models import default_model_path, load_model, tiny_model  # noqa: E402
from moeflow.moe import get_adapter  # noqa: E402
from moeflow.sim import from_trace, simulate  # noqa: E402
from moeflow.sim.simulator import belady  # noqa: E402
from moeflow.sim.study import DEFAULT_CONFIGS, capacity_of, gsm8k_prompts, sampled_trace, sweep  # noqa: E402
from moeflow.tables import FitTable  # noqa: E402

CONFIGS = (
    *DEFAULT_CONFIGS,
    ("least-stale(right=farthest)", ("least-stale", {"right": "farthest"}), "none"),
    ("least-stale(right=farthest)+pregate", ("least-stale", {"right": "farthest"}), ("pregate", {})),
)


def _spec(text: str) -> Any:
    """'name' or 'name:key=value,...' -> 'name' or (name, {key: value}) (values parsed as numbers when they are)."""
    name, _, rest = text.partition(":")
    if not rest:
        return name
    opts: dict[str, Any] = {}
    for kv in rest.split(","):
        k, _, v = kv.partition("=")
        try:
            opts[k] = int(v)
        except ValueError:
            try:
                opts[k] = float(v)
            except ValueError:
                opts[k] = v
    return (name, opts)


def chosen_configs(evictions: str, prefetches: list[str]) -> tuple[tuple[str, Any, Any], ...]:
    """`--evictions a,b --prefetch none --prefetch pregate:percentile=80`: every eviction x prefetch, labelled 'ev+pf'."""
    out = []
    for pf in prefetches:
        for ev in (e.strip() for e in evictions.split(",") if e.strip()):
            out.append((ev if pf == "none" else f"{ev}+{pf}", _spec(ev), _spec(pf)))
    return tuple(out)


def detailed_sweep(
    acc: Any,
    fractions: list[float],
    configs: tuple[tuple[str, Any, Any], ...],
    predict_logits: Any,
    link: str | None,
    layer_time_s: float,
    progress: Any,
) -> list[dict[str, Any]]:
    """`sweep`'s rows plus per-layer collision rates, prefetch loads, late hits and stall time (for SpecMD Figs. 4-6, 8-9)."""
    rows = []
    for f in fractions:
        cap = capacity_of(acc, f)
        b = belady(acc, cap)
        for label, ev, pf in [*configs, ("belady", None, None)]:
            st = (
                b
                if label == "belady"
                else simulate(acc, cap, ev, pf, predict_logits=predict_logits, link=link, layer_time_s=layer_time_s)
            )
            layers = list(acc.moe_layers)
            rows.append(
                {
                    "fraction": f,
                    "capacity": cap,
                    "config": label,
                    "hit_rate": st.hit_rate,
                    "accesses": st.accesses,
                    "collisions": st.collisions,
                    "collision_rate": st.collision_rate,
                    "misses": st.misses,
                    "loads_per_token": st.loads_per_token,
                    "prefetch_precision": st.prefetch_precision,
                    "prefetch_recall": st.prefetch_recall,
                    "stall_s": getattr(st, "stall_s", 0.0),
                    "late": getattr(st, "late", 0),
                    "belady_hit_rate": b.hit_rate,
                    "hit_rate_per_layer": [st.hits_per_layer.get(l, 0) / max(1, st.accesses_per_layer.get(l, 0)) for l in layers],
                    "collision_rate_per_layer": [
                        st.collisions_per_layer.get(l, 0) / max(1, st.accesses_per_layer.get(l, 0)) for l in layers
                    ],
                }
            )
            progress()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=default_model_path(), help="model directory; a tiny random model when absent (default %(default)s)"
    )
    ap.add_argument("--prompts", type=int, default=20, help="GSM8K test questions (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=32, help="sampled decode steps per prompt (default %(default)s)")
    ap.add_argument(
        "--fractions",
        default="0.05,0.10,0.25,0.50",
        help="capacities as fractions of all experts, comma list (default %(default)s)",
    )
    ap.add_argument(
        "--data", default=str(REPO.parent / "shared" / "data"), help="data directory holding GSM8K (default %(default)s)"
    )
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (and the random model's) (default %(default)s)")
    ap.add_argument(
        "--phase",
        choices=("decode", "prefill", "all"),
        default="decode",
        help="passes of the trace replayed (default %(default)s)",
    )
    ap.add_argument(
        "--trace",
        default=None,
        help="replay a `moeflow trace --record-hidden` folder instead of generating (the model is still loaded"
        " for pre-gating; default: generate)",
    )
    ap.add_argument(
        "--evictions",
        default=None,
        help="comma list of eviction policies (name[:k=v]); replaces the default configurations (default: those)",
    )
    ap.add_argument(
        "--prefetch",
        action="append",
        default=None,
        help="prefetch policy name[:k=v,...] for every --evictions policy (repeatable; default: none and pregate)",
    )
    ap.add_argument("--link", default=None, help="instant (default) or emulated:GBPS[,LATENCY_US] (GB/s, us) on a virtual clock")
    ap.add_argument(
        "--layer-time-us", type=float, default=0.0, help="compute per MoE layer on the virtual clock (us; default %(default)s)"
    )
    args = ap.parse_args()
    detailed = bool(args.evictions or args.prefetch or args.link or args.layer_time_us)
    torch.set_num_threads(2)
    con = Console(stderr=True)
    if (Path(args.model) / "config.json").is_file():
        model, tok = load_model(args.model)
        prompts = gsm8k_prompts(tok, args.prompts, args.data)
        which = args.model
    else:
        con.print(f"[yellow]{args.model} not found: using a tiny random olmoe (not a meaningful control)")
        model = tiny_model("olmoe", num_experts=32, top_k=4, num_hidden_layers=4)
        g = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(3, 250, (24,), generator=g) for _ in range(args.prompts)]
        which = "tiny-random-olmoe"
    ad = get_adapter(model)
    phase = {"decode": 1, "prefill": 0, "all": None}[args.phase]
    if args.trace:
        from moeflow.trace import Trace

        tr = Trace(args.trace)
        tr.check_model(model)
        acc = from_trace(tr, phase=phase, max_prompts=args.prompts, with_router_input=tr.record_hidden)
    else:
        acc = sampled_trace(model, prompts, args.new_tokens, seed=args.seed).select(phase=phase)
    fractions = [float(x) for x in args.fractions.split(",")]
    with Progress(console=con, transient=True) as prog:
        task = prog.add_task("simulating", total=len(fractions) * (len(CONFIGS) + 1))
        if detailed:
            configs = chosen_configs(args.evictions or "lru,fld,score,least-stale", args.prefetch or ["none", "pregate"])
            prog.update(task, total=len(fractions) * (len(configs) + 1))
            rows = detailed_sweep(
                acc, fractions, configs, ad.router_logits, args.link, args.layer_time_us * 1e-6, lambda: prog.advance(task)
            )
        else:
            rows = sweep(acc, fractions, CONFIGS, predict_logits=ad.router_logits, progress=lambda: prog.advance(task))
    W = acc.working_set()
    con.print(
        f"model {which}: {len(acc.moe_layers)} MoE layers x {acc.num_experts} experts, top-{acc.top_k}; "
        f"{len(acc.passes)} {args.phase} passes; working set {W:.1f} experts per pass"
    )
    out = Console()
    for f in fractions:
        sub = [r for r in rows if r["fraction"] == f]
        t = FitTable(key=1, title=f"capacity {f:.0%} = {sub[0]['capacity']} experts (pass working set {W:.1f})")
        for c in (
            "config",
            "hit rate",
            "collision misses",
            "collision rate",
            "misses",
            "transfers/token",
            "pf precision",
            "pf recall",
            "hit rate per layer",
        ):
            t.add_column(c, justify="left" if c == "config" else "right")
        for r in sub:
            t.add_row(
                r["config"],
                f"{r['hit_rate']:.3f}",
                str(r["collisions"]),
                f"{r['collision_rate']:.3f}",
                str(r["misses"]),
                f"{r['loads_per_token']:.2f}",
                "-" if r["prefetch_precision"] is None else f"{r['prefetch_precision']:.2f}",  # nothing prefetched
                f"{r['prefetch_recall']:.2f}",
                " ".join(f"{h:.2f}" for h in r["hit_rate_per_layer"]),
            )
        out.print(t)
    print(json.dumps({"model": which, "phase": args.phase, "passes": len(acc.passes), "working_set": W, "rows": rows}))


if __name__ == "__main__":
    main()
