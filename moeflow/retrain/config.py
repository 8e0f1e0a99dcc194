"""`retrain.toml`: what `moeflow retrain` traces, trains, compares and where it records the outcome.

    model = "models/olmoe"            # checkpoint folder (with its tokenizer)
    trace = "traces/live"             # trace folder, appended to
    predictors = "predictors/live"    # predictor folder (a symlink to the promoted version)
    only = ["pregate", "forest"]      # predictors to train; the promotion score is their mean recall@k at S=1
    holdout = 0.2                     # fraction of the trace's prompts held out (split by `seed`)
    seed = 0
    margin = 0.01                     # promote when new >= current - margin
    keep = 3                          # promoted versions kept (>= 2)
    log = "retrain.log"               # one line per run appended
    status = "retrain-status.json"    # the last run's outcome (written atomically)

    [[prompts]]                       # one table per prompt source (as `moeflow trace --prompts`)
    source = "data/new-prompts.jsonl"
    limit = 500                       # optional; also split, column

    [trace_options]                   # optional TraceConfig fields (max_new_tokens, record_hidden, ...)
    [train_options]                   # optional TrainConfig fields (max_s, forest_trees, ...)

Relative paths are taken from the config file's folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

_TOP = {"model", "trace", "predictors", "only", "holdout", "seed", "margin", "keep", "log", "status", "prompts"}
_TABLES = {"trace_options", "train_options"}
_SOURCE = {"source", "limit", "split", "column"}
_TRACE_FIXED = {"model", "prompts", "out", "limit", "split", "column", "data_dir", "progress", "wait"}
_TRAIN_FIXED = {"trace", "out", "model", "only", "holdout", "seed", "force", "wait"}


@dataclass(frozen=True)
class PromptSource:
    source: str
    limit: int | None = None
    split: str | None = None
    column: str | None = None


@dataclass(frozen=True)
class RetrainConfig:
    model: str
    trace: str
    predictors: str
    prompts: tuple[PromptSource, ...]
    only: tuple[str, ...] = ("pregate",)
    holdout: float = 0.2
    seed: int = 0
    margin: float = 0.0
    keep: int = 3
    log: str | None = None
    status: str | None = None
    trace_options: dict[str, Any] = field(default_factory=dict)
    train_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ConfigError("retrain config needs at least one [[prompts]] table with a `source`")
        if not self.only:
            raise ConfigError("retrain config `only` must name at least one predictor")
        if all(n in ("eam", "eap", "gps") for n in self.only):
            raise ConfigError(
                "retrain config `only` needs a layer-ahead predictor (e.g. pregate, forest): promotion compares their "
                "held-out recall@k at S=1; eam/eap/gps are trained alongside but not scored"
            )
        if not 0.0 < self.holdout < 1.0:
            raise ConfigError(f"retrain config `holdout` must be in (0, 1), got {self.holdout}")
        if self.keep < 2:
            raise ConfigError(f"retrain config `keep` must be >= 2 (the current and the previous version), got {self.keep}")

    def fingerprint_fields(self) -> dict[str, Any]:
        """What shapes the trained predictors besides the trace and the model (not log/status/keep/margin)."""
        return {
            "only": sorted(self.only),
            "holdout": self.holdout,
            "seed": self.seed,
            "train": dict(sorted(self.train_options.items())),
        }

    def config_fingerprint(self) -> str:
        blob = json.dumps(self.fingerprint_fields(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _path(base: Path, v: Any, key: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"retrain config `{key}` must be a path string")
    p = Path(v).expanduser()
    return str(p if p.is_absolute() else base / p)


def _check_fields(table: dict[str, Any], cls: type, fixed: set[str], where: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)} - fixed
    bad = sorted(set(table) - names)
    if bad:
        raise ConfigError(f"retrain config [{where}] has unknown key(s) {', '.join(bad)}; allowed: {', '.join(sorted(names))}")
    return dict(table)


def load_config(path: str | Path) -> RetrainConfig:
    """Read and check a retrain TOML file (one ConfigError line for anything wrong)."""
    from ..predict.train import TrainConfig
    from ..trace.config import TraceConfig

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"retrain config {p} does not exist; pass --config FILE (see `moeflow retrain --help`)")
    try:
        raw = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"retrain config {p} is not valid TOML: {e}") from e
    bad = sorted(set(raw) - _TOP - _TABLES)
    if bad:
        raise ConfigError(f"retrain config {p} has unknown key(s) {', '.join(bad)}; allowed: {', '.join(sorted(_TOP | _TABLES))}")
    for k in ("model", "trace", "predictors", "prompts"):
        if k not in raw:
            raise ConfigError(f"retrain config {p} needs `{k}`")
    base = p.resolve().parent
    sources = []
    raw_sources = raw["prompts"]
    if not isinstance(raw_sources, list):
        raise ConfigError("retrain config `prompts` must be a list of tables ([[prompts]] with `source`)")
    for i, s in enumerate(raw_sources):
        if not isinstance(s, dict) or "source" not in s or set(s) - _SOURCE:
            raise ConfigError(f"retrain config prompts[{i}] must be a table with `source` and optional limit, split, column")
        src = str(s["source"])
        local = base / src
        sources.append(
            PromptSource(
                source=str(local) if not Path(src).is_absolute() and local.exists() else src,
                limit=s.get("limit"),
                split=s.get("split"),
                column=s.get("column"),
            )
        )
    only = raw.get("only", ["pregate"])
    if isinstance(only, str):
        only = [only]
    try:
        return RetrainConfig(
            model=_path(base, raw["model"], "model"),
            trace=_path(base, raw["trace"], "trace"),
            predictors=_path(base, raw["predictors"], "predictors"),
            prompts=tuple(sources),
            only=tuple(str(x) for x in only),
            holdout=float(raw.get("holdout", 0.2)),
            seed=int(raw.get("seed", 0)),
            margin=float(raw.get("margin", 0.0)),
            keep=int(raw.get("keep", 3)),
            log=_path(base, raw["log"], "log") if "log" in raw else None,
            status=_path(base, raw["status"], "status") if "status" in raw else None,
            trace_options=_check_fields(raw.get("trace_options", {}), TraceConfig, _TRACE_FIXED, "trace_options"),
            train_options=_check_fields(raw.get("train_options", {}), TrainConfig, _TRAIN_FIXED, "train_options"),
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"retrain config {p}: {e}") from e
