"""`moeflow calibrate`: flags -> CalibrateConfig -> moeflow.stages.calibrate.main."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape

from .app import app
from .common import (
    device_option,
    dtype_option,
    force_option,
    json_option,
    model_option,
    no_progress_option,
    print_json,
    threads_option,
    wait_option,
)


def build_config(
    *,
    model: str,
    device: str = "cpu",
    dtype: str = "auto",
    link_gbps: float | None = None,
    link_latency_us: float = 0.0,
    sizes: str = "64,256,1024,4096,16384",
    repeats: int = 5,
    decode_steps: int = 8,
    prompt_tokens: int = 16,
    engine_rounds: int = 3,
    regime: list[str] | None = None,
    out: str | None = None,
    write: bool = True,
    progress: bool = True,
    force: bool = False,
    threads: int | None = None,
    wait: bool = False,
) -> Any:
    """The flag -> config mapping (kept separate so it can be tested without measuring)."""
    from ..errors import ConfigError
    from ..stages.calibrate import CalibrateConfig

    if out is not None and not write:
        raise ConfigError("--no-write writes nothing: drop --out, or drop --no-write")

    return CalibrateConfig(
        model=model,
        device=device,
        dtype=dtype,
        link_gbps=link_gbps,
        link_latency_s=link_latency_us * 1e-6,
        sizes_kib=CalibrateConfig.parse_sizes(sizes),
        repeats=repeats,
        decode_steps=decode_steps,
        prompt_tokens=prompt_tokens,
        engine_rounds=engine_rounds,
        regimes=tuple(regime or ()),
        out=out,
        write=write,
        progress=progress,
        force=force,
        threads=threads,
        wait=wait,
    )


def _host_rows(lt: dict[str, Any]) -> list[tuple[str, str]]:
    """The host terms of miss policy cpu (a CPU device with a link), when measured: what `tune` and `simulate`
    time a host-computed miss with."""
    if lt.get("host_miss_s") is None:
        return []
    per, split = float(lt["host_miss_s"]) * 1e3, float(lt.get("host_split_s", 0.0)) * 1e3
    return [("--miss cpu: per host expert / split call", f"+{per:.3f} ms / +{split:.3f} ms")]


def render(rec: dict[str, Any]) -> None:
    from rich.console import Console

    from ..tables import FitTable

    con = Console()
    emulated = f", {rec['link_gbps']:g} GB/s emulated" if rec["link_gbps"] else ""
    t = FitTable(f"transfer sweep ({rec['link']}{emulated})")
    for c in ("size", "time", "GB/s"):
        t.add_column(c, justify="right")
    for r in rec["sweep"]:
        mark = " (1 expert)" if r["bytes"] == rec["expert_bytes"] else ""
        t.add_row(f"{r['bytes'] / 1024:,.0f} KiB{mark}", f"{r['seconds'] * 1e6:,.1f} µs", f"{r['gbps']:.2f}")
    con.print(t)
    s = FitTable(f"calibration of {rec['device']}")
    s.add_column("quantity")
    s.add_column("value", justify="right")
    rows = [
        ("expert size E_s", f"{rec['expert_bytes']:,} B"),
        ("bandwidth C_s (one expert, latency incl.)", f"{rec['bandwidth_gbps']:.3f} GB/s"),
        ("fitted bandwidth / latency", f"{rec['fitted_bandwidth_bytes_per_s'] / 1e9:.3f} GB/s / {rec['latency_s'] * 1e6:.1f} µs"),
        ("decode layer time T_l", f"{rec['layer_time_s'] * 1e3:.3f} ms"),
        ("  attention + norms (layer - MoE)", f"{rec['attention_time_s'] * 1e3:.3f} ms"),
        ("one expert, one token", f"{rec['expert_time_s'] * 1e3:.3f} ms"),
        ("decode forward (per token)", f"{rec['compute_per_token_s'] * 1e3:.3f} ms"),
        (
            "threads: decode ms/token at each count",
            ", ".join(f"{r['threads']}: {r['compute_per_token_s'] * 1e3:.2f}" for r in rec.get("thread_sweep") or []),
        ),
        ("best threads (the commands' default)", f"{rec.get('best_threads')} ({rec.get('threads_source')})"),
        ("experts per layer N_e (top-k)", str(rec["experts_per_layer"])),
        *_host_rows(rec.get("link_timing") or {}),
        ("S = N_e E_s / (C_s T_l)", f"{rec['s_formula']:.3f} -> {rec['initial_s']}"),
    ]
    for q, v in rows:
        s.add_row(q, v)
    con.print(s)
    if rec["regimes"]:
        g = FitTable("emulated bandwidth reproducing a regime (on-demand loading, this model)")
        for c in ("regime", "GB/s", "one expert", "copy share of TPOT"):
            g.add_column(c, justify="right")
        for r in rec["regimes"]:
            g.add_row(
                r["regime"], f"{r['gbps']:.4f}", f"{r['expert_transfer_s'] * 1e3:.3f} ms", f"{r['copy_share_on_demand']:.2f}"
            )
        con.print(g)
    if rec.get("path"):
        con.print(f"wrote {escape(str(rec['path']))}")  # a path is text, not markup


@app.command("calibrate")
def calibrate_cmd(
    model: str = model_option(),
    device: str = device_option(),
    dtype: str = dtype_option(),
    link_gbps: float | None = typer.Option(
        None,
        "--link-gbps",
        help="Also calibrate the emulated link "
        "(EmulatedLink) at this bandwidth, GB/s = 1e9 bytes/s (CPU only). "
        "The file is then named <device>-emulated-<X>gbps.json.",
    ),
    link_latency_us: float = typer.Option(
        0.0, "--link-latency-us", help="Per-transfer latency of the emulated link, microseconds."
    ),
    sizes: str = typer.Option(
        "64,256,1024,4096,16384",
        "--sizes",
        help="Transfer sizes of the bandwidth sweep, KiB, comma-separated (one expert's size is always added).",
    ),
    repeats: int = typer.Option(5, "--repeats", help="Timed repeats per size and per module (median)."),
    decode_steps: int = typer.Option(8, "--decode-steps", help="Decode steps (tokens) timed for per-layer compute."),
    prompt_tokens: int = typer.Option(
        16,
        "--prompt-tokens",
        help="Prompt length before the timed decode steps (the KV length decode starts from); "
        "set it near the prompts you will run.",
    ),
    engine_rounds: int = typer.Option(
        3,
        "--engine-rounds",
        help="Timed rounds of the offload engine (every expert resident, then a small cache on --link-gbps), "
        "interleaved; each figure is the median over rounds.",
    ),
    regime: list[str] | None = typer.Option(
        None,
        "--regime",
        help="Print the emulated bandwidth that "
        "reproduces a named regime: 'copy-share=0.85' (copies are 85% "
        "of TPOT under on-demand loading; Speculating Experts, A6000 + "
        "Qwen3-30B-A3B) or 'specmd' (SpecMD's 5 GB/s, scaled so one "
        "expert takes as long as an OLMoE-1B-7B bf16 expert: 2.52 ms). "
        "Repeatable.",
    ),
    out: str | None = typer.Option(
        None, "--out", "-o", help="Output JSON file. Default: calibration/<device>.json (e.g. calibration/cpu.json)."
    ),
    no_write: bool = typer.Option(False, "--no-write", help="Measure and print only."),
    force: bool = force_option("calibration file"),
    wait: bool = wait_option(),
    threads: int | None = threads_option(
        "Time decode compute at this count only. Default: $MOEFLOW_THREADS or $OMP_NUM_THREADS if set, else at "
        "1, 2, 4, ... up to the usable CPUs; the fastest is recorded as best_threads, the default of every command."
    ),
    no_progress: bool = no_progress_option(),
    as_json: bool = json_option(),
) -> None:
    """Measure host->device bandwidth, decode compute per layer and per expert; compute ExpertFlow's step size S."""
    from ..stages.calibrate import main

    cfg = build_config(
        model=model,
        device=device,
        dtype=dtype,
        link_gbps=link_gbps,
        link_latency_us=link_latency_us,
        sizes=sizes,
        repeats=repeats,
        decode_steps=decode_steps,
        prompt_tokens=prompt_tokens,
        engine_rounds=engine_rounds,
        regime=regime,
        out=out,
        write=not no_write,
        progress=not no_progress and not as_json,
        force=force,
        threads=threads,
        wait=wait,
    )
    rec = main(cfg)
    if as_json:
        print_json(rec)
    else:
        render(rec)
