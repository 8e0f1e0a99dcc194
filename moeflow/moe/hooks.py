"""Router forward hooks: observe (and optionally replace) routing, reversibly.

A forward hook on a router sees the router input (the post-attention-norm hidden state) as
`args[0]` and `(logits, weights, indices)` as its output. `RouterTap` records them per MoE layer
for one forward pass at a time; it is the common base of tracing, model-card statistics and
prefetch predictors that read the current router input.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from .adapters import Adapter


@dataclass
class RouterEvent:
    layer: int                 # decoder-layer index
    x: torch.Tensor            # router input [T,H] (detached)
    logits: torch.Tensor       # [T,E]
    weights: torch.Tensor      # [T,k]
    indices: torch.Tensor      # [T,k]


RouterCallback = Callable[[RouterEvent], "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None"]


@contextlib.contextmanager
def router_hooks(adapter: Adapter, callback: RouterCallback) -> Iterator[None]:
    """Call `callback(event)` after every router forward of every MoE layer; remove hooks on exit.

    If the callback returns a `(logits, weights, indices)` tuple it replaces the router's output.
    """
    handles = []

    def make(layer: int):
        def hook(module: nn.Module, args, output):
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1])                                   # [T,H]
            logits, weights, indices = output
            return callback(RouterEvent(layer, x, logits.detach(), weights.detach(), indices.detach()))
        return hook

    try:
        for l in adapter.moe_layers:
            handles.append(adapter.router(l).register_forward_hook(make(l)))
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass
class RouterTap:
    """Collects router events of one or more forward passes: `events[layer]` is a list, one per pass."""

    adapter: Adapter
    keep_x: bool = True
    events: dict[int, list[RouterEvent]] = field(default_factory=dict)

    def __call__(self, ev: RouterEvent) -> None:
        if not self.keep_x:
            ev.x = ev.x[:0]
        self.events.setdefault(ev.layer, []).append(ev)
        return None

    @contextlib.contextmanager
    def attach(self) -> Iterator["RouterTap"]:
        with router_hooks(self.adapter, self):
            yield self

    def clear(self) -> None:
        self.events.clear()
