"""Routing traces: router hooks -> per-token records (`record.py`) -> Arrow shards (`writer.py`), the `Trace`
reader (`reader.py`), routing statistics (`summary.py`) (the `moeflow trace` stage is `moeflow.stages.trace`)."""

from .format import SCHEMA
from .reader import Trace
from .record import RoutingRecorder
from .summary import layer_stats, trace_summary
from .writer import TraceWriter

__all__ = [
    "SCHEMA",
    "RoutingRecorder",
    "Trace",
    "TraceWriter",
    "layer_stats",
    "trace_summary",
]
