"""The README.md of a report: the paper's tables with its numbers beside ours, figures, gaps, environment."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class RecipeView(Protocol):
    """What `render` reads of a `moeflow.report.recipe.Recipe` (its steps, tables and missing items)."""

    paper: str
    title: str
    quick: bool
    device: str
    model: str
    intro: str

    @property
    def steps(self) -> Sequence[Any]: ...

    @property
    def tables(self) -> Sequence[Any]: ...

    @property
    def missing_items(self) -> Sequence[Any]: ...


def _env_lines(env: dict[str, Any], r: RecipeView) -> list[str]:
    gpu = env.get("gpu") or "none"
    commit = (env.get("git_commit") or "unknown")[:12] + (" (with uncommitted changes)" if env.get("git_dirty") else "")
    cal = [s.command for s in r.steps if s.command.startswith("moeflow calibrate")]
    return [
        f"- moeflow {env.get('moeflow')} at git commit `{commit}`; Python {env.get('python')}, "
        f"torch {env.get('torch')}, transformers {env.get('transformers')}",
        f"- CPU: {env.get('cpu')} ({env.get('cpu_affinity') or env.get('cpu_cores')} usable cores; "
        f"load average {env.get('load_avg_1m', 0):.1f} at the start, {env.get('load_avg_1m_end') or 0:.1f} at the end); "
        f"GPU: {gpu}; device used: `{r.device}`",
        f"- model: `{r.model}`; tier: {'QUICK (small prompt sets, few tokens)' if r.quick else 'full'}",
        "- calibration: " + ("; ".join(f"`{c}`" for c in cal) if cal else "none (this recipe does not calibrate)"),
        f"- started {env.get('time')}; everything in `environment.json`",
    ]


def render(r: RecipeView, env: dict[str, Any], seconds: float) -> str:
    out = [f"# Reproducing {r.title}", ""]
    tier = "QUICK=1" if r.quick else "full"
    out.append(
        f"Written by `make reproduce-{r.paper}{' QUICK=1' if r.quick else ''}` ({tier} run, {seconds / 60:.1f} min). "
        "Every number in an `ours` column was measured by the commands in `commands.sh` during this run "
        "(raw output in `raw/`, all tables as data in `results.json`); every `paper` column is the paper's "
        "published figure. An em dash (—) means not measured here, or not published."
    )
    out.append("")
    if r.intro:
        out += [" ".join(r.intro.split()), ""]
    out += ["## Environment", *_env_lines(env, r), ""]
    for t in r.tables:
        out += [f"## {t.title}", "", t.markdown(), ""]
        for png, caption in t.figures:
            out += [f"![{caption}]({png})", "", f"*{caption}*", ""]
        for n in t.notes:
            out += [f"- {n}"]
        if t.notes:
            out.append("")
        if t.source:
            out += ["Source: " + ", ".join(f"`raw/{s}.json`" for s in t.source), ""]
    if r.missing_items:
        out += ["## Not reproduced here", ""]
        for m in r.missing_items:
            issue = f" — belongs to open issue {m.issue}" if m.issue is not None else ""
            out.append(f"- **{m.what}**{issue}: {m.why}")
        out.append("")
    failed = [s for s in r.steps if s.status == "failed"]
    if failed:
        out += ["## Failed steps", ""]
        for s in failed:
            out.append(f"- `{s.name}` (exit {s.rc}): {s.message} — full output in `raw/{s.name}.log`")
        out.append("")
    out += ["## Steps", "", "| step | status | seconds | command |", "|---|---|---|---|"]
    for s in r.steps:
        out.append(f"| {s.name} | {s.status} | {s.seconds:.0f} | `{s.command}` |")
    out.append("")
    return "\n".join(out)
