"""Tables that stay readable at any width, 80 columns included: one helper, `FitTable`.

rich shrinks a table wider than the console by cutting its cells ("f…", "0…"), and a console that
is not a terminal (output to a file or a pipe) is 80 columns wide. A `FitTable` is laid out when it is
printed, for the console's width:

- the title and the caption are paragraphs of the console's width (not squeezed to the table's);
- a header wraps at its spaces, never narrower than the column's widest cell;
- value columns that still do not fit move to a continuation table below, which repeats the key
  columns (the first `key` columns, which name the row), so no cell is ever cut.

Cells are plain text: a `[...]` in a policy or run name is printed as it is, not read as rich markup.
Pass a `rich.text.Text` for a styled cell (`Text("LOSSY", style="bold red")`).

    t = FitTable("moeflow simulate", key=2)
    for c in ("capacity", "policies", "hit rate"):
        t.add_column(c)
    t.add_row("12", "lru+pregate", "0.717")
    console.print(t)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

CONTINUED = "(continued)"


@dataclass
class _Column:
    header: str
    justify: Any  # rich JustifyMethod: "left" | "right" | "center"


def _widest_line(text: str) -> int:
    return max((cell_len(line) for line in text.split("\n")), default=0)


def _widest_word(text: str) -> int:
    return max((cell_len(w) for w in text.split()), default=0)


def _border(n: int) -> int:
    """Columns a rich table with `n` columns adds to its cells' widths (padding 1 + 1, n + 1 rules)."""
    return 3 * n + 1


class FitTable:
    """A table laid out for the console it is printed on (see the module docstring)."""

    def __init__(
        self,
        title: str | None = None,
        *,
        key: int = 1,
        caption: str | None = None,
    ) -> None:
        self.title, self.caption, self.key = title, caption, key
        self.columns: list[_Column] = []
        self.rows: list[tuple[list[Text], bool]] = []

    def add_column(self, header: str, *, justify: Any = None) -> None:
        """`justify`: "left", "right" or "center"; default left for a key column, right for a value column."""
        self.columns.append(_Column(header, justify or ("left" if len(self.columns) < self.key else "right")))

    def add_row(self, *cells: str | Text, end_section: bool = False) -> None:
        row = [c if isinstance(c, Text) else Text(str(c)) for c in cells]
        self.rows.append((row + [Text("")] * (len(self.columns) - len(row)), end_section))

    # -- layout --
    def _widths(self) -> tuple[list[int], list[int], list[int]]:
        """Per column: the natural width (header and cells on one line), the least width at which only the
        header wraps, and the least at which text cells wrap too (at their spaces)."""
        nat, least, words = [], [], []
        for i, c in enumerate(self.columns):
            cells = [r[i].plain for r, _ in self.rows]
            widest = max((_widest_line(s) for s in cells), default=0)
            nat.append(max(cell_len(c.header), widest, 1))
            least.append(max(_widest_word(c.header), widest, 1))
            words.append(max(_widest_word(c.header), max((_widest_word(s) for s in cells), default=0), 1))
        return nat, least, words

    def layout(self, width: int) -> list[list[tuple[int, int]]]:
        """The tables to print at `width`: each a list of (column index, width)."""
        n = len(self.columns)
        if n == 0:
            return []
        nat, least, words = self._widths()
        if sum(nat) + _border(n) <= width:
            return [[(i, nat[i]) for i in range(n)]]
        if sum(least) + _border(n) <= width:
            return [self._grow(list(range(n)), least, nat, width)]
        key = list(range(min(self.key, n - 1)))
        key_w = least if sum(least[i] for i in key) + _border(len(key) + 1) + max(least[len(key) :]) <= width else words
        parts: list[list[int]] = []
        for i in range(len(key), n):
            cols = [*key, *(parts[-1] if parts else []), i]
            if parts and sum(key_w[j] if j in key else least[j] for j in cols) + _border(len(cols)) <= width:
                parts[-1].append(i)
            else:
                parts.append([i])
        m = n - len(key)
        per = -(-m // len(parts))  # the same number of value columns in every table, where they fit
        even = [list(range(j, min(j + per, n))) for j in range(len(key), n, per)]
        if len(even) == len(parts) and all(
            sum(key_w[j] if j in key else least[j] for j in (*key, *p)) + _border(len(key) + len(p)) <= width for p in even
        ):
            parts = even
        out = []
        for p in parts:
            lo = [key_w[j] if j in key else least[j] for j in range(n)]
            out.append(self._grow([*key, *p], lo, nat, width))
        return out

    @staticmethod
    def _grow(cols: list[int], lo: list[int], nat: list[int], width: int) -> list[tuple[int, int]]:
        """Widths of `cols`: `lo`, each column widened to `nat` (its header on one line) while the table still
        fits `width`, the columns that need the least room first."""
        w = {i: lo[i] for i in cols}
        room = width - sum(w.values()) - _border(len(cols))
        for i in sorted(cols, key=lambda j: nat[j] - lo[j]):
            if nat[i] - w[i] <= room:
                room -= nat[i] - w[i]
                w[i] = nat[i]
        return [(i, w[i]) for i in cols]

    def tables(self, width: int) -> list[Table]:
        out = []
        for p in self.layout(width):
            t = Table(expand=False)
            for i, w in p:
                c = self.columns[i]
                t.add_column(Text(c.header), justify=c.justify, width=w, overflow="fold")
            for row, end in self.rows:
                t.add_row(*(row[i] for i, _ in p), end_section=end)
            out.append(t)
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        if self.title:
            yield Text(self.title, style="table.title")
        for n, t in enumerate(self.tables(width)):
            if n:
                yield Text(CONTINUED, style="table.title")
            yield t
        if self.caption:
            yield Text(self.caption, style="table.caption")


def render_text(renderables: Sequence[Any], width: int = 80) -> str:
    """What `renderables` print as on a console of `width` columns (no colour): for tests and logs."""
    import io

    con = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    for r in renderables:
        con.print(r)
    return con.export_text()
