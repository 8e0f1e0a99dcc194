"""Trace-driven cache simulator: the same policy objects and events as the runtime, plus Belady's bound."""

from .access import AccessTrace, LayerStep, Pass, from_trace, record_generate, synthetic
from .belady import Belady
from .simulator import SimStats, belady, simulate

__all__ = [
    "AccessTrace",
    "Belady",
    "LayerStep",
    "Pass",
    "SimStats",
    "belady",
    "from_trace",
    "record_generate",
    "simulate",
    "synthetic",
]
