"""Default vectors, the quasi-hidden state and Router-PF (Speculating Experts, section 3).

- Default vector d_{l,e}: the mean output of expert e of MoE layer l over the trace tokens routed
  to it, computed by running layer l's experts module on the traced router inputs `hidden_in`
  with each token's own routed experts, one expert per call (weight 1, so the output is unweighted).
- Layer-level default representation: d_l = sum_{e in top-k_l} g_{l,e} d_{l,e}, with g the
  routing weights layer l itself produced for the token (its own top-k).
- Quasi-hidden state (paper eq. in 3.2): q_l = LN_{l+1}(r_l + d_l), with r_l the **post-attention
  residual** of layer l (the residual the MoE output is added to) and LN_{l+1} the norm applied to
  the residual stream right before routing at the next MoE layer: its `post_attention_layernorm`.
  (`input_layernorm` of l+1 precedes attention; the paper skips layer l+1's attention entirely.)
- Router-PF: router_{l+1}(q_l).

S > 1 chains the same approximation: h_{l+1} ~= r_l + d_l, q_l = LN_{l+1}(h_{l+1}); routing q_l with
router_{l+1} gives weights and experts, hence d_{l+1}, and h_{l+2} ~= h_{l+1} + d_{l+1} (the attention
of the skipped layers is left out; so are dense MLPs and shared experts between MoE layers —
a stated limitation, exact only in what the paper defines for S = 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ArtifactError
from ..models import HALF_DTYPES
from ..moe import get_adapter, residual_norm
from .base import PREDICTORS
from .data import RoutingData, SourceBatch, target_of


@torch.no_grad()
def compute_default_vectors(
    model: torch.nn.Module, data: RoutingData, *, max_tokens: int = 50_000, chunk: int = 4096, progress: Any = None
) -> dict[int, torch.Tensor]:
    """layer -> d [E,H] float32: mean (unweighted) output of each expert over the tokens routed to it. Computed in
    float32 when the rest of the model is: float16 or bfloat16 experts (`stages.train.load_cpu_model` keeps them so)
    are cast one layer at a time and cast back after (exact: bf16 -> float32 -> bf16 is the identity)."""
    ad = get_adapter(model)
    spec = ad.spec
    E, H = spec.num_experts, spec.hidden_size
    rows = np.arange(data.n)
    if data.n > max_tokens:
        rows = np.sort(np.random.default_rng(0).choice(data.n, max_tokens, replace=False))
    out: dict[int, torch.Tensor] = {}
    for l in spec.moe_layers:
        a = data.layers[l]
        if a.hidden_in is None:
            raise ArtifactError("default vectors need traced router inputs; re-run `moeflow trace --record-hidden`")
        experts = ad.experts(l)
        own = next(experts.parameters()).dtype
        cast = own in HALF_DTYPES and ad.router_weight(l).dtype == torch.float32  # the rest of the model is float32
        dt = torch.float32 if cast else own
        if cast:
            experts.to(dt)  # this layer only; back below
        try:
            sums, counts = _expert_sums(experts, a, rows, chunk, E, H, dt)
        finally:
            if cast:
                experts.to(own)
        out[l] = (sums / counts.clamp(min=1)[:, None]).float()  # [E,H]; unseen experts: 0
        if progress is not None:
            progress()
    return out


def _expert_sums(
    experts: torch.nn.Module, a: Any, rows: np.ndarray, chunk: int, E: int, H: int, dt: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum [E,H] float64 of each expert's outputs over the `rows` routed to it, their count [E])."""
    sums = torch.zeros(E, H, dtype=torch.float64)
    counts = torch.zeros(E, dtype=torch.float64)
    for i in range(0, len(rows), chunk):
        r = rows[i : i + chunk]
        ids = torch.from_numpy(a.topk_ids[r])  # [T,k]
        x = torch.from_numpy(a.hidden_in[r]).to(dt).repeat_interleave(ids.shape[1], 0)  # [T*k,H] each token k times
        e = ids.reshape(-1, 1)  # [T*k,1] one of its routed experts per copy
        y = experts(x, e, torch.ones(e.shape, dtype=dt))  # [T*k,H] output of expert e
        sums.index_add_(0, e[:, 0], y.double())
        counts.index_add_(0, e[:, 0], torch.ones(len(e), dtype=torch.float64))
    return sums, counts


class QuasiHidden:
    """q_l and its chain S steps ahead, from default vectors and the model's norms and routers."""

    def __init__(self, model: torch.nn.Module, dvec: dict[int, torch.Tensor]):
        self.adapter = get_adapter(model)
        self.spec = self.adapter.spec
        self.dvec = dvec

    @torch.no_grad()
    def step(self, h: torch.Tensor, layer: int, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """h_{next} ~= h + sum_k w_k d_{layer, ids_k}: [T,H] (h is the post-attention residual of `layer`)."""
        d = F.embedding_bag(ids.long(), self.dvec[layer], per_sample_weights=w.float(), mode="sum")  # [T,H] sum_k w_k d_ids_k
        return h.float() + d  # [T,H]

    @torch.no_grad()
    def normed(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """LN of decoder layer `layer` before its router: [T,H] in the model dtype."""
        norm = residual_norm(self.adapter, layer, hint="router-pf needs the norm before the router")
        return norm(h.to(next(norm.parameters()).dtype))

    @torch.no_grad()
    def chain(self, batch: SourceBatch, steps: int) -> list[torch.Tensor]:
        """[q_l (for l+1), q for l+2, ...]: `steps` quasi-hidden states, each [T,H]."""
        if batch.residual is None:
            raise ArtifactError(
                "router-pf needs the post-attention residual; trace with --record-hidden or run with an engine that captures it"
            )
        ml = self.spec.moe_layers
        r = ml.index(batch.layer)
        h = self.step(batch.residual, batch.layer, batch.topk_ids, batch.topk_weights)
        qs = []
        for s in range(1, steps + 1):
            nxt = ml[r + s]
            q = self.normed(h, nxt)  # [T,H]
            qs.append(q)
            if s < steps:
                logits = batch.router_logits(self.adapter, nxt, q)  # [T,E]
                w, ids = self.adapter.select(nxt, logits)
                h = self.step(h, nxt, ids, w)
        return qs


def save_dvec(folder: Path, dvec: dict[int, torch.Tensor]) -> None:
    torch.save({int(l): v.contiguous() for l, v in dvec.items()}, folder / "default_vectors.pt")


def load_dvec(folder: Path, model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """layer -> d [E,H] from `default_vectors.pt` (tensors only), checked against `model`'s MoE layers."""
    from .io import artifact_file, load_tensors

    path = folder / "default_vectors.pt"
    raw = load_tensors(path)
    with artifact_file(path):
        spec = get_adapter(model).spec
        shape = (spec.num_experts, spec.hidden_size)
        if (
            not isinstance(raw, dict)
            or sorted(int(l) for l in raw) != sorted(spec.moe_layers)
            or not all(isinstance(v, torch.Tensor) and tuple(v.shape) == shape for v in raw.values())
        ):
            raise ValueError(f"not one [E,H] = [{shape[0]},{shape[1]}] tensor per MoE layer of this model")
        return {int(l): v.float() for l, v in raw.items()}


@PREDICTORS.register
class RouterPF:
    """Router-PF: router_{l+S}(q chained S steps from layer l)."""

    name: ClassVar[str] = "router-pf"
    needs_hidden: ClassVar[bool] = True

    def __init__(self, model: torch.nn.Module, dvec: dict[int, torch.Tensor] | None = None, max_lookahead: int = 4):
        self.model = model
        self.dvec = dvec
        self.max_lookahead = max_lookahead
        self.qh = QuasiHidden(model, dvec) if dvec is not None else None

    @classmethod
    def create(cls, model: torch.nn.Module, cfg: Any) -> RouterPF:
        return cls(model, None, cfg.max_s)

    def fit(self, data: RoutingData, model: torch.nn.Module, cfg: Any, dvec: dict[int, torch.Tensor] | None = None) -> None:
        self.dvec = dvec if dvec is not None else compute_default_vectors(model, data, max_tokens=cfg.dv_max_tokens)
        self.qh = QuasiHidden(model, self.dvec)
        self.max_lookahead = cfg.max_s

    @torch.no_grad()
    def predict(self, target_layer: int, lookahead: int, batch: SourceBatch) -> torch.Tensor:
        assert self.qh is not None, "fit or load first"
        assert target_of(self.qh.spec, batch.layer, lookahead) == target_layer
        q = self.qh.chain(batch, lookahead)[-1]  # [T,H]
        return torch.softmax(batch.router_logits(self.qh.adapter, target_layer, q).float(), -1)  # [T,E]

    def runner(self) -> Any:
        """The run-time path: every S of a source layer from one chain (`fast.ChainRunner`; the prefetch policy
        compiles its decode kernel at bind, `warm`)."""
        from .fast import ChainRunner

        assert self.qh is not None, "fit or load first"
        return ChainRunner(self.qh)

    def save(self, folder: Path) -> None:
        assert self.dvec is not None, "fit first"
        save_dvec(folder, self.dvec)
        (folder / "config.json").write_text(json.dumps({"max_lookahead": self.max_lookahead}))

    @classmethod
    def load(cls, folder: Path, model: torch.nn.Module) -> RouterPF:
        from .io import artifact_file, read_json_file

        cfg = read_json_file(folder / "config.json")
        dvec = load_dvec(folder, model)
        with artifact_file(folder / "config.json"):
            return cls(model, dvec, int(cfg["max_lookahead"]))
