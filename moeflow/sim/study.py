"""Policy sweeps on an access trace: capacities (fractions of all experts) x eviction x prefetch, plus Belady.

Used by `benchmarks/least_stale.py` and the Least-Stale test; one row per (capacity, config).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from .access import AccessTrace, record_generate
from .simulator import belady, simulate

# (label, eviction, prefetch) — prefetch None or (name, options)
DEFAULT_CONFIGS: tuple[tuple[str, Any, Any], ...] = (
    ("lru", "lru", "none"),
    ("fld", "fld", "none"),
    ("score", "score", "none"),
    ("lru2", "lru2", "none"),
    ("least-stale", "least-stale", "none"),
    ("lru+pregate", "lru", ("pregate", {})),
    ("fld+pregate", "fld", ("pregate", {})),
    ("score+pregate", "score", ("pregate", {})),
    ("lru2+pregate", "lru2", ("pregate", {})),
    ("least-stale+pregate", "least-stale", ("pregate", {})),
)


def capacity_of(acc: AccessTrace, fraction: float) -> int:
    """Slots for `fraction` of all experts, never below top_k (one token's layer must fit)."""
    return max(acc.top_k, round(fraction * len(acc.moe_layers) * acc.num_experts))


def gsm8k_prompts(tok: Any, n: int, data_dir: str | Path, max_tokens: int = 48) -> list[torch.Tensor]:
    """The first `n` GSM8K test questions, tokenised and cut to `max_tokens`."""
    path = Path(data_dir) / "gsm8k" / "test.jsonl"
    out = []
    with open(path) as f:
        for line in f:
            q = json.loads(line)["question"]
            out.append(torch.tensor(tok(q)["input_ids"][:max_tokens]))
            if len(out) == n:
                break
    return out


def sampled_trace(model: Any, prompts: Iterable[torch.Tensor], new_tokens: int, seed: int = 0) -> AccessTrace:
    """Prefill and decode passes of sampled generation (T=0.8, top-p 0.95), with router inputs for pre-gating."""
    return record_generate(model, prompts, max_new_tokens=new_tokens, do_sample=True, seed=seed, temperature=0.8, top_p=0.95)


def decode_trace(model: Any, prompts: Iterable[torch.Tensor], new_tokens: int, seed: int = 0) -> AccessTrace:
    """Decode passes only (prefill dropped) of `sampled_trace`."""
    return sampled_trace(model, prompts, new_tokens, seed).select(phase=1)


def sweep(
    acc: AccessTrace,
    fractions: Sequence[float],
    configs: Sequence[tuple[str, Any, Any]] = DEFAULT_CONFIGS,
    predict_logits: Callable | None = None,
    lookahead: int = 1,
    progress: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    rows = []
    for f in fractions:
        cap = capacity_of(acc, f)
        b = belady(acc, cap)
        for label, ev, pf in [*configs, ("belady", None, None)]:
            st = b if label == "belady" else simulate(acc, cap, ev, pf, lookahead=lookahead, predict_logits=predict_logits)
            rows.append(
                {
                    "fraction": f,
                    "capacity": cap,
                    "config": label,
                    "hit_rate": st.hit_rate,
                    "collisions": st.collisions,
                    "collision_rate": st.collision_rate,
                    "misses": st.misses,
                    "loads_per_token": st.loads_per_token,
                    "prefetch_precision": st.prefetch_precision,
                    "prefetch_recall": st.prefetch_recall,
                    "belady_hit_rate": b.hit_rate,
                    "hit_rate_per_layer": [
                        st.hits_per_layer.get(l, 0) / max(1, st.accesses_per_layer.get(l, 0)) for l in acc.moe_layers
                    ],
                }
            )
            if progress:
                progress()
    return rows
