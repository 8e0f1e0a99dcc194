"""Routing statistics of a trace, as plain functions on arrays (reusable by model cards and reports).

Definitions (per MoE layer, over the rows given):
- **load**: `counts[e]` = number of (token, slot) assignments to expert e; sums to N*k.
- **dead experts**: experts whose count is below 1% of the mean count (as in the pilot notes).
- **skewness**: max count / mean count (MoE-GPS, §2: "# of tokens in the most popular expert /
  # of average tokens per expert"); 1 is perfect balance, E/k the worst possible.
- **router entropy**: mean over tokens of the entropy of the router's probability vector, divided by
  log E (1 = uniform router, 0 = one-hot).
- **load entropy**: entropy of counts / sum(counts), divided by log E (1 = every expert equally loaded).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


def expert_counts(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Assignments per expert [E] int64 from top-k ids [N,k]."""
    return np.bincount(np.asarray(topk_ids).reshape(-1).astype(np.int64), minlength=num_experts)[:num_experts]


def skewness(counts: np.ndarray) -> float:
    """max count / mean count (MoE-GPS); nan when nothing was routed."""
    counts = np.asarray(counts, dtype=np.float64)
    mean = counts.mean() if counts.size else 0.0
    return float(counts.max() / mean) if mean > 0 else float("nan")


def dead_experts(counts: np.ndarray, frac: float = 0.01) -> np.ndarray:
    """Indices of experts with count < `frac` x mean count."""
    counts = np.asarray(counts, dtype=np.float64)
    return np.flatnonzero(counts < frac * counts.mean()) if counts.size else np.zeros(0, np.int64)


def router_entropy(probs: np.ndarray, chunk: int = 65536) -> float:
    """Mean per-token entropy of router probabilities [N,E], normalised by log E (chunked: constant memory)."""
    N, E = probs.shape
    if N == 0 or E < 2:
        return float("nan")
    total = 0.0
    for s in range(0, N, chunk):
        p = np.asarray(probs[s : s + chunk], dtype=np.float32)  # [n,E]
        p = p / np.maximum(p.sum(-1, keepdims=True), 1e-12)  # fp16 rounding
        total += float(-(p * np.log(np.maximum(p, 1e-12))).sum())
    return total / N / math.log(E)


def load_entropy(counts: np.ndarray) -> float:
    """Entropy of the load distribution counts/sum, normalised by log E."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.size < 2 or counts.sum() == 0:
        return float("nan")
    p = counts / counts.sum()
    p = p[p > 0]
    return float(-(p * np.log(p)).sum() / math.log(counts.size))


@dataclass(frozen=True)
class LayerStats:
    layer: int
    tokens: int  # rows (tokens routed through this layer)
    assignments: int  # tokens x k
    dead: list[int]  # experts under 1% of mean load
    skewness: float  # max / mean load
    router_entropy: float  # mean per-token entropy / log E
    load_entropy: float  # entropy of the load distribution / log E
    counts: list[int]  # load per expert

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def layer_stats(
    topk_ids: np.ndarray, probs: np.ndarray | None, num_experts: int, layer: int = -1, dead_frac: float = 0.01
) -> LayerStats:
    """All statistics of one layer from its top-k ids [N,k] and (optionally) router probabilities [N,E]."""
    counts = expert_counts(topk_ids, num_experts)
    return LayerStats(
        layer=layer,
        tokens=len(topk_ids),
        assignments=int(counts.sum()),
        dead=[int(e) for e in dead_experts(counts, dead_frac)],
        skewness=skewness(counts),
        router_entropy=router_entropy(probs) if probs is not None else float("nan"),
        load_entropy=load_entropy(counts),
        counts=[int(c) for c in counts],
    )


def trace_summary(trace: Any, phase: str | None = None) -> dict[str, Any]:
    """Per-MoE-layer statistics of a `Trace` (all rows, or only `"prefill"` / `"decode"` rows)."""
    spec = trace.spec
    tok = trace.tokens()
    mask = trace.mask(phase)
    layers = []
    for l in spec.moe_layers:
        d = trace.layer(l, ("topk_ids", "probs"))
        ids, probs = (d["topk_ids"], d["probs"]) if phase is None else (d["topk_ids"][mask], d["probs"][mask])
        layers.append(layer_stats(ids, probs, spec.num_experts, layer=l).to_dict())
    return {
        "path": str(trace.path),
        "model_fingerprint": trace.fingerprint,
        "arch": spec.arch,
        "num_experts": spec.num_experts,
        "top_k": spec.top_k,
        "moe_layers": list(spec.moe_layers),
        "prompts": trace.num_prompts,
        "tokens": int(mask.sum()),
        "phase": phase or "all",
        "prefill_tokens": int((tok["phase"] == 0).sum()),
        "decode_tokens": int((tok["phase"] == 1).sum()),
        "record_hidden": trace.record_hidden,
        "shards": len(trace.meta["shards"]),
        "generation": trace.meta.get("generation"),
        "layers": layers,
    }


def render_summary(summary: dict[str, Any], console: Any) -> None:
    """A rich table of `trace_summary(...)`."""
    from ..tables import FitTable

    s = summary
    title = (
        f"{s['path']}: {s['arch']}, {s['prompts']} prompts, {s['tokens']} tokens ({s['phase']}; "
        f"prefill {s['prefill_tokens']}, decode {s['decode_tokens']}), {s['num_experts']} experts top-{s['top_k']}"
    )
    t = FitTable(
        title,
        caption="dead: experts under 1% of mean load (the first 8 named); skew: max/mean load (MoE-GPS); H router: "
        "mean per-token router entropy / log E; H load: entropy of the load / log E",
    )
    for name in ("layer", "tokens", "dead", "skew", "H router", "H load", "busiest"):
        t.add_column(name, justify="left" if name == "dead" else "right")
    for L in s["layers"]:
        more = f" +{len(L['dead']) - 8}" if len(L["dead"]) > 8 else ""
        dead = f"{len(L['dead'])}" + (f": {' '.join(map(str, L['dead'][:8]))}{more}" if L["dead"] else "")
        busiest = int(np.argmax(L["counts"])) if L["assignments"] else "-"
        t.add_row(
            str(L["layer"]),
            str(L["tokens"]),
            dead,
            f"{L['skewness']:.2f}",
            f"{L['router_entropy']:.3f}",
            f"{L['load_entropy']:.3f}",
            str(busiest),
        )
    console.print(t)
