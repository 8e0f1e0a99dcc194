"""Where the checkpoints are: the default `--model` and the ones shipped in `models/`. No torch here, so the
CLI can show these in `--help` without loading a model library (`moeflow.models` re-exports them)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "models/olmoe-deep"


def default_model_path() -> str:
    """`models/olmoe-deep` of the source checkout (or MOEFLOW_MODEL), whatever the working directory."""
    env = os.environ.get("MOEFLOW_MODEL")
    if env:
        return env
    here = Path(__file__).resolve().parent.parent / DEFAULT_MODEL
    return str(here) if here.exists() else DEFAULT_MODEL


def shipped_models() -> list[str]:
    """The checkpoints that come with the repository (`models/<name>` with a config.json), as --model paths: relative
    in the checkout's root, absolute from anywhere else (where `models/<name>` names nothing)."""
    root = Path(__file__).resolve().parent.parent / "models"
    if not root.is_dir():
        return []
    try:
        here = Path.cwd().resolve() == root.parent
    except OSError:  # the working directory was removed
        here = False
    return [f"models/{d.name}" if here else str(d) for d in sorted(root.iterdir()) if (d / "config.json").is_file()]
