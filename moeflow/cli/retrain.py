"""`moeflow retrain --config retrain.toml`: the cron-safe trace-append + train + compare + promote run."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from .app import app
from .common import hidden_required_alias, json_option, print_json


@app.command("retrain")
def retrain(
    config: Path = typer.Option(..., "--config", help="retrain TOML file (its keys: docs/retrain.md)."),
    config_c: Path | None = hidden_required_alias("config", "--config", "-c"),
    as_json: bool = json_option(),
) -> None:
    """Append new prompts to the trace, retrain when anything changed, promote the new predictors only when
    they are not worse (exit 0: unchanged / promoted / rejected; 75: another retrain holds the lock)."""
    from ..stages.retrain import load_config
    from ..stages.retrain import retrain as run

    cfg = load_config(config)
    console = Console(stderr=as_json)
    rec = run(cfg, console)
    if as_json:
        print_json(rec)
        return
    f = rec.get("figures") or {}

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    console.print(
        f"{rec['outcome']}: version {rec.get('version') or '-'}, {rec.get('prompts_added', 0)} prompts added, "
        f"recall@k (S=1) new {fmt(f.get('new'))}"
        + (f" vs current {fmt(f.get('current'))}" if f.get("current") is not None else "")
        + f" (margin {cfg.margin})"
        + (f"; {rec['message']}" if rec.get("message") else "")
    )
