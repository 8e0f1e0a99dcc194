"""`moeflow run`: generate with routed experts offloaded to host memory (flags -> RunConfig -> runtime.main)."""

from __future__ import annotations

from typing import List, Optional

import typer

from .app import app
from .common import device_option, dtype_option, json_option, model_option


def _split(values: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in values.split(",") if v.strip())


@app.command("run")
def run(
    model: str = model_option(),
    prompts: Optional[str] = typer.Option(None, "--prompts", "-p",
                                          help="Prompt file (.txt one per line, .json, .jsonl, .csv, .tsv) or a set "
                                               "name (sharegpt, alpaca, gsm8k, mmlu, sst2, mt_bench, ...)."),
    prompt: Optional[List[str]] = typer.Option(None, "--prompt", help="A literal prompt (repeatable)."),
    limit: Optional[int] = typer.Option(None, "--limit", "-n", help="Run at most N prompts."),
    split: Optional[str] = typer.Option(None, "--split", help="Split of a set name (e.g. gsm8k: train/test)."),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="Data directory for set names "
                                           "(default $MOEFLOW_DATA or ../shared/data)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="New tokens per prompt."),
    min_new_tokens: Optional[int] = typer.Option(None, "--min-new-tokens",
                                                 help="Ignore EOS before this many new tokens (equal-length runs)."),
    max_prompt_tokens: int = typer.Option(256, "--max-prompt-tokens", help="Truncate longer prompts (tokens)."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature; 0 = greedy."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (per prompt)."),
    mode: str = typer.Option("offload", "--mode",
                             help="offload (C-slot cache + policies), resident (stock model, all experts on the "
                                  "device: speed/quality reference) or on-demand (load after routing, keep nothing, "
                                  "no prefetch). Comma list with --sweep."),
    cache_capacity: str = typer.Option("25%", "--cache-capacity", "-c",
                                       help="Device expert slots for the whole model: N experts (48), P% of all "
                                            "routed experts (25%), or a size (64MB, 1.5GiB). Comma list with --sweep."),
    per_layer_cache: bool = typer.Option(False, "--per-layer-cache",
                                         help="Split the slots evenly between MoE layers (a layer evicts only its own)."),
    eviction: str = typer.Option("lru", "--eviction", "-e",
                                 help="Eviction policy: lru, lfu, fld, score, lru2, least-stale. Comma list with --sweep."),
    eviction_opt: Optional[List[str]] = typer.Option(None, "--eviction-opt", help="key=value for the eviction policy."),
    prefetch: str = typer.Option("pregate", "--prefetch", "-f",
                                 help="Prefetch policy: none, pregate, all-next-layer. Comma list with --sweep."),
    prefetch_opt: Optional[List[str]] = typer.Option(None, "--prefetch-opt",
                                                     help="key=value for the prefetch policy (e.g. overfetch=1.5)."),
    miss: str = typer.Option("fetch", "--miss", help="Miss policy: fetch (blocking load, exact)."),
    routing: str = typer.Option("standard", "--routing", help="Routing policy: standard (the router's choice)."),
    link: str = typer.Option("auto", "--link",
                             help="Transfer link: cuda (side stream), direct (copy now, no emulation), or "
                                  "emulated:GBPS[,LATENCY_US] (worker thread, e.g. emulated:2,10 = 2 GB/s, 10 us). "
                                  "auto = cuda on CUDA, direct on CPU."),
    lookahead: Optional[int] = typer.Option(None, "--lookahead", "-S",
                                            help="Step size S: MoE layers ahead to prefetch (default: calibration, else 1)."),
    calibration: Optional[str] = typer.Option(None, "--calibration",
                                              help="Calibration JSON (default: calibration/<device>.json as `moeflow calibrate` names it "
                                                   "for this device and link). Gives the step size S."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch intra-op CPU threads (default: torch's). "
                                          "1 is much faster for small models on shared cores."),
    dtype: str = dtype_option(),
    device: str = device_option(),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="JSONL file: one line per prompt and run "
                                      "(text + metrics), written atomically."),
    as_json: bool = json_option(),
    adaptive_s: bool = typer.Option(False, "--adaptive-s",
                                    help="Adapt step size S while running (ExpertFlow 3.2.1-3.2.2): stalls raise S, "
                                         "already-resident experts lower it, observed transfers update the bandwidth "
                                         "estimate; starts from the calibration's S."),
    speculative: bool = typer.Option(False, "--speculative",
                                     help="LOSSY: run the experts a learned prefetcher (router-pf, estimator, hybrid) "
                                          "predicted instead of the router's (Speculating Experts sec. 4). Off by "
                                          "default; quality cost: `moeflow eval --speculative`."),
    sweep: bool = typer.Option(False, "--sweep", help="Run every combination of the comma lists in --mode, "
                               "--cache-capacity, --eviction, --prefetch; print one table."),
) -> None:
    """Generate with routed experts in host memory and a device expert cache; print text and metrics."""
    from ..runtime.config import RunConfig, parse_opts
    from ..runtime.main import main

    cfg = RunConfig(
        model=model, prompts=prompts, prompt=tuple(prompt or ()), data_dir=data_dir, split=split, limit=limit,
        max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, max_prompt_tokens=max_prompt_tokens,
        temperature=temperature, seed=seed, modes=_split(mode), capacities=_split(cache_capacity),
        per_layer_cache=per_layer_cache, evictions=_split(eviction), prefetches=_split(prefetch),
        eviction_opts=parse_opts(eviction_opt or ()), prefetch_opts=parse_opts(prefetch_opt or ()), miss=miss,
        routing=routing, link=link, lookahead=lookahead, calibration=calibration, dtype=dtype, device=device,
        out=out, json=as_json, sweep=sweep, threads=threads, adaptive_s=adaptive_s,
        speculative=speculative)
    main(cfg)
