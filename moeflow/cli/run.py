"""`moeflow run`: generate with routed experts offloaded to host memory (flags -> RunConfig -> moeflow.stages.run)."""

from __future__ import annotations

from typing import Any

import typer

from ..registry import DEFAULT_EVICTION
from .app import app
from .common import (
    alias,
    capacity_option,
    column_option,
    data_dir_option,
    device_option,
    dtype_option,
    eviction_option,
    force_option,
    given_flags,
    hidden_alias,
    json_option,
    limit_option,
    lookahead_option,
    max_new_tokens_option,
    max_prompt_tokens_option,
    miss_option,
    model_option,
    no_progress_option,
    off_switch,
    on_switch,
    policy_opt_option,
    prefetch_option,
    prompt_option,
    routing_option,
    split_option,
    switched,
    threads_option,
    wait_option,
)


@app.command("run")
def run(
    ctx: typer.Context,
    model: str = model_option(),
    prompts: str | None = typer.Option(
        None,
        "--prompts",
        "-p",
        help="Prompt file (.txt one per line, .json, .jsonl, .csv, .tsv) or a set "
        "name (sharegpt, alpaca, gsm8k, mmlu, sst2, mt_bench, ...).",
    ),
    column: str | None = column_option(),
    prompt: list[str] | None = prompt_option(),
    limit: int | None = limit_option(),
    split: str | None = split_option(),
    data_dir: str | None = data_dir_option("Data directory for set names (default $MOEFLOW_DATA or ../shared/data)."),
    max_new_tokens: int = max_new_tokens_option(),
    min_new_tokens: int | None = typer.Option(
        None, "--min-new-tokens", help="Ignore EOS before this many new tokens (equal-length runs; at most --max-new-tokens)."
    ),
    max_prompt_tokens: int = max_prompt_tokens_option(),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature; 0 = greedy."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (per prompt)."),
    mode: list[str] | None = typer.Option(
        None,
        "--mode",
        help="offload (C-slot cache + policies), resident (stock model, all "
        "experts on the device: speed/quality reference) or on-demand "
        "(load after routing, keep nothing, no prefetch). Several with "
        "--sweep. Default offload.",
    ),
    capacity: list[str] | None = capacity_option("25%"),
    cache_capacity: list[str] | None = hidden_alias("--cache-capacity"),
    per_layer_cache: bool = typer.Option(
        False, "--per-layer-cache", help="Split the slots evenly between MoE layers (a layer evicts only its own)."
    ),
    eviction: list[str] | None = eviction_option(DEFAULT_EVICTION),
    eviction_opt: list[str] | None = policy_opt_option("eviction"),
    prefetch: list[str] | None = prefetch_option("pregate"),
    prefetch_opt: list[str] | None = policy_opt_option("prefetch"),
    miss: str = miss_option(),
    miss_opt: list[str] | None = policy_opt_option("miss"),
    routing: str = routing_option(),
    routing_opt: list[str] | None = policy_opt_option("routing"),
    link: str = typer.Option(
        "auto",
        "--link",
        help="Transfer link: cuda (side stream), direct (copy now, no emulation), or emulated:GBPS[,US] "
        "(worker thread; US: latency in microseconds; e.g. emulated:2,10 = 2 GB/s, 10 us). "
        "auto = cuda on CUDA, direct on CPU.",
    ),
    lookahead: int | None = lookahead_option(
        None,
        ", 1..MoE layers - 1 (a larger S is refused; default: the calibration's, else 1). A learned prefetcher"
        " runs at most at the S it was trained for (moeflow train --max-s), with a note; the JSON's `lookahead`"
        " is the S used",
    ),
    calibration: str | None = typer.Option(
        None,
        "--calibration",
        help="Calibration JSON (default: the file `moeflow calibrate` writes for this device and link, "
        "e.g. calibration/cpu.json). Gives the step size S.",
    ),
    threads: int | None = threads_option(),
    dtype: str = dtype_option(),
    device: str = device_option(),
    out: str | None = typer.Option(
        None, "--out", "-o", help="JSONL file: one line per prompt and run (text + metrics), written atomically."
    ),
    force: bool = force_option("`moeflow run` JSONL"),
    wait: bool = wait_option(),
    no_progress: bool = no_progress_option(),
    as_json: bool = json_option(),
    adaptive_s: bool = typer.Option(
        False,
        "--adaptive-s",
        help="Adapt step size S while running (ExpertFlow 3.2.1-3.2.2): stalls raise S, "
        "already-resident experts lower it, observed transfers update the bandwidth "
        "estimate; starts from the calibration's S.",
    ),
    speculative: bool = typer.Option(
        False,
        "--speculative",
        help="LOSSY: run the experts a learned prefetcher (router-pf, estimator, hybrid) "
        "predicted instead of the router's (Speculating Experts sec. 4). Off by "
        "default; quality cost: `moeflow eval --speculative`.",
    ),
    batch_size: int = typer.Option(
        1,
        "--batch-size",
        "-b",
        help="Decode this many prompts together (left-padded); greedy output per prompt as at batch size 1.",
    ),
    no_warmup: bool = off_switch("warmup", "Skip the untimed short generation that precedes each timed run (done by default)."),
    _warmup: bool = on_switch("warmup"),
    prefill: str = typer.Option(
        "staged",
        "--prefill",
        help="Prefill path of offload runs: staged (each layer's routed experts copied in waves, the next wave "
        "and, with a prefetch policy, the next layer's predicted experts copied during compute) or serial "
        "(one wave after another). Default staged.",
    ),
    load_experts: str = typer.Option(
        "auto",
        "--load-experts",
        help="Where the routed experts' weights load: device (the whole model on --device first; an engine moves "
        "them to host memory), host (they never reach the device: a model whose experts do not fit there; no "
        "--mode resident), or auto: host when the checkpoint exceeds 90% of the device's free memory, else device. "
        "On a CPU device both are host memory.",
    ),
    experts_impl: str = typer.Option(
        "auto",
        "--experts-impl",
        help="Stock experts implementation of --mode resident: auto (batched_mm or grouped_mm, whichever a short "
        "timed probe of the first prompt finds cheaper for a generation of --max-new-tokens tokens, its prefill "
        "included), batched_mm or grouped_mm.",
    ),
    plan: str | None = typer.Option(
        None,
        "--plan",
        help="casmoe: CasMoE's prompt-level plan of experts per layer, made before decoding; "
        "--plan-opt predictors=DIR mode=preload (exact) | restricted (LOSSY) eps=0.3 k=N | mass=0.8.",
    ),
    plan_opt: list[str] | None = typer.Option(
        None, "--plan-opt", help="key=value of --plan (repeatable): predictors, mode, eps, k, mass, renorm, update, buffer."
    ),
    sweep: bool = typer.Option(
        False,
        "--sweep",
        help="Run every combination of --mode, --capacity, --eviction, "
        "--prefetch; print one table. Every value is checked before the first run.",
    ),
    config: str | None = typer.Option(
        None,
        "--config",
        help="Run configuration file written by `moeflow tune --out`: its model, capacity, eviction, prefetch, "
        "lookahead (S), adaptive S, miss, link and calibration; a flag given here wins over the file.",
    ),
) -> None:
    """Generate with routed experts in host memory and a device expert cache; print text and metrics
    (with --json: each run's metrics and each prompt's generated text)."""
    from ..policies.parse import parse_opts, split_list
    from ..stages.run import main
    from ..stages.run_config import RunConfig

    kw: dict[str, Any] = dict(
        model=model,
        prompts=prompts,
        column=column,
        prompt=tuple(prompt or ()),
        data_dir=data_dir,
        split=split,
        limit=limit,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        temperature=temperature,
        seed=seed,
        modes=split_list(mode, "--mode") or ("offload",),
        capacities=split_list(alias(capacity, cache_capacity, "--capacity", "--cache-capacity"), "--capacity") or ("25%",),
        per_layer_cache=per_layer_cache,
        evictions=split_list(eviction, "--eviction") or (DEFAULT_EVICTION,),
        prefetches=split_list(prefetch, "--prefetch") or ("pregate",),
        eviction_opts=parse_opts(eviction_opt or ()),
        prefetch_opts=parse_opts(prefetch_opt or ()),
        miss=miss,
        routing=routing,
        miss_opts=parse_opts(miss_opt or ()),
        routing_opts=parse_opts(routing_opt or ()),
        link=link,
        lookahead=lookahead,
        calibration=calibration,
        dtype=dtype,
        device=device,
        out=out,
        force=force,
        wait=wait,
        json=as_json,
        progress=not no_progress,
        sweep=sweep,
        threads=threads,
        adaptive_s=adaptive_s,
        speculative=speculative,
        batch_size=batch_size,
        warmup=switched("warmup", no_warmup, _warmup),
        prefill=prefill,
        load_experts=load_experts,
        experts_impl=experts_impl,
        plan=plan,
        plan_opts=parse_opts(plan_opt or ()),
    )
    from ..stages.run_config import check_offload_flags, naming_config_file

    keys: tuple[str, ...] = ()
    given = given_flags(ctx)
    check_offload_flags(kw["modes"], given)
    if config:
        from ..stages.run_config import apply_config_file

        kw = apply_config_file(config, kw, given)
        keys = kw["config_keys"]
    with naming_config_file(config, keys):  # a refused value the file set says it came from the file
        main(RunConfig(**kw))
