"""Held-out evaluation of predictors: recall@k / precision per (layer, S), the decay fit, a plot.

For every predictor and every (source layer, S) with S in 1..max_s, on the held-out rows:
- recall@k: |top-k(scores) ∩ routed experts| / k, averaged over tokens (= precision of a k-set);
- mass-set precision / recall / size: the set of experts taken in descending normalised score
  until their cumulative mass reaches `mass` (ExpertFlow 3.2.1's way of sizing a prefetch);
- the ExpertFlow fit of accuracy against step, f(t) = a e^{-bt} + c, on the per-pair recall@k
  points (scipy `curve_fit` when importable, else a grid over b with least squares for a, c),
  and Delta_inf = c_p - c_g (predictor minus pre-gate), ExpertFlow Table 2's quantities (the paper's own
  values are quoted by `make reproduce-expertflow`, recipes/reproduce/expertflow.py).
  The fit is bounded to a decay (a in [0, 2], b in [0, 5], c in [0, 1]): accuracy falls with S towards c.
  Note: with L MoE layers only S <= L-1 exists; with 3 distinct S the 3-parameter fit interpolates, so
  c is an extrapolation from three points (read it with that in mind).
  A fit whose c the points do not determine is reported as degenerate (`decay_fit_status`): a parameter
  ends at a bound (c = 0 or 1, no decay, all of it before the first S), or the fitted curve covers less
  than half of its decay over the measured S (b * (S_max - S_min) < ln 2: a near-linear fall, whose
  asymptote is whatever the bounds allow). Its numbers are then not reported (`fit` null, `fit_status`).
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


class DecayFit(TypedDict):
    """`fit_decay`'s result: f(t) = a e^{-bt} + c, its rmse, the number and range of distinct t, the fit method."""

    a: float
    b: float
    c: float
    rmse: float
    distinct_S: int
    min_S: float
    max_S: float
    method: str
    delta_inf_vs_pregate: NotRequired[float]  # set by `evaluate`: c - c of pre-gate


FIT_BOUNDS = {"a": (0.0, 2.0), "b": (0.0, 5.0), "c": (0.0, 1.0)}  # fit_decay's parameter bounds


def row_metrics(scores: torch.Tensor, truth: torch.Tensor, mass: float) -> torch.Tensor:
    """[T,3] per row: recall@k hits, routed experts inside the mass set, mass-set size. scores [T,E], truth [T,k]."""
    k = truth.shape[1]
    scores = scores.float().clamp(min=0)
    top = torch.topk(scores, k, -1).indices  # [T,k]
    hit_k = topk_hits(top, truth)  # [T]
    p = scores / scores.sum(-1, keepdim=True).clamp(min=1e-12)  # [T,E]
    chosen = mass_mask(p, mass)  # [T,E] first item always kept
    truth_hot = torch.zeros_like(chosen).scatter(-1, truth, True)
    inter = (chosen & truth_hot).sum(-1)  # [T]
    return torch.stack([hit_k, inter, chosen.sum(-1)], 1).double()  # [T,3]


def _summary(m: torch.Tensor, k: int) -> dict[str, float]:
    """Means of `row_metrics` rows m [n,3] (n > 0)."""
    n = len(m)
    hits, inter, size = m.sum(0).tolist()
    return {
        "recall_at_k": hits / (n * k),
        "mass_precision": inter / max(size, 1.0),
        "mass_recall": inter / (n * k),
        "mass_set_size": size / n,
    }


def _mean_by_s(results: Mapping[str, Mapping[str, Mapping[str, float]]]) -> dict[str, dict[int, float]]:
    return {
        name: {
            s: float(np.mean([m["recall_at_k"] for m in r.values() if m["S"] == s]))
            for s in sorted({int(m["S"]) for m in r.values()})
        }
        for name, r in results.items()
    }


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
    batched: bool = True,
) -> dict[str, Any]:
    """{'pairs': [...], 'results': {name: {'src->tgt': metrics}}, 'by_s': {name: {S: mean recall}}, 'fit': {...},
    'decode_by_s': the same means on decode tokens only (None without any)}.

    `rows` restricts scoring to those records (e.g. decode tokens); token contexts use all of `data`.
    Each predictor scores each (layer, S) once for all rows; a predictor with `delegate(layer, S)` (Hybrid)
    reuses the scores of the predictor it delegates to when that one is among `predictors`. With `batched`, a
    predictor with a `runner()` (`moeflow.predict.fast`, the run-time path) scores every S of a source layer in
    one call per chunk of rows, as `moeflow run` does (its scores equal `predict`'s up to float32 rounding);
    without, every (layer, S) calls `predict`."""
    sel = np.arange(data.n) if rows is None else np.asarray(rows)
    results, decode = score(
        predictors, data, max_s=max_s, window=window, mass=mass, chunk=chunk, progress=progress, rows=rows, batched=batched
    )
    return summarize(results, decode, data, sel, max_s=max_s, mass=mass)


def score(
    predictors: Mapping[str, Any],
    data: RoutingData,
    *,
    max_s: int = 4,
    window: int = 4,
    mass: float = 0.8,
    chunk: int = 2048,
    progress: Callable[[], None] | None = None,
    rows: np.ndarray | None = None,
    batched: bool = True,
) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, dict[str, dict[str, float]]]]:
    """`evaluate`'s per-pair metrics (results, decode-only results), without the summary: predictors that share
    no work (no `delegate` to one another) can be scored in separate calls, e.g. in two threads, and merged."""
    ctx = data.context(window)
    sel = np.arange(data.n) if rows is None else np.asarray(rows)
    dec = torch.from_numpy(data.phase[sel] == 1)  # [n] decode rows among sel
    pairs = data.rank_pairs(max_s)
    done: dict[tuple[int, int, int], torch.Tensor] = {}  # (id(predictor), layer, S) -> row_metrics [n,3]
    runners: dict[int, Any] = {}  # id(predictor) -> its runner
    results: dict[str, dict[str, dict[str, float]]] = {}
    decode: dict[str, dict[str, dict[str, float]]] = {}
    for name, pred in predictors.items():
        res: dict[str, dict[str, float]] = {}
        res_dec: dict[str, dict[str, float]] = {}
        for src, s in pairs:
            if s > getattr(pred, "max_lookahead", max_s):
                continue
            tgt = target_of(data.spec, src, s)
            k = data.layers[tgt].topk_ids.shape[1]
            who = pred.delegate(src, s) if hasattr(pred, "delegate") else pred
            m = done.get((id(who), src, s))
            if m is None and batched and hasattr(who, "runner"):
                lim = getattr(who, "max_lookahead", max_s)
                steps = max(s_ for l_, s_ in pairs if l_ == src and s_ <= lim)
                if id(who) not in runners:
                    runners[id(who)] = who.runner()
                for j, m_j in enumerate(_runner_metrics(runners[id(who)], data, src, steps, sel, ctx, chunk, mass), 1):
                    done[(id(who), src, j)] = m_j
                m = done[(id(who), src, s)]
            if m is None:
                parts = []
                for sl in iter_chunks(len(sel), chunk):
                    b = batch_from_rows(data, src, sel[sl], ctx=ctx)
                    parts.append(row_metrics(who.predict(tgt, s, b), torch.from_numpy(data.layers[tgt].topk_ids[sel[sl]]), mass))
                m = done[(id(who), src, s)] = torch.cat(parts)  # [n,3]
            res[f"{src}->{tgt}"] = {"source": src, "target": tgt, "S": s, **_summary(m, k)}
            if bool(dec.any()):
                res_dec[f"{src}->{tgt}"] = {"S": s, **_summary(m[dec], k)}
            if progress is not None:
                progress()
        results[name] = res
        decode[name] = res_dec
    return results, decode


def summarize(
    results: Mapping[str, dict[str, dict[str, float]]],
    decode: Mapping[str, dict[str, dict[str, float]]],
    data: RoutingData,
    sel: np.ndarray,
    *,
    max_s: int,
    mass: float,
) -> dict[str, Any]:
    """`evaluate`'s report from `score`'s metrics on rows `sel` of `data`: means by S, the decay fits."""
    dec = data.phase[sel] == 1  # [n] decode rows among sel
    pairs = data.rank_pairs(max_s)
    by_s = _mean_by_s(results)
    raw = {name: fit_decay([(m["S"], m["recall_at_k"]) for m in r.values()]) for name, r in results.items()}
    status = {name: decay_fit_status(f, len({m["S"] for m in r.values()})) for (name, f), r in zip(raw.items(), results.values())}
    fits = {name: f if status[name] == "ok" else None for name, f in raw.items()}
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
        "results": dict(results),
        "by_s": by_s,
        "fit": fits,
        "fit_status": status,
        "decode_by_s": _mean_by_s(decode) if bool(dec.any()) else None,
    }


def _runner_metrics(
    runner: Any, data: RoutingData, src: int, steps: int, sel: np.ndarray, ctx: np.ndarray, chunk: int, mass: float
) -> list[torch.Tensor]:
    """`row_metrics` [n,3] of S = 1..steps from source layer `src` on rows `sel`: one `runner.scores` call
    ([steps,T,E]) and one `row_metrics` call per chunk of rows."""
    truth = [data.layers[target_of(data.spec, src, s)].topk_ids for s in range(1, steps + 1)]  # each [N,k]
    parts: list[list[torch.Tensor]] = [[] for _ in range(steps)]
    for sl in iter_chunks(len(sel), chunk):
        r = sel[sl]
        b = batch_from_rows(data, src, r, ctx=ctx)
        scores = torch.from_numpy(np.ascontiguousarray(runner.scores(b, steps), dtype=np.float32))  # [steps,T,E]
        tr = torch.from_numpy(np.concatenate([t[r] for t in truth]))  # [steps*T,k]
        m = row_metrics(scores.reshape(steps * len(r), -1), tr, mass).reshape(steps, len(r), 3)  # [steps,T,3]
        for j in range(steps):
            parts[j].append(m[j])
    return [torch.cat(p) for p in parts]


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
                f, t, y, p0=(max(y) - min(y) + 1e-3, 0.5, min(y)), bounds=tuple(zip(*FIT_BOUNDS.values())), maxfev=20000
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
    return {
        "a": float(a),
        "b": float(b),
        "c": float(c),
        "rmse": rmse,
        "distinct_S": len(np.unique(t)),
        "min_S": float(t.min()),
        "max_S": float(t.max()),
        "method": method,
    }


def decay_fit_status(fit: DecayFit | None, distinct_s: int) -> str:
    """'ok' when the fit determines its asymptote c; else why not ('too few S ...', 'degenerate: ...').

    Degenerate: a parameter at its bound (the bounded least squares did not find a free optimum: c = 0 or 1
    is the bound, not the data; a = 0 or b = 0: no decay; b = 5: all decay before the first S), or the
    curve covers less than half of its decay over the measured S (b * (S_max - S_min) < ln 2), so c is
    extrapolated further below the last point than the points fall in all."""
    if fit is None:
        return f"too few S ({distinct_s} distinct; a fit needs 3)" if distinct_s < 3 else "degenerate: no fit converged"
    params = {"a": fit["a"], "b": fit["b"], "c": fit["c"]}
    for k, (lo, hi) in FIT_BOUNDS.items():
        tol = 1e-3 * (hi - lo)
        if not lo + tol < params[k] < hi - tol:
            at_lo = params[k] <= lo + tol
            hint = {
                ("a", True): ": recall does not fall with S",
                ("b", True): ": no decay",
                ("b", False): ": all decay before the first S",
            }
            return f"degenerate: {k} at its bound {lo if at_lo else hi:g}" + hint.get((k, at_lo), "")
    if fit["b"] * (fit["max_S"] - fit["min_S"]) < math.log(2):
        return f"degenerate: less than half the decay within S {fit['min_S']:g}..{fit['max_S']:g} (c extrapolated)"
    return "ok"


# ---- held out or not ------------------------------------------------------------------------------


def trace_prompt_ids(trace: str | Path, data: RoutingData | None = None) -> list[str]:
    """The prompt ids (content hashes) of a trace folder's meta.json, or of the prompts `data` holds (read
    from that trace: `data.prompt_id` indexes meta.json's `prompt_ids`), sorted."""
    from ..trace import Trace

    ids = Trace(str(trace), verify=False).prompt_ids  # meta only: the rows were verified as they loaded
    if data is None:
        return sorted(ids)
    return sorted({ids[int(i)] for i in np.unique(data.prompt_id)})


def sample_overlap(meta: Mapping[str, Any], eval_prompt_ids: list[str]) -> dict[str, Any]:
    """Whether an evaluation's prompts are held out from a predictor folder's training: `heldout` (None:
    unknown), `overlap_prompts` (how many of them the predictors saw), `eval_prompts`, `overlap_basis`.

    The folder's `trace.trained_prompt_ids` (the prompts fitted on) when recorded; else (an older folder) the
    training trace's prompts if that trace is still readable at its recorded path."""
    tr = meta.get("trace") or {}
    seen: list[str] | None = tr.get("trained_prompt_ids")
    basis = "trained prompts"
    if seen is None:
        basis = "training trace"
        try:
            seen = trace_prompt_ids(tr["path"])
        except Exception:  # moved or deleted: unknown
            seen = None
    out: dict[str, Any] = {"eval_prompts": len(eval_prompt_ids), "overlap_basis": basis if seen is not None else None}
    if seen is None:
        return {**out, "heldout": None, "overlap_prompts": None}
    n = len(set(eval_prompt_ids) & set(seen))
    return {**out, "heldout": n == 0, "overlap_prompts": n}


def sample_label(report: Mapping[str, Any]) -> str:
    """'held-out', or what else the figures of `report` are (its `sample_overlap` keys; absent: held out)."""
    h = report.get("heldout", True)
    if h is False:
        how = "were trained on" if report.get("overlap_basis") == "trained prompts" else "were in the training trace"
        return f"in-sample ({report['overlap_prompts']} of {report['eval_prompts']} eval prompts {how})"
    if h is None:
        return "held-out unknown (the predictor folder does not record its training prompts, nor can its trace be read)"
    return "held-out"


# ---- presentation -------------------------------------------------------------------------------


def tables(report: dict[str, Any]) -> list:
    """Renderables of a train / eval report that stay readable at 80 columns: per predictor and step S the mean
    recall@k over target layers with its worst and best layer (the per-layer values are in `--json`)."""
    from ..tables import FitTable

    res = report["results"]
    sample = sample_label(report)
    t1 = FitTable(
        f"{sample} recall@k by step S ({report['n_tokens']} tokens, {report['n_prompts']} prompts): mean over "
        f"target layers, worst and best layer; precision and size of the mass-{report['mass']} set. "
        "Per-layer values: --json",
        key=2,
    )
    for c_ in ("predictor", "S", "recall@k", "worst layer", "best layer", "prec@mass", "|set|"):
        t1.add_column(c_)
    for name, r in res.items():
        steps = sorted({m["S"] for m in r.values()})
        for s in steps:
            ms = [m for m in r.values() if m["S"] == s]
            lo = min(ms, key=lambda m: m["recall_at_k"])
            hi = max(ms, key=lambda m: m["recall_at_k"])
            t1.add_row(
                name,
                str(s),
                f"{np.mean([m['recall_at_k'] for m in ms]):.3f}",
                f"{lo['recall_at_k']:.3f} L{lo['target']}",
                f"{hi['recall_at_k']:.3f} L{hi['target']}",
                f"{np.mean([m['mass_precision'] for m in ms]):.3f}",
                f"{np.mean([m['mass_set_size'] for m in ms]):.1f}",
                end_section=s == steps[-1],
            )
    status = report.get("fit_status") or {}
    why = {n: st.removeprefix("degenerate: ") for n, st in status.items() if st.startswith("degenerate")}
    few = "a fit needs recall at 3 distinct S (--max-s 3 or more, and more MoE layers than S)"
    too_few = any(st.startswith("too few") for st in status.values())
    if not any(f is not None for f in report["fit"].values()):  # no fit to show: one line saying why, not a table
        from rich.text import Text

        by_why: dict[str, list[str]] = {}
        for n, w in why.items():
            by_why.setdefault(w, []).append(n)
        said = [f"{', '.join(ns)}: {w}" for w, ns in by_why.items()]
        if too_few:
            said.append(few)
        return [t1, Text(f"No fit of recall against S as a·exp(-b·S) + c: {'; '.join(said) or few}."), *_decode_table(report)]
    caption = few if too_few else ""
    if why:
        caption += (
            ("; " if caption else "")
            + "* degenerate: the points do not determine c, so no c is given ("
            + "; ".join(f"{n}: {w}" for n, w in why.items())
            + ")"
        )
    t2 = FitTable(
        f"recall@k against step S fitted as a·exp(-b·S) + c, {sample} (this model); "
        "c: the recall far ahead; vs pregate: c minus pregate's c",
        caption=caption or None,
    )
    for c_ in ("predictor", "a", "b", "c", "vs pregate", "fit rmse", "S values"):
        t2.add_column(c_)
    for name, f in report["fit"].items():
        if f is None:
            n_s = len({m["S"] for m in res[name].values()})
            if name in why:
                t2.add_row(name, "—", "—", "degenerate fit*", "—", "—", str(n_s))
            else:
                t2.add_row(name, "-", "-", "-", "-", "-", str(n_s))
            continue
        d = f.get("delta_inf_vs_pregate")
        t2.add_row(
            name,
            f"{f['a']:.3f}",
            f"{f['b']:.3f}",
            f"{f['c']:.3f}",
            "—" if d is None else f"{d:+.3f}",
            f"{f['rmse']:.4f}",
            str(f["distinct_S"]),
        )
    return [t1, t2, *_decode_table(report)]


def _decode_table(report: dict[str, Any]) -> list:
    """The decode tokens' mean recall@k by S (a table), when the report has them."""
    from ..tables import FitTable

    dec = report.get("decode_by_s")
    if not dec:
        return []
    t4 = FitTable("decode tokens only: mean recall@k by step S (a batch-1 decode step's prefetch)")
    ss = sorted({int(s) for v in dec.values() for s in v})
    t4.add_column("predictor")
    for s in ss:
        t4.add_column(f"S={s}")
    for name, v in dec.items():
        by_step = {int(k): x for k, x in v.items()}
        t4.add_row(name, *[f"{by_step[s]:.3f}" if s in by_step else "" for s in ss])
    return [t4]


def preload_plot() -> None:
    """Import what `plot` draws with (matplotlib's `Figure` and Agg canvas: most of its time); `moeflow train` does
    it while it would wait for the forest's process."""
    import matplotlib.backends.backend_agg
    import matplotlib.figure  # noqa: F401


def plot(report: dict[str, Any], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))  # no pyplot: no global figure state, and its import is skipped
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
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
    ax2.set(xlabel="step S", ylabel="mean recall@k", title="recall vs S (dotted: fit a·exp(-b·S) + c)")  # no mathtext parser
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.12, top=0.93, wspace=0.18)  # tight_layout: 0.2-0.6 s of text measuring
    fig.savefig(path, dpi=110)
    return path
