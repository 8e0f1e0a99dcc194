"""`moeflow train --only eam --only eap` and `moeflow eval` for the CasMoE planner.

`fit_planner(train, held, cfg, ...)` labels the training prompts (eq. 3), builds the EAM over them,
trains the EAP (held-out recall per epoch), then plans every held-out prompt with EAM alone, EAP alone
and the cascade at eps, and scores them (`evaluate_plans`) beside the mean training pattern (a
prompt-independent baseline). It returns the report and the savers that write `eam/` and `eap/` into the
predictor folder being written (`moeflow.predict.io.save_predictors(extra=...)`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..predict.data import RoutingData
from .eap import EAPConfig
from .gate import CascadePlanner, evaluate_plans, fit_eam, fit_eap
from .labels import ep_labels, normalize, prompt_texts

PLANNERS = ("eam", "eap")


def load_tokenizer(model_dir: str) -> Any:
    """The MoE model's tokenizer (prompts are its decoded prefill tokens), or None without one."""
    from transformers import AutoTokenizer

    from ..models import _has_tokenizer

    p = Path(model_dir)
    return AutoTokenizer.from_pretrained(p) if _has_tokenizer(p) else None


def eap_config(cfg: Any) -> EAPConfig:
    return EAPConfig(
        layers=cfg.eap_layers,
        hidden=cfg.eap_hidden,
        intermediate=cfg.eap_intermediate,
        epochs=cfg.eap_epochs,
        lr=cfg.eap_lr,
        batch=cfg.eap_batch,
        seed=cfg.seed,
    )


def labelled(data: RoutingData, tokenizer: Any, phase: str, kind: str) -> tuple[list[str], np.ndarray]:
    pids, ep = ep_labels(data, phase=phase, kind=kind)
    texts = prompt_texts(data, pids, tokenizer)
    keep = [i for i, t in enumerate(texts) if t.strip()]
    return [texts[i] for i in keep], ep[keep]


def fit_planner(
    train: RoutingData,
    held: RoutingData,
    cfg: Any,
    *,
    fingerprint: str,
    tokenizer: Any,
    names: tuple[str, ...] = PLANNERS,
    progress: Any = None,
) -> tuple[dict[str, Any], dict[str, Callable[[Path], Any]]]:
    """(report, name -> saver) for the requested planner parts (`eam`, `eap`)."""
    from .eam import Embedder

    if tokenizer is None:
        return {"skipped": "the model folder has no tokenizer (the planner reads prompt text)"}, {}
    texts, ep = labelled(train, tokenizer, cfg.plan_phase, cfg.plan_label)
    htexts, hep = labelled(held, tokenizer, "prefill", "ep")  # scored against the EP of the prompt itself
    if len(texts) < 2:
        raise ConfigError(f"the CasMoE planner needs at least 2 training prompts with text (got {len(texts)})")
    k = cfg.plan_k or train.spec.top_k
    embedder = Embedder(cfg.embedder or None)
    eam = eap = None
    savers: dict[str, Callable[[Path], Any]] = {}
    rep: dict[str, Any] = {"label": cfg.plan_label, "phase": cfg.plan_phase, "train_prompts": len(texts), "eps": cfg.plan_eps}
    if "eam" in names:
        eam = fit_eam(texts, ep, embedder, k_prime=cfg.eam_k_prime, weighted=cfg.eam_weighted)
        savers["eam"] = lambda d: eam.save(
            d, fingerprint=fingerprint, embedder=embedder.name, extra={"embedder_path": embedder.path, "label": cfg.plan_label}
        )
    if "eap" in names:
        eap = fit_eap(texts, ep, eap_config(cfg), k=k, val=(htexts, hep) if htexts else None, progress=progress)
        savers["eap"] = lambda d: eap.save(d, fingerprint=fingerprint)
        rep["eap_training"] = eap.report
    if htexts:
        base = normalize(ep, "mean1").mean(0)
        held_rep = {}
        variants = {"eam": (eam, None), "eap": (None, eap), "cascade": (eam, eap)}
        for name, (a, b) in variants.items():
            if (a is None and b is None) or (name == "cascade" and (a is None or b is None)):
                continue
            planner = CascadePlanner(a, b, embedder if a is not None else None, cfg.plan_eps)
            held_rep[name] = evaluate_plans(planner.plan(htexts), hep, k=k, mass=cfg.mass, baseline=base)
        rep["heldout"] = held_rep
    return rep, savers


def eval_planner(folder: str, data: RoutingData, cfg: Any, *, fingerprint: str, model_dir: str) -> dict[str, Any] | None:
    """`moeflow eval`: plan every prompt of `data` with the folder's planner; None when it has none."""
    if not ((Path(folder) / "eam").exists() or (Path(folder) / "eap").exists()):
        return None
    tok = load_tokenizer(model_dir)
    if tok is None:
        return {"skipped": "the model folder has no tokenizer"}
    planner = CascadePlanner.load(folder, fingerprint=fingerprint, eps=cfg.plan_eps)
    texts, ep = labelled(data, tok, "prefill", "ep")
    k = cfg.plan_k or data.spec.top_k
    return {"cascade": evaluate_plans(planner.plan(texts), ep, k=k, mass=cfg.mass)}


# what each planner variant of a report is, in words (the report's keys: eam, eap, cascade)
PLANNER_LABELS = {
    "eam": "EAM alone (the experts of the most similar training prompts)",
    "eap": "EAP alone (the learned predictor)",
    "cascade": "cascade (the EAM when a training prompt is similar enough, else the EAP)",
}


def planner_tables(rep: dict[str, Any]) -> list[Any]:
    """Renderables of a planner report (train or eval), one per planner variant: a row per MoE layer and a
    mean, so they stay readable at 80 columns however many layers the model has."""
    from ..tables import FitTable

    out: list[Any] = []
    if "skipped" in rep:
        return out
    for name, r in (rep.get("heldout") or {k: v for k, v in rep.items() if k == "cascade"}).items():
        if not r:
            continue
        L = len(r["recall_at_k"])
        t = FitTable(
            f"CasMoE planner, {PLANNER_LABELS.get(name, name)}, on {r['prompts']} held-out prompts: recall@{r['k']} "
            f"per MoE layer (chance {r['chance_recall_at_k']:.3f}) and the mass-{r['mass']} set's precision, recall "
            f"and size; {r['split']['eam']} prompts planned by the EAM, {r['split']['eap']} by the EAP; "
            f"{r['ms_per_prompt']['mean']:.2f} ms per prompt"
        )
        cols: list[tuple[str, str]] = [("recall@k", "recall_at_k")]
        cols += [(h, k) for h, k in (("EAM's", "recall_at_k_eam"), ("EAP's", "recall_at_k_eap")) if k in r]
        cols += [
            (h, k)
            for h, k in (
                ("baseline", "baseline_recall_at_k"),
                ("mass prec", "mass_precision"),
                ("mass recall", "mass_recall"),
                ("set size", "mass_set_size"),
            )
            if k in r
        ]
        t.add_column("layer")
        for h, _ in cols:
            t.add_column(h)
        for l in range(L):
            t.add_row(
                str(l),
                *[f"{r[k][l]:.3f}" if k != "mass_set_size" else f"{r[k][l]:.1f}" for _, k in cols],
                end_section=l == L - 1,
            )
        t.add_row("mean", *[f"{np.mean(r[k]):.3f}" if k != "mass_set_size" else f"{np.mean(r[k]):.1f}" for _, k in cols])
        if any(k in r for k in ("recall_at_k_eam", "recall_at_k_eap", "baseline_recall_at_k")):
            t.caption = "EAM's / EAP's: recall@k over the prompts each planned; baseline: the training prompts' mean pattern"
        out.append(t)
    return out


# `--plan-opt key=value` (train, eval) -> TrainConfig / EvalConfig fields
PLAN_OPTS = {
    "eps": "plan_eps",
    "k": "plan_k",
    "label": "plan_label",
    "phase": "plan_phase",
    "k_prime": "eam_k_prime",
    "weighted": "eam_weighted",
    "embedder": "embedder",
    "eap_layers": "eap_layers",
    "eap_hidden": "eap_hidden",
    "eap_intermediate": "eap_intermediate",
    "eap_epochs": "eap_epochs",
    "eap_lr": "eap_lr",
    "eap_batch": "eap_batch",
}


def plan_overrides(items: list[str] | None, allowed: tuple[str, ...] = tuple(PLAN_OPTS)) -> dict[str, Any]:
    """['eps=0.5', 'eap_epochs=10'] -> {'plan_eps': 0.5, 'eap_epochs': 10}; ConfigError for an unknown key."""
    from ..policies.parse import opts_dict, parse_opts

    out = {}
    for k, v in opts_dict(parse_opts(items or [])).items():
        if k not in allowed:
            raise ConfigError(f"unknown --plan-opt {k!r}; choose from: {', '.join(allowed)}")
        out[PLAN_OPTS[k]] = v
    return out
