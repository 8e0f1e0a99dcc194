"""Eviction / prefetch / miss / routing policies: small classes behind Protocols, one registry per kind."""

from .base import (EVICTION, MISS, PREFETCH, ROUTING, EvictionPolicy, ExpertKey, LayerContext, MissPolicy, Position,
                   PrefetchPolicy, PrefetchRequest, Registry, RoutingPolicy)

__all__ = ["EVICTION", "MISS", "PREFETCH", "ROUTING", "EvictionPolicy", "ExpertKey", "LayerContext", "MissPolicy",
           "Position", "PrefetchPolicy", "PrefetchRequest", "Registry", "RoutingPolicy"]
