"""The flag vocabulary: one spelling per concept, shared by every command (docs/cli.md lists them).

| concept | flag | old spelling (hidden alias, removed in the next release) |
| prompt source | `--prompts/-p` (trace, run) | |
| prompt column | `--column` (trace, run) | |
| at most N prompts | `--limit/-n` (trace, run, simulate) | simulate `--max-prompts` |
| trace folder | `--trace/-t` (train, eval, simulate) | |
| predictor folder | `--predictors` (eval) | eval `-p` |
| output / replace it / wait for its writer | `--out/-o`, `--force`, `--wait` | |
| cache size | `--capacity/-c` (run, simulate) | run `--cache-capacity` |
| eviction / prefetch | `--eviction/-e`, `--prefetch/-f` (run, simulate) | simulate `-p` |
| step size S | `--lookahead/-S` (run, simulate) | |
| no progress display | `--no-progress` (trace, train, calibrate, run, simulate, tune: the commands that draw it) | |

`-p` means prompts and nothing else. A hidden alias still works and prints a one-line note on stderr.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TypeVar

import typer

from ..model_paths import default_model_path
from ..registry import BUILTIN, LEARNED_PREFETCH, host_miss

T = TypeVar("T")


def model_option() -> Any:
    return typer.Option(
        default_model_path(),
        "--model",
        "-m",
        help="Local Hugging Face MoE checkpoint folder (config.json + safetensors). "
        "Default: the project's own models/olmoe-deep, 12 MoE layers (or $MOEFLOW_MODEL).",
        show_default=False,  # the help says it; the absolute path would not fit
    )


def traced_model_option() -> Any:
    """`--model` of a command that replays a trace (simulate, tune): None leaves it to the trace's own checkpoint."""
    return typer.Option(
        None,
        "--model",
        "-m",
        help="The traced checkpoint, for pregate's routers (default: the model the trace records, else "
        "models/olmoe-deep or $MOEFLOW_MODEL).",
    )


def dtype_option() -> Any:
    return typer.Option(
        "auto", "--dtype", help="auto (float32 on CPU, checkpoint dtype on CUDA), checkpoint, float32, bfloat16, float16."
    )


def device_option() -> Any:
    return typer.Option("cpu", "--device", help="torch device for the model: cpu or cuda[:N] (checked before anything loads).")


def json_option() -> Any:
    return typer.Option(False, "--json", help="Print results as one JSON object on stdout (for scripts).")


def off_switch(name: str, help: str) -> Any:
    """`--no-NAME` for a setting that is on by default (the parameter is True when it was given). One name per
    option: a `--NAME/--no-NAME` pair would widen the short-flag column of --help and leave an 80-column terminal a
    help column of about 20 characters. `--NAME` itself is still accepted (`on_switch`: it is the default)."""
    return typer.Option(False, f"--no-{name}", help=help, show_default=False)


def on_switch(name: str) -> Any:
    """The hidden `--NAME` of an `off_switch` (on is the default), so scripts that spell it keep working; `switched`
    reads the pair."""
    return typer.Option(False, f"--{name}", hidden=True)


def switched(name: str, off: bool, on: bool) -> bool:
    """The setting of an `off_switch` / `on_switch` pair: on unless `--no-NAME`; both given is one line (they were
    one `--NAME/--no-NAME` flag where the last one won, which two parameters cannot tell)."""
    if off and on:
        raise typer.BadParameter(f"--{name} and --no-{name} contradict each other; give one", param_hint=f"--no-{name}")
    return not off


def no_progress_option() -> Any:
    """`--no-progress`, on every command that draws progress (`moeflow.progress`): the stage's config gets
    `progress=not no_progress` (and `False` where the command's `--json` silences it too)."""
    return typer.Option(
        False,
        "--no-progress",
        help="No progress display: neither the bar on a terminal nor the plain progress lines on stderr otherwise.",
    )


def threads_option(help: str | None = None) -> Any:
    """`--threads N`; without it every command follows one rule (`moeflow.threads`, stated in the help)."""
    from ..threads import HELP

    return typer.Option(None, "--threads", help=HELP if help is None else f"torch CPU threads (>= 1). {help}")


def force_option(what: str) -> Any:
    return typer.Option(False, "--force", help=f"Replace an existing {what} at --out (anything else there is never replaced).")


def wait_option() -> Any:
    return typer.Option(
        False,
        "--wait",
        help="Wait for another writer of --out to finish instead of refusing (exit 75) while it holds the --out lock.",
    )


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


def policy_names(kind: str, learned: bool | None = None) -> str:
    """The built-in `kind` policy names (eviction, prefetch, miss, routing), comma-separated, for --help, from the
    torch-free list `moeflow.registry.BUILTIN` (the registries are checked against it, so the help cannot miss a
    policy; one a test or a plugin registers is not listed). `learned` keeps only the prefetchers that need (True)
    or need no (False) predictor folder."""
    return ", ".join(n for n in BUILTIN[kind] if learned is None or (n in LEARNED_PREFETCH) == learned)


def eviction_option(default: str = "lru") -> Any:
    return typer.Option(
        None,
        "--eviction",
        "-e",
        help=f"Eviction policy name[:key=value,...]: {policy_names('eviction')}. "
        f"Repeat the flag or give a comma list. Default {default}.",
    )


def prefetch_option(default: str, learned: bool = True) -> Any:
    """`--prefetch/-f`; `learned=False` for `moeflow simulate`, which replays no learned prefetcher."""
    rule = "pregate takes overfetch=1.5 | percentile=80 | mass=0.9"
    if learned:
        names = (
            f"{policy_names('prefetch', learned=False)} ({rule}); learned, with "
            f"--prefetch-opt predictors=DIR from `moeflow train`: {policy_names('prefetch', learned=True)}"
        )
    else:
        names = (
            f"{policy_names('prefetch', learned=False)} ({rule}). The learned prefetchers "
            f"({policy_names('prefetch', learned=True)}) need the running model: measure them with `moeflow run`"
        )
    return typer.Option(
        None,
        "--prefetch",
        "-f",
        help=f"Prefetch policy name[:key=value,...]: {names}. Repeat the flag or give a comma list. Default {default}.",
    )


def miss_option(many: bool = False) -> Any:
    """`--miss`: what a needed expert that is not resident costs (`moeflow.policies.miss`)."""
    return typer.Option(
        None if many else "fetch",
        "--miss",
        help=f"Miss policy name[:key=value,...]: {policy_names('miss')}. fetch (blocking load) is exact; "
        "cpu / auto compute on the host (exact on CPU); drop, substitute and the low-bit ones (fetch-lowest-bit, "
        "fetch-priority, cascade: a low-precision copy) are LOSSY. Options: name:k=v or --miss-opt."
        + (" Several (comma list) with --sweep." if many else "")
        + " Default fetch.",
        show_default=False,
    )


def routing_option(many: bool = False) -> Any:
    """`--routing`: whether the cache may change which experts a layer selects (`moeflow.policies.routing`)."""
    return typer.Option(
        None if many else "standard",
        "--routing",
        help=f"Routing policy name[:key=value,...]: {policy_names('routing')}. standard and hit-first are exact; "
        "cache-aware (--routing-opt lambda=0.3) and plan-restricted are LOSSY."
        + (" Several with --sweep." if many else "")
        + " Default standard.",
        show_default=False,
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


def hidden_required_alias(new_name: str, new_flag: str, old_flag: str) -> Any:
    """The old spelling `old_flag` of a required option (parameter `new_name`, flag `new_flag`): hidden in --help.
    Given, it prints the note of `alias` and stands in for `new_flag`, which --help then still marks required."""

    def fill(ctx: typer.Context, value: Any) -> Any:
        if value is not None:
            alias(None, value, new_flag, old_flag)
            ctx.default_map = {**(ctx.default_map or {}), new_name: value}
        return value

    return typer.Option(None, old_flag, hidden=True, is_eager=True, callback=fill)


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


def given_flags(ctx: Any) -> set[str]:
    """The parameters typed on the command line (not left at their default); typer may carry its own click, so
    its ParameterSource is compared by name."""
    return {p for p in ctx.params if getattr(ctx.get_parameter_source(p), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")}


def hit_rate_cell(row: dict[str, Any]) -> str:
    """A table's hit rate of a simulated row: `-` where the cache saw no access (miss cpu: every access is a hit,
    the misses go to the host, so a rate of 0 means none), else three decimals."""
    if host_miss(row) and not row["hit_rate"]:
        return "-"
    return f"{row['hit_rate']:.3f}"
