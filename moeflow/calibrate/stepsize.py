"""ExpertFlow's step-size formula, the initial S, and the link bandwidths of named hardware regimes.

- `s_formula` / `ceil_s`: S = N_e * E_s / (C_s * T_l) (ExpertFlow 3.2.1) and its rounding up; the one
  implementation, also used by the run-time controller (`moeflow.runtime.adaptive_s`);
- `cumulative_distance` / `mean_pairwise_distance`: ExpertFlow's semantic diversity Dist(t) (Sec. 2.2,
  Observation III) over token embeddings, and per pair of tokens;
- `occupancy_limit`: the largest S whose predicted experts the cache can hold (ExpertFlow 3.3.2 (1));
- `initial_step_size`: that S rounded up and clamped to
  [1, num_moe_layers - 1]: how many MoE layers ahead a prefetch must be issued so that loading one
  layer's experts (N_e * E_s bytes at C_s bytes/s) is hidden behind S layers of compute (T_l each).
- `copy_share_bandwidth`: the bandwidth at which copies are a given share of TPOT under on-demand
  loading (every activated expert is loaded when its layer runs, nothing overlaps):
  share = (B/bw) / (B/bw + t_c)  =>  bw = B * (1 - share) / (share * t_c),
  B = bytes per token (num_moe_layers * top_k * expert_bytes), t_c = compute per token (all resident).
  "copy-share=0.85" is Speculating Experts' A6000 + Qwen3-30B-A3B regime.
- `specmd_bandwidth`: SpecMD's 5 GB/s (A100, OLMoE-1B-7B) scaled to this model so that ONE EXPERT takes
  as long to move as in the paper: 12,582,912 bytes (OLMoE-1B-7B expert in bf16: 3 x 2048 x 1024 x 2 B;
  the paper's 5% = 0.6 GB cache matches bf16) at 5 GB/s = 2.52 ms per expert. Keeping per-expert time
  (not bytes/s) keeps a miss as costly in absolute time; the copy share this gives on this machine is
  reported beside it because the compute side differs from an A100.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

SPECMD_GBPS = 5.0
SPECMD_EXPERT_BYTES = 3 * 2048 * 1024 * 2  # OLMoE-1B-7B expert, bf16


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


def copy_share_bandwidth(bytes_per_token: float, compute_per_token_s: float, share: float) -> float:
    """Bytes/s at which on-demand copies are `share` of TPOT (0 < share < 1)."""
    if not 0 < share < 1:
        raise ConfigError(f"copy-share must be in (0, 1), got {share}")
    if bytes_per_token <= 0 or compute_per_token_s <= 0:
        raise ConfigError("copy-share needs bytes per token > 0 and compute per token > 0")
    return bytes_per_token * (1 - share) / (share * compute_per_token_s)


def copy_share(bytes_per_token: float, compute_per_token_s: float, bandwidth: float) -> float:
    """The share of TPOT spent copying under on-demand loading at `bandwidth` bytes/s."""
    t = bytes_per_token / bandwidth
    return t / (t + compute_per_token_s)


def specmd_bandwidth(expert_bytes: float) -> float:
    """Bytes/s moving one expert of `expert_bytes` in the time SpecMD's link moves an OLMoE-1B-7B expert."""
    return SPECMD_GBPS * 1e9 * expert_bytes / SPECMD_EXPERT_BYTES


@dataclass(frozen=True)
class Regime:
    name: str  # "copy-share" or "specmd"
    value: float | None = None

    def label(self) -> str:
        return f"{self.name}={self.value:g}" if self.value is not None else self.name


def parse_regime(text: str) -> Regime:
    """'copy-share=0.85' or 'specmd' (also 'specmd-5gbps')."""
    t = text.strip().lower()
    m = re.fullmatch(r"copy-share=([0-9.]+)", t)
    if m:
        v = float(m.group(1))
        if not 0 < v < 1:
            raise ConfigError(f"--regime copy-share must be in (0, 1), got {v}")
        return Regime("copy-share", v)
    if t in ("specmd", "specmd-5gbps"):
        return Regime("specmd")
    raise ConfigError(f"unknown --regime {text!r}; use copy-share=0.85 (Speculating Experts) or specmd (5 GB/s scaled)")


def regime_bandwidth(
    regime: Regime, *, bytes_per_token: float, compute_per_token_s: float, expert_bytes: float
) -> dict[str, float | str]:
    """The link bandwidth of `regime` for this model, with what it means (per-expert time, copy share)."""
    if regime.name == "copy-share" and regime.value is not None:
        bw = copy_share_bandwidth(bytes_per_token, compute_per_token_s, regime.value)
    else:
        bw = specmd_bandwidth(expert_bytes)
    return {
        "regime": regime.label(),
        "bandwidth_bytes_per_s": bw,
        "gbps": bw / 1e9,
        "expert_transfer_s": expert_bytes / bw,
        "copy_share_on_demand": copy_share(bytes_per_token, compute_per_token_s, bw),
    }
