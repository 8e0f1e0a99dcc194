"""Hybrid-PF (Speculating Experts, section 6.3): Router-PF everywhere, except on the (layer, S) pairs where
Router-PF's recall on a validation part of the training prompts is below a threshold; the threshold is the one
that maximises mean validation recall of the mix (so it is chosen on the training split only). The estimator it
uses is the one `moeflow train` fits (same validation part), not a second fit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from ..moe.sets import recall_at_k
from .base import PREDICTORS
from .data import RoutingData, SourceBatch, batch_from_rows, split_rows, target_of
from .default_vectors import RouterPF, compute_default_vectors
from .estimator import Estimator


def _recall(scores: torch.Tensor, truth: torch.Tensor) -> float:
    """recall@k of the top-k scores [T,E] against the routed experts truth [T,k]."""
    return recall_at_k(torch.topk(scores, truth.shape[1], -1).indices, truth)


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
        router_pf: RouterPF | None = None,
    ) -> None:
        """Picks the (layer, S) pairs the estimator serves on the validation part of the training prompts
        (`Estimator.fit`'s: `cfg.hybrid_val` of them, seed `cfg.seed + 1`). Reuses `estimator` when it was
        fitted on `data` (its validation prompts are this split's), else fits one; reuses `router_pf` when it
        holds these default vectors."""
        _, val_rows = split_rows(data.prompt_id, cfg.hybrid_val, cfg.seed + 1)  # `Estimator.fit`'s validation prompts
        dvec = dvec if dvec is not None else compute_default_vectors(model, data, max_tokens=cfg.dv_max_tokens)
        if router_pf is None or router_pf.dvec is not dvec or router_pf.max_lookahead < cfg.max_s:
            router_pf = RouterPF(model, dvec, cfg.max_s)
        self.router_pf = router_pf
        vp = np.unique(data.prompt_id[val_rows])
        if (
            estimator is None
            or estimator.val_recall is None
            or estimator.val_prompts is None
            or not np.array_equal(estimator.val_prompts, vp)
            or estimator.max_lookahead < cfg.max_s
        ):
            estimator = Estimator.create(model, cfg)
            estimator.fit(data, model, cfg, dvec=dvec, progress=progress)
        assert estimator.val_recall is not None
        self.estimator = estimator
        self.max_lookahead = cfg.max_s
        rec: dict[tuple[int, int], tuple[float, float]] = {}
        qh = router_pf.qh
        assert qh is not None
        pairs = data.rank_pairs(cfg.max_s)
        for src in sorted({l for l, _ in pairs}):  # Router-PF: one chain per source layer serves every S
            smax = max(s for l, s in pairs if l == src)
            b = batch_from_rows(data, src, val_rows)
            for s, q in enumerate(qh.chain(b, smax), start=1):
                tgt = target_of(data.spec, src, s)
                scores = torch.softmax(b.router_logits(qh.adapter, tgt, q).float(), -1)  # [T,E] = RouterPF.predict
                truth = torch.from_numpy(data.layers[tgt].topk_ids[val_rows])  # [T,k]
                rec[(src, s)] = (_recall(scores, truth), estimator.val_recall[(src, s)])
        best = (-1.0, 0.0)
        for thr in [*sorted({0.0, *[r for r, _ in rec.values()]}), 1.01]:
            mean = float(np.mean([e if r < thr else r for r, e in rec.values()]))
            if mean > best[0] + 1e-9:
                best = (mean, thr)
        self.threshold = best[1]
        self.use_estimator = {p for p, (r, _) in rec.items() if r < self.threshold}
        self.val = {f"{l}+{s}": {"router_pf": r, "estimator": e} for (l, s), (r, e) in rec.items()}

    def delegate(self, layer: int, lookahead: int) -> Estimator | RouterPF:
        """The predictor that serves source layer `layer` at step `lookahead` (what `predict` calls)."""
        assert self.estimator is not None and self.router_pf is not None, "fit or load first"
        return self.estimator if (layer, lookahead) in self.use_estimator else self.router_pf

    def predict(self, target_layer: int, lookahead: int, batch: SourceBatch) -> torch.Tensor:
        assert self.estimator is not None and self.router_pf is not None, "fit or load first"
        if (batch.layer, lookahead) in self.use_estimator:
            return self.estimator.predict(target_layer, lookahead, batch)
        return self.router_pf.predict(target_layer, lookahead, batch)

    def runner(self) -> Any:
        """The run-time path: one chain and one estimator pass per source layer (`fast.HybridRunner`)."""
        from .fast_estimator import HybridRunner

        return HybridRunner(self)

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
