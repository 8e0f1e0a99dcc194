"""`moeflow quality`: the quality cost of configurations against `resident`, beside their speed
(flags -> QualityConfig -> moeflow.stages.quality.main)."""

from __future__ import annotations

import typer

from ..registry import DEFAULT_EVICTION
from .app import app
from .common import (
    capacity_option,
    column_option,
    data_dir_option,
    device_option,
    dtype_option,
    eviction_option,
    given_flags,
    json_option,
    lookahead_option,
    max_new_tokens_option,
    max_prompt_tokens_option,
    miss_option,
    model_option,
    off_switch,
    on_switch,
    policy_opt_option,
    prefetch_option,
    prompt_option,
    routing_option,
    split_option,
    switched,
    threads_option,
)


@app.command("quality")
def quality(
    ctx: typer.Context,
    model: str = model_option(),
    prompts: str | None = typer.Option(
        "alpaca", "--prompts", "-p", help="Prompts for greedy agreement (file or set name, as `run`). Default alpaca."
    ),
    column: str | None = column_option(),
    prompt: list[str] | None = prompt_option(),
    limit: int | None = typer.Option(
        None, "--limit", "-n", help="At most N prompts. Default: 8; with --prompt, every text given."
    ),
    split: str | None = split_option("Split of a prompt set name."),
    data_dir: str | None = data_dir_option("Data directory (default $MOEFLOW_DATA or ../shared/data)."),
    max_new_tokens: int = max_new_tokens_option("Greedy tokens per prompt (EOS ignored)."),
    max_prompt_tokens: int = max_prompt_tokens_option(),
    mode: list[str] | None = typer.Option(
        None, "--mode", help="offload and/or on-demand (resident is always the reference). Default offload."
    ),
    capacity: list[str] | None = capacity_option("25%"),
    per_layer_cache: bool = typer.Option(False, "--per-layer-cache", help="Split the slots evenly between MoE layers."),
    eviction: list[str] | None = eviction_option(DEFAULT_EVICTION),
    eviction_opt: list[str] | None = policy_opt_option("eviction"),
    prefetch: list[str] | None = prefetch_option("pregate"),
    prefetch_opt: list[str] | None = policy_opt_option("prefetch"),
    miss: list[str] | None = miss_option(many=True),
    miss_opt: list[str] | None = policy_opt_option("miss"),
    routing: list[str] | None = routing_option(many=True),
    routing_opt: list[str] | None = policy_opt_option("routing"),
    speculative: bool = typer.Option(
        False, "--speculative", help="LOSSY: run the experts a learned prefetcher predicted (as `run --speculative`)."
    ),
    link: str = typer.Option("auto", "--link", help="Transfer link, as `run` (direct, cuda, emulated:GBPS[,US])."),
    lookahead: int | None = lookahead_option(
        None, ", 1..MoE layers - 1, a larger S is refused (default: the calibration's, else 1)"
    ),
    calibration: str | None = typer.Option(None, "--calibration", help="Calibration JSON (as `run`)."),
    text: str = typer.Option(
        "wikitext2",
        "--text",
        help="Perplexity text: wikitext2 (the wikitext2 documents the models hold out), wikitext2-test, or a text file.",
    ),
    ppl_tokens: int = typer.Option(256, "--ppl-tokens", help="Scored tokens per perplexity window (one forward each)."),
    ppl_windows: int = typer.Option(4, "--ppl-windows", help="Perplexity windows (0: no perplexity)."),
    task: str = typer.Option("mmlu", "--task", help="mmlu (answer-letter likelihood), gsm8k (final number) or none."),
    task_limit: int = typer.Option(40, "--task-limit", help="Questions of --task."),
    task_new_tokens: int = typer.Option(96, "--task-new-tokens", help="gsm8k: greedy tokens per answer."),
    plan: str | None = typer.Option(
        None,
        "--plan",
        help="casmoe: CasMoE's plan on the offload runs, as `run` (the perplexity windows are planned from their "
        "own text); --plan-opt mode=preload (exact) | restricted (LOSSY).",
    ),
    plan_opt: list[str] | None = typer.Option(
        None, "--plan-opt", help="key=value of --plan (repeatable): predictors, mode, eps, k, mass, renorm, update, buffer."
    ),
    threads: int | None = threads_option(),
    dtype: str = dtype_option(),
    device: str = device_option(),
    no_warmup: bool = off_switch("warmup", "Skip the untimed short generation that precedes each run (done by default)."),
    _warmup: bool = on_switch("warmup"),
    as_json: bool = json_option(),
    sweep: bool = typer.Option(
        False, "--sweep", help="Every combination of --mode, --capacity, --eviction, --prefetch, --miss, --routing."
    ),
) -> None:
    """Perplexity, greedy agreement and task accuracy of each configuration against `resident`, beside its
    TPOT and bytes per token; lossy configurations are labelled LOSSY."""
    from ..errors import ConfigError
    from ..policies.parse import parse_opts, split_list
    from ..stages.quality import main
    from ..stages.quality_config import QualityConfig
    from ..stages.run_config import RunConfig, check_offload_flags

    misses = split_list(miss, "--miss") or ("fetch",)
    routings = split_list(routing, "--routing") or ("standard",)
    modes = split_list(mode, "--mode") or ("offload",)
    bad = [m for m in modes if m not in ("offload", "on-demand")]
    if bad:  # resident is the reference, always run: naming it would change nothing
        raise ConfigError(f"--mode {bad[0]!r}: quality compares offload and/or on-demand with the resident model it always runs")
    check_offload_flags(modes, given_flags(ctx))
    run = RunConfig(
        model=model,
        prompts=prompts if not prompt or prompts != "alpaca" else None,
        column=column,
        prompt=tuple(prompt or ()),
        data_dir=data_dir,
        split=split,
        limit=limit if limit is not None else (None if prompt else 8),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        modes=modes,
        capacities=split_list(capacity, "--capacity") or ("25%",),
        per_layer_cache=per_layer_cache,
        evictions=split_list(eviction, "--eviction") or (DEFAULT_EVICTION,),
        prefetches=split_list(prefetch, "--prefetch") or ("pregate",),
        eviction_opts=parse_opts(eviction_opt or ()),
        prefetch_opts=parse_opts(prefetch_opt or ()),
        miss=misses[0],  # each (miss, routing) of the sweep is checked with the --*-opt pairs (`run_config_for`)
        routing=routings[0],
        miss_opts=parse_opts(miss_opt or ()),
        routing_opts=parse_opts(routing_opt or ()),
        link=link,
        lookahead=lookahead,
        calibration=calibration,
        dtype=dtype,
        device=device,
        json=as_json,
        sweep=sweep,
        threads=threads,
        speculative=speculative,
        warmup=switched("warmup", no_warmup, _warmup),
        plan=plan,
        plan_opts=parse_opts(plan_opt or ()),
    )
    cfg = QualityConfig(
        run=run,
        misses=misses,
        routings=routings,
        text=text,
        ppl_tokens=ppl_tokens,
        ppl_windows=ppl_windows,
        task=task,
        task_limit=task_limit,
        task_new_tokens=task_new_tokens,
    )
    main(cfg)
