"""Offloaded MoE inference: host expert store, device expert cache, transfer links, the per-layer engine,
the generate loop and its metrics. `moeflow run` is `moeflow.stages.run.main(RunConfig)`."""

from ..policies.parse import parse_capacity
from .cache import CacheCounters, ExpertCache
from .engine import IMPL_NAME, OffloadEngine, PassStats, register_experts_implementation
from .generate import build_engine, generate_one
from .link import CudaLink, DirectLink, EmulatedLink, Link, make_link, parse_link
from .metrics import RunMetrics, metrics_table
from .store import ExpertLayout, HostExpertStore

__all__ = [
    "IMPL_NAME",
    "CacheCounters",
    "CudaLink",
    "DirectLink",
    "EmulatedLink",
    "ExpertCache",
    "ExpertLayout",
    "HostExpertStore",
    "Link",
    "OffloadEngine",
    "PassStats",
    "RunMetrics",
    "build_engine",
    "generate_one",
    "make_link",
    "metrics_table",
    "parse_capacity",
    "parse_link",
    "register_experts_implementation",
]
