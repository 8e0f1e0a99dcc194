"""The predictor Protocol and registry.

A predictor scores the experts of a *target* MoE layer from what is known at a *source* layer
`lookahead` MoE layers earlier (`SourceBatch`: router input, residual, chosen experts, token ids,
earlier layers' experts). Scores are [T,E], non-negative, one row per token; higher = more likely.
The same `predict` serves offline evaluation (batches built from traced rows) and the run-time
prefetch policies (batches built from a `LayerContext`).

Every predictor is fitted on a `RoutingData` (a trace in memory), saves itself into its own
sub-folder of the predictor folder (`moeflow.predict.io`), and is loaded against a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from ..registry import Registry
from .data import RoutingData, SourceBatch


@runtime_checkable
class Predictor(Protocol):
    name: ClassVar[str]
    needs_hidden: ClassVar[bool]  # needs traced hidden states (`moeflow trace --record-hidden`)
    max_lookahead: int  # largest S it was fitted for

    def fit(self, data: RoutingData, model: torch.nn.Module, cfg: Any) -> None: ...

    def predict(self, target_layer: int, lookahead: int, batch: SourceBatch) -> torch.Tensor:
        """Scores [T,E] for the experts of `target_layer`, from `batch` at `lookahead` MoE layers before it."""
        ...

    def save(self, folder: Path) -> None: ...

    @classmethod
    def load(cls, folder: Path, model: torch.nn.Module) -> Predictor: ...


PREDICTORS = Registry("predictor", what="predictor")
