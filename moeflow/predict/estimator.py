"""The neural estimator (Speculating Experts, section 6.1 + appendix A) and Hybrid-PF (section 6.3).

Estimator: quasi-hidden state q [H] -> linear projection A (H->m) + a learned embedding of the
(source layer, S) pair (the paper's "positional embedding" of layer l; with S > 1 one embedding per
pair) -> z + C(SiLU(B z)) (B: m->n, C: n->m, residual) -> LayerNorm(m) -> head (m->E) = router logits
of the target layer. Trained by distillation: KL(router probs || softmax(estimator logits)) on the
traced router probabilities of the target layer. The input for S steps is the chained quasi-hidden
state of `default_vectors.QuasiHidden` (for S = 1 exactly the paper's q_l).

Hybrid-PF: Router-PF everywhere, except on the (layer, S) pairs where Router-PF's recall on a
validation part of the training prompts is below a threshold; the threshold is the one that
maximises mean validation recall of the mix (so it is chosen on the training split only).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..moe.sets import recall_at_k
from .base import PREDICTORS
from .data import RoutingData, SourceBatch, batch_from_rows, iter_chunks, target_of
from .default_vectors import QuasiHidden, RouterPF, compute_default_vectors, load_dvec, save_dvec


class EstimatorNet(nn.Module):
    def __init__(self, hidden: int, num_experts: int, num_pairs: int, m: int = 64, n: int = 128):
        super().__init__()
        self.A = nn.Linear(hidden, m)
        self.pos = nn.Embedding(num_pairs, m)
        self.B = nn.Linear(m, n)
        self.C = nn.Linear(n, m)
        self.norm = nn.LayerNorm(m)
        self.head = nn.Linear(m, num_experts)

    def forward(self, q: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
        z = self.A(q) + self.pos(pair)  # [T,m]
        z = z + self.C(F.silu(self.B(z)))  # [T,m]
        return self.head(self.norm(z))  # [T,E] logits


def _recall(scores: torch.Tensor, truth: torch.Tensor) -> float:
    """recall@k of the top-k scores [T,E] against the routed experts truth [T,k]."""
    return recall_at_k(torch.topk(scores, truth.shape[1], -1).indices, truth)


@PREDICTORS.register
class Estimator:
    name: ClassVar[str] = "estimator"
    needs_hidden: ClassVar[bool] = True

    def __init__(self, model: torch.nn.Module, max_lookahead: int = 4, m: int = 64, n: int = 128):
        self.model = model
        self.max_lookahead = max_lookahead
        self.m, self.n = m, n
        self.qh: QuasiHidden | None = None
        self.pairs: list[tuple[int, int]] = []  # (source layer, S) -> embedding row
        self.net: EstimatorNet | None = None
        self.history: list[dict[str, float]] = []

    @classmethod
    def create(cls, model: torch.nn.Module, cfg: Any) -> Estimator:
        return cls(model, cfg.max_s, cfg.est_latent, cfg.est_hidden)

    def _pair(self, source: int, s: int) -> int:
        return self.pairs.index((source, s))

    @torch.no_grad()
    def _inputs(self, data: RoutingData, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [M,H], pair [M], teacher probs [M,E]) over all pairs for `rows`."""
        qs, ps, ys = [], [], []
        for src in data.spec.moe_layers:
            smax = max([s for (l, s) in self.pairs if l == src], default=0)
            if smax == 0:
                continue
            for sl in iter_chunks(len(rows), 4096):
                b = batch_from_rows(data, src, rows[sl])
                assert self.qh is not None
                chain = self.qh.chain(b, smax)
                for s, q in enumerate(chain, start=1):
                    tgt = target_of(data.spec, src, s)
                    qs.append(q.float())
                    ps.append(torch.full((len(q),), self._pair(src, s), dtype=torch.long))
                    ys.append(torch.from_numpy(data.layers[tgt].probs[rows[sl]]).float())
        return torch.cat(qs), torch.cat(ps), torch.cat(ys)

    def fit(
        self,
        data: RoutingData,
        model: torch.nn.Module,
        cfg: Any,
        dvec: dict[int, torch.Tensor] | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        dvec = dvec if dvec is not None else compute_default_vectors(model, data, max_tokens=cfg.dv_max_tokens)
        self.qh = QuasiHidden(model, dvec)
        self.max_lookahead = cfg.max_s
        self.pairs = data.rank_pairs(cfg.max_s)
        spec = data.spec
        rng = np.random.default_rng(cfg.seed)
        rows = np.arange(data.n)
        if len(rows) > cfg.est_max_tokens:
            rows = np.sort(rng.choice(rows, cfg.est_max_tokens, replace=False))
        q, pair, y = self._inputs(data, rows)
        y = y.clamp(min=1e-6)
        y = y / y.sum(-1, keepdim=True)
        torch.manual_seed(cfg.seed)
        self.net = EstimatorNet(spec.hidden_size, spec.num_experts, len(self.pairs), self.m, self.n)
        opt = torch.optim.AdamW(self.net.parameters(), lr=cfg.est_lr, weight_decay=1e-4)
        per_epoch = (len(q) + cfg.est_batch - 1) // cfg.est_batch
        epochs = max(cfg.est_epochs, -(-cfg.est_min_steps // per_epoch))  # small traces: at least est_min_steps
        steps = epochs * per_epoch
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.est_lr, total_steps=max(1, steps))
        self.net.train()
        done = 0
        for ep in range(epochs):
            perm = torch.randperm(len(q))
            tot = 0.0
            for i in range(0, len(q), cfg.est_batch):
                j = perm[i : i + cfg.est_batch]
                logq = F.log_softmax(self.net(q[j], pair[j]), -1)
                loss = F.kl_div(logq, y[j], reduction="batchmean")
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                tot += loss.item() * len(j)
                done += 1
                if progress is not None:
                    progress(done / max(1, steps))
            self.history.append({"epoch": ep + 1, "kl": tot / len(q)})
        self.net.eval()

    @torch.no_grad()
    def predict(self, target_layer: int, lookahead: int, batch: SourceBatch) -> torch.Tensor:
        assert self.net is not None and self.qh is not None, "fit or load first"
        q = self.qh.chain(batch, lookahead)[-1].float()  # [T,H]
        pair = torch.full((len(q),), self._pair(batch.layer, lookahead), dtype=torch.long)
        return torch.softmax(self.net(q, pair), -1)  # [T,E]

    def save(self, folder: Path) -> None:
        assert self.net is not None and self.qh is not None, "fit first"
        save_dvec(folder, self.qh.dvec)
        torch.save(self.net.state_dict(), folder / "estimator.pt")
        params = sum(int(p.numel()) for p in self.net.parameters())
        (folder / "config.json").write_text(
            json.dumps(
                {
                    "max_lookahead": self.max_lookahead,
                    "m": self.m,
                    "n": self.n,
                    "pairs": self.pairs,
                    "history": self.history,
                    "params": params,
                }
            )
        )

    @classmethod
    def load(cls, folder: Path, model: torch.nn.Module) -> Estimator:
        from .io import artifact_file, load_tensors, read_json_file

        c = read_json_file(folder / "config.json")
        with artifact_file(folder / "config.json"):
            self = cls(model, int(c["max_lookahead"]), int(c["m"]), int(c["n"]))
            self.pairs = [(int(l), int(s)) for l, s in c["pairs"]]
            self.history = list(c.get("history", []))
        self.qh = QuasiHidden(model, load_dvec(folder, model))
        spec = self.qh.spec
        self.net = EstimatorNet(spec.hidden_size, spec.num_experts, len(self.pairs), self.m, self.n)
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
        for src, s in data.rank_pairs(cfg.max_s):
            tgt = target_of(data.spec, src, s)
            b = batch_from_rows(val, src, np.arange(val.n))
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
