"""Eviction / prefetch / miss / routing policies: small classes behind Protocols, one registry per kind.

Importing this package registers every built-in policy (`EVICTION.create("lru")`, ...).
"""

from ..registry import DEFAULT_EVICTION
from . import belady_approx, eviction, least_stale, miss, next_use, prefetch, routing  # noqa: F401  (registration side effects)
from .base import (
    EVICTION,
    MISS,
    PREFETCH,
    ROUTING,
    EvictionPolicy,
    ExpertKey,
    LayerContext,
    MissPolicy,
    Position,
    PrefetchPolicy,
    PrefetchRequest,
    Registry,
    RoutingPolicy,
)
from .parse import parse_policy

__all__ = [
    "DEFAULT_EVICTION",
    "EVICTION",
    "MISS",
    "PREFETCH",
    "ROUTING",
    "EvictionPolicy",
    "ExpertKey",
    "LayerContext",
    "MissPolicy",
    "Position",
    "PrefetchPolicy",
    "PrefetchRequest",
    "Registry",
    "RoutingPolicy",
    "parse_policy",
]
from . import learned  # noqa: F401  (router-pf, estimator, hybrid, forest: moeflow train predictors)
