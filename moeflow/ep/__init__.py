"""Expert-parallel execution: the routed experts of each MoE layer partitioned across torch.distributed ranks.

- `placement`: which rank(s) hold each expert (`{"layer": {"expert": [ranks]}}` JSON, duplication allowed);
- `engine`: `ExpertParallel`, the `moeflow-ep` experts implementation (all_to_all dispatch / combine);
- `moeflow.stages.ep`: `moeflow ep` (spawned gloo/NCCL workers, or torchrun), identity check, per-layer report.
"""

from __future__ import annotations

from .engine import IMPL_NAME, EPLayerStats, ExpertParallel
from .placement import Placement, default_placement, load_placement, parse_placement

__all__ = ["IMPL_NAME", "EPLayerStats", "ExpertParallel", "Placement", "default_placement", "load_placement", "parse_placement"]
