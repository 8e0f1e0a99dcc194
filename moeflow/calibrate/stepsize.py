"""ExpertFlow's step-size formula, the initial S, and the link bandwidths of named hardware regimes.

- `s_formula`, `ceil_s`, `initial_step_size`, `occupancy_limit`, `mean_pairwise_distance`: the formula and
  its parts, implemented once in `moeflow.runtime.stepsize` (the run-time controller uses them too) and
  re-exported here;
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

import re
from dataclasses import dataclass

from ..errors import ConfigError
from ..runtime.stepsize import (
    ceil_s,
    cumulative_distance,
    initial_step_size,
    mean_pairwise_distance,
    occupancy_limit,
    s_formula,
)

__all__ = [
    "SPECMD_EXPERT_BYTES",
    "SPECMD_GBPS",
    "Regime",
    "ceil_s",
    "copy_share",
    "copy_share_bandwidth",
    "cumulative_distance",
    "initial_step_size",
    "mean_pairwise_distance",
    "occupancy_limit",
    "parse_regime",
    "regime_bandwidth",
    "s_formula",
    "specmd_bandwidth",
]

SPECMD_GBPS = 5.0
SPECMD_EXPERT_BYTES = 3 * 2048 * 1024 * 2  # OLMoE-1B-7B expert, bf16


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
