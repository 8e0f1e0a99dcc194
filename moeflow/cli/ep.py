"""`moeflow ep`: greedy generation with the routed experts partitioned across N processes
(flags -> EPConfig -> moeflow.stages.ep)."""

from __future__ import annotations

import typer

from .app import app
from .common import (
    alias,
    column_option,
    data_dir_option,
    device_option,
    dtype_option,
    hidden_alias,
    json_option,
    limit_option,
    max_new_tokens_option,
    max_prompt_tokens_option,
    model_option,
    off_switch,
    on_switch,
    prompt_option,
    split_option,
    switched,
    threads_option,
)


@app.command("ep")
def ep(
    model: str = model_option(),
    prompts: str | None = typer.Option(
        None, "--prompts", "-p", help="Prompt file (.txt, .json, .jsonl, .csv, .tsv) or a set name, as `moeflow run`."
    ),
    column: str | None = column_option(),
    prompt: list[str] | None = prompt_option(),
    limit: int | None = limit_option(),
    split: str | None = split_option(),
    data_dir: str | None = data_dir_option("Data directory for set names."),
    max_new_tokens: int = max_new_tokens_option(),
    min_new_tokens: int | None = typer.Option(None, "--min-new-tokens", help="Ignore EOS before this many new tokens."),
    max_prompt_tokens: int = max_prompt_tokens_option(),
    batch_size: int = typer.Option(1, "--batch-size", "-b", help="Decode this many prompts together (left-padded)."),
    world_size: int | None = typer.Option(
        None,
        "--world-size",
        help="Processes (ranks) to spawn on this machine (default 2). Under torchrun: taken from it.",
    ),
    world_size_n: int | None = hidden_alias("-N"),
    placement: list[str] | None = typer.Option(
        None,
        "--placement",
        help="Expert placement: contiguous (default: --world-size blocks) or a JSON file mapping MoE layer -> "
        'expert -> ranks, e.g. {"*": {"3": [0, 1]}} ("*" = every MoE layer; expert 3 on ranks 0 and 1: a '
        "duplicated expert). Repeat to run and compare several.",
    ),
    backend: str = typer.Option(
        "auto", "--backend", help="torch.distributed backend: auto (nccl on cuda, gloo on cpu), gloo, nccl."
    ),
    no_compare: bool = off_switch(
        "compare", "Rank 0 does not run the single-process model to compare token ids (it does by default)."
    ),
    _compare: bool = on_switch("compare"),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds a collective may wait for the other ranks."),
    no_warmup: bool = off_switch("warmup", "Skip the untimed short generation per placement (done by default)."),
    _warmup: bool = on_switch("warmup"),
    threads: int | None = threads_option(
        "Per rank. Default: $MOEFLOW_THREADS, else $OMP_NUM_THREADS, else 1 for a small model (hidden x expert "
        "size < 2^20) and the usable CPUs divided by the ranks on this machine otherwise."
    ),
    dtype: str = dtype_option(),
    device: str = device_option(),
    as_json: bool = json_option(),
) -> None:
    """Run the model expert-parallel over torch.distributed (all_to_all dispatch and combine; gloo on CPU,
    NCCL on GPUs), check its greedy tokens against one process, print per-layer dispatch / compute /
    combine times and rows per rank. Several GPUs or nodes: `torchrun ... -m moeflow ep` (docs/distributed.md)."""
    from ..stages.ep import EPConfig, main
    from ..stages.run_config import RunConfig

    rc = RunConfig(
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
        modes=("resident",),
        dtype=dtype,
        device=device,
        threads=threads,
        json=as_json,
        batch_size=batch_size,
    )
    cfg = EPConfig(
        run=rc,
        world_size=alias(world_size, world_size_n, "--world-size", "-N"),
        placements=tuple(placement or ("contiguous",)),
        backend=backend,
        compare=switched("compare", no_compare, _compare),
        timeout_s=timeout,
        warmup=switched("warmup", no_warmup, _warmup),
    )
    main(cfg)
