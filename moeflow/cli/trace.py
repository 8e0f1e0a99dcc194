"""`moeflow trace` and `moeflow inspect`: flags -> TraceConfig -> moeflow.stages.trace.main."""

from __future__ import annotations

from typing import Any

import typer

from .app import app
from .common import (
    alias,
    column_option,
    data_dir_option,
    device_option,
    dtype_option,
    json_option,
    max_new_tokens_option,
    max_prompt_tokens_option,
    model_option,
    no_progress_option,
    print_json,
    split_option,
    threads_option,
    wait_option,
)

_PROMPTS_HELP = (
    "Prompt file (ShareGPT/Alpaca json, GSM8K/MT-Bench/jsonl, MMLU csv, GLUE tsv, .txt one per line), "
    "a set name (sharegpt, alpaca, gsm8k, mmlu, sst2, cola, rte, wnli, mrpc, mt_bench, wmt16) "
    "resolved in the data dir, or a Hugging Face dataset owner/name (online only)."
)


def build_config(**flags: Any) -> Any:
    """The flag -> config mapping (kept separate so it can be tested without running a trace): the flags are
    TraceConfig's fields, with its defaults."""
    from ..stages.trace import TraceConfig

    return TraceConfig(**flags)


def _summarize(path: str, phase: str | None, as_json: bool) -> None:
    from rich.console import Console

    from ..stages.inspect import main
    from ..trace.summary import render_summary

    s = main(path, phase)
    if as_json:
        print_json(s)
    else:
        render_summary(s, Console())


@app.command("trace")
def trace_cmd(
    model: str = model_option(),
    prompts: str | None = typer.Option(None, "--prompts", "-p", help=_PROMPTS_HELP),
    out: str | None = typer.Option(
        None, "--out", "-o", help="Trace folder to create, or to append to (prompts already traced there are skipped)."
    ),
    max_new_tokens: int = max_new_tokens_option("Decode steps per prompt (tokens)."),
    batch_size: int = typer.Option(
        16,  # TraceConfig's default (tests/test_cli_trace.py checks they agree)
        "--batch-size",
        "-b",
        help="Prompts generated at once (left-padded, grouped by length; the trace keeps the prompt order). "
        "Routing can differ from batch 1 by float rounding; 1 = each prompt alone, the routing `moeflow run` sees.",
    ),
    limit: int | None = typer.Option(
        None, "--limit", "-n", help="Trace at most N prompts (after removing duplicates). Default: all."
    ),
    record_hidden: bool = typer.Option(
        False,
        "--record-hidden",
        help="Also store each MoE layer's router input "
        "and post-attention residual (float16, 2 x H x 2 bytes per token and layer).",
    ),
    hidden_dtype: str = typer.Option(
        "float16",
        "--hidden-dtype",
        help="Storage of --record-hidden states: float16, or float32 (exact router inputs of fp32/bf16 models, "
        "so `moeflow simulate --prefetch pregate` predicts exactly what `moeflow run` does).",
    ),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature; 0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1] (needs --temperature > 0 below 1)."),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help="1.0 = off."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (per prompt: seed + hash of the prompt)."),
    max_prompt_tokens: int = max_prompt_tokens_option("Truncate longer prompts to this many tokens (the beginning is kept)."),
    data_dir: str | None = data_dir_option(
        "Data directory for set names. Default: $MOEFLOW_DATA, else ../shared/data beside the checkout."
    ),
    split: str | None = split_option(
        "Split of a set name (e.g. gsm8k: train/test) or of a Hugging Face dataset (default train)."
    ),
    column: str | None = column_option(),
    dtype: str = dtype_option(),
    device: str = device_option(),
    shard_size: int | None = typer.Option(
        None,
        "--shard-size",
        help="Token records per Arrow shard; a shard "
        "(and meta.json) is written each time this many are buffered. "
        "Default: about 256 MiB of records.",
    ),
    load_experts: str = typer.Option(
        "auto",
        "--load-experts",
        help="Where the routed experts' weights load: device (the whole model on --device), host (they never reach "
        "it: the trace runs through an exact offload engine of --capacity slots), or auto: host when the checkpoint "
        "exceeds 90% of the device's free memory. On a CPU device both are host memory.",
    ),
    capacity: str = typer.Option(
        "25%",
        "--capacity",
        "-c",
        help="With host-loaded experts: the engine's device expert slots (N experts, P% of all routed experts, "
        "or a size such as 8GB). Default 25%.",
    ),
    threads: int | None = threads_option(),
    summary: str | None = typer.Option(None, "--summary", hidden=True, help="Old spelling of `moeflow inspect DIR`."),
    phase: str | None = typer.Option(None, "--phase", hidden=True, help="With --summary: prefill or decode."),
    no_progress: bool = no_progress_option(),
    wait: bool = wait_option(),
    as_json: bool = json_option(),
) -> None:
    """Record expert routing: generate from the prompts (--batch-size at a time) with router hooks and write, per
    token and MoE layer, the top-k experts, their weights and the router probabilities to Arrow shards."""
    if summary:
        alias(None, summary, "`moeflow inspect DIR`", "`moeflow trace --summary DIR`")
        _summarize(summary, phase, as_json)
        return
    from ..stages.trace import main

    cfg = build_config(
        model=model,
        prompts=prompts or "",
        out=out or "",
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        limit=limit,
        record_hidden=record_hidden,
        hidden_dtype=hidden_dtype,
        temperature=temperature,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        max_prompt_tokens=max_prompt_tokens,
        data_dir=data_dir,
        split=split,
        column=column,
        dtype=dtype,
        device=device,
        shard_size=shard_size,
        load_experts=load_experts,
        capacity=capacity,
        threads=threads,
        progress=not no_progress and not as_json,
        wait=wait,
    )
    main(cfg, json_out=as_json)


@app.command("inspect")
def inspect_cmd(
    path: str = typer.Argument(..., help="An artifact folder (a trace folder written by `moeflow trace`)."),
    phase: str | None = typer.Option(None, "--phase", help="Only prefill or decode tokens (default: all)."),
    as_json: bool = json_option(),
) -> None:
    """Print a trace folder's per-MoE-layer expert load (dead experts, skewness = max/mean load) and routing entropy."""
    _summarize(path, phase, as_json)
