"""Pre-gate predictor (`pregate`): the router of layer l+S applied to layer l's router input (any S).

The parameter-free baseline of ExpertFlow and Speculating Experts: it needs the routers only,
so `fit` and `save` store nothing but S's range. The run-time prefetch policy of the same idea is
`moeflow.policies.prefetch.PreGatePrefetch`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..moe import get_adapter
from .base import PREDICTORS
from .data import RoutingData, SourceBatch


@PREDICTORS.register
class PreGatePredictor:
    name: ClassVar[str] = "pregate"
    needs_hidden: ClassVar[bool] = True  # it reads the traced router input

    def __init__(self, model: torch.nn.Module, max_lookahead: int = 4):
        self.adapter = get_adapter(model)
        self.max_lookahead = max_lookahead

    @classmethod
    def create(cls, model: torch.nn.Module, cfg: Any) -> PreGatePredictor:
        return cls(model, cfg.max_s)

    def fit(self, data: RoutingData, model: torch.nn.Module, cfg: Any) -> None:
        self.max_lookahead = cfg.max_s

    @torch.no_grad()
    def predict(self, target_layer: int, lookahead: int, batch: SourceBatch) -> torch.Tensor:
        logits = batch.router_logits(self.adapter, target_layer, batch.router_input)  # [T,E]
        return torch.softmax(logits.float(), -1)

    def save(self, folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps({"max_lookahead": self.max_lookahead}))

    @classmethod
    def load(cls, folder: Path, model: torch.nn.Module) -> PreGatePredictor:
        return cls(model, json.loads((folder / "config.json").read_text())["max_lookahead"])
