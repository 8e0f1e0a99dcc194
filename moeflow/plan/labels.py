"""Prompt-level expert-pattern labels (CasMoE eq. 3) from a trace.

For prompt i, EP_i is an L x K matrix (L MoE layers, K experts): entry (l, e) is the sum, over the
prompt's tokens, of the router weight layer l gave expert e on the tokens where e was selected (top-k):

    EP_i[l, e] = sum_j alpha_{j,l,e} * 1[e in topk_l(x_j)]

By default only prefill tokens (the prompt itself: what the planner can see before decoding) count;
`phase="all"` adds the traced decode tokens. `kind="count"` is the paper's Table 4 alternative: the
number of tokens that selected e (the paper applies a softmax over these frequencies; `normalize(...,
"softmax")` does that).

The learners (EAM values, EAP targets) use `normalize(ep, "mean1")`: each layer's row divided by its sum
and multiplied by K, so every layer's entries average 1 whatever the prompt length (raw sums grow with
the number of tokens, which would make a Huber loss with delta=1 regress the length). Per-layer top-k
(what a plan is made of) is unchanged by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..predict.data import RoutingData

PHASES = ("prefill", "all")
KINDS = ("ep", "count")
NORMS = ("none", "sum1", "mean1", "softmax")


def ep_from_routing(
    topk_ids: Sequence[np.ndarray], topk_weights: Sequence[np.ndarray], num_experts: int, kind: str = "ep"
) -> np.ndarray:
    """EP [L,K] of one prompt from its per-layer routing: topk_ids[l] [T,k] ints, topk_weights[l] [T,k]."""
    if kind not in KINDS:
        raise ConfigError(f"label kind must be one of {', '.join(KINDS)}, got {kind!r}")
    out = np.zeros((len(topk_ids), num_experts), dtype=np.float64)
    for l, (ids, w) in enumerate(zip(topk_ids, topk_weights, strict=True)):
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        val = np.ones(ids.shape, dtype=np.float64) if kind == "count" else np.asarray(w, dtype=np.float64).reshape(-1)
        np.add.at(out[l], ids, val)
    return out.astype(np.float32)


def ep_labels(data: RoutingData, *, phase: str = "prefill", kind: str = "ep") -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids [P] (the trace's prompt indices, sorted), EP [P,L,K] float32) for every prompt of `data`.

    Prompts with no token of the chosen phase are left out."""
    if phase not in PHASES:
        raise ConfigError(f"label phase must be one of {', '.join(PHASES)}, got {phase!r}")
    if kind not in KINDS:
        raise ConfigError(f"label kind must be one of {', '.join(KINDS)}, got {kind!r}")
    rows = np.flatnonzero(data.phase == 0) if phase == "prefill" else np.arange(data.n)
    pids, inv = np.unique(data.prompt_id[rows], return_inverse=True)
    K = data.spec.num_experts
    ep = np.zeros((len(pids), len(data.spec.moe_layers), K), dtype=np.float64)
    for li, l in enumerate(data.spec.moe_layers):
        a = data.layers[l]
        ids = a.topk_ids[rows]  # [N,k]
        w = np.ones(ids.shape) if kind == "count" else a.topk_weights[rows].astype(np.float64)
        flat = inv[:, None] * K + ids  # [N,k] index into ep[:, li, :] flattened
        acc = np.zeros(len(pids) * K)
        np.add.at(acc, flat.reshape(-1), w.reshape(-1))
        ep[:, li, :] = acc.reshape(len(pids), K)
    return pids.astype(np.int64), ep.astype(np.float32)


def normalize(ep: np.ndarray, how: str = "mean1") -> np.ndarray:
    """EP [..., L, K] rescaled per layer: `sum1` (row sums 1), `mean1` (row means 1), `softmax`, `none`."""
    if how not in NORMS:
        raise ConfigError(f"normalisation must be one of {', '.join(NORMS)}, got {how!r}")
    x = np.asarray(ep, dtype=np.float64)
    if how == "none":
        return x.astype(np.float32)
    if how == "softmax":  # Table 4's "count": softmax over the prompt-level frequencies (tokens' shares)
        f = x / np.maximum(x.sum(-1, keepdims=True), 1e-12)
        z = np.exp(f - f.max(-1, keepdims=True))
        return (z / z.sum(-1, keepdims=True)).astype(np.float32)
    s = np.maximum(x.sum(-1, keepdims=True), 1e-12)
    y = x / s
    return (y * x.shape[-1] if how == "mean1" else y).astype(np.float32)


def prompt_tokens(data: RoutingData, pids: np.ndarray) -> list[list[int]]:
    """The prefill token ids of each prompt in `pids`, in position order."""
    pre = data.phase == 0
    out = []
    for p in pids:
        rows = np.flatnonzero((data.prompt_id == p) & pre)
        rows = rows[np.argsort(data.position[rows], kind="stable")]
        out.append(data.token_id[rows].tolist())
    return out


def prompt_texts(data: RoutingData, pids: np.ndarray, tokenizer: Any) -> list[str]:
    """Each prompt's text as the model saw it: its prefill tokens decoded by the model's tokenizer.

    A trace stores token ids, not text (and `moeflow run` decodes its input ids the same way), so the
    planner is trained and queried on the same strings, truncation by `--max-prompt-tokens` included."""
    return [tokenizer.decode(t, skip_special_tokens=True) for t in prompt_tokens(data, pids)]
