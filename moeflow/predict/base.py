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

import numpy as np
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


class Runner(Protocol):
    """A predictor's run-time path (`moeflow.predict.fast`: `ChainRunner`, `EstimatorRunner`, `HybridRunner`,
    `ForestRunner`), what a learned prefetch policy calls per decode step; `Predictor.runner()` makes one."""

    def warm(self) -> Runner:
        """Compile (or load from numba's cache) the kernels a decode step calls, now rather than in the first step."""
        ...

    def precompute(self, horizon: int) -> Runner:
        """Stack the per-(layer, S) arrays for every S up to `horizon`."""
        ...

    def scores(self, batch: SourceBatch, steps: int) -> np.ndarray:
        """Scores [steps,T,E] of the next `steps` MoE layers from `batch`'s source layer."""
        ...

    def requests(
        self, batch: SourceBatch, steps: int, m: int, targets: np.ndarray, k: float, ib: np.ndarray, fb: np.ndarray
    ) -> int | None:
        """A decode step's requests written into ib [2,>=S*m] (target, expert) and fb [2,>=S*m] (priority,
        confidence) in one compiled call, their count returned; None when this call does not run compiled."""
        ...


PREDICTORS = Registry("predictor", what="predictor")
