"""The MoE part of a transformers model: spec, per-architecture adapters, hooks, expert sets."""

from .adapters import SUPPORTED, Adapter, get_adapter, model_fingerprint, spec_from_config
from .hooks import RouterEvent, RouterTap, residual_hooks, residual_norm, router_hooks
from .spec import MoESpec

__all__ = [
    "SUPPORTED",
    "Adapter",
    "MoESpec",
    "RouterEvent",
    "RouterTap",
    "get_adapter",
    "model_fingerprint",
    "residual_hooks",
    "residual_norm",
    "router_hooks",
    "spec_from_config",
]
