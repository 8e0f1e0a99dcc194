"""`moeflow train` and `moeflow eval` stages: fit predictors on a trace, evaluate on held-out prompts, save.

`main(TrainConfig)` loads the model and the trace, splits prompts into train / held-out, computes the
default vectors once (shared by router-pf, estimator, hybrid), fits each requested predictor plus the
trivial baselines (`frequency`, `token-id`) and the parameter-free `pregate` (`moeflow.predict.train.fit_all`),
evaluates all of them on the held-out prompts, fits the CasMoE planner (`moeflow.plan.train`) and the MoE-GPS
predictors (`moeflow.gps.predictors`) when asked, and writes the predictor folder atomically
(`moeflow.predict.io`). `eval_main(EvalConfig)` evaluates a predictor folder on a trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ArtifactError, ConfigError
from ..moe import model_fingerprint
from ..predict.base import PREDICTORS
from ..predict.data import from_trace, split_from_trace
from ..predict.estimator import EST_DTYPES
from ..predict.train import (
    BASELINES,
    GPS,
    LEARNED,
    PLANNERS,
    check_names,
    fit_all,
    fit_threads,
    fit_workers,
    sequences,
)
from ..threads import idle_cpus

__all__ = ["BASELINES", "GPS", "LEARNED", "PLANNERS", "EvalConfig", "TrainConfig", "eval_main", "load_cpu_model", "main"]


DEFAULT_MAX_S = 4  # `--max-s`'s default: S = 1..4 MoE layers ahead, fewer where the model has fewer (`within_model`)
DEFAULT_MAX_TOKENS = 100_000  # `--max-tokens`'s default, lowered where the host cannot hold it (`tokens_to_load`)
LOAD_SHARE = 0.5  # of the memory available once the model is loaded: what the default lets the loaded rows take


@dataclass(frozen=True)
class TrainConfig:
    trace: str
    out: str
    model: str
    only: tuple[str, ...] = LEARNED  # learned predictors to fit (pregate and baselines always come along)
    holdout: float = 0.2  # fraction of prompts held out for evaluation
    seed: int = 0
    # traced tokens loaded: beyond it, whole prompts drawn at random (`prompt_rows`); 0: all; None: DEFAULT_MAX_TOKENS,
    # or fewer where the host cannot hold them (`tokens_to_load`, which `_main` resolves it by)
    max_tokens: int | None = None
    max_s: int | None = None  # largest step S fitted and evaluated (None: DEFAULT_MAX_S; `within_model` resolves)
    mass: float = 0.8  # cumulative score mass of the evaluated prefetch set
    threads: int | None = None  # torch threads and forest jobs (None: moeflow.threads' rule)
    fit_workers: int | None = None  # fits at once, 1 or 2 (None: the idle-CPU rule, `predict.train.fit_workers`)
    dv_max_tokens: int = 50_000  # tokens per layer used for the default vectors
    est_latent: int = 128  # estimator m
    est_hidden: int = 256  # estimator n
    est_blocks: int = 1  # residual SiLU blocks
    est_context: int = 2  # input embeddings of the last tokens fed to the estimator
    est_epochs: int = 3  # most epochs (fewer when validation recall stops improving, more for est_min_steps)
    est_lr: float = 6e-3
    est_weight_decay: float = 1e-4
    est_bce: float = 0.0  # weight of a multi-label BCE on the routed top-k beside the KL (held out: 0 was best)
    est_batch: int = 1024  # samples (rows x (layer, S) pairs) per optimiser step
    est_patience: int = 1  # stop after this many epochs without a better validation recall
    est_residual: bool = True  # the network adds to the target router's logits of q (Router-PF's); False: plain
    est_max_tokens: int = 30_000  # training rows (tokens), each used for every (layer, S) pair
    est_max_samples: int = 133_000  # rows x pairs cap per epoch, i.e. the fit's time (and memory: q of every pair is kept)
    est_min_steps: int = 300  # at least this many optimiser steps (small traces)
    est_dtype: str = "auto"  # what the training steps multiply in: bfloat16 (autocast), float32, auto (`native_bf16`)
    hybrid_val: float = 0.25  # part of the training prompts used to pick Hybrid-PF's threshold
    forest_trees: int = 24
    forest_depth: int = 0  # 0: no limit (forest_min_leaf bounds the trees)
    forest_min_leaf: int = 8
    forest_max_features: float = 0.064  # part of the features tried per split (at least forest_arrays.MIN_SPLIT_FEATURES)
    forest_max_samples: int = 120_000  # the pool: rows x (layer, S) pairs, subsampled per pair
    forest_tree_samples: int = 9_000  # each tree's bootstrap draw from the pool (the whole pool when smaller)
    forest_window: int = 4
    forest_base: str = "none"  # forest learns y - base: none (y itself; best held out) | pregate (top-k; ExpertFlow) | prior
    forest_dim: int = 16
    plan_phase: str = "prefill"  # CasMoE EP labels from prefill tokens, or "all" (+ decode)
    plan_label: str = "ep"  # ep (eq. 3) | count (Table 4)
    plan_k: int = 0  # experts per layer a plan is scored on (0: the model's top-k)
    plan_eps: float = 0.3  # cascade gate: EAM when its best cosine >= eps, else EAP
    eam_k_prime: int = 3  # EAM neighbours fused (eq. 5)
    eam_weighted: bool = False  # similarity-weighted fusion instead of the plain mean
    eap_layers: int = 6  # EAP encoder (initialised from MiniLM; the paper: 6 / 64 / 128)
    eap_hidden: int = 64
    eap_intermediate: int = 128
    eap_epochs: int = 30
    eap_lr: float = 1e-3
    eap_batch: int = 32
    embedder: str = ""  # sentence-transformers model folder for the EAM ("": all-MiniLM-L6-v2)
    force: bool = False  # replace an existing predictor folder at `out`
    wait: bool = False  # wait for another writer of `out` instead of refusing (moeflow.locks.out_lock)
    progress: bool = True  # the progress display (moeflow.progress) where a console is given; --no-progress: False

    def __post_init__(self) -> None:
        for flag, v in (
            ("--max-s", 1 if self.max_s is None else self.max_s),
            ("--threads", 1 if self.threads is None else self.threads),
            ("--forest-trees", self.forest_trees),
            ("--forest-samples", self.forest_max_samples),
            ("forest_tree_samples", self.forest_tree_samples),
            ("--est-epochs", self.est_epochs),
        ):
            if v < 1:
                raise ConfigError(f"{flag} must be >= 1 (got {v})")
        if not 0.0 < self.holdout < 1.0:
            raise ConfigError(f"--holdout must be in (0, 1), got {self.holdout}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ConfigError(f"--max-tokens must be >= 0 (0: every traced token), got {self.max_tokens}")
        if self.est_dtype not in EST_DTYPES:
            raise ConfigError(f"--est-dtype must be one of {', '.join(EST_DTYPES)} (got {self.est_dtype!r})")
        if self.fit_workers not in (None, 1, 2):
            raise ConfigError(f"--fit-workers must be 1 or 2 (got {self.fit_workers}); leave it out for the idle-CPU rule")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["only"] = list(self.only)
        return d


@dataclass(frozen=True)
class EvalConfig:
    predictors: str
    trace: str
    model: str
    only: tuple[str, ...] = ()
    max_s: int | None = None  # None: DEFAULT_MAX_S; `within_model` resolves it against the model
    mass: float = 0.8
    window: int = 4
    plan_eps: float = 0.3  # CasMoE cascade gate threshold
    plan_k: int = 0  # experts per layer a plan is scored on (0: top-k)
    speculative: bool = False  # also measure speculative execution's quality cost
    spec_sequences: int = 24  # trace prompts (prompt + generated tokens) used for that
    threads: int | None = None  # torch threads (None: moeflow.threads' rule)
    max_tokens: int | None = None  # traced tokens scored: as TrainConfig's (prompts drawn with seed 0)

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1 (got {self.threads})")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ConfigError(f"--max-tokens must be >= 0 (0: every traced token), got {self.max_tokens}")
        for flag, v in (
            ("--max-s", 1 if self.max_s is None else self.max_s),
            ("--spec-sequences", self.spec_sequences),
            ("window", self.window),
        ):
            if v < 1:
                raise ConfigError(f"{flag} must be >= 1 (got {v})")
        if not 0.0 < self.mass <= 1.0:
            raise ConfigError(f"--mass must be in (0, 1], got {self.mass}")


def load_cpu_model(path: str, *, float_experts: bool = False) -> torch.nn.Module:
    """The model on the CPU in float32, except (without `float_experts`) the routed experts' stacked weights, which
    stay in the checkpoint's dtype (`models.load_routing_model`); the default vectors, the only fit that runs the
    experts, cast one layer at a time (`compute_default_vectors`). `float_experts`: everything in float32, for a
    forward through the whole model (`eval --speculative`)."""
    from ..models import load_model, load_routing_model

    _check_model_dir(path)
    if float_experts:
        model, _ = load_model(path, dtype="float32", device="cpu", tokenizer=False)
        return model
    return load_routing_model(path)


def main(cfg: TrainConfig, console: Any = None) -> dict[str, Any]:
    """`moeflow train`: fit, evaluate on held-out prompts, save the predictor folder; the report.

    The checks come first; the lock of `cfg.out` is held from then until the folder is published."""
    from ..locks import out_lock
    from ..models import torch_threads

    cfg = _check(cfg, console)
    with (
        out_lock(cfg.out, wait=cfg.wait, command="moeflow train", check=lambda: _check(cfg)),
        torch_threads(cfg.threads),
        contextlib.ExitStack() as restore,
    ):
        return _main(cfg, console, restore)


def blas_threads(n: int) -> Any:
    """A context that runs numpy's BLAS (the run-time runners' products in the evaluation) with `n` threads and
    restores its count after: it takes every core otherwise, whatever `--threads` says."""
    from threadpoolctl import threadpool_limits  # scikit-learn's dependency

    return threadpool_limits(limits=n, user_api="blas")


def _check(cfg: TrainConfig, console: Any = None) -> TrainConfig:
    """Before any work: the predictor names, --fit-workers 2 against --threads 1, --out (`outputs.check_out`), the
    inputs; `cfg` with --max-s within the trace's model (`within_model`)."""
    from ..outputs import check_out
    from ..predict.io import KIND

    check_names(cfg.only)  # --holdout and --fit-workers' values: `TrainConfig.__post_init__`
    if cfg.fit_workers == 2 and cfg.threads == 1:  # the user's flags (the stage later sets threads to the fits' own)
        raise ConfigError("--fit-workers 2 runs two fits at once, which --threads 1 forbids; drop one of them")
    check_out(cfg.out, kind=KIND, inputs=(cfg.trace, cfg.model), force=cfg.force)
    return within_model(cfg, _check_inputs(cfg.trace, cfg.model), console)


def _check_inputs(trace: str, model: str) -> int:
    """The trace's meta and the model folder, read before the model loads (seconds): a missing or corrupt trace
    or a missing model is one line at once. The shards are checked as they are read. The trace's MoE layers."""
    from ..trace import Trace

    _check_model_dir(model)
    return Trace(trace).spec.num_moe_layers


def tokens_to_load(tr: Any, max_tokens: int | None, use: str = "the fits") -> tuple[int, str | None]:
    """(`--max-tokens` to load trace `tr` (a `Trace`) with, a line to print or None), from the bytes a loaded token
    takes (`predict.data.token_bytes`) and what the host has left once the model is loaded (`models.host_available`).
    The default (None): DEFAULT_MAX_TOKENS, lowered to the tokens whose rows take LOAD_SHARE of the memory (swap not
    counted), the rest left to `use` (the fits: their own arrays are capped, --est-tokens, --forest-samples; the
    evaluation; the forest's process), with a line. Typed (`max_tokens` not None): kept, told where its rows take more
    than LOAD_SHARE, refused in one line only where they alone exceed memory and swap (a certain failure). Whole
    prompts are drawn (`prompt_rows`), so the rows loaded may pass the count by part of a prompt."""
    from ..models import host_available
    from ..predict.data import token_bytes

    per, total = token_bytes(tr), int(tr.num_tokens)
    asked = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    want = total if asked == 0 else min(total, asked)
    ram, avail = host_available(swap=False), host_available()
    if ram is None or avail is None or want * per <= LOAD_SHARE * ram:
        return asked, None
    fit = max(1, int(LOAD_SHARE * ram) // per)
    size = f"{want:,} traced tokens take {want * per / 1e9:.3g} GB once loaded ({per / 1e3:.3g} KB each)"
    if max_tokens is None:
        return fit, (
            f"--max-tokens: {size}, more than half of the {ram / 1e9:.3g} GB of memory this host has available; "
            f"loading {fit:,} tokens of whole prompts drawn at random (--max-tokens N chooses)"
        )
    if want * per > avail:
        raise ConfigError(
            f"--max-tokens {asked:,}: {size}, and this host has {avail / 1e9:.3g} GB available (memory and swap); "
            f"pass --max-tokens between 1 and {fit:,}, or use a larger host"
        )
    return asked, (
        f"--max-tokens {asked:,}: {size}, more than half of the {ram / 1e9:.3g} GB of memory available; {use} may run short of it"
    )


def _open_trace(cfg: Any, model: torch.nn.Module, console: Any, use: str) -> tuple[Any, int]:
    """(the trace `cfg.trace`, open, `--max-tokens` to load it with: `tokens_to_load`, its line printed) for
    `train` and `eval`; refuses a trace of another model than `model` in one line first."""
    from ..trace import Trace

    tr = Trace(cfg.trace)
    tr.check_model(model)
    max_tokens, line = tokens_to_load(tr, cfg.max_tokens, use)
    if console is not None and line:
        console.print(f"[yellow]{line}[/]")
    return tr, max_tokens


def resolved(cfg: Any) -> int:
    """`cfg.max_s` once `within_model` has resolved it (an int)."""
    if cfg.max_s is None:
        raise RuntimeError("max_s is resolved by within_model before the fits")  # a caller skipped the checks
    return int(cfg.max_s)


def within_model(cfg: Any, layers: int, console: Any = None) -> Any:
    """`cfg` (a `TrainConfig` or `EvalConfig`) with its `max_s` resolved: S counts MoE layers ahead, so a model of L
    MoE layers has S = 1 .. L-1. No --max-s (None): DEFAULT_MAX_S, or L-1 where fewer; one the user typed above L-1
    is lowered with a line on `console`. A model of one MoE layer has no layer ahead: S stays 1 (no pair to fit)."""
    top = max(1, layers - 1)
    if cfg.max_s is None:
        return dataclasses.replace(cfg, max_s=min(DEFAULT_MAX_S, top))
    if cfg.max_s <= top:
        return cfg
    if console is not None and layers >= 2:  # one MoE layer: no S at all, and no line saying one
        console.print(f"[dim]--max-s {cfg.max_s}: the trace's model has {layers} MoE layers, so S goes up to {top}[/]")
    return dataclasses.replace(cfg, max_s=top)


def _check_model_dir(path: str) -> None:
    """A missing model folder in one line, before transformers' import (which `load_model` pays first)."""
    if not Path(path).is_dir():
        from ..models import missing_model

        raise ArtifactError(missing_model(path))


def _main(cfg: TrainConfig, console: Any = None, restore: contextlib.ExitStack | None = None) -> dict[str, Any]:
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    from ..predict.evaluate import plot, trace_prompt_ids
    from ..predict.io import save_predictors
    from ..progress import progress
    from .threads import apply_threads

    t_start = time.perf_counter()
    steps: dict[str, float] = {}  # seconds of the work no one predictor owns
    model = load_cpu_model(cfg.model)
    threads = apply_threads(cfg.threads, model, "cpu")
    # the training rule's measure (0.1 s), read once (the thread rule's when it capped a count); not needed with
    # --threads nor with --fit-workers 2 (which keeps the threads: `fit_threads`)
    idle = None
    if threads.source != "--threads" and cfg.fit_workers != 2:
        idle = threads.idle if threads.idle is not None else idle_cpus()
    workers = fit_workers(threads.n, threads.source, idle=idle, requested=cfg.fit_workers) if "forest" in cfg.only else 1
    n = fit_threads(threads.n, threads.source, workers, idle)
    if n != threads.n:
        torch.set_num_threads(n)  # restored by `main`'s torch_threads
    cfg = dataclasses.replace(cfg, threads=n)  # the forest's jobs too
    if restore is not None:
        restore.enter_context(blas_threads(n))
    if console is not None:
        fits = f"; fits: {n} thread(s), {idle:.1f} CPU(s) idle" if n != threads.n and idle is not None else ""
        console.print(f"[dim]threads: {threads.describe()}{fits}[/]")
    need_hidden = any(PREDICTORS[n].needs_hidden for n in cfg.only if n not in PLANNERS and n not in GPS)
    tr, max_tokens = _open_trace(cfg, model, console, "the fits")
    cfg = dataclasses.replace(cfg, max_tokens=max_tokens)  # the saved config and retrain's held-out split read it
    # the two parts read apart: the loaded rows are never held twice (a whole load, then its split's copies)
    train, held = split_from_trace(tr, cfg.holdout, cfg.seed, need_hidden=need_hidden, max_tokens=cfg.max_tokens)
    trace_fingerprint, trace_tokens = train.trace_fingerprint, train.trace_tokens
    steps["load"] = time.perf_counter() - t_start
    columns = (TextColumn("{task.description:<22}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn())
    if console is not None and workers > 1:
        console.print("[dim]fits: the forest in a process of its own beside the others (2 at once)[/]")
    with progress(
        "train", enabled=console is not None and cfg.progress, console=console, columns=columns, transient=False
    ) as prog:
        with _threads_beside_forest(n, workers):
            preds, report, steps["evaluate"] = _fit_and_evaluate(train, held, model, cfg, prog, steps, workers)
    report["fit_seconds"] = {n: round(float(getattr(p, "fit_seconds", 0.0)), 3) for n, p in preds.items()}
    per = {n: float(getattr(p, "fit_seconds", 0.0)) for n, p in preds.items()}
    report["train_tokens"], report["heldout_tokens"] = train.n, held.n
    report["trace_tokens"] = trace_tokens  # more than train + held out: --max-tokens drew prompts
    report["max_tokens"] = cfg.max_tokens  # as resolved (`tokens_to_load`)
    planners = tuple(n for n in cfg.only if n in PLANNERS)
    savers: dict[str, Any] = {}
    if planners:
        from ..plan.train import fit_planner, load_tokenizer

        t0 = time.perf_counter()
        report["planner"], savers = fit_planner(
            train, held, cfg, fingerprint=model_fingerprint(model), tokenizer=load_tokenizer(cfg.model), names=planners
        )
        took = time.perf_counter() - t0  # EAP's own training time is in its report; EAM gets the rest
        eap = float((report["planner"].get("eap_training") or {}).get("fit_seconds", 0.0)) if "eap" in planners else 0.0
        per.update({"eam": took - eap, "eap": eap} if len(planners) == 2 else {planners[0]: took})
    if "gps" in cfg.only:
        from ..gps.predictors import fit_and_evaluate

        t0 = time.perf_counter()
        suite, report["gps"] = fit_and_evaluate(train, held, model)
        per["gps"] = time.perf_counter() - t0
        savers = {**savers, "gps": lambda d, s=suite: (d.mkdir(), s.save(d))}
    report["seconds_per_predictor"] = {n: round(v, 3) for n, v in per.items()}
    est = preds.get("estimator") or getattr(preds.get("hybrid"), "estimator", None)  # --only hybrid fits its own
    if est is not None:
        report["est_bf16"] = bool(est.bf16)
    if "hybrid" in preds:
        report["hybrid"] = {
            "threshold": preds["hybrid"].threshold,
            "estimator_on": [f"{l}+{s}" for l, s in sorted(preds["hybrid"].use_estimator)],
        }
    t0 = time.perf_counter()
    save_predictors(
        cfg.out,
        preds,
        model,
        trace=cfg.trace,
        trace_fingerprint=trace_fingerprint,
        config=cfg.to_dict(),
        report=report,
        plot_fn=plot,
        extra=savers,
        trained_prompt_ids=trace_prompt_ids(cfg.trace, train),
    )
    steps["save"] = time.perf_counter() - t0
    report["seconds_steps"] = {n: round(v, 3) for n, v in steps.items()}
    report["seconds"] = round(time.perf_counter() - t_start, 3)
    report["out"] = str(cfg.out)
    report.update(threads.to_dict())
    report["fit_workers"], report["fit_threads"] = workers, n
    return report


def _fit_and_evaluate(
    train: Any, held: Any, model: torch.nn.Module, cfg: TrainConfig, prog: Any, steps: dict[str, float], workers: int
) -> tuple[dict[str, Any], dict[str, Any], float]:
    """(name -> fitted predictor, their held-out report (`moeflow.predict.evaluate.evaluate`'s), the seconds from
    the end of this process's fits to the report). With 2 workers the forest (which shares no work with the
    others) is fitted and scored in a process of its own (`moeflow.predict.train.fit_all`) while the others are
    fitted and scored here."""
    from ..predict.evaluate import preload_plot, score, summarize
    from ..predict.train import fitted_names

    max_s = resolved(cfg)
    kw: dict[str, Any] = {"max_s": max_s, "window": cfg.forest_window, "mass": cfg.mass}
    total = len(held.rank_pairs(max_s)) * len(fitted_names(cfg.only, train.has_hidden))
    task: list[Any] = []
    started: list[float] = []

    def scores(preds: dict[str, Any], here: bool) -> tuple[dict[str, Any], ...]:
        if not here:  # the forest's process: no progress display there
            return score(preds, held, **kw)
        started.append(time.perf_counter())
        task.append(prog.add_task("evaluate (held out)", total=total))
        return score(preds, held, progress=lambda: prog.update(task[0], advance=1), **kw)

    got: list[Any] = []
    preds = fit_all(train, model, cfg, prog, seconds=steps, workers=workers, score=scores, scored=got, idle=preload_plot)
    if task:
        prog.update(task[0], completed=total)
    results, decode = got[0]
    report = summarize(results, decode, held, np.arange(held.n), max_s=max_s, mass=cfg.mass)
    return preds, report, time.perf_counter() - (started[0] if started else time.perf_counter())


@contextlib.contextmanager
def _threads_beside_forest(n: int, workers: int) -> Any:
    """While the forest fits and is scored in its own process (n // 2 tree jobs, one torch thread), torch and BLAS
    get the other n - n // 2 threads here (at least 1): the two never ask for more threads than `--threads` in
    all (each of torch's parallel regions waits for all its threads, so one more thread than cores stalls them)."""
    if workers < 2 or n < 2:
        yield
        return
    was = torch.get_num_threads()
    torch.set_num_threads(max(1, n - n // 2))
    try:
        with blas_threads(max(1, n - n // 2)):
            yield
    finally:
        torch.set_num_threads(was)


def eval_main(cfg: EvalConfig, console: Any = None) -> dict[str, Any]:
    """`moeflow eval`: the report (torch's thread count restored after)."""
    from ..models import torch_threads

    with torch_threads(cfg.threads):
        return _eval_main(cfg, console)


def _eval_main(cfg: EvalConfig, console: Any = None) -> dict[str, Any]:
    from ..predict.evaluate import evaluate, sample_overlap, trace_prompt_ids
    from ..predict.io import load_predictors, read_predictor_meta
    from .threads import apply_threads

    check_names(cfg.only)  # before the model loads: an unknown name, a missing folder or trace, at once
    meta = read_predictor_meta(cfg.predictors)
    asked = cfg.max_s  # None: not typed
    cfg = within_model(cfg, _check_inputs(cfg.trace, cfg.model), console)
    model = load_cpu_model(cfg.model, float_experts=cfg.speculative)
    threads = apply_threads(cfg.threads, model, "cpu")
    if console is not None:
        console.print(f"[dim]threads: {threads.describe()}[/]")
    # the layer-ahead predictors; CasMoE's planner (eam, eap) and MoE-GPS's suite (gps) are scored apart below
    names = [n for n in (cfg.only or meta.get("predictors", [])) if n not in PLANNERS and n not in GPS]
    tr, max_tokens = _open_trace(cfg, model, console, "the scoring")
    data = from_trace(tr, max_tokens=max_tokens)
    skipped = []
    if not data.has_hidden:
        skipped = [n for n in names if PREDICTORS[n].needs_hidden]
        names = [n for n in names if n not in skipped]
    _, preds = load_predictors(cfg.predictors, model, names)
    max_s = resolved(cfg)
    report = evaluate(preds, data, max_s=max_s, window=cfg.window, mass=cfg.mass)
    scored = max((m["S"] for r in report["results"].values() for m in r.values()), default=max_s)
    if scored < max_s:  # each predictor is scored up to the S it was trained for (`max_lookahead`)
        if console is not None and asked is not None:
            console.print(f"[dim]--max-s {max_s}: the predictors were trained for S <= {scored} (train --max-s)[/]")
        report["max_s"] = scored
    report["skipped_no_hidden"] = skipped
    wanted = set(cfg.only)  # empty: everything the folder holds
    if {"eam", "eap"} & set(meta.get("extra") or []) and (not wanted or wanted & set(PLANNERS)):
        from ..plan.train import eval_planner

        report["planner"] = eval_planner(cfg.predictors, data, cfg, fingerprint=model_fingerprint(model), model_dir=cfg.model)
    if (Path(cfg.predictors) / "gps" / "config.json").is_file() and (not wanted or wanted & set(GPS)):
        from ..gps.predictors import GPSSuite, RoutingRows, input_embeddings

        suite = GPSSuite.load(Path(cfg.predictors) / "gps")
        report["gps"] = suite.evaluate(None, RoutingRows.from_data(data), input_embeddings(model))
    if cfg.speculative:
        from ..quality.speculative import measure_quality

        seqs = sequences(data, cfg.spec_sequences)
        report["speculative"] = {
            n: measure_quality(model, p, seqs) for n, p in preds.items() if n in ("router-pf", "estimator", "hybrid", "pregate")
        }
    report.update(sample_overlap(meta, trace_prompt_ids(cfg.trace, data)))  # in-sample when they saw these prompts
    report["trace_overlap_warning"] = report["heldout"] is False
    report["scored_tokens"], report["trace_tokens"] = data.n, data.trace_tokens  # fewer: --max-tokens drew
    report["max_tokens"] = max_tokens  # as resolved (`tokens_to_load`)
    report.update(threads.to_dict())
    return report
