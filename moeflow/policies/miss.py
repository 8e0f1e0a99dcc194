"""Miss policies: what to do with a needed expert that is not resident.

| name | action | exact |
|---|---|---|
| fetch | blocking load, then run the expert (SpecMD "Fetch") | yes |

Lossy policies (drop, substitute, run on host, low precision) register here under their own names.
"""

from __future__ import annotations

from typing import ClassVar

from .base import MISS, ExpertKey, Position


@MISS.register
class Fetch:
    """Load the missing expert and wait for it: the layer's output is exactly the model's."""

    name: ClassVar[str] = "fetch"
    exact: ClassVar[bool] = True

    def on_miss(self, key: ExpertKey, pos: Position) -> str:
        return "fetch"
