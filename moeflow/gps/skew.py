"""Re-routing a trace to a chosen batch skewness, for MoE-GPS's skewness sweep: a per-expert bias on the log router
probabilities that sharpens (γ > 0, toward the layer's measured distribution) or flattens (γ < 0, DeepSeek-V3's
auxiliary-loss-free balancing update), and the bisection that finds the γ of a target skewness."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..trace.summary import expert_counts, skewness
from .predictors import batches

# ---- skewness sweep over a trace --------------------------------------------------------------------


def biased_topk(logp: np.ndarray, bias: np.ndarray, gamma: float, k: int) -> np.ndarray:
    """Top-k of log router probabilities + gamma * bias [E] (gamma = 0: the trace's own ranking)."""
    s = logp + gamma * bias[None, :]
    return np.argsort(-s, axis=1, kind="stable")[:, :k]


def balancing_bias(logp: np.ndarray, k: int, iters: int = 150, step: float = 0.5) -> np.ndarray:
    """A per-expert bias [E] that evens the top-k load of these rows (DeepSeek-V3's auxiliary-loss-free update
    b_e -= u sign(load_e - mean), with a shrinking step u)."""
    E = logp.shape[1]
    b = np.zeros(E)
    for i in range(iters):
        ids = np.argpartition(-(logp + b[None]), k - 1, axis=1)[:, :k]
        load = np.bincount(ids.reshape(-1), minlength=E)
        b -= step * (0.97**i) * np.sign(load - load.mean())
    return b


@dataclass
class LayerRouting:
    logp: np.ndarray  # [N,E] log router probabilities
    ids: np.ndarray  # [N,k] the trace's top-k
    bias: np.ndarray  # [E] log of the layer's measured distribution (sharpening)
    flat: np.ndarray | None = None  # [E] balancing bias (flattening); None: computed on first use


def routed(layers: list[LayerRouting], gamma: float, k: int) -> list[np.ndarray]:
    """Each layer's top-k at bias γ: γ > 0 adds γ log p̄ (sharper), γ in [-1, 0) adds |γ| x the balancing bias
    (flatter; γ = -1 is as balanced as a bias makes it), γ = 0 is the trace."""
    out = []
    for L in layers:
        if gamma == 0:
            out.append(L.ids)
        elif gamma > 0:
            out.append(biased_topk(L.logp, L.bias, gamma, k))
        else:
            if L.flat is None:
                L.flat = balancing_bias(L.logp, k)
            out.append(biased_topk(L.logp, L.flat, -gamma, k))
    return out


def mean_batch_skew(ids: list[np.ndarray], E: int, S: int) -> float:
    v = [skewness(expert_counts(a[b], E)) for a in ids for b in batches(len(a), S)]
    return float(np.nanmean(v))


def find_gamma(layers: list[LayerRouting], target: float, E: int, k: int, S: int) -> float:
    """Bias γ whose re-routing (`routed`) has mean batch skewness `target`, by bisection: flattening searches
    [-1, 0], sharpening [0, 12]; skewness grows with γ on both."""

    def f(g: float) -> float:
        return mean_batch_skew(routed(layers, g, k), E, S)

    s0 = f(0.0)
    lo, hi = (0.0, 12.0) if target >= s0 else (-1.0, 0.0)
    for _ in range(16):  # skew increases with γ on [lo, hi] in both cases
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
