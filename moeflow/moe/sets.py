"""Expert sets: which experts a score row selects, and how many of the routed ones a set holds.

One implementation each, used by the prefetch policies, the predictor evaluation, the hybrid
predictor's validation and the model card:
- `mass_mask(probs, mass)`: per row, experts in descending probability until `mass` is covered
  (ExpertFlow 3.2.1's expected-activation set);
- `topk_mask(scores, m)`: per row, the `m` highest-scoring experts;
- `topk_hits(pred, truth)` / `recall_at_k(pred, truth)`: per row, how many of the predicted
  experts were routed; recall@k = hits / k averaged over rows (= precision of a k-set).
"""

from __future__ import annotations

from typing import Any

import torch


def mass_mask(probs: torch.Tensor, mass: float) -> torch.Tensor:
    """Boolean [T,E]: per row, the experts in descending probability until `mass` is covered.

    An expert is kept when the mass strictly before it is below `mass`, so the first is always kept.
    """
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [T,E]
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < mass  # [T,E]
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def topk_mask(scores: torch.Tensor, m: int) -> torch.Tensor:
    """Boolean [T,E]: per row, the `m` highest-scoring experts."""
    idx = scores.topk(m, dim=-1).indices  # [T,m]
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter(-1, idx, True)


def topk_hits(pred: Any, truth: Any) -> Any:
    """[N]: per row, how many experts of `pred` [N,m] are in `truth` [N,k] (numpy arrays or tensors)."""
    return (pred[:, :, None] == truth[:, None, :]).any(-1).sum(-1)


def recall_at_k(pred: Any, truth: Any) -> float:
    """Mean over rows of |pred ∩ truth| / k for expert ids pred [N,k'], truth [N,k]; NaN without rows."""
    if len(truth) == 0:
        return float("nan")
    return float(topk_hits(pred, truth).sum()) / (len(truth) * truth.shape[1])
