"""moeflow's experts implementations in transformers' experts interface: one check, one registration, one tag.

An owner (the offload engine `moeflow`, expert-parallel execution `moeflow-ep`) has
`experts_forward(module, layer, hidden [T,H], top_k_index [T,k], top_k_weights [T,k]) -> [T,H]`.
`use_experts_impl(model, adapter, name, owner)` registers `name` in transformers' registry (through
`moeflow.moe.tx_compat`), tags every MoE layer's experts module with the owner, its layer and `name`
(attributes on the module instance; no global holds an owner), switches the model to `name`, and on exit
restores the previous implementation and removes the tags. The registered function dispatches a call to
the module's owner.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import ConfigError
from . import tx_compat

OWNER, LAYER, IMPL = "_moeflow_owner", "_moeflow_layer", "_moeflow_impl"  # the tags on an experts module


class ExpertsOwner(Protocol):
    def experts_forward(
        self, module: nn.Module, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor: ...


def check_replaceable(model: nn.Module, adapter: Any, name: str, what: str) -> None:
    """Refuse a model not on `grouped_mm` (or `name`) and a transformers without the internals the compute uses."""
    impl = getattr(model.config, "_experts_implementation", None)
    if impl not in ("grouped_mm", name):
        raise ConfigError(
            f"{what} replaces the 'grouped_mm' experts implementation, the model uses "
            f"{impl!r}; load it with experts_implementation='grouped_mm'"
        )
    tx_compat.check()
    for l in adapter.moe_layers:
        tx_compat.check_experts_module(adapter.experts(l))


@functools.cache
def dispatcher(name: str) -> Callable[..., torch.Tensor]:
    """The function registered as `name`: the call goes to the experts module's owner (one per name)."""

    def experts_forward(
        module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        owner = module.__dict__.get(OWNER)
        if owner is None or module.__dict__.get(IMPL) != name:
            raise RuntimeError(f"experts implementation {name!r} used on a module nothing is attached to")
        return owner.experts_forward(module, module.__dict__[LAYER], hidden_states, top_k_index, top_k_weights)

    experts_forward.__qualname__ = f"experts_forward[{name}]"
    return experts_forward


def register_experts_impl(name: str) -> None:
    """Idempotent: `name` in transformers' experts implementations (`model.set_experts_implementation(name)`)."""
    tx_compat.register_experts(name, dispatcher(name))


def tag(module: nn.Module, owner: ExpertsOwner, layer: int, name: str) -> None:
    """Route `module`'s experts calls under implementation `name` to `owner` as MoE layer `layer`."""
    module.__dict__.update({OWNER: owner, LAYER: layer, IMPL: name})  # plain attributes, not submodules


def untag(module: nn.Module) -> None:
    for a in (OWNER, LAYER, IMPL):
        module.__dict__.pop(a, None)


@contextlib.contextmanager
def use_experts_impl(model: Any, adapter: Any, name: str, owner: ExpertsOwner) -> Iterator[None]:
    """Tag every MoE layer's experts module with `owner`, register `name` and switch `model` to it; undo on exit."""
    with contextlib.ExitStack() as stack:
        for l in adapter.moe_layers:
            ex = adapter.experts(l)
            tag(ex, owner, l, name)
            stack.callback(untag, ex)
        register_experts_impl(name)
        prev = model.config._experts_implementation
        model.set_experts_implementation(name)
        stack.callback(model.set_experts_implementation, prev)
        yield
