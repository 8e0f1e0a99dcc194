"""`moeflow simulate`: flags -> SimulateConfig -> moeflow.sim.run.main."""

from __future__ import annotations

from typing import Any, Optional

import typer

from .app import app
from .common import json_option, print_json


def render(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"{res['trace']}: {res['passes']} {res['phase']} passes, {res['tokens']} tokens, "
                    f"{res['working_set']:.1f} experts needed per pass of {res['total_experts']}")
    for c in ("capacity", "eviction", "prefetch", "hit rate", "collision misses", "transfers/token",
              "pf precision", "pf recall"):
        t.add_column(c, justify="left" if c in ("eviction", "prefetch") else "right")
    for r in res["rows"]:
        t.add_row(str(r["capacity"]), r["eviction"], r["prefetch"], f"{r['hit_rate']:.3f}", str(r["collisions"]),
                  f"{r['loads_per_token']:.2f}", f"{r['prefetch_precision']:.2f}", f"{r['prefetch_recall']:.2f}")
    Console().print(t)


@app.command("simulate")
def simulate_cmd(
    trace: str = typer.Option(..., "--trace", "-t", help="Trace folder written by `moeflow trace` "
                              "(with --record-hidden for --prefetch pregate)."),
    capacity: Optional[list[str]] = typer.Option(None, "--capacity", "-c", help="Cache size: experts (13) or "
                                                 "percent of all routed experts (10%). Repeatable. Default 10%."),
    eviction: Optional[list[str]] = typer.Option(None, "--eviction", "-e", help="Eviction policy name[:k=v,...] "
                                                 "(lru, lfu, fld, score, lru2, least-stale). Repeatable. Default lru."),
    prefetch: Optional[list[str]] = typer.Option(None, "--prefetch", "-p", help="Prefetch policy name[:k=v,...] "
                                                 "(none, pregate[:overfetch=1.5|percentile=80|mass=0.9], "
                                                 "all-next-layer). Repeatable. Default none."),
    lookahead: int = typer.Option(1, "--lookahead", "-S", help="Step size S: MoE layers ahead to prefetch."),
    phase: str = typer.Option("decode", "--phase", help="decode, prefill or all passes of the trace."),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts", help="Replay only the first N prompts."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Checkpoint whose routers pre-gating applies "
                                        "(must be the traced model)."),
    no_belady: bool = typer.Option(False, "--no-belady", help="Skip Belady's MIN (the demand-paging optimum)."),
    as_json: bool = json_option(),
) -> None:
    """Replay a routing trace through a simulated expert cache: hit rate, collision misses, transfers per token."""
    from ..sim.run import SimulateConfig, main
    cfg = SimulateConfig(trace=trace, capacities=tuple(capacity or ("10%",)), evictions=tuple(eviction or ("lru",)),
                         prefetches=tuple(prefetch or ("none",)), lookahead=lookahead, phase=phase,
                         max_prompts=max_prompts, model=model, belady=not no_belady, progress=not as_json)
    res = main(cfg)
    if as_json:
        print_json(res)
    else:
        render(res)
