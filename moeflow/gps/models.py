"""MoE-GPS's token-to-expert predictors: frequency tables (global, token id, position) and the two networks of the
paper's Appendix B (an FFN on the token embedding, an LSTM with attention over the sequence), with their training loop."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from ..trace.summary import expert_counts

# ---- token-to-expert: frequency tables ----------------------------------------------------------


class TableModel:
    """Most frequent experts per key (global / token id / position) for every layer; unseen keys -> global."""

    def __init__(self, kind: str, num_experts: int, layers: list[int]):
        self.kind, self.E, self.layers = kind, num_experts, layers
        self.keys = np.zeros(0, np.int64)  # sorted keys with a row in `counts`
        self.counts = np.zeros((0, len(layers), num_experts), np.float32)  # [n_keys, L, E]
        self.glob = np.zeros((len(layers), num_experts), np.int64)  # [L, E]

    def key_of(self, token_id: np.ndarray, position: np.ndarray) -> np.ndarray:
        return token_id if self.kind == "token-id" else position

    def fit(self, token_id: np.ndarray, position: np.ndarray, ids: dict[int, np.ndarray]) -> TableModel:
        E = self.E
        self.glob = np.stack([expert_counts(ids[l], E) for l in self.layers])
        if self.kind == "probability":
            return self
        key = self.key_of(token_id, position).astype(np.int64)
        self.keys, inv = np.unique(key, return_inverse=True)
        # n_{k,i} over all top-k slots; slot j weighs 1 + (k - j) 1e-3 so ties go to the router's first choice
        self.counts = np.zeros((len(self.keys), len(self.layers), E), np.float32)
        for j, l in enumerate(self.layers):
            k = ids[l].shape[1]
            w = np.tile(1.0 + (k - np.arange(k)) * 1e-3, len(inv))
            np.add.at(self.counts[:, j, :], (np.repeat(inv, k), ids[l].reshape(-1).astype(np.int64)), w)
        return self

    def scores(self, token_id: np.ndarray, position: np.ndarray) -> np.ndarray:
        """[n, L, E] scores (counts; ties broken towards the global frequency)."""
        n = len(token_id)
        g = self.glob / max(1, self.glob.sum(-1, keepdims=True).max())  # < 1: only breaks ties
        out = np.broadcast_to(g[None], (n, *g.shape)).astype(np.float64)
        if self.kind == "probability" or not len(self.keys):
            return out
        key = self.key_of(token_id, position).astype(np.int64)
        pos = np.clip(np.searchsorted(self.keys, key), 0, len(self.keys) - 1)
        hit = self.keys[pos] == key
        out = out.copy()
        out[hit] += self.counts[pos[hit]]
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        return {f"{self.kind}.keys": self.keys, f"{self.kind}.counts": self.counts, f"{self.kind}.glob": self.glob}

    @classmethod
    def from_arrays(cls, kind: str, z: Any, num_experts: int, layers: list[int]) -> TableModel:
        self = cls(kind, num_experts, layers)
        self.keys, self.counts, self.glob = z[f"{kind}.keys"], z[f"{kind}.counts"], z[f"{kind}.glob"]
        return self


# ---- token-to-expert: neural predictors ---------------------------------------------------------


class FFNPredictor(nn.Module):
    """Appendix B FFN: Linear(H,128) -> ReLU -> one Linear(128,K) head per MoE layer."""

    def __init__(self, hidden: int, num_experts: int, num_layers: int, width: int = 128):
        super().__init__()
        self.proj = nn.Linear(hidden, width)
        self.heads = nn.ModuleList([nn.Linear(width, num_experts) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B,T,H] -> logits [B,T,L,K]."""
        h = torch.relu(self.proj(x))
        return torch.stack([head(h) for head in self.heads], dim=-2)


class LSTMPredictor(nn.Module):
    """Appendix B LSTM with sparse attention (small: 128 compressed, 2-layer LSTM of 64)."""

    def __init__(self, hidden: int, num_experts: int, num_layers: int, width: int = 128, lstm: int = 64, attn_topk: int = 8):
        super().__init__()
        self.attn_topk = attn_topk
        self.proj = nn.Linear(hidden, width)
        self.lstm = nn.LSTM(width, lstm, num_layers=2, batch_first=True)
        self.ff = nn.Linear(width, lstm)
        self.heads = nn.ModuleList([nn.Linear(lstm, num_experts) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B,T,H], mask [B,T] (True = real token) -> logits [B,T,L,K]."""
        c = torch.relu(self.proj(x))  # [B,T,128]
        o, _ = self.lstm(c)  # [B,T,64]
        T = o.shape[1]
        s = o @ o.transpose(1, 2) / math.sqrt(o.shape[-1])  # [B,T,T]
        allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if mask is not None:
            allowed = allowed & mask[:, None, :]
        s = s.masked_fill(~allowed, float("-inf"))
        m = min(self.attn_topk, T)
        kth = s.topk(m, dim=-1).values[..., -1:]  # sparse: keep each query's m largest scores
        s = s.masked_fill(s < kth, float("-inf"))
        a = torch.softmax(s, dim=-1).nan_to_num(0.0) @ o  # [B,T,64]
        h = a + self.ff(c)
        return torch.stack([head(h) for head in self.heads], dim=-2)


def sequences(prompt_id: np.ndarray, position: np.ndarray, max_len: int) -> list[np.ndarray]:
    """Row indices of each prompt in position order, cut into pieces of at most max_len."""
    out: list[np.ndarray] = []
    order = np.lexsort((position, prompt_id))
    pid = prompt_id[order]
    starts = np.flatnonzero(np.r_[True, pid[1:] != pid[:-1]])
    for a, b in zip(starts, np.r_[starts[1:], len(order)]):
        rows = order[a:b]
        out.extend(rows[s : s + max_len] for s in range(0, len(rows), max_len))
    return out


def _pad(seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    T = max(len(s) for s in seqs)
    rows = np.zeros((len(seqs), T), np.int64)
    mask = np.zeros((len(seqs), T), bool)
    for i, s in enumerate(seqs):
        rows[i, : len(s)], mask[i, : len(s)] = s, True
    return rows, mask


def train_net(
    net: nn.Module,
    emb: torch.Tensor,
    token_id: np.ndarray,
    seqs: list[np.ndarray],
    targets: torch.Tensor,
    *,
    steps: int,
    lr: float,
    batch: int,
    seed: int,
) -> list[float]:
    """Cross-entropy (soft targets [N,L,K]) + Adam over padded sequences; the loss curve."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    tok = torch.from_numpy(token_id)
    losses = []
    net.train()
    for _ in range(steps):
        pick = rng.choice(len(seqs), size=min(batch, len(seqs)), replace=False)
        rows, mask = _pad([seqs[i] for i in pick])
        r, m = torch.from_numpy(rows), torch.from_numpy(mask)
        logits = net(emb[tok[r]], m)  # [B,T,L,K]
        logp = torch.log_softmax(logits, -1)[m]  # [n,L,K]
        loss = -(targets[r[m]] * logp).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    net.eval()
    return losses


def soft_targets(ids: dict[int, np.ndarray], layers: list[int], num_experts: int) -> torch.Tensor:
    """[N,L,K]: the routed experts, slot j weighted (k - j) / (k (k+1) / 2) so the first choice leads."""
    N, k = ids[layers[0]].shape
    w = torch.arange(k, 0, -1, dtype=torch.float32) / (k * (k + 1) / 2)
    t = torch.zeros(N, len(layers), num_experts)
    for j, l in enumerate(layers):
        t[torch.arange(N)[:, None], j, torch.from_numpy(ids[l].astype(np.int64))] = w
    return t


@torch.no_grad()
def net_scores(net: nn.Module, emb: torch.Tensor, token_id: np.ndarray, seqs: list[np.ndarray], n: int) -> np.ndarray:
    """[n, L, K] logits for every row (each sequence run alone, as at prefill)."""
    out: np.ndarray | None = None
    tok = torch.from_numpy(token_id)
    for s in seqs:
        r = torch.from_numpy(s)
        y = net(emb[tok[r]][None])[0].numpy()
        if out is None:
            out = np.zeros((n, *y.shape[1:]), np.float32)
        out[s] = y
    assert out is not None
    return out
