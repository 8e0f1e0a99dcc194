"""`moeflow gps`: flags -> GPSConfig -> moeflow.stages.gps.main (the MoE-GPS strategy guideline)."""

from __future__ import annotations

import typer

from .app import app
from .common import json_option, print_json


@app.command("gps")
def gps_cmd(
    trace: str = typer.Option(
        ..., "--trace", "-t", help="Trace folder written by `moeflow trace` (its prefill routing is used)."
    ),
    gpus: int = typer.Option(4, "--gpus", help="GPUs: tensor-parallel attention, expert-parallel FFN."),
    interconnect: str = typer.Option("nvlink", "--interconnect", help="nvlink (300 GB/s per direction) or pcie (32 GB/s)."),
    link_gbps: float | None = typer.Option(
        None, "--link-gbps", help="Override the interconnect's bandwidth (GB/s per GPU per direction)."
    ),
    link_latency_us: float | None = typer.Option(
        None, "--link-latency-us", help="Override its latency per collective step (µs)."
    ),
    seq_len: int = typer.Option(512, "--seq-len", help="Prefill tokens per batch (batch size 1; trace prompts packed)."),
    model_shape: str = typer.Option(
        "mixtral-8x7b",
        "--model-shape",
        help="Layer dimensions: mixtral-8x7b, olmoe-1b-7b or trace (experts and top-k: the trace's).",
    ),
    gpu: str = typer.Option("a100", "--gpu", help="Roofline of a100, h100, or this (measured on this machine)."),
    redundant: int = typer.Option(1, "--redundant", help="Spare expert slots per GPU for replicas of hot experts."),
    skew: list[float] | None = typer.Option(None, "--skew", help="Skewness values of the sweep (repeat; default 1.5 ... 4.5)."),
    max_batches: int = typer.Option(12, "--max-batches", help="Held-out batches simulated per layer and skewness."),
    predictors: str | None = typer.Option(
        None,
        "--predictors",
        help="Predictor folder with gps/ (`moeflow train --only gps`): fit the accuracy -> overhead curve on it.",
    ),
    plot: str | None = typer.Option(
        None, "--plot", help="Write Fig. 2's kind of plot (latency vs skewness per strategy) to FILE.png."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the held-out split and the simulated predictions."),
    as_json: bool = json_option(),
) -> None:
    """Which expert-prediction strategy to use (MoE-GPS): simulated prefill latency per MoE layer on N GPUs for no prediction,
    distribution-only and token-to-expert prediction, broken into attention / FFN / communication / overhead."""
    from ..stages.gps import GPSConfig, main, render

    cfg = GPSConfig(
        trace=trace,
        gpus=gpus,
        interconnect=interconnect,
        link_gbps=link_gbps,
        link_latency_us=link_latency_us,
        seq_len=seq_len,
        model_shape=model_shape,
        gpu=gpu,
        redundant=redundant,
        skews=tuple(skew) if skew else GPSConfig.skews,
        max_batches=max_batches,
        predictors=predictors,
        plot=plot,
        seed=seed,
    )
    res = main(cfg)
    if as_json:
        print_json(res)
        return
    from rich.console import Console

    render(res, Console())
