"""Fitting the predictors of `moeflow train` (the stage is `moeflow.stages.train`): `fit_all` computes the
default vectors once (shared by router-pf, estimator, hybrid) and fits each requested predictor plus the
trivial baselines (`frequency`, `token-id`) and the parameter-free `pregate`; `sequences` are the token
sequences the speculative-quality measurement uses.
`cfg` is the stage's `TrainConfig` (the predictors read their hyperparameters from it).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..threads import idle_cpus
from .base import PREDICTORS
from .data import RoutingData

LEARNED = ("router-pf", "estimator", "hybrid", "forest")
BASELINES = ("frequency", "token-id")
PLANNERS = ("eam", "eap")  # the CasMoE prompt-level planner (moeflow.plan), written to eam/ and eap/
GPS = ("gps",)  # the MoE-GPS predictors (moeflow.gps.predictors), written to gps/


def check_names(names: tuple[str, ...]) -> None:
    bad = [n for n in names if n not in PREDICTORS and n not in PLANNERS and n not in GPS]
    if bad:
        raise ConfigError(
            f"unknown predictor {', '.join(bad)}; choose from: {', '.join((*LEARNED, 'pregate', *BASELINES, *PLANNERS, *GPS))}"
        )


def fit_workers(
    threads: int, source: str, cores: int | None = None, idle: float | None = None, requested: int | None = None
) -> int:
    """Fits run at once by `moeflow train` (the training rule): with 2 the forest fits in a process of its own
    (`in_child`) beside the estimator and the other fits, one after the other with 1. `--threads N` (source
    "--threads") gives min(N, 2): `--threads 1` keeps training on one core. Otherwise (the environment, a
    calibration or the size default: decode's rule, which picks 1 thread for a small model because one decode
    token's products are too small to split) it is 2 when the process may use 2 CPUs or more and at least
    `IDLE_FOR_TWO` of them are idle now (`idle`: idle CPUs, default `idle_cpus()`, this process's own included): the
    two fits are independent, each a whole core's work for seconds, so a second free core halves their wall time,
    and beside one busy job on 2 cores (about 1 CPU idle) the two still finish sooner than one after the other
    (they get two thirds of the machine, not half); on a machine that other work keeps busy, the two would take
    turns on one core, each evicting the other's data from its caches, slower than one after the other.
    1 where processes cannot be forked (`can_fork`). `requested` (`moeflow train --fit-workers 1|2`) replaces the
    idle-CPU rule; `--threads` and `can_fork` still decide first (the stage refuses `--threads 1` with 2)."""
    from ..threads import usable_cores

    if not can_fork():
        return 1
    if source == "--threads":
        return min(max(1, threads), 2)
    if requested is not None:
        return requested
    if max(threads, cores or usable_cores()) < 2:
        return 1
    return 2 if (idle_cpus() if idle is None else idle) >= IDLE_FOR_TWO else 1


def fit_threads(threads: int, source: str, workers: int, idle: float | None = None) -> int:
    """Threads of the fits (torch's, BLAS's, the forest's tree jobs) under the training rule: `--threads N` gives N,
    and so do 2 fits at once (the stage splits them between the two). One fit at a time takes at most the CPUs
    idle now (`idle`, default `idle_cpus()`; rounded, at least 1): each of torch's parallel regions waits at its
    end for all its threads, so a thread that waits for a core other work holds stalls the others; beside one
    busy loop on 2 cores the estimator's fit took 19.5 s with 2 threads against 7.9 s with 1."""
    if source == "--threads" or workers >= 2 or threads <= 1:
        return threads
    free = idle_cpus() if idle is None else idle
    return max(1, min(threads, int(free + 0.5)))


IDLE_FOR_TWO = 0.8  # idle CPUs (this process's own included, as it waits while measuring) for 2 fits at once


def can_fork() -> bool:
    """Whether `in_child` can fork: Linux only (Windows has no fork, and on macOS a forked child of a process that
    loaded torch's and the system's frameworks is not safe)."""
    import multiprocessing as mp
    import sys

    return sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods()


_CHILD: list[Callable[[], Any]] = []  # the function the next forked child runs (inherited, never pickled)


def _run_child() -> Any:
    """In the child: one torch and one BLAS thread (an OpenMP team of the parent's is not usable after fork: a
    parallel region would wait for threads that do not exist; one thread never opens one), then the function."""
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        return _CHILD[0]()


def in_child(fn: Callable[[], Any]) -> Future[Any]:
    """Run `fn()` in a forked process with one torch thread (`_run_child`); its (picklable) result comes back
    through the future. The child inherits everything `fn` reads (the model, the trace arrays) without pickling it, and runs
    apart from this process's GIL: a fit in a thread beside the estimator's many small torch calls would make each
    of them wait for the GIL. The caller calls `.result()` (the pool shuts down once the result is in)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    _CHILD[:] = [fn]
    pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("fork"))
    try:
        fut = pool.submit(_run_child)  # forks here: the child sees _CHILD as set
    finally:
        pool.shutdown(wait=False)  # the submitted call still runs; the worker exits after it
        _CHILD.clear()
    return fut


def fitted_names(only: tuple[str, ...], has_hidden: bool) -> list[str]:
    """The predictors `fit_all` fits for `--only` names `only`, in its order: the baselines, pregate (with hidden
    states), then the learned ones (hybrid after the estimator and router-pf it reuses)."""
    own = [n for n in only if n != "pregate" and n not in PLANNERS and n not in GPS]
    own.sort(key=lambda n: n == "hybrid")
    return list(BASELINES) + (["pregate"] if has_hidden else []) + own


Scores = tuple[dict[str, Any], ...]  # a scorer's output: dicts keyed by predictor name


def fit_all(
    train: RoutingData,
    model: torch.nn.Module,
    cfg: Any,
    progress: Any = None,
    seconds: dict[str, float] | None = None,
    workers: int = 1,
    score: Callable[[dict[str, Any], bool], Scores] | None = None,
    scored: list[Scores] | None = None,
    idle: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """name -> fitted predictor: the baselines, pregate if hidden states exist, then cfg.only (`fitted_names`;
    hybrid reuses the estimator). `seconds` gets the shared default vectors' time under "default vectors".
    `score(preds, here)` (optional) scores a set of them (`here` is False in the forest's process): a tuple of
    picklable dicts keyed by predictor name; the dicts of all its calls, merged in the predictors' order, are
    appended to `scored`. `idle()` (optional) is work this process needs later (e.g. imports), done while it would
    wait for the forest's process.

    `workers` 2 (see `fit_workers`): the forest fits in a process of its own (`in_child`: one torch thread, with
    `cfg.threads // 2` (at least 1) tree jobs: the splitter releases the GIL) while the rest fit here. That process
    also scores the forest, then saves it to a temporary folder read back here; everything else is scored here
    (the forest's process, with scikit-learn's import and the trees, is the longer one). Each fit is seeded on its
    own, so the predictors and scores are the same as one after the other."""
    from .default_vectors import compute_default_vectors

    names = fitted_names(cfg.only, train.has_hidden)
    task = (lambda name, total: progress.add_task(name, total=total)) if progress else (lambda *a: None)
    adv = (lambda t, **kw: progress.update(t, **kw)) if progress else (lambda *a, **k: None)
    order = list(names)
    aside = None  # the forest's fit (and scores) in a process of its own, which saves it to a temporary folder
    if workers >= 2 and "forest" in names:
        import tempfile

        names.remove("forest")
        tmp = tempfile.TemporaryDirectory(prefix="moeflow-forest-")
        forest_cfg = dataclasses.replace(cfg, threads=max(1, int(cfg.threads or 1) // 2))
        ft = task("fit forest", 1.0)
        folder = Path(tmp.name) / "forest"
        aside = in_child(lambda: _fit_aside(train, model, forest_cfg, folder, score))
    dvec = None
    if any(n in ("router-pf", "estimator", "hybrid") for n in names):
        t = task("mean expert outputs", len(train.spec.moe_layers))  # the default vectors (Speculating Experts 3)
        t0 = time.perf_counter()
        dvec = compute_default_vectors(model, train, max_tokens=cfg.dv_max_tokens, progress=lambda: adv(t, advance=1))
        if seconds is not None:
            seconds["default vectors"] = time.perf_counter() - t0
    out: dict[str, Any] = {}
    scores = None
    try:
        _fit_here(names, train, model, cfg, dvec, out, task, adv)
        if score is not None:
            scores = score({n: out[n] for n in names}, True)
        if aside is not None:
            if idle is not None and not aside.done():
                idle()
            seconds_, got = aside.result()
            out["forest"] = PREDICTORS["forest"].load(folder, model)
            out["forest"].fit_seconds = seconds_
            adv(ft, completed=1.0)
            if scores is not None and got is not None:
                scores = tuple(_in_order({**a, **b}, order) for a, b in zip(scores, got))
    finally:
        if aside is not None:
            aside.cancel()
            tmp.cleanup()
    if scores is not None and scored is not None:
        scored.append(scores)
    return {n: out[n] for n in order}


def _in_order(d: dict[str, Any], order: list[str]) -> dict[str, Any]:
    return {n: d[n] for n in order if n in d}


def _fit_aside(train: RoutingData, model: torch.nn.Module, cfg: Any, folder: Path, score: Any) -> tuple[float, Scores | None]:
    """In the forest's process: fit the forest and save it to `folder` (its own save format, read back with its
    `load`); then score it with `score` (optional). (The forest's fit seconds, the scores or None.)"""
    p = _fit_one("forest", train, model, cfg)
    folder.mkdir()
    p.save(folder)
    if score is None:
        return float(p.fit_seconds), None
    return float(p.fit_seconds), score({"forest": p}, False)


def _fit_one(name: str, train: RoutingData, model: torch.nn.Module, cfg: Any, **kw: Any) -> Any:
    """One predictor fitted (its `fit_seconds` set); `kw` what it reuses of the others (`_fit_here`)."""
    p = PREDICTORS[name].create(model, cfg)
    t0 = time.perf_counter()
    p.fit(train, model, cfg, **kw)
    p.fit_seconds = getattr(p, "fit_seconds", 0.0) or (time.perf_counter() - t0)
    return p


def _fit_here(
    names: list[str], train: RoutingData, model: torch.nn.Module, cfg: Any, dvec: Any, out: dict[str, Any], task: Any, adv: Any
) -> None:
    for n in names:
        t = task(f"fit {n}", 1.0)
        kw: dict[str, Any] = {}
        if n in ("router-pf", "estimator", "hybrid"):
            kw["dvec"] = dvec
        if n in ("estimator", "hybrid"):
            kw["progress"] = lambda f, t=t: adv(t, completed=f)
        if n == "hybrid":
            kw.update(estimator=out.get("estimator"), router_pf=out.get("router-pf"))
        out[n] = _fit_one(n, train, model, cfg, **kw)
        adv(t, completed=1.0)


def sequences(data: RoutingData, limit: int, max_len: int = 256) -> list[list[int]]:
    """The first `limit` prompts' token sequences (prompt + generated tokens), in position order."""
    out = []
    for pid in np.unique(data.prompt_id)[:limit]:
        rows = np.flatnonzero(data.prompt_id == pid)
        rows = rows[np.argsort(data.position[rows])]
        out.append(data.token_id[rows][:max_len].tolist())
    return out
