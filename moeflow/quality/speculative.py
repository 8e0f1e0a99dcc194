"""What speculative execution (`moeflow.predict.speculative`) costs in quality: `measure_quality` runs the model
teacher-forced on token sequences with its own routing and with the predictor's, and reports greedy (argmax)
agreement and perplexities with the 95% interval of their ratio."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..predict.speculative import speculative_routing
from .measure import dppl_interval, within_noise


@torch.no_grad()
def measure_quality(model: torch.nn.Module, predictor: Any, sequences: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Teacher-forced on each sequence: argmax agreement (speculative vs own routing) and perplexities, with the
    95% interval of their ratio (`ppl_ratio_ci95`: a paired bootstrap over blocks of tokens,
    `moeflow.quality.measure.dppl_interval`) and whether it holds 1 (`ppl_within_noise`)."""
    agree = n = 0
    nll_ref = nll_spec = 0.0
    tok_ref: list[list[float]] = []
    tok_spec: list[list[float]] = []
    stats: dict[str, Any] = {}
    for seq in sequences:
        ids = torch.tensor([list(seq)], dtype=torch.long)
        if ids.shape[1] < 2:
            continue
        ref = model(ids).logits[0, :-1].float()  # [T-1,V]
        with speculative_routing(model, predictor, stats=stats):
            spec = model(ids).logits[0, :-1].float()
        tgt = ids[0, 1:]
        agree += int((ref.argmax(-1) == spec.argmax(-1)).sum())
        n += len(tgt)
        tok_ref.append(torch.nn.functional.cross_entropy(ref, tgt, reduction="none").double().tolist())  # [T-1]
        tok_spec.append(torch.nn.functional.cross_entropy(spec, tgt, reduction="none").double().tolist())
        nll_ref += sum(tok_ref[-1])
        nll_spec += sum(tok_spec[-1])
    if n == 0:
        return {"tokens": 0}
    ci = dppl_interval(tok_spec, tok_ref)
    return {
        "tokens": n,
        "greedy_agreement": agree / n,
        "ppl_resident": math.exp(nll_ref / n),
        "ppl_speculative": math.exp(nll_spec / n),
        "ppl_ratio": math.exp((nll_spec - nll_ref) / n),
        "ppl_ratio_ci95": None if ci is None else [1 + ci[0] / 100, 1 + ci[1] / 100],
        "ppl_within_noise": within_noise(ci),
        "routing_exact_match": stats["agree"] / max(1, stats["replaced"]),
    }
