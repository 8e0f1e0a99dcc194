"""The neural estimator (Speculating Experts, section 6.1 + appendix A) and Hybrid-PF (section 6.3).

Estimator: features x -> standardise -> linear projection A (F->m) + a learned embedding of the
(source layer, S) pair (the paper's "positional embedding" of layer l; with S > 1 one embedding per
pair) -> `blocks` x [z + C(SiLU(B z))] (B: m->n, C: n->m, residual) -> LayerNorm(m) -> head (m->E)
= router logits of the target layer. The paper feeds q alone; here x also carries what is known at
the source layer and what the token-id baseline shows to be predictive at every S:

    x = [ q_S       [H]  the quasi-hidden state chained S steps (`default_vectors.QuasiHidden`; S=1: q_l),
          u_l       [H]  the source layer's router input (its normed hidden state),
          e_t, e_t-1 [cH] the model's own input embeddings of the last `context` tokens (0 = none),
          g         [L*E] the gate weights of the experts each MoE layer up to the source chose
                          (scattered per layer; later layers 0) ]

so F = (2 + context) H + L E (`feature_dim`). Trained by distillation, KL(router probs ||
softmax(logits)) on the traced router probabilities of the target layer, plus `bce` x a multi-label
binary cross-entropy against the routed top-k set (what recall@k scores), AdamW with a one-cycle
learning-rate schedule. The standardisation (mean / std per feature of the training set) is part of
the saved network.

Hybrid-PF: Router-PF everywhere, except on the (layer, S) pairs where Router-PF's recall on a
validation part of the training prompts is below a threshold; the threshold is the one that
maximises mean validation recall of the mix (so it is chosen on the training split only).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ArtifactError
from ..moe.sets import recall_at_k
from .base import PREDICTORS
from .data import RoutingData, SourceBatch, batch_from_rows, iter_chunks, target_of
from .default_vectors import QuasiHidden, RouterPF, compute_default_vectors, load_dvec, save_dvec

FEATURES_VERSION = 2  # config.json "features": 1 = q only (older folders, refused with a message)


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
        z = self.A((x - self.mu) / self.sd) + self.pos(pair)  # [T,m]
        for B, C in zip(self.B, self.C):
            z = z + C(F.silu(B(z)))  # [T,m]
        return self.head(self.norm(z))  # [T,E] logits


def _hidden(data: RoutingData, layer: int) -> np.ndarray:
    h = data.layers[layer].hidden_in
    if h is None:
        raise ArtifactError("the estimator needs traced router inputs; re-run `moeflow trace --record-hidden`")
    return h


def _recall(scores: torch.Tensor, truth: torch.Tensor) -> float:
    """recall@k of the top-k scores [T,E] against the routed experts truth [T,k]."""
    return recall_at_k(torch.topk(scores, truth.shape[1], -1).indices, truth)


class _Features:
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


@PREDICTORS.register
class Estimator:
    name: ClassVar[str] = "estimator"
    needs_hidden: ClassVar[bool] = True

    def __init__(
        self,
        model: torch.nn.Module,
        max_lookahead: int = 4,
        m: int = 128,
        n: int = 256,
        blocks: int = 1,
        context: int = 2,
    ):
        self.model = model
        self.max_lookahead = max_lookahead
        self.m, self.n, self.blocks, self.context = m, n, blocks, context
        self.qh: QuasiHidden | None = None
        self.feat: _Features | None = None
        self.pairs: list[tuple[int, int]] = []  # (source layer, S) -> embedding row
        self.net: EstimatorNet | None = None
        self.history: list[dict[str, float]] = []
        self.fit_seconds = 0.0

    @classmethod
    def create(cls, model: torch.nn.Module, cfg: Any) -> Estimator:
        return cls(model, cfg.max_s, cfg.est_latent, cfg.est_hidden, cfg.est_blocks, cfg.est_context)

    def _pair(self, source: int, s: int) -> int:
        return self.pairs.index((source, s))

    @torch.no_grad()
    def _components(self, data: RoutingData, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Per-row inputs of all pairs for `rows` (built into features per mini-batch, see `_batch`)."""
        assert self.qh is not None and self.feat is not None
        ml = list(data.spec.moe_layers)
        ctx = data.context(max(1, self.context))[rows]
        qs: list[torch.Tensor] = []
        by_src: dict[int, list[torch.Tensor]] = {}
        for src in ml:
            smax = max([s for (l, s) in self.pairs if l == src], default=0)
            if smax == 0:
                continue
            parts: list[list[torch.Tensor]] = [[] for _ in range(smax)]
            for sl in iter_chunks(len(rows), 4096):
                b = batch_from_rows(data, src, rows[sl])
                for j, q in enumerate(self.qh.chain(b, smax)):
                    parts[j].append(q.half())
            by_src[src] = [torch.cat(p) for p in parts]
        for src, s in self.pairs:
            qs.append(by_src[src][s - 1])
        return {
            "q": torch.stack(qs),  # [P,N,H] f16
            "u": torch.stack([torch.from_numpy(_hidden(data, l)[rows]) for l in ml]),  # [L,N,H] f16
            "ids": torch.stack([torch.from_numpy(data.layers[l].topk_ids[rows]) for l in ml], 1),  # [N,L,k]
            "w": torch.stack([torch.from_numpy(data.layers[l].topk_weights[rows]) for l in ml], 1),  # [N,L,k]
            "tok": self.feat.tokens(torch.from_numpy(ctx), len(rows)).half(),  # [N,cH]
            "src_rank": torch.tensor([ml.index(l) for l, _ in self.pairs]),  # [P]
            "tgt_rank": torch.tensor([ml.index(target_of(data.spec, l, s)) for l, s in self.pairs]),  # [P]
        }

    def _batch(self, c: dict[str, torch.Tensor], p: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        """Features [B,F] of samples (pair p, row i); history weights: 1 for earlier layers, g at the source."""
        assert self.feat is not None
        r = c["src_rank"][p]
        w = torch.ones_like(c["w"][i])
        own = torch.arange(w.shape[1])[None, :] == r[:, None]
        w = torch.where(own[..., None], c["w"][i], w)
        g = self.feat.gates(c["ids"][i], w, r)
        return _Features.assemble(c["q"][p, i], c["u"][r, i], c["tok"][i].float(), g)

    def fit(
        self,
        data: RoutingData,
        model: torch.nn.Module,
        cfg: Any,
        dvec: dict[int, torch.Tensor] | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        t0 = time.perf_counter()
        dvec = dvec if dvec is not None else compute_default_vectors(model, data, max_tokens=cfg.dv_max_tokens)
        self.qh = QuasiHidden(model, dvec)
        self.feat = _Features(model, data.spec, self.context)
        self.max_lookahead = cfg.max_s
        self.pairs = data.rank_pairs(cfg.max_s)
        spec = data.spec
        ml = list(spec.moe_layers)
        rng = np.random.default_rng(cfg.seed)
        rows = np.arange(data.n)
        per_row = max(1, cfg.est_max_samples // max(1, len(self.pairs)))  # samples = rows x pairs
        if len(rows) > min(cfg.est_max_tokens, per_row):
            rows = np.sort(rng.choice(rows, min(cfg.est_max_tokens, per_row), replace=False))
        c = self._components(data, rows)
        probs = torch.stack([torch.from_numpy(data.layers[l].probs[rows]) for l in ml])  # [L,N,E] f16
        N, P = len(rows), len(self.pairs)
        torch.manual_seed(cfg.seed)
        self.net = EstimatorNet(self.feat.dim, spec.num_experts, P, self.m, self.n, self.blocks)
        with torch.no_grad():  # feature standardisation from a sample of the training set
            idx = torch.randperm(P * N)[:20000]
            x = self._batch(c, idx // N, idx % N)
            self.net.mu.copy_(x.mean(0))
            self.net.sd.copy_(x.std(0).clamp(min=1e-3))
        opt = torch.optim.AdamW(self.net.parameters(), lr=cfg.est_lr, weight_decay=cfg.est_weight_decay)
        per_epoch = (P * N + cfg.est_batch - 1) // cfg.est_batch
        epochs = max(cfg.est_epochs, -(-cfg.est_min_steps // per_epoch))  # small traces: at least est_min_steps
        steps = epochs * per_epoch
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.est_lr, total_steps=max(1, steps), pct_start=0.1)
        self.net.train()
        done = 0
        for ep in range(epochs):
            perm = torch.randperm(P * N)
            tot = 0.0
            for i in range(0, P * N, cfg.est_batch):
                j = perm[i : i + cfg.est_batch]
                p_, r_ = j // N, j % N
                tgt = c["tgt_rank"][p_]
                y = probs[tgt, r_].float().clamp(min=1e-6)
                y = y / y.sum(-1, keepdim=True)
                logits = self.net(self._batch(c, p_, r_), p_)
                loss = F.kl_div(F.log_softmax(logits, -1), y, reduction="batchmean")
                if cfg.est_bce > 0:
                    hot = torch.zeros_like(logits).scatter(-1, c["ids"][r_, tgt], 1.0)
                    loss = loss + cfg.est_bce * F.binary_cross_entropy_with_logits(logits, hot) * spec.num_experts / spec.top_k
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                tot += loss.item() * len(j)
                done += 1
                if progress is not None:
                    progress(done / max(1, steps))
            self.history.append({"epoch": ep + 1, "loss": tot / (P * N)})
        self.net.eval()
        self.fit_seconds = time.perf_counter() - t0

    def features(self, lookahead: int, batch: SourceBatch) -> torch.Tensor:
        """The estimator's input x [T, feature_dim] for `batch` and step `lookahead`."""
        assert self.qh is not None and self.feat is not None, "fit or load first"
        q = self.qh.chain(batch, lookahead)[-1].float()  # [T,H]
        return self.feat.of_batch(q, batch)

    @property
    def feature_dim(self) -> int:
        assert self.feat is not None, "fit or load first"
        return self.feat.dim

    @torch.no_grad()
    def predict(self, target_layer: int, lookahead: int, batch: SourceBatch) -> torch.Tensor:
        assert self.net is not None, "fit or load first"
        x = self.features(lookahead, batch)
        pair = torch.full((len(x),), self._pair(batch.layer, lookahead), dtype=torch.long)
        return torch.softmax(self.net(x, pair), -1)  # [T,E]

    def save(self, folder: Path) -> None:
        assert self.net is not None and self.qh is not None, "fit first"
        save_dvec(folder, self.qh.dvec)
        torch.save(self.net.state_dict(), folder / "estimator.pt")
        params = sum(int(p.numel()) for p in self.net.parameters())
        (folder / "config.json").write_text(
            json.dumps(
                {
                    "features": FEATURES_VERSION,
                    "max_lookahead": self.max_lookahead,
                    "m": self.m,
                    "n": self.n,
                    "blocks": self.blocks,
                    "context": self.context,
                    "pairs": self.pairs,
                    "history": self.history,
                    "params": params,
                    "fit_seconds": self.fit_seconds,
                }
            )
        )

    @classmethod
    def load(cls, folder: Path, model: torch.nn.Module) -> Estimator:
        from .io import artifact_file, load_tensors, read_json_file

        c = read_json_file(folder / "config.json")
        if int(c.get("features", 1)) != FEATURES_VERSION:
            raise ArtifactError(
                f"{folder} holds an estimator with input features v{c.get('features', 1)}; this moeflow needs "
                f"v{FEATURES_VERSION}: re-run `moeflow train`"
            )
        with artifact_file(folder / "config.json"):
            self = cls(model, int(c["max_lookahead"]), int(c["m"]), int(c["n"]), int(c["blocks"]), int(c["context"]))
            self.pairs = [(int(l), int(s)) for l, s in c["pairs"]]
            self.history = list(c.get("history", []))
            self.fit_seconds = float(c.get("fit_seconds", 0.0))
        self.qh = QuasiHidden(model, load_dvec(folder, model))
        spec = self.qh.spec
        self.feat = _Features(model, spec, self.context)
        self.net = EstimatorNet(self.feat.dim, spec.num_experts, len(self.pairs), self.m, self.n, self.blocks)
        state = load_tensors(folder / "estimator.pt")
        with artifact_file(folder / "estimator.pt"):
            self.net.load_state_dict(state)  # a wrong key or shape is refused too
        self.net.eval()
        return self


@PREDICTORS.register
class Hybrid:
    name: ClassVar[str] = "hybrid"
    needs_hidden: ClassVar[bool] = True

    def __init__(self, model: torch.nn.Module, max_lookahead: int = 4):
        self.model = model
        self.max_lookahead = max_lookahead
        self.router_pf: RouterPF | None = None
        self.estimator: Estimator | None = None
        self.threshold = 0.0
        self.use_estimator: set[tuple[int, int]] = set()
        self.val: dict[str, dict[str, float]] = {}

    @classmethod
    def create(cls, model: torch.nn.Module, cfg: Any) -> Hybrid:
        return cls(model, cfg.max_s)

    def fit(
        self,
        data: RoutingData,
        model: torch.nn.Module,
        cfg: Any,
        dvec: dict[int, torch.Tensor] | None = None,
        estimator: Estimator | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        """Fits an estimator on part of the training prompts (or reuses `estimator` if it was fitted
        on `fit_part`) and picks the threshold on the rest."""
        fit_part, val = data.split(cfg.hybrid_val, cfg.seed + 1)
        dvec = dvec if dvec is not None else compute_default_vectors(model, data, max_tokens=cfg.dv_max_tokens)
        self.router_pf = RouterPF(model, dvec, cfg.max_s)
        self.estimator = Estimator.create(model, cfg)
        self.estimator.fit(fit_part, model, cfg, dvec=dvec, progress=progress)
        self.max_lookahead = cfg.max_s
        rec: dict[tuple[int, int], tuple[float, float]] = {}
        val_ctx = val.context(max(1, self.estimator.context))
        for src, s in data.rank_pairs(cfg.max_s):
            tgt = target_of(data.spec, src, s)
            b = batch_from_rows(val, src, np.arange(val.n), ctx=val_ctx)
            truth = torch.from_numpy(val.layers[tgt].topk_ids)
            rec[(src, s)] = (_recall(self.router_pf.predict(tgt, s, b), truth), _recall(self.estimator.predict(tgt, s, b), truth))
        best = (-1.0, 0.0)
        for thr in [*sorted({0.0, *[r for r, _ in rec.values()]}), 1.01]:
            mean = float(np.mean([e if r < thr else r for r, e in rec.values()]))
            if mean > best[0] + 1e-9:
                best = (mean, thr)
        self.threshold = best[1]
        self.use_estimator = {p for p, (r, _) in rec.items() if r < self.threshold}
        self.val = {f"{l}+{s}": {"router_pf": r, "estimator": e} for (l, s), (r, e) in rec.items()}

    def predict(self, target_layer: int, lookahead: int, batch: SourceBatch) -> torch.Tensor:
        assert self.estimator is not None and self.router_pf is not None, "fit or load first"
        if (batch.layer, lookahead) in self.use_estimator:
            return self.estimator.predict(target_layer, lookahead, batch)
        return self.router_pf.predict(target_layer, lookahead, batch)

    def save(self, folder: Path) -> None:
        assert self.estimator is not None, "fit first"
        self.estimator.save(folder)
        (folder / "hybrid.json").write_text(
            json.dumps(
                {
                    "threshold": self.threshold,
                    "use_estimator": sorted(self.use_estimator),
                    "validation_recall": self.val,
                    "max_lookahead": self.max_lookahead,
                }
            )
        )

    @classmethod
    def load(cls, folder: Path, model: torch.nn.Module) -> Hybrid:
        from .io import artifact_file, read_json_file

        c = read_json_file(folder / "hybrid.json")
        self = cls(model)
        self.estimator = Estimator.load(folder, model)
        assert self.estimator.qh is not None
        with artifact_file(folder / "hybrid.json"):
            self.max_lookahead = int(c["max_lookahead"])
            self.router_pf = RouterPF(model, self.estimator.qh.dvec, self.max_lookahead)
            self.threshold = float(c["threshold"])
            self.use_estimator = {(int(l), int(s)) for l, s in c["use_estimator"]}
            self.val = dict(c["validation_recall"])
        return self
