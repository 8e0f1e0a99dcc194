"""Miss policies: what to do with a needed expert that is not resident.

An extension point: today it holds one policy, `fetch`, and both the runtime engine and the simulator
implement only its action (`on_miss` returning anything else is a `ConfigError` there). Lossy
policies (drop, substitute, run on the host, low precision; SpecMD 3.1.2) are planned: each registers
here under its own name, returns its own action string, and the engine / simulator learn that action.

| name | action | exact |
|---|---|---|
| fetch | blocking load, then run the expert (SpecMD "Fetch") | yes |
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
