"""The `moeflow` command. Each stage's flags live in `moeflow/cli/<stage>.py`, which turns them
into the stage's frozen config and calls the stage; this module only assembles the app and maps
errors and signals to one line and an exit code:

- a `MoeflowError` (bad flag, missing or corrupt artifact): its line, exit 2;
- a flag click cannot parse (`--threads abc`): one `error:` line, exit 2;
- Ctrl-C: "interrupted", exit 130; SIGTERM: "terminated", exit 143. Both reach the stage as an
  exception, so its `finally` / `except BaseException` clean-ups run and nothing is left half-written;
- anything else: its type and first line, exit 1.

`MOEFLOW_DEBUG=1` shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

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


# click's exception base, or that of the click copy newer typers carry (typer._click): found through a public class
ClickException: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _flags_take_no_value() -> None:
    """typer's --help shows a type placeholder (`<bool>`) beside a flag, which takes no value (`--json true`
    is refused): show none for flags."""
    opt: Any = getattr(getattr(typer, "core", None), "TyperOption", None)
    show = getattr(opt, "display_type_rich", None)
    if show is None or getattr(show, "moeflow_flags", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> Any:
        return None if getattr(self, "is_flag", False) else show(self, ctx)

    display_type_rich.moeflow_flags = True  # type: ignore[attr-defined]
    opt.display_type_rich = display_type_rich


def _visible_options(ctx: Any) -> list[str]:
    """The spellings --help shows for `ctx`'s command (not the hidden old ones)."""
    cmd = getattr(ctx, "command", None)
    if cmd is None:
        return []
    return [o for p in cmd.get_params(ctx) if not getattr(p, "hidden", False) for o in (*p.opts, *p.secondary_opts)]


def _no_such_option(e: Any) -> str:
    """click's "No such option" with its close matches among the options --help shows: click's own list also
    offers hidden old spellings (`--capcity` -> `--cache-capacity`)."""
    import difflib

    name = str(getattr(e, "option_name", "") or "")
    shown = [o for o in _visible_options(getattr(e, "ctx", None)) if o.startswith("--")]
    close = difflib.get_close_matches(name, shown, cutoff=0.75) if name.startswith("--") else []
    return f"no such option: {name}" + (f" (did you mean {' or '.join(close)}?)" if close else "")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt so every stage unwinds the same way."""


class Stopped(BaseException):
    """Ctrl-C or SIGTERM carried past click, which would turn a KeyboardInterrupt into a silent exit."""

    def __init__(self, word: str, code: int):
        super().__init__(word)
        self.word, self.code = word, code


def _version(value: bool) -> None:
    if value:
        typer.echo(f"moeflow {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """moeflow: offloaded MoE inference with learned expert prefetching."""
    _freeze_at_exit()


def _freeze_at_exit() -> None:
    """At interpreter exit, move every object left to gc's permanent generation (`gc.freeze`): the collections of
    the interpreter's teardown then skip them (after a train, the modules of torch, transformers, scikit-learn and
    matplotlib took 1.2-1.5 s to tear down on a 2-core machine under load, 0.2-0.3 s frozen). Every command
    registers it, once per process; nothing changes before the exit (an in-process caller, a test runner)."""
    import atexit
    import gc

    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


def _stoppable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command so Ctrl-C / SIGTERM inside it leave click as `Stopped` (the signature is kept for typer)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Terminated as e:
            raise Stopped("terminated", 143) from e
        except KeyboardInterrupt as e:
            raise Stopped("interrupted", 130) from e

    run.__moeflow_stoppable__ = True  # type: ignore[attr-defined]
    return run


def _register() -> None:
    # Each module adds its command(s) to `app`; import order is the order in --help.
    _flags_take_no_value()
    for name in ("trace", "train", "retrain", "calibrate", "run", "simulate", "tune", "quality", "ep", "gps"):
        try:
            __import__(f"{__package__}.{name}")
        except ModuleNotFoundError as e:  # a stage not built yet in this checkout
            if e.name != f"{__package__}.{name}":
                raise
    for cmd in app.registered_commands:
        if cmd.callback is not None and not getattr(cmd.callback, "__moeflow_stoppable__", False):
            cmd.callback = _stoppable(cmd.callback)


def fail(message: str, code: int = 2) -> None:
    """Print one red line to stderr and exit with `code`. The message is printed as it is: a path, a prompt or a
    TOML table it quotes may hold square brackets, which are not markup."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, markup=True)
    raise SystemExit(code)


def _say(word: str, code: int) -> None:
    sys.stderr.write(f"{word}\n")
    sys.stderr.flush()
    raise SystemExit(code)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the command runs, SIGTERM raises `Terminated` in the main thread (restored after)."""

    def on_term(signum: int, frame: Any) -> None:
        raise Terminated()

    try:
        before = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: list[str] | None = None) -> None:
    debug = os.environ.get("MOEFLOW_DEBUG", "") not in ("", "0")
    _register()
    try:
        with _sigterm_raises():
            code = app(args=argv, standalone_mode=False, prog_name="moeflow")
    except Stopped as e:
        if debug:
            raise (e.__cause__ or e) from None
        _say(e.word, e.code)
    except Terminated:  # outside a command (while parsing flags)
        _say("terminated", 143)
    except KeyboardInterrupt:
        _say("interrupted", 130)
    except MoeflowError as e:
        if debug:  # the traceback, and the exit code a script sees without it
            traceback.print_exc()
            raise SystemExit(e.exit_code) from None
        fail(_one_line(str(e)), e.exit_code)
    except ClickException as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `moeflow` alone: the help, as click prints it
            e.show()
            raise SystemExit(e.exit_code) from None
        if debug:
            traceback.print_exc()
            raise SystemExit(e.exit_code) from None
        hint = f"; see `{e.ctx.command_path} --help`" if getattr(e, "ctx", None) is not None else ""
        text = _no_such_option(e) if type(e).__name__ == "NoSuchOption" else e.format_message()
        fail(_one_line(text).rstrip(".") + hint, e.exit_code)
    except typer.Abort:
        _say("aborted", 1)
    except Exception as e:
        if debug:
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        fail(f"{type(e).__name__}: {first} (set MOEFLOW_DEBUG=1 for the traceback)", 1)
    if code == 130:  # typer's own KeyboardInterrupt exit (outside a command)
        _say("interrupted", 130)
    raise SystemExit(code if isinstance(code, int) else 0)  # like click's standalone mode: always exit


if __name__ == "__main__":  # pragma: no cover
    # `python -m moeflow.cli.app`: this file runs as `__main__`, a second copy of the module, while the commands
    # register on `moeflow.cli.app`'s app; run that one
    from moeflow.cli.app import main as _main

    _main(sys.argv[1:])
