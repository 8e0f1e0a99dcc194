"""Routing policies: an optional additive bias on a layer's router selection scores.

| name | bias | exact |
|---|---|---|
| standard | none: the router's own choice (SpecMD "Standard") | yes |

Cache-aware routing (SpecMD eq. 1, Skliar et al.) registers here under its own name.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch

from .base import ROUTING, ExpertKey


@ROUTING.register
class Standard:
    """Unmodified routing."""

    name: ClassVar[str] = "standard"
    exact: ClassVar[bool] = True

    def bias(self, layer: int, num_experts: int, resident: Callable[[ExpertKey], bool]) -> torch.Tensor | None:
        return None
