"""Options shared by several commands, so every command spells them the same way."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

from ..models import default_model_path


def model_option() -> Any:
    return typer.Option(default_model_path(), "--model", "-m",
                        help="Local Hugging Face MoE checkpoint folder (config.json + safetensors). "
                             "Default: the project's own olmoe-mini (or $MOEFLOW_MODEL).")


def dtype_option() -> Any:
    return typer.Option("auto", "--dtype", help="auto (float32 on CPU, checkpoint dtype on CUDA), float32, bfloat16, float16.")


def device_option() -> Any:
    return typer.Option("cpu", "--device", help="torch device for the model: cpu or cuda[:N].")


def json_option() -> Any:
    return typer.Option(False, "--json", help="Print results as one JSON object on stdout (for scripts).")


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
