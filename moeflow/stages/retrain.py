"""`moeflow retrain`: under a lock, append new prompts to the trace, skip when nothing changed, else train a
new version, evaluate it beside the promoted one on the same held-out prompts, promote it only when it is
not worse, keep the last N versions, log one line and write a JSON status file.

Outcomes: "unchanged" (the trace + model + config fingerprint equals the promoted version's, or the one a
previous run rejected with the same margin), "promoted", "rejected", "failed". A kill at any instant leaves
the promoted version intact: the candidate is written under `.<name>.versions/tmp-<ns>-<pid>/` (removed
by the next write once its pid is gone) and promotion is `atomic_dir`'s one symlink `os.replace`.

The config, `retrain.toml`: what `moeflow retrain` traces, trains, compares and where it records the outcome.

    model = "/abs/path/models/olmoe-deep"  # checkpoint folder with its tokenizer (relative: from this file's folder)
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

The retrain lock: the predictor folder's artifact lock (`moeflow.locks.out_lock`), so a retrain, a
`moeflow train --out` of the same folder and a second retrain never write it at once.

Busy: `LockBusy` (exit 75, EX_TEMPFAIL) naming the holder; a cron run does nothing and tries again later.
A holder killed in any way (kill -9 included) releases it; the next run takes over and records the dead
holder (`took_over`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..artifacts import META, _current, _versions, atomic_dir, now_iso, write_json_atomic
from ..errors import ArtifactError, ConfigError
from ..locks import EX_TEMPFAIL, LockBusy, describe, lock_path, out_lock
from ..outputs import check_out

_TOP = {"model", "trace", "predictors", "only", "holdout", "seed", "margin", "keep", "log", "status", "prompts"}
_TABLES = {"trace_options", "train_options"}
_SOURCE = {"source", "limit", "split", "column"}
_TRACE_FIXED = {"model", "prompts", "out", "limit", "split", "column", "data_dir", "progress", "wait"}
_TRAIN_FIXED = {"trace", "out", "model", "only", "holdout", "seed", "force", "wait", "progress"}


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
        from ..predict.base import PREDICTORS  # registered on import (moeflow.predict)

        hidden = [n for n in self.only if n in PREDICTORS and PREDICTORS[n].needs_hidden]
        if hidden and not self.trace_options.get("record_hidden"):  # said before any prompt is traced
            raise ConfigError(
                f"retrain config `only` has {', '.join(hidden)}, which need the trace's hidden states: "
                "set record_hidden = true under [trace_options]"
            )

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
    """The table's keys are `cls`'s fields; their values are checked now, by `cls` itself (with placeholders for
    what the config sets elsewhere), and a refusal names the table's key, not the command-line flag it stands for."""
    names = {f.name for f in dataclasses.fields(cls)} - fixed
    bad = sorted(set(table) - names)
    if bad:
        raise ConfigError(f"retrain config [{where}] has unknown key(s) {', '.join(bad)}; allowed: {', '.join(sorted(names))}")
    try:
        required = [f.name for f in dataclasses.fields(cls) if f.name in ("model", "prompts", "out", "trace")]
        cls(**{n: "-" for n in required}, **table)  # its __post_init__ checks
    except ConfigError as e:  # `--max-new-tokens must be >= 1` -> `max_new_tokens must be >= 1`
        said = re.sub(r"--([a-z][a-z0-9-]*)", lambda m: m.group(1).replace("-", "_"), str(e))
        raise ConfigError(f"retrain config [{where}]: {said}") from None
    except (TypeError, ValueError):  # a value of the wrong type: said where the config is built
        pass
    return dict(table)


def load_config(path: str | Path) -> RetrainConfig:
    """Read and check a retrain TOML file (one ConfigError line for anything wrong)."""
    from .trace import TraceConfig
    from .train import TrainConfig

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
    model = _path(base, raw["model"], "model")
    if not Path(model).is_dir():  # one line naming the file's key (retrain has no --model flag)
        from ..model_paths import shipped_models

        ships = ", ".join(str(Path(m).resolve()) for m in shipped_models())
        raise ConfigError(
            f"retrain config {p}: model = {raw['model']!r} is {model}, not a model folder; set `model =` to a checkpoint "
            f"folder with its tokenizer (a relative path is taken from the config's folder)"
            + (f"; the repository ships {ships}" if ships else "")
        )
    try:
        return RetrainConfig(
            model=model,
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


__all__ = ["EX_TEMPFAIL", "LockBusy", "describe", "lock_path", "retrain_lock"]


@contextlib.contextmanager
def retrain_lock(predictors: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Hold the lock of `predictors`; raise LockBusy naming the holder when another process has it.

    Yields {"path", "took_over": the previous holder's record when its process is gone (a stale lock), or None}.
    """
    with out_lock(
        predictors, command="moeflow retrain", flag="predictors", hint="this run does nothing, try again later"
    ) as held:
        yield held


S = 1  # the promotion score is mean recall@k at step S=1 of the chosen predictors


def trace_fingerprint(trace: str | os.PathLike) -> str:
    """Shards (name + sha256) and prompt ids of a trace's meta.json."""
    p = Path(trace) / META
    if not p.is_file():
        return "none"
    meta = json.loads(p.read_text())
    shards = [[s.get("name"), s.get("sha256")] for s in meta.get("shards", [])]
    blob = json.dumps({"shards": shards, "prompt_ids": sorted(meta.get("prompt_ids") or [])}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _log_line(cfg: RetrainConfig, rec: dict[str, Any]) -> None:
    if not cfg.log:
        return
    f = rec.get("figures") or {}
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    line = (
        f"{rec['time']} moeflow retrain {rec['outcome']} version={rec.get('version') or '-'} "
        f"new={fmt(f.get('new'))} current={fmt(f.get('current'))} prompts_added={rec.get('prompts_added', 0)} "
        f"seconds={rec.get('seconds')}"
    )
    if rec.get("message"):
        line += f" message={' '.join(str(rec['message']).split())!r}"
    Path(cfg.log).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(cfg.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _last_status(cfg: RetrainConfig) -> dict[str, Any]:
    if not cfg.status:
        return {}
    with contextlib.suppress(OSError, ValueError):
        rec = json.loads(Path(cfg.status).read_text())
        if isinstance(rec, dict):
            return rec
    return {}


def _trace_new(cfg: RetrainConfig, model: Any, tok: Any, console: Any) -> int:
    """Append every source's prompts not yet in the trace (`moeflow.stages.trace.run_trace`); prompts added."""
    from ..data import load_prompts
    from .trace import TraceConfig, check_trace_out, run_trace

    added = 0
    for src in cfg.prompts:
        tcfg = TraceConfig(
            model=cfg.model,
            prompts=src.source,
            out=cfg.trace,
            limit=src.limit,
            split=src.split,
            column=src.column,
            progress=False,
            **cfg.trace_options,
        )
        check_trace_out(tcfg)
        prompts = load_prompts(tcfg.prompts, data_dir=tcfg.data_dir, limit=tcfg.limit, split=tcfg.split, column=tcfg.column)
        added += int(run_trace(model, tok, prompts, tcfg, None)["prompts_added"])
    return added


def _score(folder: str | Path, names: list[str], model: Any, held: Any, window: int) -> dict[str, float] | None:
    """name -> mean recall@k at S=1 on `held` for the predictors of `folder` (None if it lacks one of them)."""
    from ..predict.evaluate import evaluate
    from ..predict.io import load_predictors, read_predictor_meta

    meta = read_predictor_meta(folder)
    if any(n not in meta.get("predictors", []) for n in names):
        return None
    _, preds = load_predictors(folder, model, names)
    rep = evaluate(preds, held, max_s=S, window=window, mass=0.8)
    return {n: float(rep["by_s"][n][S]) for n in names}


def _mean(d: dict[str, float] | None) -> float | None:
    return None if d is None else sum(d.values()) / len(d)


def retrain(cfg: RetrainConfig, console: Any = None) -> dict[str, Any]:
    """One cron run; the status record (also written to cfg.status). Raises LockBusy (exit 75) when locked."""
    t0 = time.perf_counter()
    with retrain_lock(cfg.predictors) as lock:
        rec: dict[str, Any] = {"time": now_iso(), "outcome": "failed", "pid": os.getpid(), "predictors": cfg.predictors}
        if lock["took_over"]:
            rec["took_over_stale_lock"] = lock["took_over"]
        try:
            _run(cfg, rec, console)
        except BaseException as e:
            rec["outcome"] = "failed"
            rec["message"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            raise
        finally:
            rec["seconds"] = round(time.perf_counter() - t0, 3)
            if cfg.status:
                write_json_atomic(cfg.status, rec)
            _log_line(cfg, rec)
    return rec


def _run(cfg: RetrainConfig, rec: dict[str, Any], console: Any) -> None:
    from ..models import load_model, torch_threads
    from ..moe import model_fingerprint
    from ..predict.data import split_from_trace
    from ..predict.io import KIND, read_predictor_meta
    from ..predict.train import PLANNERS, check_names
    from .threads import apply_threads
    from .train import TrainConfig, load_cpu_model
    from .train import main as train_main

    check_names(cfg.only)
    final = Path(os.path.abspath(cfg.predictors))
    check_out(final, kind=KIND, inputs=(cfg.trace, cfg.model), reuse=True)
    model, tok = load_model(
        cfg.model, dtype=cfg.trace_options.get("dtype", "auto"), device=cfg.trace_options.get("device", "cpu")
    )
    if tok is None:
        raise ArtifactError(f"{cfg.model} has no tokenizer (tokenizer.json); save one beside the checkpoint")
    with torch_threads(None):  # the trace's threads as `moeflow trace` picks them; restored after
        threads = apply_threads(cfg.trace_options.get("threads"), model, cfg.trace_options.get("device", "cpu"))
        rec["prompts_added"] = _trace_new(cfg, model, tok, console)
    rec.update(threads.to_dict())
    fp = {
        "trace": trace_fingerprint(cfg.trace),
        "model": model_fingerprint(model),
        "config": cfg.config_fingerprint(),
    }
    rec["fingerprint"] = fp
    del model
    current = _current(final)
    rec["current_version"] = rec["version"] = current
    cur_meta: dict[str, Any] = {}
    if current is not None:
        with contextlib.suppress(ArtifactError):
            cur_meta = read_predictor_meta(final)
    last = _last_status(cfg)
    promoted_these = (cur_meta.get("retrain") or {}).get("fingerprint") == fp
    if promoted_these or (
        last.get("outcome") == "rejected"
        and last.get("fingerprint") == fp
        and last.get("figures", {}).get("margin") == cfg.margin
    ):
        rec["outcome"] = "unchanged"
        # the figures the message names: the promoted version's, or the rejected candidate's (not the current one's)
        rec["figures"] = ((cur_meta.get("retrain") or {}).get("figures") if promoted_these else None) or last.get("figures")
        rec["message"] = (
            "the current version was trained on these inputs (its figures: when it was promoted)"
            if promoted_these
            else "the last run rejected a candidate of these same inputs (its figures)"
        )
        return

    # train a candidate inside the versions folder, as a writer's tmp-<ns>-<pid> (cleaned up once we are gone)
    vroot = _versions(final)
    vroot.mkdir(parents=True, exist_ok=True)
    work = vroot / f"tmp-{time.time_ns():020d}-{os.getpid()}"
    work.mkdir()
    try:
        cand = work / "candidate"
        tcfg = TrainConfig(
            trace=cfg.trace,
            out=str(cand),
            model=cfg.model,
            only=cfg.only,
            holdout=cfg.holdout,
            seed=cfg.seed,
            force=True,
            **cfg.train_options,
        )
        trained = train_main(tcfg)
        # the same held-out prompts for both: predict's split of the current trace by seed, of the tokens train loaded
        need_hidden = "pregate" in cfg.only or any(n in cfg.only for n in ("router-pf", "estimator", "hybrid"))
        mt = trained["max_tokens"]
        _, held = split_from_trace(cfg.trace, cfg.holdout, cfg.seed, need_hidden=need_hidden, max_tokens=mt)
        emodel = load_cpu_model(cfg.model)
        names = [n for n in cfg.only if n not in PLANNERS and n != "gps"]
        new = _score(cand, names, emodel, held, tcfg.forest_window)
        old = None
        if cur_meta:
            try:
                old = _score(final, names, emodel, held, tcfg.forest_window)
            except ArtifactError:
                old = None  # made for another model, unreadable: the new version replaces it
        n_new, n_old = _mean(new), _mean(old)
        rec["figures"] = {
            "new": n_new,
            "current": n_old,
            "margin": cfg.margin,
            "s": S,
            "new_by_predictor": new,
            "current_by_predictor": old,
        }
        if n_new is None:
            raise ArtifactError(f"the new predictors lack one of {', '.join(names)}")
        if n_old is not None and n_new < n_old - cfg.margin:
            rec["outcome"] = "rejected"
            rec["message"] = f"new recall@k {n_new:.4f} < current {n_old:.4f} - margin {cfg.margin}"
            return
        src = Path(os.path.realpath(cand))
        meta = json.loads((src / META).read_text())
        meta["retrain"] = {"fingerprint": fp, "figures": rec["figures"], "promoted_at": now_iso()}
        with atomic_dir(final, keep_versions=cfg.keep) as tmp:
            for child in src.iterdir():
                if child.name != META:
                    os.rename(child, tmp / child.name)
            write_json_atomic(tmp / META, meta)
        rec["outcome"] = "promoted"
        rec["version"] = _current(final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
