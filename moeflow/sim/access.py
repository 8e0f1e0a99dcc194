"""Access sequences for the simulator: per forward pass, per MoE layer, which experts were needed.

An `AccessTrace` is a list of `Pass`es, each a list of `LayerStep`s in execution order. A step keeps
the router's choice (`indices [T,k]`, `weights [T,k]`) and, when recorded, the router input
(`router_input [T,H]`) so that pre-gating prefetchers can be replayed.

Builders:
- `record_generate(model, prompts, ...)`: run `generate` under router hooks (`moeflow.moe.RouterTap`);
  one model forward = one pass (the first per prompt is the prefill);
- `from_trace(trace, ...)`: a `moeflow.trace.Trace` (rows grouped into passes: all prefill rows of a
  prompt = one pass, each decode row = one pass; prompts replayed one after another, batch 1);
- `synthetic(...)`: random accesses for tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class LayerStep:
    layer: int  # decoder-layer index
    indices: np.ndarray  # [T,k] int: experts chosen per token
    weights: np.ndarray | None = None  # [T,k] float: gate weights (score-based eviction)
    router_input: torch.Tensor | None = None  # [T,H] (pre-gating replay)

    def needed(self) -> list[int]:
        """Unique experts of this step, in order of first use (token-major, rank-minor)."""
        return list(dict.fromkeys(self.indices.reshape(-1).tolist()))

    def scores(self) -> dict[int, float]:
        """Accumulated gate weight per needed expert over the step's tokens (1 per use if unknown)."""
        w = np.ones(self.indices.shape, dtype=np.float64) if self.weights is None else self.weights
        out: dict[int, float] = {}
        for e, s in zip(self.indices.reshape(-1).tolist(), w.reshape(-1).tolist()):
            out[e] = out.get(e, 0.0) + float(s)
        return out


@dataclass
class Pass:
    phase: int  # 0 prefill, 1 decode
    prompt_id: int
    steps: list[LayerStep] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return int(self.steps[0].indices.shape[0]) if self.steps else 0


@dataclass
class AccessTrace:
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    passes: list[Pass] = field(default_factory=list)
    expert_bytes: int = 0  # one routed expert (MoESpec.expert_bytes); 0 = unknown (bytes counters then count 1 per load)

    def select(self, phase: int | None = None, max_passes: int | None = None) -> AccessTrace:
        """Only prefill (0) or decode (1) passes, the first `max_passes` of them."""
        ps = [p for p in self.passes if phase is None or p.phase == phase]
        return AccessTrace(self.moe_layers, self.num_experts, self.top_k, ps[:max_passes], self.expert_bytes)

    @property
    def has_router_input(self) -> bool:
        return all(s.router_input is not None for p in self.passes for s in p.steps)

    def working_set(self) -> float:
        """Mean unique experts needed per pass (all layers)."""
        if not self.passes:
            return 0.0
        return float(np.mean([sum(len(s.needed()) for s in p.steps) for p in self.passes]))


# ---- builders ---------------------------------------------------------------------------------


def record_generate(
    model: Any,
    prompts: Iterable[torch.Tensor],
    *,
    max_new_tokens: int = 32,
    do_sample: bool = True,
    seed: int = 0,
    keep_router_input: bool = True,
    **generate_kwargs: Any,
) -> AccessTrace:
    """Generate from each prompt (token ids [S] or [1,S]) under router hooks; one pass per model forward.

    Sampling is the default: a briefly trained small model loops under greedy decoding, which makes
    temporal reuse look higher than it is (see shared/notes/pilot-training-run.md).
    """
    from ..moe import RouterTap, get_adapter
    from ..runtime.generate import generate_exactly

    ad = get_adapter(model)
    spec = ad.spec
    acc = AccessTrace(spec.moe_layers, spec.num_experts, spec.top_k, expert_bytes=spec.expert_bytes)
    torch.manual_seed(seed)
    for pid, ids in enumerate(prompts):
        ids = ids.reshape(1, -1).to(next(model.parameters()).device)
        tap = RouterTap(ad, keep_x=keep_router_input)
        with tap.attach(), torch.no_grad():
            generate_exactly(model, ids, max_new_tokens, do_sample=do_sample, **generate_kwargs)
        n = len(tap.events[spec.moe_layers[0]])
        for i in range(n):
            p = Pass(phase=0 if i == 0 else 1, prompt_id=pid)
            for l in spec.moe_layers:
                ev = tap.events[l][i]
                p.steps.append(
                    LayerStep(
                        l, ev.indices.cpu().numpy(), ev.weights.float().cpu().numpy(), ev.x.cpu() if keep_router_input else None
                    )
                )
            acc.passes.append(p)
    return acc


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    try:
        return obj[name]
    except (KeyError, TypeError, IndexError, ValueError):
        return getattr(obj, name, None)


def from_trace(
    trace: Any, *, phase: int | None = None, max_prompts: int | None = None, with_router_input: bool = False
) -> AccessTrace:
    """Passes from a `moeflow.trace.Trace`: `trace.tokens()` (prompt_id, position, phase) and
    `trace.layer(l)` (`topk_ids [N,k]`, `topk_weights [N,k]`, `hidden_in [N,H]` if recorded).

    Rows are grouped into passes: the prefill rows of a prompt form one pass, each decode row one pass,
    ordered by (prompt, position); prompts are replayed one after another (batch 1).
    """
    from ..moe import MoESpec

    spec = trace.spec if isinstance(getattr(trace, "spec", None), MoESpec) else MoESpec.from_dict(trace.meta["spec"])
    tok = trace.tokens()
    pid = np.asarray(_field(tok, "prompt_id"))
    pos = np.asarray(_field(tok, "position"))
    ph = np.asarray(_field(tok, "phase"))
    order = np.lexsort((pos, ph, pid))  # by prompt, prefill first, position
    prompts = list(dict.fromkeys(pid[order].tolist()))[:max_prompts]
    keep = np.isin(pid[order], prompts)
    if phase is not None:
        keep &= ph[order] == phase
    order = order[keep]
    # pass boundaries: a new prompt, a decode row, or the first prefill row of a prompt
    groups: list[np.ndarray] = []
    start = 0
    for i in range(1, len(order) + 1):
        if i == len(order) or pid[order[i]] != pid[order[i - 1]] or ph[order[i]] == 1 or ph[order[i - 1]] == 1:
            groups.append(order[start:i])
            start = i
    per_layer = {}
    wanted = ["topk_ids", "topk_weights"] + (["hidden_in"] if with_router_input else [])
    for l in spec.moe_layers:
        try:
            lay = trace.layer(l, fields=wanted)
        except TypeError:  # a reader without field selection
            lay = trace.layer(l)
        ids = np.asarray(_field(lay, "topk_ids"))
        w = _field(lay, "topk_weights")
        x = _field(lay, "hidden_in") if with_router_input else None
        per_layer[l] = (ids, None if w is None else np.asarray(w), None if x is None else np.asarray(x))
    acc = AccessTrace(spec.moe_layers, spec.num_experts, spec.top_k, expert_bytes=spec.expert_bytes)
    for g in groups:
        p = Pass(phase=int(ph[g[0]]), prompt_id=int(pid[g[0]]))
        for l in spec.moe_layers:
            ids, w, x = per_layer[l]
            p.steps.append(
                LayerStep(
                    l,
                    ids[g],
                    None if w is None else w[g],
                    None if x is None else torch.from_numpy(np.asarray(x[g], dtype=np.float32)),
                )
            )
        acc.passes.append(p)
    return acc


def synthetic(
    num_passes: int,
    moe_layers: Sequence[int] = (0, 1, 2, 3),
    num_experts: int = 16,
    top_k: int = 2,
    tokens: int = 1,
    seed: int = 0,
    skew: float = 1.0,
) -> AccessTrace:
    """Random routing with a Zipf-like popularity per layer (`skew` 0 = uniform) for tests."""
    rng = np.random.default_rng(seed)
    acc = AccessTrace(tuple(moe_layers), num_experts, top_k)
    pop = {l: rng.permutation(num_experts) for l in moe_layers}
    p_rank = 1.0 / np.arange(1, num_experts + 1) ** skew
    for _ in range(num_passes):
        p = Pass(phase=1, prompt_id=0)
        for l in moe_layers:
            probs = np.empty(num_experts)
            probs[pop[l]] = p_rank / p_rank.sum()
            idx = np.stack([rng.choice(num_experts, top_k, replace=False, p=probs) for _ in range(tokens)])
            w = rng.random(idx.shape).astype(np.float32)
            p.steps.append(LayerStep(l, idx, w / w.sum(-1, keepdims=True)))
        acc.passes.append(p)
    return acc
