"""`Recipe`: run a paper's reproduction as the project's own commands, then publish `reports/<paper>/`.

A recipe (recipes/reproduce/<paper>.py) is a function `main(r: Recipe)` that calls
- `r.moeflow(step, *args)` / `r.python(step, script, *args)`: one subprocess each, run from the repository
  root; the exact command line is recorded for `commands.sh`, stdout/stderr go to `raw/<step>.log`, and the
  command's JSON (`--json`'s object, or a benchmark's final JSON line) is returned and kept as
  `raw/<step>.json`. A step that fails is recorded with its last error line and returns None: the tables
  built from it print an em dash and the README lists the failure. Nothing is ever filled in.
- `produces=PATH` (+ `after=[inputs]`) makes a step reusable: when PATH exists and the same command over
  the same inputs made it (a stamp in the work folder), it is not run again. Trace, predictors and
  calibration live in `reports/_work/<model>-<tier>-<device>/`, shared by every recipe, so
  `make reproduce-all` traces and trains once.
- `r.missing(what, why, issue=N)`: a table or figure this checkout cannot produce, printed and listed.
- `r.table(...)` / `r.figure(...)`: the report's content (moeflow.report.table.Table, matplotlib figures).

`Recipe.execute(main)` runs it and publishes the report with `moeflow.artifacts.atomic_dir`: an interrupted
or crashed recipe leaves the previous report untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..artifacts import atomic_dir, write_json_atomic
from .env import environment
from .readme import render
from .table import Table


class StepFailed(Exception):
    """A step's command failed; raised only by `Recipe.require`, which a recipe uses for steps the rest needs."""


@dataclass
class Step:
    name: str
    command: str  # as a user types it from the repository root
    status: str  # "ran", "reused", "failed"
    seconds: float = 0.0
    rc: int | None = None
    message: str = ""
    json_file: str | None = None


@dataclass
class Missing:
    what: str
    why: str
    issue: int | None = None


def _last_json(text: str) -> Any:
    """`--json`'s one object, or the last line of a benchmark's output that parses as a JSON object."""
    s = text.strip()
    if s.startswith("{"):
        try:
            return json.loads(s)
        except json.JSONDecodeError:
            pass
    for line in reversed(s.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


def _fingerprint(paths: Sequence[str | os.PathLike]) -> str:
    """Content stamp of step inputs: a folder's meta.json (moeflow artifacts), else the file's bytes."""
    h = hashlib.sha256()
    for p in paths:
        p = Path(p)
        target = p / "meta.json" if p.is_dir() else p
        h.update(str(p).encode())
        h.update(target.read_bytes() if target.is_file() else b"<absent>")
    return h.hexdigest()[:16]


@dataclass
class Recipe:
    """One paper's reproduction run. See the module docstring."""

    paper: str  # e.g. "specmd": the report folder reports/<paper>/
    title: str  # the paper's title, for the README
    quick: bool = False
    device: str = "cpu"
    model: str = "models/olmoe-deep"
    data_dir: str | None = None
    threads: int = 1
    root: Path = Path("reports")
    repo: Path = Path(".")
    intro: str = ""  # what the paper claims and how this recipe measures it (README top)
    log: Callable[[str], None] = print
    steps: list[Step] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    missing_items: list[Missing] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    _logs: dict[str, str] = field(default_factory=dict)  # step name -> its command, exit, stdout, stderr
    _figures: dict[str, Any] = field(default_factory=dict)  # PNG name -> matplotlib figure
    _copies: dict[str, Path] = field(default_factory=dict)  # report file name -> a file a step wrote

    # ---- paths ------------------------------------------------------------------------------------

    @property
    def tier(self) -> str:
        return "quick" if self.quick else "full"

    @property
    def work(self) -> Path:
        """Shared, reusable artifacts (trace, predictors, calibration) for this model, tier and device."""
        return self.root / "_work" / f"{Path(self.model).name}-{self.tier}-{self.device}"

    @property
    def scratch(self) -> Path:
        """This paper's own outputs (benchmark folders, run jsonl); copied into raw/ when they are JSON/PNG."""
        return self.work / self.paper

    def pick(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full

    # ---- steps ------------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.data_dir:
            env["MOEFLOW_DATA"] = str(self.data_dir)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _stamp_file(self, produces: Path) -> Path:
        return self.work / ".stamps" / (hashlib.sha256(str(produces).encode()).hexdigest()[:20] + ".json")

    def _exec(
        self,
        name: str,
        display: list[str],
        argv: list[str],
        produces: str | os.PathLike | None,
        after: Sequence[str | os.PathLike],
        timeout: float | None,
    ) -> Any:
        if any(s.name == name for s in self.steps):
            raise ValueError(f"step name {name!r} used twice in recipe {self.paper}")
        command = shlex.join(display)
        key = {"command": command, "inputs": _fingerprint(after)}
        stamp = self._stamp_file(Path(produces)) if produces is not None else None
        if stamp is not None and produces is not None and Path(produces).exists() and stamp.is_file():
            try:
                rec = json.loads(stamp.read_text())
            except (OSError, ValueError):
                rec = {}
            if rec.get("key") == key:
                self.log(f"[recipe {self.paper}] {name}: reused {produces} (same command and inputs)")
                self.steps.append(Step(name, command, "reused", json_file=f"raw/{name}.json" if rec.get("json") else None))
                if rec.get("json") is not None:
                    self.raw[name] = rec["json"]
                return rec.get("json")
        self.log(f"[recipe {self.paper}] {name}: {command}")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                argv, cwd=self.repo, env=self._env(), capture_output=True, text=True, timeout=timeout, check=False
            )
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = 124
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = f"timed out after {timeout:.0f} s"
        seconds = time.perf_counter() - t0
        self._logs[name] = f"$ {command}\n# exit {rc}, {seconds:.1f} s\n--- stdout\n{out}\n--- stderr\n{err}"
        if rc != 0:
            msg = _last_error(err or out)
            self.log(f"[recipe {self.paper}] {name}: FAILED (exit {rc}, {seconds:.0f} s): {msg}")
            self.steps.append(Step(name, command, "failed", seconds, rc, msg))
            return None
        data = _last_json(out)
        self.log(f"[recipe {self.paper}] {name}: done in {seconds:.0f} s")
        self.steps.append(Step(name, command, "ran", seconds, rc, json_file=f"raw/{name}.json" if data is not None else None))
        if data is not None:
            self.raw[name] = data
        if stamp is not None:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(stamp, {"key": key, "json": data, "produces": str(produces)})
        return data

    def moeflow(
        self,
        name: str,
        *args: Any,
        produces: str | os.PathLike | None = None,
        after: Sequence[str | os.PathLike] = (),
        json_out: bool = True,
        timeout: float | None = None,
    ) -> Any:
        """Run `moeflow ARGS` (adding `--json` unless `json_out=False`); its JSON object, or None if it failed."""
        a = [str(x) for x in args]
        if json_out and "--json" not in a:
            a.append("--json")
        return self._exec(name, ["moeflow", *a], [sys.executable, "-m", "moeflow", *a], produces, after, timeout)

    def python(
        self,
        name: str,
        script: str,
        *args: Any,
        produces: str | os.PathLike | None = None,
        after: Sequence[str | os.PathLike] = (),
        timeout: float | None = None,
    ) -> Any:
        """Run `python SCRIPT ARGS` (a benchmark); its final JSON line, or None if it failed."""
        a = [str(x) for x in args]
        return self._exec(name, ["python", script, *a], [sys.executable, script, *a], produces, after, timeout)

    def ok(self, name: str) -> bool:
        return any(s.name == name and s.status in ("ran", "reused") for s in self.steps)

    def require(self, value: Any, name: str) -> Any:
        """`value` if step `name` succeeded, else StepFailed (for steps every later table needs)."""
        if value is None or not self.ok(name):
            raise StepFailed(f"step {name} failed; the tables that need it are not in this report")
        return value

    def missing(self, what: str, why: str, issue: int | None = None) -> None:
        """A table/figure (or part) this checkout cannot produce: printed now, listed in the README."""
        where = f" (issue {issue})" if issue is not None else ""
        self.log(f"[recipe {self.paper}] MISSING {what}{where}: {why}")
        self.missing_items.append(Missing(what, why, issue))

    # ---- content ----------------------------------------------------------------------------------

    def table(self, key: str, title: str, columns: list[str], label: str = "", source: Sequence[str] = ()) -> Table:
        t = Table(key, title, list(columns), label=label, source=list(source))
        self.tables.append(t)
        return t

    def figure(self, table: Table, name: str, fig: Any, caption: str) -> None:
        """Attach a matplotlib figure to `table`; saved as `<name>.png` in the report."""
        if not name.endswith(".png"):
            name += ".png"
        self._figures[name] = fig
        table.figures.append((name, caption))

    def copy_file(self, src: str | os.PathLike, name: str | None = None) -> str | None:
        """Copy a file a step wrote (a PNG, a JSON) into the report; its report-relative name, or None."""
        src = Path(src)
        if not src.is_file():
            return None
        name = name or src.name
        self._copies[name] = src
        return name

    # ---- publish ----------------------------------------------------------------------------------

    def execute(self, main: Callable[[Recipe], None]) -> int:
        """Run `main(self)`, then publish reports/<paper>/ atomically. 0 if every step ran, 1 if some failed."""
        import matplotlib

        matplotlib.use("Agg")
        t0 = time.time()
        self.work.mkdir(parents=True, exist_ok=True)
        self.scratch.mkdir(parents=True, exist_ok=True)
        env = environment(self.repo, self.device)
        aborted: str | None = None
        try:
            main(self)
        except StepFailed as e:
            aborted = str(e)
            self.log(f"[recipe {self.paper}] stopped: {aborted}")
        except Exception as e:  # a bug in a paper's table code: keep what was measured, say where it stopped
            import traceback

            traceback.print_exc()
            aborted = f"the recipe stopped with {type(e).__name__}: {e} (traceback on stderr; a bug in the recipe)"
            self.log(f"[recipe {self.paper}] stopped: {aborted}")
        if aborted:
            self.missing("the rest of this report", aborted)
        env["load_avg_1m_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        seconds = time.time() - t0
        final = self.root / self.paper
        with atomic_dir(final, keep_versions=2) as stage:
            raw = stage / "raw"
            raw.mkdir()
            for name, data in self.raw.items():
                write_json_atomic(raw / f"{name}.json", data)
            for name, text in self._logs.items():
                (raw / f"{name}.log").write_text(text)
            for name, src in self._copies.items():
                shutil.copyfile(src, stage / name)
            for name, fig in self._figures.items():
                fig.savefig(stage / name, dpi=120, bbox_inches="tight")
            write_json_atomic(stage / "environment.json", env)
            results = {
                "paper": self.paper,
                "tier": self.tier,
                "device": self.device,
                "model": self.model,
                "seconds": round(seconds, 1),
                "tables": [t.to_json() for t in self.tables],
                "missing": [m.__dict__ for m in self.missing_items],
                "steps": [s.__dict__ for s in self.steps],
            }
            write_json_atomic(stage / "results.json", results)
            (stage / "commands.sh").write_text(self._commands())
            (stage / "README.md").write_text(render(self, env, seconds))
        failed = [s for s in self.steps if s.status == "failed"]
        self.log(
            f"[recipe {self.paper}] wrote {final}/README.md in {seconds / 60:.1f} min: {len(self.tables)} tables, "
            f"{len(failed)} failed steps, {len(self.missing_items)} missing items"
        )
        return 1 if failed or aborted else 0

    def _commands(self) -> str:
        lines = [
            "#!/usr/bin/env bash",
            f"# The commands `make reproduce-{self.paper}{' QUICK=1' if self.quick else ''}` ran, in order, from the",
            "# repository root with .venv activated. Steps marked 'reused' were made by an earlier run with the",
            "# same command and inputs (reports/_work/ keeps them); delete reports/_work/ to redo everything.",
            "set -euo pipefail",
        ]
        if self.data_dir:
            lines.append(f"export MOEFLOW_DATA={shlex.quote(str(self.data_dir))}")
        for s in self.steps:
            tag = {"ran": "", "reused": "  # reused", "failed": f"  # FAILED (exit {s.rc})"}[s.status]
            lines.append(s.command + tag)
        return "\n".join(lines) + "\n"
