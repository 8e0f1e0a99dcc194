"""The `moeflow` command. Each stage's flags live in `moeflow/cli/<stage>.py`, which turns them
into the stage's frozen config and calls the stage; this module only assembles the app and maps
errors to one line and an exit code."""

from __future__ import annotations

import os
import sys

import typer

from .. import __version__
from ..errors import MoeflowError

app = typer.Typer(
    name="moeflow",
    help="Run Mixture-of-Experts models whose experts do not fit in device memory: "
         "trace routing, train predictors, calibrate the link, run offloaded generation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"moeflow {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """moeflow: offloaded MoE inference with learned expert prefetching."""


def _register() -> None:
    # Each module adds its command(s) to `app`; import order is the order in --help.
    for name in ("trace", "train", "calibrate", "run", "simulate"):
        try:
            __import__(f"{__package__}.{name}")
        except ModuleNotFoundError as e:  # a stage not built yet in this checkout
            if e.name != f"{__package__}.{name}":
                raise


def fail(message: str, code: int = 2) -> None:
    """Print one red line to stderr and exit with `code`."""
    from rich.console import Console
    Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {message}", soft_wrap=True)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    debug = os.environ.get("MOEFLOW_DEBUG", "") not in ("", "0")
    _register()
    try:
        app(args=argv, standalone_mode=True)
    except MoeflowError as e:
        if debug:
            raise
        fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except (OSError, ValueError, RuntimeError) as e:
        if debug:
            raise
        fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (set MOEFLOW_DEBUG=1 for the traceback)", 1)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
