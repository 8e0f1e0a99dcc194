"""Routing policies: an optional additive bias on a layer's router selection scores.

An extension point: today it holds one policy, `standard` (no bias: the router's own choice). The
runtime engine already applies any bias a policy returns (it re-selects with `adapter.select(layer,
logits, bias)`, which is lossy); the simulator replays recorded routing and ignores routing policies.
Cache-aware routing (SpecMD eq. 1, Skliar et al.) is planned and registers here under its own name.

| name | bias | exact |
|---|---|---|
| standard | none: the router's own choice (SpecMD "Standard") | yes |
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from .base import ROUTING, ExpertKey


@ROUTING.register
class Standard:
    """Unmodified routing: `bias` is always None."""

    name: ClassVar[str] = "standard"
    exact: ClassVar[bool] = True

    def bias(self, layer: int, num_experts: int, resident: Callable[[ExpertKey], bool]) -> torch.Tensor | None:
        return None
