"""Model hooks, one implementation each: router outputs and post-attention residuals, reversibly.

- `router_hooks(adapter, callback)`: a forward hook on every MoE layer's router. It sees the router
  input (the post-attention-norm hidden state) as `args[0]` and `(logits, weights, indices)` as its
  output; the callback gets a `RouterEvent` and may return a replacement `(logits, weights, indices)`.
  Tracing, the offload engine, speculative routing, the simulator's recorder and the model card use it.
- `residual_hooks(adapter, callback)`: a forward pre-hook on every MoE layer's
  `post_attention_layernorm`; its input is the post-attention residual r_l (h + attn(...)), so
  `post_attention_layernorm(r_l)` is the router input. Tracing (`--record-hidden`), the engine
  (learned prefetchers) and speculative routing use it.
- `RouterTap`: collects router events per MoE layer over one or more forward passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .adapters import Adapter


@dataclass
class RouterEvent:
    layer: int  # decoder-layer index
    x: torch.Tensor  # router input [T,H] (detached)
    logits: torch.Tensor  # [T,E]
    weights: torch.Tensor  # [T,k]
    indices: torch.Tensor  # [T,k]


RouterCallback = Callable[[RouterEvent], "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None"]
ResidualCallback = Callable[[int, torch.Tensor], None]


def _detached(t: torch.Tensor) -> torch.Tensor:
    """`t` without autograd history: itself when it has none (inference: no op per call)."""
    return t.detach() if t.requires_grad else t


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = _detached(t)
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])  # [T,H]


@contextlib.contextmanager
def router_hooks(adapter: Adapter, callback: RouterCallback, *, prepend: bool = False) -> Iterator[None]:
    """Call `callback(event)` after every router forward of every MoE layer; remove hooks on exit.

    If the callback returns a `(logits, weights, indices)` tuple it replaces the router's output.
    `prepend=True` runs it before hooks registered earlier (so they see the replacement).
    """
    handles = []

    def make(layer: int):
        def hook(module: nn.Module, args, output):
            logits, weights, indices = output
            return callback(RouterEvent(layer, _rows(args[0]), _detached(logits), _detached(weights), _detached(indices)))

        return hook

    try:
        for l in adapter.moe_layers:
            handles.append(adapter.router(l).register_forward_hook(make(l), prepend=prepend))
        yield
    finally:
        for h in handles:
            h.remove()


def residual_norm(adapter: Adapter, layer: int, *, hint: str = "") -> nn.Module:
    """The norm between the post-attention residual and the router of decoder layer `layer`.

    In the pre-norm decoders supported here the router reads `post_attention_layernorm(r)` with
    r = h + attn(input_layernorm(h)). A layer without it raises `UnsupportedModelError` (+ `hint`).
    """
    norm = getattr(adapter.layers[layer], "post_attention_layernorm", None)
    if norm is None:
        raise UnsupportedModelError(
            f"{adapter.spec.arch} layer {layer} has no post_attention_layernorm (the "
            f"post-attention residual is not observable){'; ' + hint if hint else ''}"
        )
    return norm


@contextlib.contextmanager
def residual_hooks(adapter: Adapter, callback: ResidualCallback, *, hint: str | None = "") -> Iterator[None]:
    """Call `callback(layer, r [T,H])` with the post-attention residual of every MoE layer; remove hooks on exit.

    A layer without `post_attention_layernorm` raises `UnsupportedModelError` (ending in `hint`), or is
    skipped when `hint` is None.
    """
    handles = []

    def make(layer: int):
        def hook(module: nn.Module, args):
            callback(layer, _rows(args[0]))

        return hook

    try:
        for l in adapter.moe_layers:
            if hint is None and getattr(adapter.layers[l], "post_attention_layernorm", None) is None:
                continue
            handles.append(residual_norm(adapter, l, hint=hint or "").register_forward_pre_hook(make(l)))
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
    def attach(self) -> Iterator[RouterTap]:
        with router_hooks(self.adapter, self):
            yield self

    def clear(self) -> None:
        self.events.clear()
