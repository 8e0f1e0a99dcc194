"""The MoE part of a transformers model: spec, per-architecture adapters, router hooks."""

from .adapters import SUPPORTED, Adapter, get_adapter, model_fingerprint, spec_from_config
from .hooks import RouterEvent, RouterTap, router_hooks
from .spec import MoESpec

__all__ = ["SUPPORTED", "Adapter", "MoESpec", "RouterEvent", "RouterTap", "get_adapter", "model_fingerprint",
           "router_hooks", "spec_from_config"]
