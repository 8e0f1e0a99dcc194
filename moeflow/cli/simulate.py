"""`moeflow simulate`: flags -> SimulateConfig -> moeflow.sim.run.main."""

from __future__ import annotations

from typing import Any

import typer

from .app import app
from .common import (
    alias,
    capacity_option,
    eviction_option,
    hidden_alias,
    json_option,
    limit_option,
    lookahead_option,
    policy_opt_option,
    prefetch_option,
    print_json,
)


def render(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"{res['trace']}: {res['passes']} {res['phase']} passes ({res['replayed_passes']} replayed), "
        f"{res['tokens']} tokens, {res['working_set']:.1f} experts needed per pass of {res['total_experts']}; "
        f"link {res['link']}; {res['accesses_per_s'] / 1e6:.2f} M accesses/s"
    )
    cols = ("capacity", "eviction", "prefetch", "hit rate", "collision misses", "transfers/token", "pf precision", "pf recall")
    for c in (*cols, "stall s", "M acc/s"):
        t.add_column(c, justify="left" if c in ("eviction", "prefetch") else "right")
    for r in res["rows"]:
        t.add_row(
            str(r["capacity"]),
            r["eviction"],
            r["prefetch"],
            f"{r['hit_rate']:.3f}",
            str(r["collisions"]),
            f"{r['loads_per_token']:.2f}",
            f"{r['prefetch_precision']:.2f}",
            f"{r['prefetch_recall']:.2f}",
            f"{r['stall_s']:.4f}",
            f"{r['accesses_per_s'] / 1e6:.2f}",
        )
    Console().print(t)


@app.command("simulate")
def simulate_cmd(
    trace: str = typer.Option(
        ..., "--trace", "-t", help="Trace folder written by `moeflow trace` (with --record-hidden for --prefetch pregate)."
    ),
    capacity: list[str] | None = capacity_option("10%"),
    eviction: list[str] | None = eviction_option(),
    eviction_opt: list[str] | None = policy_opt_option("eviction"),
    prefetch: list[str] | None = prefetch_option("none"),
    prefetch_opt: list[str] | None = policy_opt_option("prefetch"),
    prefetch_p: list[str] | None = hidden_alias("-p"),
    lookahead: int = lookahead_option(1),
    phase: str = typer.Option("decode", "--phase", help="decode, prefill or all passes of the trace."),
    limit: int | None = limit_option("prompts of the trace (the first ones)"),
    max_prompts: int | None = hidden_alias("--max-prompts"),
    model: str | None = typer.Option(
        None, "--model", "-m", help="Checkpoint whose routers pre-gating applies (must be the traced model)."
    ),
    no_belady: bool = typer.Option(False, "--no-belady", help="Skip Belady's MIN (the demand-paging optimum)."),
    link: str = typer.Option(
        "instant",
        "--link",
        help="instant (copies complete at once, as --link direct) or emulated:GBPS[,LATENCY_US] "
        "(EmulatedLink's FIFO schedule on a virtual clock).",
    ),
    layer_time_us: float = typer.Option(
        0.0, "--layer-time-us", help="Compute per MoE layer per pass on the modelled link's virtual clock (microseconds)."
    ),
    as_json: bool = json_option(),
) -> None:
    """Replay a routing trace through the runtime's expert cache (no weights): hit rate, collision misses, transfers
    per token; `--json` rows carry `decode_counters` with the fields of `moeflow run --json`."""
    from ..policies.parse import parse_opts, split_list
    from ..sim.run import SimulateConfig, main

    cfg = SimulateConfig(
        trace=trace,
        capacities=split_list(capacity) or ("10%",),
        evictions=split_list(eviction) or ("lru",),
        prefetches=split_list(alias(prefetch, prefetch_p, "--prefetch/-f", "-p")) or ("none",),
        eviction_opts=parse_opts(eviction_opt or ()),
        prefetch_opts=parse_opts(prefetch_opt or ()),
        lookahead=lookahead,
        phase=phase,
        max_prompts=alias(limit, max_prompts, "--limit/-n", "--max-prompts"),
        model=model,
        belady=not no_belady,
        progress=not as_json,
        link=link,
        layer_time_us=layer_time_us,
    )
    res = main(cfg)
    if as_json:
        print_json(res)
    else:
        render(res)
