"""Progress display for every long-running command: one helper, `progress(name, ...)`.

On a terminal it is a rich progress bar. When the output goes elsewhere (a file, a pipe, a CI log) a
bar would show nothing until the end, so plain lines are written to stderr instead, at a modest rate:

    simulate: 120/600 configs (20%), 00:35 elapsed

one when a task crosses a tenth of its total or every `INTERVAL_S` seconds, whichever comes first,
never more than one per second per task, none in the first `QUIET_S` seconds (a command that ends
within them prints nothing), and a last line at 100% once a line was printed. `enabled=False`
(`--no-progress`, `--json` where a command says so) shows nothing either way.

The object yielded has the subset of rich's `Progress` the commands use: `add_task(description,
total=..., **fields)`, `advance(task, n)`, `update(task, advance=, completed=, description=, total=,
**fields)`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

INTERVAL_S = 10.0  # a line at least this often while a task advances
MIN_GAP_S = 1.0  # at most one line per second per task
QUIET_S = 2.0  # nothing in the first seconds


@dataclass
class _Task:
    description: str
    total: float | None
    unit: str
    completed: float = 0.0
    last_line: float | None = None  # clock of the last line printed
    last_tenth: int = 0
    finished: bool = False
    fields: dict[str, Any] = field(default_factory=dict)


class PlainProgress:
    """Plain progress lines on a stream (stderr): rich's `Progress` API subset, rate-limited."""

    def __init__(
        self,
        name: str,
        stream: TextIO | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float | None = None,
        quiet_s: float | None = None,
        min_gap_s: float | None = None,
    ):
        self.name = name
        self.stream = stream
        self.clock = clock
        self.interval_s = INTERVAL_S if interval_s is None else interval_s
        self.quiet_s = QUIET_S if quiet_s is None else quiet_s
        self.min_gap_s = MIN_GAP_S if min_gap_s is None else min_gap_s
        self.start = clock()
        self.tasks: dict[int, _Task] = {}

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add_task(self, description: str, total: float | None = 100.0, *, unit: str = "", **fields: Any) -> int:
        tid = len(self.tasks)
        self.tasks[tid] = _Task(description, total, unit, fields=dict(fields))
        return tid

    def advance(self, task: int, advance: float = 1.0) -> None:
        self.update(task, advance=advance)

    def update(
        self,
        task: int,
        *,
        advance: float | None = None,
        completed: float | None = None,
        description: str | None = None,
        total: float | None = None,
        **fields: Any,
    ) -> None:
        t = self.tasks[task]
        if description is not None:
            t.description = description
        if total is not None:
            t.total = total
        if completed is not None:
            t.completed = float(completed)
        if advance:
            t.completed += float(advance)
        t.fields.update(fields)
        self._maybe_print(t)

    def _maybe_print(self, t: _Task) -> None:
        now = self.clock()
        if t.finished or now - self.start < self.quiet_s:
            return
        done = t.total is not None and t.total > 0 and t.completed >= t.total
        if t.last_line is not None and now - t.last_line < self.min_gap_s and not done:
            return
        tenth = int(10 * t.completed / t.total) if t.total else 0
        since = now - (t.last_line if t.last_line is not None else self.start)
        if done or tenth > t.last_tenth or since >= self.interval_s:
            t.last_line, t.last_tenth, t.finished = now, tenth, done
            self._write(self.line(t, now))

    def line(self, t: _Task, now: float) -> str:
        """`name: [description ]done/total unit (pct%), mm:ss elapsed`; a fractional total shows the % only."""
        head = f"{self.name}: " + (f"{t.description} " if t.description and t.description != self.name else "")
        elapsed = _clock(now - self.start)
        unit = f" {t.unit}" if t.unit else ""
        if not t.total:
            return f"{head}{_num(t.completed)}{unit} done, {elapsed} elapsed"
        pct = min(100.0, 100.0 * t.completed / t.total)
        if float(t.total).is_integer() and t.total > 1 and float(t.completed).is_integer():
            return f"{head}{_num(t.completed)}/{_num(t.total)}{unit} ({pct:.0f}%), {elapsed} elapsed"
        return f"{head}{pct:.0f}%, {elapsed} elapsed"

    def _write(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        stream.write(text + "\n")
        stream.flush()


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _clock(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def is_terminal(console: Any = None) -> bool:
    """Whether a bar would be seen: the console's stream (default stderr) is a terminal."""
    if console is not None:
        return bool(getattr(console, "is_terminal", False))
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


@contextlib.contextmanager
def progress(
    name: str,
    *,
    enabled: bool = True,
    console: Any = None,
    columns: Sequence[Any] = (),
    transient: bool = True,
) -> Iterator[Any]:
    """The progress display of command `name` (module docstring): a rich bar with `columns` (rich's
    default columns when empty) on `console` (default: a stderr console) when it is a terminal, plain
    lines on stderr when it is not, nothing when not `enabled`."""
    from rich.progress import Progress

    if not enabled:
        with Progress(disable=True) as off:
            yield off
        return
    if is_terminal(console):
        if console is None:
            from rich.console import Console

            console = Console(stderr=True)
        with Progress(*columns, console=console, transient=transient) as bar:
            yield bar
        return
    with PlainProgress(name) as plain:
        yield plain
