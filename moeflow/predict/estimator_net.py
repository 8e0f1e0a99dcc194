"""The estimator's network (`EstimatorNet`) and its input features (`EstimatorFeatures`); `estimator.py` fits,
saves and loads them (the features and the network's shape are described in its docstring)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .data import SourceBatch


class EstimatorNet(nn.Module):
    mu: torch.Tensor  # [F] feature means (buffer)
    sd: torch.Tensor  # [F] feature standard deviations (buffer)

    def __init__(self, in_dim: int, num_experts: int, num_pairs: int, m: int = 128, n: int = 256, blocks: int = 1):
        super().__init__()
        self.register_buffer("mu", torch.zeros(in_dim))
        self.register_buffer("sd", torch.ones(in_dim))
        self.A = nn.Linear(in_dim, m)
        self.pos = nn.Embedding(num_pairs, m)
        self.B = nn.ModuleList(nn.Linear(m, n) for _ in range(blocks))
        self.C = nn.ModuleList(nn.Linear(n, m) for _ in range(blocks))
        self.norm = nn.LayerNorm(m)
        self.head = nn.Linear(m, num_experts)

    def forward(self, x: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
        return self.trunk(self.A((x - self.mu) / self.sd) + self.pos(pair))  # [T,E] logits

    def project(self, x: torch.Tensor, cols: slice) -> torch.Tensor:
        """The first layer's term of the input features `cols` (standardised): [...,len(cols)] -> [...,m], no bias."""
        return ((x.float() - self.mu[cols]) / self.sd[cols]) @ self.A.weight[:, cols].T

    def trunk(self, z: torch.Tensor) -> torch.Tensor:
        """After the first layer: residual SiLU blocks, LayerNorm, head. [...,m] -> [...,E] logits."""
        for B, C in zip(self.B, self.C):
            z = z + C(F.silu(B(z)))  # [...,m]
        return self.head(self.norm(z))


class EstimatorFeatures:
    """The estimator's input x for a source batch (see the module docstring); shape-agnostic."""

    def __init__(self, model: torch.nn.Module, spec: Any, context: int):
        self.spec = spec
        self.context = context
        self.emb = model.get_input_embeddings().weight.detach().float()  # type: ignore[operator]  # [V,H]
        self.ml = list(spec.moe_layers)

    @property
    def dim(self) -> int:
        return (2 + self.context) * self.spec.hidden_size + len(self.ml) * self.spec.num_experts

    def tokens(self, ctx: torch.Tensor | None, t: int) -> torch.Tensor:
        """[T, context*H] input embeddings of the last `context` tokens (most recent first; 0 = unknown)."""
        H = self.spec.hidden_size
        out = torch.zeros(t, self.context * H)
        if ctx is None or self.context == 0:
            return out
        for j in range(min(self.context, ctx.shape[1])):
            ids = ctx[:, -1 - j].long()
            ok = (ids >= 0) & (ids < len(self.emb))
            out[ok, j * H : (j + 1) * H] = self.emb[ids[ok]]
        return out

    def gates(self, hist_ids: torch.Tensor, hist_w: torch.Tensor, upto: torch.Tensor) -> torch.Tensor:
        """[T, L*E]: gate weights of the chosen experts per MoE layer rank r <= upto[t] (else 0).
        hist_ids / hist_w [T,L,k] (rows of ranks not yet routed may hold anything)."""
        T, L, _ = hist_ids.shape
        E = self.spec.num_experts
        g = torch.zeros(T, L, E).scatter(-1, hist_ids.long(), hist_w.float())
        g = g * (torch.arange(L)[None, :] <= upto[:, None]).float()[..., None]
        return g.reshape(T, L * E)

    def of_batch(self, q: torch.Tensor, batch: SourceBatch) -> torch.Tensor:
        T, L, k = batch.t, len(self.ml), self.spec.top_k
        ids = torch.zeros(T, L, k, dtype=torch.long)
        w = torch.zeros(T, L, k)
        r_src = self.ml.index(batch.layer)
        # the history keeps ids only: earlier layers' chosen experts weigh 1, the source's its gate weights
        for l, h in batch.history.items():
            if l in self.ml and self.ml.index(l) < r_src:
                ids[:, self.ml.index(l)] = h.long()
                w[:, self.ml.index(l)] = 1.0
        w[:, r_src] = batch.topk_weights.float()
        ids[:, r_src] = batch.topk_ids.long()
        return self.assemble(
            q, batch.router_input.float(), self.tokens(batch.token_ctx, T), self.gates(ids, w, torch.full((T,), r_src))
        )

    @staticmethod
    def assemble(q: torch.Tensor, u: torch.Tensor, tok: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        return torch.cat([q.float(), u.float(), tok, gates], 1)
