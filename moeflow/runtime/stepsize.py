"""ExpertFlow's step-size formula S = N_e * E_s / (C_s * T_l) (ExpertFlow 3.2.1), the one implementation, used
by `moeflow calibrate` (the initial S) and by the run-time controller (`moeflow.runtime.adaptive_s`).

- `s_formula` / `ceil_s`: the formula and its rounding up;
- `cumulative_distance` / `mean_pairwise_distance`: ExpertFlow's semantic diversity Dist(t) (Sec. 2.2,
  Observation III) over token embeddings, and per pair of tokens;
- `occupancy_limit`: the largest S whose predicted experts the cache can hold (ExpertFlow 3.3.2 (1));
- `initial_step_size`: that S rounded up and clamped to [1, num_moe_layers - 1]: how many MoE layers ahead a
  prefetch must be issued so that loading one layer's experts (N_e * E_s bytes at C_s bytes/s) is hidden
  behind S layers of compute (T_l each).
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError


def s_formula(n_e: float, e_s: float, c_s: float, t_l: float) -> float:
    """ExpertFlow's S = N_e * E_s / (C_s * T_l): e_s in bytes, c_s in bytes/s (> 0), t_l in s (> 0)."""
    return n_e * e_s / (c_s * t_l)


def ceil_s(raw: float) -> int:
    """The whole step size for a formula value: ceil (a hair of float noise ignored), at least 1."""
    return max(1, math.ceil(raw - 1e-9))


def cumulative_distance(emb: Any) -> float:
    """ExpertFlow's semantic diversity Dist(t) = sum_{i<j} ||v_i - v_j||_2 over token embeddings `emb [k,H]`."""
    import torch

    v = torch.as_tensor(emb).detach().float().reshape(len(emb), -1)
    if v.shape[0] < 2:
        return 0.0
    d = torch.cdist(v.unsqueeze(0), v.unsqueeze(0)).squeeze(0)  # [k,k]
    return float(torch.triu(d, diagonal=1).sum())


def mean_pairwise_distance(emb: Any) -> float:
    """Dist(t) / (k (k-1) / 2): the same diversity, independent of how many tokens the window holds."""
    k = len(emb)
    return cumulative_distance(emb) / (k * (k - 1) / 2) if k >= 2 else 0.0


def occupancy_limit(capacity: float, needed_per_layer: float, predicted_per_layer: float) -> int:
    """Largest S whose prefetches fit beside the running layer: needed + S * predicted <= capacity.

    (ExpertFlow 3.3.2 (1): query cache occupancy before computing S.) 0 when not even one layer fits;
    a large number when nothing is predicted."""
    if predicted_per_layer <= 0:
        return 1 << 30
    return max(0, math.floor((capacity - needed_per_layer) / predicted_per_layer + 1e-9))


def initial_step_size(n_e: float, e_s: float, c_s: float, t_l: float, num_moe_layers: int) -> tuple[int, float]:
    """(S clamped to [1, num_moe_layers - 1], raw formula value). c_s in bytes/s, t_l in s, e_s in bytes."""
    if c_s <= 0 or t_l <= 0:
        raise ConfigError(f"step size needs bandwidth > 0 and layer time > 0 (got {c_s} B/s, {t_l} s)")
    raw = s_formula(n_e, e_s, c_s, t_l)
    hi = max(1, num_moe_layers - 1)
    return min(hi, ceil_s(raw)), raw
