"""Markdown tables for reports: the paper's published numbers beside ours, and a sentence per difference."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MISSING = "—"


def fmt(v: Any, digits: int = 3) -> str:
    """A cell: None (not measured / not published) -> an em dash; floats to `digits` significant-ish places."""
    if v is None:
        return MISSING
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return MISSING if math.isnan(v) else str(v)
        if abs(v) >= 1000:
            return f"{v:.0f}"
        if abs(v) >= 100:
            return f"{v:.1f}"
        return f"{v:.{digits}g}"
    return str(v)


@dataclass
class Table:
    """One table or figure's numbers in the paper's layout.

    `columns` name every column after the row label; by convention a measured column is `ours: X` and the
    published one beside it `paper: X`. Cells are raw values (None prints as an em dash: not measured here,
    or not in the paper); `notes` are the sentences that explain each difference.
    """

    key: str  # e.g. "table2", "fig4": names the raw JSON and the PNG
    title: str
    columns: list[str]
    label: str = ""
    rows: list[tuple[str, list[Any]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    figures: list[tuple[str, str]] = field(default_factory=list)  # (png file name, caption)
    source: list[str] = field(default_factory=list)  # step names whose JSON the numbers come from

    def row(self, label: str, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.key}: row {label!r} has {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append((label, list(cells)))

    def note(self, text: str) -> None:
        self.notes.append(" ".join(text.split()))

    def markdown(self, digits: int = 3) -> str:
        head = [self.label or "", *self.columns]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for label, cells in self.rows:
            lines.append("| " + " | ".join([label] + [fmt(c, digits) for c in cells]) + " |")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "title": self.title,
            "columns": self.columns,
            "rows": [{"label": lab, "cells": dict(zip(self.columns, cells, strict=True))} for lab, cells in self.rows],
            "notes": self.notes,
            "figures": [f for f, _ in self.figures],
            "source": self.source,
        }
