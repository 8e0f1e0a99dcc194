"""Routing traces: router hooks -> per-token records -> Arrow shards (`writer.py`), the `Trace`
reader (`reader.py`), routing statistics (`summary.py`) and the `moeflow trace` stage (`run.py`)."""

from .config import TraceConfig
from .format import SCHEMA
from .reader import Trace
from .run import main, run_trace
from .summary import layer_stats, trace_summary
from .writer import RoutingRecorder, TraceWriter

__all__ = [
    "SCHEMA",
    "RoutingRecorder",
    "Trace",
    "TraceConfig",
    "TraceWriter",
    "layer_stats",
    "main",
    "run_trace",
    "trace_summary",
]
