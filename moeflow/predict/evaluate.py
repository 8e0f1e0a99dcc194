"""Held-out evaluation of predictors: recall@k / precision per (layer, S), the decay fit, a plot.

For every predictor and every (source layer, S) with S in 1..max_s, on the held-out rows:
- recall@k: |top-k(scores) ∩ routed experts| / k, averaged over tokens (= precision of a k-set);
- mass-set precision / recall / size: the set of experts taken in descending normalised score
  until their cumulative mass reaches `mass` (ExpertFlow 3.2.1's way of sizing a prefetch);
- the ExpertFlow fit of accuracy against step, f(t) = a e^{-bt} + c, on the per-pair recall@k
  points (scipy `curve_fit` when importable, else a grid over b with least squares for a, c),
  and Delta_inf = c_p - c_g (predictor minus pre-gate), beside the paper's Table 2.
  The fit is bounded to a decay (a in [0, 2], b in [0, 5], c in [0, 1]): accuracy falls with S towards c.
  Note: with L MoE layers only S <= L-1 exists; with 3 distinct S the 3-parameter fit interpolates, so
  c is an extrapolation from three points (read it with that in mind).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import numpy as np
import torch

from ..moe.sets import mass_mask, topk_hits
from .data import RoutingData, batch_from_rows, iter_chunks, target_of

# ExpertFlow (Table 2, section 4.3): fitted asymptotic accuracy of their predictor (c_p) and of
# pre-gate (c_g), in percent, on DeepSeek-V2-Lite, Qwen1.5-MoE and Qwen2-MoE. The paper's numbers,
# copied for comparison; not measured here.
PAPER_TABLE2 = {
    "DeepSeek": {"c_p": 63.44, "c_g": 26.43, "delta_inf": 37.01},
    "Qwen1.5": {"c_p": 65.31, "c_g": 33.29, "delta_inf": 32.02},
    "Qwen2": {"c_p": 60.45, "c_g": 29.61, "delta_inf": 30.84},
}
PAPER_CITATION = "ExpertFlow (shared/papers/expertflow.txt), Table 2, section 4.3"


class DecayFit(TypedDict):
    """`fit_decay`'s result: f(t) = a e^{-bt} + c, its rmse, the number of distinct t and the fit method."""

    a: float
    b: float
    c: float
    rmse: float
    distinct_S: int
    method: str
    delta_inf_vs_pregate: NotRequired[float]  # set by `evaluate`: c - c of pre-gate


def set_metrics(scores: torch.Tensor, truth: torch.Tensor, mass: float) -> dict[str, float]:
    """Sums (not means) over rows: recall@k hits, mass-set hits, mass-set sizes. scores [T,E], truth [T,k]."""
    k = truth.shape[1]
    scores = scores.float().clamp(min=0)
    top = torch.topk(scores, k, -1).indices  # [T,k]
    hit_k = topk_hits(top, truth).sum()
    p = scores / scores.sum(-1, keepdim=True).clamp(min=1e-12)  # [T,E]
    chosen = mass_mask(p, mass)  # [T,E] first item always kept
    truth_hot = torch.zeros_like(chosen).scatter(-1, truth, True)
    inter = (chosen & truth_hot).sum()
    return {"n": float(len(truth)), "hits_k": float(hit_k), "inter": float(inter), "set_size": float(chosen.sum()), "k": float(k)}


def evaluate(
    predictors: Mapping[str, Any],
    data: RoutingData,
    *,
    max_s: int = 4,
    window: int = 4,
    mass: float = 0.8,
    chunk: int = 2048,
    progress: Callable[[], None] | None = None,
    rows: np.ndarray | None = None,
) -> dict[str, Any]:
    """{'pairs': [...], 'results': {name: {'src->tgt': metrics}}, 'by_s': {name: {S: mean recall}}, 'fit': {...}}.

    `rows` restricts scoring to those records (e.g. decode tokens); token contexts use all of `data`."""
    ctx = data.context(window)
    sel = np.arange(data.n) if rows is None else np.asarray(rows)
    pairs = data.rank_pairs(max_s)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, pred in predictors.items():
        res: dict[str, dict[str, float]] = {}
        for src, s in pairs:
            if s > getattr(pred, "max_lookahead", max_s):
                continue
            tgt = target_of(data.spec, src, s)
            acc: dict[str, float] = {}
            for sl in iter_chunks(len(sel), chunk):
                r_ = sel[sl]
                b = batch_from_rows(data, src, r_, ctx=ctx)
                m = set_metrics(pred.predict(tgt, s, b), torch.from_numpy(data.layers[tgt].topk_ids[r_]), mass)
                for k_, v in m.items():
                    acc[k_] = acc.get(k_, 0.0) + v if k_ != "k" else v
            n, k = acc["n"], acc["k"]
            res[f"{src}->{tgt}"] = {
                "source": src,
                "target": tgt,
                "S": s,
                "recall_at_k": acc["hits_k"] / (n * k),
                "mass_precision": acc["inter"] / max(acc["set_size"], 1.0),
                "mass_recall": acc["inter"] / (n * k),
                "mass_set_size": acc["set_size"] / n,
            }
            if progress is not None:
                progress()
        results[name] = res
    by_s = {
        name: {
            s: float(np.mean([m["recall_at_k"] for m in r.values() if m["S"] == s])) for s in sorted({m["S"] for m in r.values()})
        }
        for name, r in results.items()
    }
    fits = {name: fit_decay([(m["S"], m["recall_at_k"]) for m in r.values()]) for name, r in results.items()}
    g = fits.get("pregate")
    for f in fits.values():
        if f is not None and g is not None:
            f["delta_inf_vs_pregate"] = f["c"] - g["c"]
    return {
        "n_tokens": len(sel),
        "n_prompts": len(np.unique(data.prompt_id[sel])),
        "mass": mass,
        "max_s": max_s,
        "pairs": [[src, s] for src, s in pairs],
        "results": results,
        "by_s": by_s,
        "fit": fits,
        "paper_table2": {"source": PAPER_CITATION, "values_percent": PAPER_TABLE2},
    }


def fit_decay(points: list[tuple[float, float]]) -> DecayFit | None:
    """Fit f(t) = a e^{-bt} + c to (t, accuracy) points; None with fewer than 3 distinct t."""
    t = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    if len(np.unique(t)) < 3:
        return None
    f = lambda t_, a, b, c: a * np.exp(-b * t_) + c  # noqa: E731
    try:
        import warnings

        from scipy.optimize import curve_fit

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 3 points, 3 parameters: no covariance, expected
            (a, b, c), _ = curve_fit(
                f, t, y, p0=(max(y) - min(y) + 1e-3, 0.5, min(y)), bounds=([0.0, 0.0, 0.0], [2.0, 5.0, 1.0]), maxfev=20000
            )
        method = "scipy.curve_fit"
    except Exception:  # scipy missing or no convergence: grid over b, least squares for a, c
        best = None
        for b_ in np.logspace(-3, np.log10(5.0), 400):
            A = np.stack([np.exp(-b_ * t), np.ones_like(t)], 1)
            (a_, c_), *_ = np.linalg.lstsq(A, y, rcond=None)
            if a_ < 0 or not 0 <= c_ <= 1:
                continue
            err = float(((A @ np.array([a_, c_]) - y) ** 2).sum())
            if best is None or err < best[0]:
                best = (err, a_, b_, c_)
        if best is None:
            return None
        _, a, b, c = best
        method = "numpy grid"
    rmse = float(math.sqrt(np.mean((f(t, a, b, c) - y) ** 2)))
    return {"a": float(a), "b": float(b), "c": float(c), "rmse": rmse, "distinct_S": len(np.unique(t)), "method": method}


# ---- presentation -------------------------------------------------------------------------------


def tables(report: dict[str, Any]) -> list:
    from rich.table import Table

    res = report["results"]
    targets = sorted({m["target"] for r in res.values() for m in r.values()})
    t1 = Table(
        title=f"held-out recall@k per target layer and step S ({report['n_tokens']} tokens, "
        f"{report['n_prompts']} prompts); mass-set precision at mass {report['mass']}"
    )
    t1.add_column("predictor")
    t1.add_column("S", justify="right")
    for tg in targets:
        t1.add_column(f"L{tg}", justify="right")
    t1.add_column("mean", justify="right")
    t1.add_column("prec@mass", justify="right")
    t1.add_column("|set|", justify="right")
    for name, r in res.items():
        for s in sorted({m["S"] for m in r.values()}):
            ms = [m for m in r.values() if m["S"] == s]
            by_t = {m["target"]: m["recall_at_k"] for m in ms}
            t1.add_row(
                name,
                str(s),
                *[f"{by_t[tg]:.3f}" if tg in by_t else "" for tg in targets],
                f"{np.mean([m['recall_at_k'] for m in ms]):.3f}",
                f"{np.mean([m['mass_precision'] for m in ms]):.3f}",
                f"{np.mean([m['mass_set_size'] for m in ms]):.1f}",
            )
    t2 = Table(title="accuracy vs step: f(t) = a e^{-bt} + c fitted to held-out recall@k (this model)")
    for c_ in ("predictor", "a", "b", "c (asymptote)", "Δ∞ = c - c_pregate", "fit rmse", "distinct S"):
        t2.add_column(c_, justify="right")
    for name, f in report["fit"].items():
        if f is None:
            t2.add_row(name, "-", "-", "-", "-", "-", "<3 (fit needs 3)")
            continue
        d = f.get("delta_inf_vs_pregate")
        t2.add_row(
            name,
            f"{f['a']:.3f}",
            f"{f['b']:.3f}",
            f"{f['c']:.3f}",
            "" if d is None else f"{d:+.3f}",
            f"{f['rmse']:.4f}",
            str(f["distinct_S"]),
        )
    t3 = Table(title=f"for comparison, the PAPER's values (not measured here): {PAPER_CITATION}, accuracy in %")
    for c_ in ("model group", "c_p (predictor)", "c_g (pre-gate)", "Δ∞ = c_p - c_g"):
        t3.add_column(c_, justify="right")
    for g, v in PAPER_TABLE2.items():
        t3.add_row(g, f"{v['c_p']:.2f}", f"{v['c_g']:.2f}", f"{v['delta_inf']:.2f}")
    out = [t1, t2, t3]
    dec = report.get("decode_by_s")
    if dec:
        t4 = Table(title="decode tokens only: mean recall@k by step S (a batch-1 decode step's prefetch)")
        ss = sorted({int(s) for v in dec.values() for s in v})
        t4.add_column("predictor")
        for s in ss:
            t4.add_column(f"S={s}", justify="right")
        for name, v in dec.items():
            by_step = {int(k): x for k, x in v.items()}
            t4.add_row(name, *[f"{by_step[s]:.3f}" if s in by_step else "" for s in ss])
        out.append(t4)
    return out


def plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in report["results"].items():
        ms = sorted((m for m in r.values() if m["S"] == 1), key=lambda m: m["target"])
        ax1.plot([m["target"] for m in ms], [m["recall_at_k"] for m in ms], marker="o", label=name)
        s = report["by_s"][name]
        ax2.plot(list(s), list(s.values()), marker="o", label=name)
        f = report["fit"].get(name)
        if f is not None:
            tt = np.linspace(min(s), max(s), 50)
            ax2.plot(tt, f["a"] * np.exp(-f["b"] * tt) + f["c"], ls=":", color=ax2.lines[-1].get_color())
    ax1.xaxis.get_major_locator().set_params(integer=True)
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax1.set(xlabel="target MoE layer (S = 1)", ylabel="recall@k (hit rate)", title="per-layer recall, held out")
    ax2.set(xlabel="step S", ylabel="mean recall@k", title="recall vs S (dotted: a e^{-bS} + c)")
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
