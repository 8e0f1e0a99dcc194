"""`moeflow train` (fit layer-ahead predictors on a trace) and `moeflow eval` (score them on another trace)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from .app import app
from .common import (
    hidden_required_alias,
    json_option,
    model_option,
    no_progress_option,
    print_json,
    threads_option,
    wait_option,
)


def _print_report(report: dict, console: Console) -> None:
    from ..predict.evaluate import tables

    for t in tables(report):
        console.print(t)


def _print_planner(report: dict, console: Console) -> None:
    from ..plan.train import planner_tables

    rep = report.get("planner")
    if not rep:
        return
    if "skipped" in rep:
        console.print(f"[yellow]CasMoE planner skipped:[/] {rep['skipped']}")
    for t in planner_tables(rep):
        console.print(t)


def _print_seconds(report: dict, console: Console) -> None:
    """Wall seconds of each predictor's fit and of the shared steps (the --json `seconds_per_predictor`,
    `seconds_steps`, `seconds`)."""
    from rich.table import Table

    t = Table(title=f"train seconds: {report['seconds']:.1f} in all")
    t.add_column("fit / step")
    t.add_column("seconds", justify="right")
    for name, sec in report["seconds_per_predictor"].items():
        t.add_row(f"fit {name}", f"{sec:.2f}")
    for name, sec in report["seconds_steps"].items():
        t.add_row(name, f"{sec:.2f}")
    console.print(t)


def _print_gps(report: dict, console: Console) -> None:
    if report.get("gps"):
        from ..gps.predictors import render

        render(report["gps"], console)


@app.command("train")
def train(
    trace: Path = typer.Option(
        ..., "--trace", "-t", help="Trace folder written by `moeflow trace` (router-pf/estimator/hybrid need `--record-hidden`)."
    ),
    out: Path = typer.Option(
        ...,
        "--out",
        "-o",
        help="Predictor folder to write (new or empty; an existing predictor folder is replaced atomically with --force).",
    ),
    only: list[str] | None = typer.Option(
        None,
        "--only",
        help="Learned predictor(s) to fit (repeat the flag): router-pf, estimator, hybrid, forest, the CasMoE "
        "planner's eam / eap (for `run --plan casmoe`), and gps (the MoE-GPS predictors). Default: router-pf, "
        "estimator, hybrid, forest, the ones `moeflow run --prefetch` loads; eam, eap and gps only when named "
        "(e.g. --only eam --only eap). pregate and the baselines frequency / token-id are always included.",
    ),
    plan_opt: list[str] | None = typer.Option(
        None,
        "--plan-opt",
        help="CasMoE planner option key=value (repeat): eps (0.3), k (top-k), label ep|count, phase prefill|all, "
        "k_prime (3), weighted (false), embedder DIR, eap_layers (6), eap_hidden (64), eap_intermediate (128), "
        "eap_epochs (30), eap_lr (1e-3), eap_batch (32).",
    ),
    model: str = model_option(),
    holdout: float = typer.Option(0.2, "--holdout", help="Fraction of the trace's prompts held out for evaluation."),
    seed: int = typer.Option(
        0, "--seed", help="Seed of the split, the prompts --max-tokens draws, the random token embedding and the fits."
    ),
    max_tokens: int | None = typer.Option(
        None,
        "--max-tokens",
        help="Traced tokens loaded (train and held out together): from a longer trace, whole prompts drawn at random "
        "until they hold this many, so its hidden states need not fit in memory (the layer-ahead fits subsample "
        "fewer; eam, eap and gps see only the drawn prompts). 0: all. Default 100,000, or fewer where their arrays "
        "would take more than half of the memory the host has left once the model is loaded (a line says how many).",
        show_default=False,
    ),
    max_s: int | None = typer.Option(
        None,
        "--max-s",
        help="Largest step S (MoE layers ahead) to fit and evaluate: at most the model's MoE layers - 1. "
        "Default 4, or the model's MoE layers - 1 where fewer.",
        show_default=False,
    ),
    forest_trees: int = typer.Option(24, "--forest-trees", help="Random-forest trees."),
    forest_samples: int = typer.Option(
        120_000,
        "--forest-samples",
        help="Training samples for the forest (rows x (layer, S) pairs, subsampled); each tree draws 9,000 of "
        "them (all when fewer).",
    ),
    est_epochs: int = typer.Option(
        3,
        "--est-epochs",
        help="Most estimator training epochs: it stops earlier once recall on a validation part of the training "
        "prompts stops improving, and trains at least 300 steps.",
    ),
    est_dtype: str = typer.Option(
        "auto",
        "--est-dtype",
        help="What the estimator's training steps multiply in: bfloat16 (autocast; the loss, the optimiser and the "
        "saved network stay float32), float32, or auto: bfloat16 where the CPU multiplies it in hardware "
        "(avx512_bf16 or amx_bf16), float32 elsewhere. bfloat16 fitted a fifth faster for the same held-out recall on a "
        "2-core AMD EPYC (docs/predictors.md).",
    ),
    threads: int | None = threads_option(),
    fit_workers: int | None = typer.Option(
        None,
        "--fit-workers",
        help="Fits at once: 2 fits the forest in a process of its own beside the other fits, 1 fits one after the "
        "other. Default: 2 when at least 0.8 CPUs are idle when training starts (beside one busy job on 2 cores "
        "too), else 1 (`--threads 1`: 1).",
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing predictor folder at --out."),
    wait: bool = wait_option(),
    no_progress: bool = no_progress_option(),
    as_json: bool = json_option(),
) -> None:
    """Fit layer-ahead expert predictors on a trace, evaluate them on held-out prompts, save a predictor folder."""
    from ..plan.train import plan_overrides
    from ..stages.train import LEARNED, TrainConfig, main

    cfg = TrainConfig(
        trace=str(trace),
        out=str(out),
        model=str(model),
        only=tuple(only) if only else LEARNED,
        holdout=holdout,
        seed=seed,
        max_tokens=max_tokens,
        max_s=max_s,
        forest_trees=forest_trees,
        forest_max_samples=forest_samples,
        est_epochs=est_epochs,
        est_dtype=est_dtype,
        threads=threads,
        fit_workers=fit_workers,
        force=force,
        wait=wait,
        progress=not no_progress,
        **plan_overrides(plan_opt),
    )
    console = Console(stderr=as_json)
    report = main(cfg, console=console)
    if as_json:
        print_json(report)
        return
    _print_report(report, console)
    _print_planner(report, console)
    _print_gps(report, console)
    _print_seconds(report, console)
    if "hybrid" in report:
        h = report["hybrid"]
        on = ", ".join(h["estimator_on"]) or "none"
        console.print(f"hybrid: the estimator on (layer+S) {on}, router-pf elsewhere (threshold {h['threshold']:.3f})")
    console.print(f"wrote [bold]{escape(str(out))}[/] (meta.json, one folder per predictor, recall.png)")


@app.command("eval")
def eval_(
    predictors: Path = typer.Option(..., "--predictors", help="Predictor folder written by `moeflow train`."),
    predictors_p: Path | None = hidden_required_alias("predictors", "--predictors", "-p"),
    trace: Path = typer.Option(..., "--trace", "-t", help="Held-out trace folder (prompts not used for training)."),
    only: list[str] | None = typer.Option(None, "--only", help="Predictor(s) to evaluate (default: all in the folder)."),
    model: str = model_option(),
    max_s: int | None = typer.Option(
        None,
        "--max-s",
        help="Largest step S (MoE layers ahead) to evaluate: at most the model's MoE layers - 1 and the S the "
        "predictors were trained for. Default 4, or fewer where the model or the predictors have fewer.",
        show_default=False,
    ),
    mass: float = typer.Option(0.8, "--mass", help="Cumulative score mass of the prefetch set for precision."),
    speculative: bool = typer.Option(
        False,
        "--speculative",
        help="Also measure speculative execution (run the "
        "predicted experts, Speculating Experts 4): greedy agreement and perplexity vs "
        "the model's own routing, teacher-forced on the trace's sequences.",
    ),
    spec_sequences: int = typer.Option(24, "--spec-sequences", help="Trace prompts used by --speculative."),
    max_tokens: int | None = typer.Option(
        None,
        "--max-tokens",
        help="Traced tokens scored: from a longer trace, whole prompts drawn at random (seed 0) until they hold this "
        "many, so its hidden states need not fit in memory. 0: all. Default 100,000, or fewer where their arrays "
        "would take more than half of the memory the host has left once the model is loaded (a line says how many).",
        show_default=False,
    ),
    plan_opt: list[str] | None = typer.Option(
        None, "--plan-opt", help="CasMoE planner option key=value: eps (cascade gate, 0.3), k (experts per layer scored)."
    ),
    threads: int | None = threads_option(),
    as_json: bool = json_option(),
) -> None:
    """Evaluate a predictor folder on a trace: recall@k / precision per layer and S, decay fit vs pre-gate."""
    from ..plan.train import plan_overrides
    from ..stages.train import EvalConfig, eval_main

    cfg = EvalConfig(
        predictors=str(predictors),
        trace=str(trace),
        model=str(model),
        only=tuple(only) if only else (),
        max_s=max_s,
        mass=mass,
        speculative=speculative,
        spec_sequences=spec_sequences,
        max_tokens=max_tokens,
        **plan_overrides(plan_opt, ("eps", "k")),
        threads=threads,
    )
    console = Console(stderr=as_json)
    report = eval_main(cfg, console)
    if as_json:
        print_json(report)
        return
    _print_report(report, console)
    _print_planner(report, console)
    _print_gps(report, console)
    if report.get("speculative"):
        from ..tables import FitTable

        t = FitTable(
            "speculative execution (lossy): the predicted experts run instead of the router's; teacher-forced on trace sequences"
        )
        for c in ("predictor", "tokens", "greedy agreement", "ppl own routing", "ppl speculative", "ppl ratio"):
            t.add_column(c)
        for n, q in report["speculative"].items():
            if q.get("tokens"):
                t.add_row(
                    n,
                    str(q["tokens"]),
                    f"{q['greedy_agreement']:.3f}",
                    f"{q['ppl_resident']:.2f}",
                    f"{q['ppl_speculative']:.2f}",
                    f"{q['ppl_ratio']:.3f}"
                    + (f" [{q['ppl_ratio_ci95'][0]:.3f}, {q['ppl_ratio_ci95'][1]:.3f}]" if q.get("ppl_ratio_ci95") else "")
                    + (" within noise" if q.get("ppl_within_noise") else ""),
                )
        console.print(t)
    if report["skipped_no_hidden"]:
        console.print(f"[yellow]skipped (trace has no hidden states):[/] {', '.join(report['skipped_no_hidden'])}")
    if report["trace_overlap_warning"]:
        from ..predict.evaluate import sample_label

        console.print(f"[yellow]warning:[/] figures are {sample_label(report)}; evaluate on prompts the predictors did not see")
    elif report.get("heldout") is None:
        console.print("[yellow]warning:[/] could not check that the eval prompts are held out (no training prompt ids)")
