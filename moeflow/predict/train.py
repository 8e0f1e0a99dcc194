"""Fitting the predictors of `moeflow train` (the stage is `moeflow.stages.train`): `fit_all` computes the
default vectors once (shared by router-pf, estimator, hybrid) and fits each requested predictor plus the
trivial baselines (`frequency`, `token-id`) and the parameter-free `pregate`; `sequences` are the token
sequences the speculative-quality measurement uses.
`cfg` is the stage's `TrainConfig` (the predictors read their hyperparameters from it).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..moe import model_fingerprint
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


def check_trace_model(data: RoutingData, model: torch.nn.Module, trace: str) -> None:
    fp = model_fingerprint(model)
    if data.fingerprint is not None and data.fingerprint != fp:
        import json

        from ..artifacts import another_model

        try:  # the trace's meta names the model it was traced with (when recorded)
            meta = {**json.loads((Path(trace) / "meta.json").read_text()), "model_fingerprint": data.fingerprint}
        except (OSError, ValueError, TypeError):
            meta = {"model_fingerprint": data.fingerprint}
        raise another_model(f"trace {trace}", meta, fp, "pass the --model it was traced with")


def fit_workers(threads: int, source: str, cores: int | None = None) -> int:
    """Fits run at once by `moeflow train` (the training rule): the forest (scikit-learn's splitter, which releases
    the GIL) fits in a thread of its own beside the estimator and the other fits when this is 2, one after the
    other when 1. `--threads N` (source "--threads") gives min(N, 2): `--threads 1` keeps training on one core.
    Otherwise (the environment, a calibration or the size default: decode's rule, which picks 1 thread for a
    small model because one decode token's products are too small to split) it is 2 whenever the process may use
    2 CPUs or more: the two fits are independent, each a whole core's work for seconds, so a second core halves
    their wall time instead of waiting on barriers."""
    from ..threads import usable_cores

    if source == "--threads":
        return min(max(1, threads), 2)
    return 2 if max(threads, cores or usable_cores()) >= 2 else 1


def fit_all(
    train: RoutingData,
    model: torch.nn.Module,
    cfg: Any,
    progress: Any = None,
    seconds: dict[str, float] | None = None,
    workers: int = 1,
) -> dict[str, Any]:
    """name -> fitted predictor (baselines, pregate if hidden states exist, then cfg.only; hybrid reuses the
    estimator). `seconds` gets the shared default vectors' time under "default vectors". `workers` 2 (see
    `fit_workers`): the forest fits in a thread of its own, with `cfg.threads // 2` (at least 1) tree jobs,
    while the rest fit here; each fit is seeded on its own, so the predictors are the same as one after the
    other."""
    from .default_vectors import compute_default_vectors

    own = [n for n in cfg.only if n != "pregate" and n not in PLANNERS and n not in GPS]
    own.sort(key=lambda n: n == "hybrid")  # after the estimator and router-pf it reuses
    names = list(BASELINES) + (["pregate"] if train.has_hidden else []) + own
    task = (lambda name, total: progress.add_task(name, total=total)) if progress else (lambda *a: None)
    adv = (lambda t, **kw: progress.update(t, **kw)) if progress else (lambda *a, **k: None)
    order = list(names)
    aside = None  # the forest's fit in its own thread
    if workers >= 2 and "forest" in names:
        from concurrent.futures import ThreadPoolExecutor

        names.remove("forest")
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeflow-forest")
        forest_cfg = dataclasses.replace(cfg, threads=max(1, int(cfg.threads or 1) // 2))
        ft = task("fit forest", 1.0)
        aside = pool.submit(_fit_one, "forest", train, model, forest_cfg, lambda t=ft: adv(t, completed=1.0))
    dvec = None
    if any(n in ("router-pf", "estimator", "hybrid") for n in names):
        t = task("mean expert outputs", len(train.spec.moe_layers))  # the default vectors (Speculating Experts 3)
        t0 = time.perf_counter()
        dvec = compute_default_vectors(model, train, max_tokens=cfg.dv_max_tokens, progress=lambda: adv(t, advance=1))
        if seconds is not None:
            seconds["default vectors"] = time.perf_counter() - t0
    out: dict[str, Any] = {}
    try:
        _fit_here(names, train, model, cfg, dvec, out, task, adv)
    finally:
        if aside is not None:
            pool.shutdown(wait=True)
    if aside is not None:
        out["forest"] = aside.result()
    return {n: out[n] for n in order}


def _fit_one(name: str, train: RoutingData, model: torch.nn.Module, cfg: Any, done: Any = None) -> Any:
    """One predictor that needs nothing from the others, fitted (its `fit_seconds` set)."""
    p = PREDICTORS[name].create(model, cfg)
    t0 = time.perf_counter()
    p.fit(train, model, cfg)
    p.fit_seconds = getattr(p, "fit_seconds", 0.0) or (time.perf_counter() - t0)
    if done is not None:
        done()
    return p


def _fit_here(
    names: list[str], train: RoutingData, model: torch.nn.Module, cfg: Any, dvec: Any, out: dict[str, Any], task: Any, adv: Any
) -> None:
    for n in names:
        t = task(f"fit {n}", 1.0)
        p = PREDICTORS[n].create(model, cfg)
        t0 = time.perf_counter()
        if n in ("router-pf",):
            p.fit(train, model, cfg, dvec=dvec)
        elif n == "estimator":
            p.fit(train, model, cfg, dvec=dvec, progress=lambda f, t=t: adv(t, completed=f))
        elif n == "hybrid":
            p.fit(
                train,
                model,
                cfg,
                dvec=dvec,
                estimator=out.get("estimator"),
                progress=lambda f, t=t: adv(t, completed=f),
                router_pf=out.get("router-pf"),
            )
        else:
            p.fit(train, model, cfg)
        p.fit_seconds = getattr(p, "fit_seconds", 0.0) or (time.perf_counter() - t0)
        adv(t, completed=1.0)
        out[n] = p


def sequences(data: RoutingData, limit: int, max_len: int = 256) -> list[list[int]]:
    """The first `limit` prompts' token sequences (prompt + generated tokens), in position order."""
    out = []
    for pid in np.unique(data.prompt_id)[:limit]:
        rows = np.flatnonzero(data.prompt_id == pid)
        rows = rows[np.argsort(data.position[rows])]
        out.append(data.token_id[rows][:max_len].tolist())
    return out
