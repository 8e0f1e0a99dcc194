"""Held-out recall of the layer-ahead predictors on prompt sets that differ from the training set.

Trains every predictor (`moeflow train`) on a ShareGPT trace and evaluates the folder (`moeflow eval`)
on traces of GSM8K, MMLU and GLUE (SST-2 + RTE) prompts; prints recall@k per predictor x S x set, the
per-layer recall at S = 1, the decode-step cost of each predictor (one source layer, batch 1, every S),
the recall targets, then one JSON line (`recall_at_k[predictor][set][S]`, `per_layer`, `targets`).
Shape-agnostic: S runs 1..min(--max-s, MoE layers - 1) for whatever model `--model` is.

    .venv/bin/python benchmarks/predictors_heldout.py --model models/olmoe-mini --threads 1   # traces in /tmp/pred
    .venv/bin/python benchmarks/predictors_heldout.py --model models/olmoe-deep --root /tmp/pred-deep

Missing traces are recorded first, with the commands printed (and in the JSON), e.g.
    moeflow trace --prompts sharegpt --limit 150 --record-hidden --max-new-tokens 24 --max-prompt-tokens 96
                  --temperature 0.8 --threads 1 --out ROOT/sharegpt

With recorded traces (`--eval-trace NAME=DIR`, repeat; `--train-trace DIR` when it trains) nothing is recorded
and the folder is evaluated on those traces directly (no CasMoE planner), and three Speculating Experts
measurements can be added to the JSON line:
    --rank-alignment      per target layer and rank r (by routing weight) at S = 1: the share of tokens whose
                          rank-r true expert is the predictor's rank-r expert (`rank_alignment`, Fig. 5) and is
                          anywhere in its top-k (`rank_in_topk`)
    --speculative         the quality cost of running the predicted experts (`moeflow eval --speculative`):
                          greedy agreement and perplexity per set (`speculative[set][predictor]`)
    --train-tokens N      (repeat) refit the estimator alone with est_max_tokens=N on --train-trace and report its
                          held-out recall@k at S = 1 per set (`train_tokens_sweep`, Fig. 9)
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from moeflow.models import default_model_path  # noqa: E402

EVAL_SETS = {"gsm8k": ["gsm8k"], "mmlu": ["mmlu"], "glue": ["sst2", "rte"]}
LEARNED = ("estimator", "forest", "router-pf", "hybrid")


def trace_cmds(args: argparse.Namespace, name: str, sources: list[str], limit: int) -> list[list[str]]:
    common = ["--record-hidden", "--max-new-tokens", str(args.new_tokens), "--max-prompt-tokens", str(args.prompt_tokens)]
    common += ["--temperature", "0.8", "--threads", str(args.threads), "--model", args.model, "--no-progress"]
    per = -(-limit // len(sources))
    return [
        [
            sys.executable,
            "-m",
            "moeflow",
            "trace",
            "--prompts",
            src,
            "--limit",
            str(per),
            *common,
            "--out",
            str(Path(args.root) / name),
        ]
        for src in sources
    ]


def decode_cost(preds: dict, data, max_s: int, reps: int = 30) -> dict[str, float]:
    """Seconds per decode token and source layer: every S of one source layer for one token with the run-time path
    (`predictor.runner()`: one call for all S, what the prefetch policies run; `predict` per S for a predictor
    without one), averaged over `reps` decode rows of `data`."""
    from moeflow.predict.data import batch_from_rows, target_of

    ml = data.spec.moe_layers
    rows = np.flatnonzero(data.phase == 1)[:reps]
    ctx = data.context(4)
    src = ml[0]
    ss = [s for s in range(1, max_s + 1) if s < len(ml)]
    out = {}
    for name, p in preds.items():
        run = p.runner() if hasattr(p, "runner") else None
        if run is not None:  # compile / warm once outside the timing
            run.scores(batch_from_rows(data, src, rows[:1], ctx=ctx), len(ss))
        t0 = time.perf_counter()
        for r in rows:
            b = batch_from_rows(data, src, np.array([r]), ctx=ctx)
            if run is not None:
                run.scores(b, len(ss))
            else:
                for s in ss:
                    p.predict(target_of(data.spec, src, s), s, b)
        out[name] = (time.perf_counter() - t0) / max(1, len(rows))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model_path(), help="model directory (default %(default)s)")
    ap.add_argument(
        "--root", default="/tmp/pred", help="folder of the traces (created if missing) and the predictors (default %(default)s)"
    )
    ap.add_argument("--train-set", default="sharegpt", help="prompt set the predictors train on (default %(default)s)")
    ap.add_argument(
        "--train-limit", type=int, default=150, help="training prompts (when the trace is recorded here) (default %(default)s)"
    )
    ap.add_argument(
        "--eval-limit", type=int, default=60, help="prompts per held-out set (when recorded here) (default %(default)s)"
    )
    ap.add_argument("--new-tokens", type=int, default=24, help="sampled new tokens per traced prompt (default %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=96, help="max prompt tokens per traced prompt (default %(default)s)")
    ap.add_argument(
        "--max-s",
        type=int,
        default=4,
        help="largest step size S trained and scored, capped at MoE layers - 1 (MoE layers ahead; default %(default)s)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default %(default)s)")
    ap.add_argument(
        "--predictors", default=None, help="use this predictor folder instead of training (default: train into ROOT/predictors)"
    )
    ap.add_argument(
        "--train-opt", action="append", default=[], help="TrainConfig field=value (repeat), e.g. est_epochs=12 (default: none)"
    )
    ap.add_argument(
        "--train-trace",
        default=None,
        help="a recorded training trace (--record-hidden) instead of ROOT/<train-set> (default: that)",
    )
    ap.add_argument(
        "--eval-trace",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="evaluate on recorded traces (repeat); records nothing (default: record and evaluate the built-in sets)",
    )
    ap.add_argument(
        "--eval-only", action="append", default=[], help="with --eval-trace: predictors to evaluate (repeat; default all)"
    )
    ap.add_argument(
        "--rank-alignment",
        action="store_true",
        help="with --eval-trace: per-layer rank alignment at S = 1 (Fig. 5) (default off)",
    )
    ap.add_argument(
        "--speculative", action="store_true", help="with --eval-trace: speculative execution's quality cost per set (default off)"
    )
    ap.add_argument(
        "--spec-sequences", type=int, default=24, help="trace prompts per set scored by --speculative (default %(default)s)"
    )
    ap.add_argument(
        "--train-tokens",
        action="append",
        type=int,
        default=[],
        help="with --eval-trace: estimator refit at est_max_tokens=N (tokens; repeat; default: none)",
    )
    args = ap.parse_args()
    if args.eval_trace:
        return main_traces(args)
    if args.rank_alignment or args.speculative or args.train_tokens or args.eval_only:
        ap.error("--rank-alignment, --speculative, --train-tokens and --eval-only need --eval-trace")

    from moeflow.models import torch_threads
    from moeflow.predict.data import from_trace
    from moeflow.stages.train import EvalConfig, TrainConfig, eval_main
    from moeflow.stages.train import main as train_main

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    commands: list[str] = []
    sets = {args.train_set: ([args.train_set], args.train_limit), **{k: (v, args.eval_limit) for k, v in EVAL_SETS.items()}}
    for name, (sources, limit) in sets.items():
        for cmd in trace_cmds(args, name, sources, limit):
            commands.append(shlex.join(["moeflow", *cmd[3:]]))
            if not (root / name / "meta.json").is_file() or len(sources) > 1:  # appending skips traced prompts
                print("+", commands[-1], flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)

    model_layers = len(from_trace(str(root / args.train_set)).spec.moe_layers)
    max_s = max(1, min(args.max_s, model_layers - 1))
    pred_dir = Path(args.predictors) if args.predictors else root / "predictors"
    fit_seconds: dict = {}
    if not args.predictors:
        opts = _train_opts(args.train_opt)
        cfg = TrainConfig(
            trace=str(root / args.train_set),
            out=str(pred_dir),
            model=args.model,
            max_s=max_s,
            threads=args.threads,
            force=True,
            **{"only": LEARNED, **opts},  # the layer-ahead predictors (not the prompt-level planners)
        )
        commands.append(
            f"moeflow train --trace {root / args.train_set} --out {pred_dir} --model {args.model} "
            f"--max-s {max_s} --threads {args.threads} --force " + " ".join(f"--only {p}" for p in LEARNED)
        )
        t0 = time.perf_counter()
        rep = train_main(cfg)
        fit_seconds = {**rep["fit_seconds"], "total": round(time.perf_counter() - t0, 1)}

    recall: dict = {}
    per_layer: dict = {}
    with torch_threads(args.threads):
        for name in EVAL_SETS:
            commands.append(
                f"moeflow eval --predictors {pred_dir} --trace {root / name} --model {args.model} --max-s {max_s} --json"
            )
            rep = eval_main(EvalConfig(predictors=str(pred_dir), trace=str(root / name), model=args.model, max_s=max_s))
            for p, by_s in rep["by_s"].items():
                recall.setdefault(p, {})[name] = {int(s): round(v, 4) for s, v in by_s.items()}
            for p, res in rep["results"].items():
                per_layer.setdefault(p, {})[name] = {
                    f"L{m['target']}": {int(m["S"]): round(m["recall_at_k"], 4)} for m in res.values() if m["S"] == 1
                }
                for m in res.values():
                    per_layer[p][name].setdefault(f"L{m['target']}", {})[int(m["S"])] = round(m["recall_at_k"], 4)

        from moeflow.predict.io import load_predictors
        from moeflow.stages.train import load_cpu_model as _load_model

        model = _load_model(args.model)
        _, preds = load_predictors(pred_dir, model)
        cost = decode_cost(preds, from_trace(str(root / "gsm8k")), max_s)

    from rich.console import Console

    from moeflow.tables import FitTable

    con = Console()
    ss = list(range(1, max_s + 1))
    t = FitTable(key=1, title=f"held-out recall@k (trained on {args.train_set}; {args.model})")
    t.add_column("predictor")
    for name in EVAL_SETS:
        for s in ss:
            t.add_column(f"{name} S={s}", justify="right")
    t.add_column("decode µs/layer", justify="right")
    for p, by_set in recall.items():
        t.add_row(p, *[f"{by_set[n].get(s, float('nan')):.3f}" for n in EVAL_SETS for s in ss], f"{cost.get(p, 0) * 1e6:.0f}")
    con.print(t)
    t2 = FitTable(key=1, title="held-out recall@k per target layer (S = 1 / 2 / ...), mean over the three sets")
    t2.add_column("predictor")
    layers = sorted({lay for v in per_layer.values() for d in v.values() for lay in d}, key=lambda x: int(x[1:]))
    for lay in layers:
        t2.add_column(lay, justify="right")
    for p, by_set in per_layer.items():
        cells = []
        for lay in layers:
            vals = [
                f"{np.mean([by_set[n][lay][s] for n in EVAL_SETS if lay in by_set[n] and s in by_set[n][lay]]):.2f}"
                for s in ss
                if any(lay in by_set[n] and s in by_set[n][lay] for n in EVAL_SETS)
            ]
            cells.append(" / ".join(vals))
        t2.add_row(p, *cells)
    con.print(t2)

    tok = recall.get("token-id", {})
    pg = recall.get("pregate", {})
    targets = {}
    for p in LEARNED:
        if p not in recall:
            continue
        margin = min(recall[p][n][s] - tok[n][s] for n in EVAL_SETS for s in ss if s in recall[p][n])
        targets[f"{p}_vs_token_id_min_margin"] = round(margin, 4)
        targets[f"{p}_beats_token_id_by_5"] = margin >= 0.05
    if "forest" in recall and pg:
        m2 = [recall["forest"][n][s] - pg[n][s] for n in EVAL_SETS for s in ss if s >= 2]
        targets["forest_vs_pregate_min_margin_s2plus"] = round(min(m2), 4) if m2 else None
        targets["forest_beats_pregate_by_20_s2plus"] = bool(m2) and min(m2) >= 0.20
    best_s1 = max((min(recall[p][n][1] for n in EVAL_SETS), p) for p in recall)
    targets["best_s1_min_over_sets"] = {"predictor": best_s1[1], "recall": round(best_s1[0], 4), "ge_0.85": best_s1[0] >= 0.85}
    for k, v in targets.items():
        con.print(f"{k}: {v}")
    print(
        json.dumps(
            {
                "model": args.model,
                "train_set": args.train_set,
                "max_s": max_s,
                "recall_at_k": recall,
                "per_layer": per_layer,
                "decode_seconds_per_layer": {k: round(v, 6) for k, v in cost.items()},
                "fit_seconds": fit_seconds,
                "targets": targets,
                "commands": commands,
            }
        )
    )


def _train_opts(kvs: list[str]) -> dict:
    from moeflow.stages.train import TrainConfig

    opts: dict = {}
    for kv in kvs:
        k, v = kv.split("=", 1)
        kind = str(TrainConfig.__dataclass_fields__[k].type).removesuffix(" | None")  # e.g. max_tokens: int | None
        opts[k] = {"int": int, "float": float, "bool": lambda x: x.lower() in ("1", "true"), "str": str}[kind](v)
    return opts


def rank_alignment(pred, data, layer_pairs: list[tuple[int, int]], k: int, chunk: int = 2048) -> dict:
    """Per target layer: for each rank r (true experts ordered by routing weight, predicted ones by score), the share
    of tokens whose rank-r true expert is the predicted rank-r expert, and the share where it is in the predicted top-k."""
    from moeflow.predict.data import batch_from_rows, iter_chunks

    ctx = data.context(4)
    same: dict[str, list[float]] = {}
    in_set: dict[str, list[float]] = {}
    for src, tgt in layer_pairs:
        n = 0
        hit_same = np.zeros(k)
        hit_set = np.zeros(k)
        w = data.layers[tgt].topk_weights
        ids = data.layers[tgt].topk_ids
        order = np.argsort(-w, axis=1, kind="stable")
        truth = np.take_along_axis(ids, order, axis=1)  # [N,k] by routing weight, descending
        for sl in iter_chunks(data.n, chunk):
            rows = np.arange(data.n)[sl]
            scores = pred.predict(tgt, 1, batch_from_rows(data, src, rows, ctx=ctx)).float()
            top = torch.topk(scores, k, dim=-1).indices.numpy()  # sorted by score, descending
            t = truth[rows]
            hit_same += (top == t).sum(0)
            hit_set += (t[:, :, None] == top[:, None, :]).any(-1).sum(0)
            n += len(rows)
        same[f"L{tgt}"] = [round(float(x) / n, 4) for x in hit_same]
        in_set[f"L{tgt}"] = [round(float(x) / n, 4) for x in hit_set]
    return {"rank_alignment": same, "rank_in_topk": in_set}


def main_traces(args: argparse.Namespace) -> None:
    """--eval-trace mode: recorded traces only; evaluate (and optionally train) without recording anything."""
    from moeflow.models import torch_threads
    from moeflow.predict.data import from_trace, target_of
    from moeflow.predict.evaluate import evaluate
    from moeflow.predict.io import load_predictors, read_predictor_meta
    from moeflow.predict.train import sequences
    from moeflow.stages.train import TrainConfig
    from moeflow.stages.train import load_cpu_model as _load_model
    from moeflow.stages.train import main as train_main

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    sets = dict(kv.split("=", 1) for kv in args.eval_trace)
    if not args.predictors and not args.train_trace:
        raise SystemExit("--eval-trace needs --predictors DIR or --train-trace DIR (nothing is recorded in this mode)")
    if args.train_tokens and not args.train_trace:
        raise SystemExit("--train-tokens needs --train-trace DIR")
    first = from_trace(next(iter(sets.values())), need_hidden=True)
    max_s = max(1, min(args.max_s, len(first.spec.moe_layers) - 1))
    k = int(first.layers[first.spec.moe_layers[0]].topk_ids.shape[1])
    commands: list[str] = []
    fit_seconds: dict = {}
    pred_dir = Path(args.predictors) if args.predictors else root / "predictors"
    if not args.predictors:
        cfg = TrainConfig(
            trace=args.train_trace,
            out=str(pred_dir),
            model=args.model,
            max_s=max_s,
            threads=args.threads,
            force=True,
            **{"only": LEARNED, **_train_opts(args.train_opt)},
        )
        commands.append(f"moeflow train --trace {args.train_trace} --out {pred_dir} --max-s {max_s} --force")
        t0 = time.perf_counter()
        rep = train_main(cfg)
        fit_seconds = {**rep["fit_seconds"], "total": round(time.perf_counter() - t0, 1)}

    recall: dict = {}
    per_layer: dict = {}
    extra: dict = {}
    with torch_threads(args.threads):
        model = _load_model(args.model)
        names = args.eval_only or list(read_predictor_meta(str(pred_dir)).get("predictors", []))
        _, preds = load_predictors(pred_dir, model, names)
        datas = {name: from_trace(path, need_hidden=True) for name, path in sets.items()}
        for name, data in datas.items():
            t0 = time.perf_counter()
            rep = evaluate(preds, data, max_s=max_s)
            for p, by_s in rep["by_s"].items():
                recall.setdefault(p, {})[name] = {int(s): round(v, 4) for s, v in by_s.items()}
            for p, res in rep["results"].items():
                d = per_layer.setdefault(p, {}).setdefault(name, {})
                for m in res.values():
                    d.setdefault(f"L{m['target']}", {})[int(m["S"])] = round(m["recall_at_k"], 4)
            print(f"{name}: evaluated {len(preds)} predictors on {data.n} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
            if args.rank_alignment:
                ml = data.spec.moe_layers
                pairs = [(ml[i], target_of(data.spec, ml[i], 1)) for i in range(len(ml) - 1)]
                for p in preds:
                    ra = rank_alignment(preds[p], data, pairs, k)
                    for key, v in ra.items():
                        extra.setdefault(key, {}).setdefault(name, {})[p] = v
            if args.speculative:
                from moeflow.quality.speculative import measure_quality

                seqs = sequences(data, args.spec_sequences)
                t0 = time.perf_counter()
                extra.setdefault("speculative", {})[name] = {
                    p: measure_quality(model, pr, seqs)
                    for p, pr in preds.items()
                    if p in ("router-pf", "estimator", "hybrid", "pregate")
                }
                print(f"{name}: speculative quality in {time.perf_counter() - t0:.1f} s", flush=True)
        cost = decode_cost(preds, first, max_s)

    sweep: list[dict] = []
    for n_tok in args.train_tokens:
        out = root / f"estimator-tokens-{n_tok}"
        opts = {**_train_opts(args.train_opt), "est_max_tokens": n_tok}
        cfg = TrainConfig(
            trace=args.train_trace,
            out=str(out),
            model=args.model,
            max_s=1,
            threads=args.threads,
            force=True,
            only=("estimator",),
            **opts,
        )
        commands.append(
            f"moeflow train --trace {args.train_trace} --out {out} --only estimator --max-s 1 --force (est_max_tokens={n_tok})"
        )
        t0 = time.perf_counter()
        rep = train_main(cfg)
        secs = time.perf_counter() - t0
        with torch_threads(args.threads):
            _, est = load_predictors(out, model, ["estimator"])
            row = {"est_max_tokens": n_tok, "train_tokens": min(n_tok, int(rep["train_tokens"])), "fit_seconds": round(secs, 1)}
            row["recall_at_k_s1"] = {
                name: round(evaluate(est, data, max_s=1)["by_s"]["estimator"][1], 4) for name, data in datas.items()
            }
        print(f"estimator on {row['train_tokens']} tokens: {row['recall_at_k_s1']} ({secs:.0f} s)", flush=True)
        sweep.append(row)

    from rich.console import Console

    from moeflow.tables import FitTable

    con = Console()
    ss = list(range(1, max_s + 1))
    t = FitTable(key=1, title=f"held-out recall@k ({pred_dir}; {args.model})")
    t.add_column("predictor")
    for name in sets:
        for s in ss:
            t.add_column(f"{name} S={s}", justify="right")
    for p, by_set in recall.items():
        t.add_row(p, *[f"{by_set[n].get(s, float('nan')):.3f}" for n in sets for s in ss])
    con.print(t)
    for key in ("rank_alignment", "rank_in_topk"):
        for name, by_p in extra.get(key, {}).items():
            tr = FitTable(key=1, title=f"{key} per target layer, ranks 1..{k} ({name}, S = 1)")
            tr.add_column("predictor")
            layers = list(next(iter(by_p.values())))
            for lay in layers:
                tr.add_column(lay, justify="right")
            for p, d in by_p.items():
                tr.add_row(p, *[" ".join(f"{x:.2f}" for x in d[lay]) for lay in layers])
            con.print(tr)
    print(
        json.dumps(
            {
                "model": args.model,
                "predictors": str(pred_dir),
                "eval_traces": sets,
                "max_s": max_s,
                "k": k,
                "recall_at_k": recall,
                "per_layer": per_layer,
                "decode_seconds_per_layer": {k_: round(v, 6) for k_, v in cost.items()},
                "fit_seconds": fit_seconds,
                **extra,
                "train_tokens_sweep": sweep,
                "commands": commands,
            }
        )
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
