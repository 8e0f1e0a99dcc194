"""The flag vocabulary: one spelling per concept, shared by every command (README "Commands").

| concept | flag | old spelling (hidden alias, removed in the next release) |
| prompt source | `--prompts/-p` (trace, run) | |
| prompt column | `--column` (trace, run) | |
| at most N prompts | `--limit/-n` (trace, run, simulate) | simulate `--max-prompts` |
| trace folder | `--trace/-t` (train, eval, simulate) | |
| predictor folder | `--predictors` (eval) | eval `-p` |
| output / replace it | `--out/-o`, `--force` | |
| cache size | `--capacity/-c` (run, simulate) | run `--cache-capacity` |
| eviction / prefetch | `--eviction/-e`, `--prefetch/-f` (run, simulate) | simulate `-p` |
| step size S | `--lookahead/-S` (run, simulate) | |

`-p` means prompts and nothing else. A hidden alias still works and prints a one-line note on stderr.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TypeVar

import typer

from ..models import default_model_path

T = TypeVar("T")


def model_option() -> Any:
    return typer.Option(
        default_model_path(),
        "--model",
        "-m",
        help="Local Hugging Face MoE checkpoint folder (config.json + safetensors). "
        "Default: the project's own olmoe-deep, 12 MoE layers (or $MOEFLOW_MODEL).",
    )


def dtype_option() -> Any:
    return typer.Option("auto", "--dtype", help="auto (float32 on CPU, checkpoint dtype on CUDA), float32, bfloat16, float16.")


def device_option() -> Any:
    return typer.Option("cpu", "--device", help="torch device for the model: cpu or cuda[:N] (checked before anything loads).")


def json_option() -> Any:
    return typer.Option(False, "--json", help="Print results as one JSON object on stdout (for scripts).")


def threads_option(default: int | None = None) -> Any:
    return typer.Option(
        default,
        "--threads",
        help="torch CPU threads (>= 1). Default: "
        + ("torch's (1 is often faster for small models on shared cores)." if default is None else f"{default}."),
    )


def force_option(what: str) -> Any:
    return typer.Option(False, "--force", help=f"Replace an existing {what} at --out (anything else there is never replaced).")


def column_option() -> Any:
    return typer.Option(
        None,
        "--column",
        help="Prompt column of a csv/tsv/json/jsonl prompt file or dataset "
        "(default: detected from the usual ones: prompt, question, "
        "instruction, text, input; any case).",
    )


def prompt_option() -> Any:
    return typer.Option(None, "--prompt", help="A literal prompt (repeatable).")


def split_option(help: str = "Split of a set name (e.g. gsm8k: train/test).") -> Any:
    return typer.Option(None, "--split", help=help)


def data_dir_option(help: str) -> Any:
    return typer.Option(None, "--data-dir", help=help)


def max_new_tokens_option(help: str = "New tokens per prompt.") -> Any:
    return typer.Option(32, "--max-new-tokens", help=help)


def max_prompt_tokens_option(help: str = "Truncate longer prompts (tokens).") -> Any:
    return typer.Option(256, "--max-prompt-tokens", help=help)


def limit_option(what: str = "prompts") -> Any:
    return typer.Option(None, "--limit", "-n", help=f"At most N {what}. Default: all.")


def capacity_option(default: str) -> Any:
    return typer.Option(
        None,
        "--capacity",
        "-c",
        help="Device expert slots for the whole model: N experts (48), P% of all routed experts "
        f"(25%), or a size (64MB, 1.5GiB). Repeat the flag or give a comma list. Default {default}.",
    )


def eviction_option() -> Any:
    return typer.Option(
        None,
        "--eviction",
        "-e",
        help="Eviction policy name[:key=value,...]: lru, lfu, fld, score, lru2, least-stale. "
        "Repeat the flag or give a comma list. Default lru.",
    )


def prefetch_option(default: str) -> Any:
    return typer.Option(
        None,
        "--prefetch",
        "-f",
        help="Prefetch policy name[:key=value,...]: none, pregate[:overfetch=1.5|percentile=80|"
        "mass=0.9], all-next-layer, router-pf, estimator, hybrid, forest (learned: "
        f"predictors=DIR). Repeat the flag or give a comma list. Default {default}.",
    )


def policy_opt_option(kind: str) -> Any:
    return typer.Option(
        None, f"--{kind}-opt", help=f"key=value for every {kind} policy (repeatable; an inline name:key=value wins)."
    )


def lookahead_option(default: int | None, more: str = "") -> Any:
    return typer.Option(default, "--lookahead", "-S", help="Step size S: MoE layers ahead to prefetch" + more + ".")


def hidden_alias(*decls: str) -> Any:
    """An old spelling kept for one release: hidden in --help, merged by `alias`."""
    return typer.Option(None, *decls, hidden=True)


def alias(new: T | None, old: T | None, new_flag: str, old_flag: str) -> T | None:
    """The value of `new_flag`, or of its old spelling `old_flag` (with a note on stderr); lists are joined."""
    if old is None or old == []:
        return new
    sys.stderr.write(f"note: {old_flag} is now {new_flag}; the old spelling goes away in the next release\n")
    if isinstance(new, list) or isinstance(old, list):
        joined: Any = [*(new or []), *(old or [])]  # type: ignore[misc]
        return joined
    return new if new is not None else old


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
