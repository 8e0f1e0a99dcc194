"""`benchmarks/offload.py`'s plan of runs (the pure part; the benchmark itself is not a test)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def offload():
    sys.path.insert(0, str(BENCH))  # its sibling modules (_profile, engine_overhead)
    try:
        spec = importlib.util.spec_from_file_location("offload_bench", BENCH / "offload.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def _labels(plan):
    return [(mode, ev, pf, bool(opts), s, adaptive, miss) for mode, ev, pf, opts, s, adaptive, miss in plan]


def test_each_run_comes_once_when_the_users_runs_include_a_comparison_row(offload):
    plan = offload.run_plan(["fetch"], ["lru"], ["none"])
    labels = _labels(plan)
    assert len(labels) == len(set(labels)), labels
    assert labels == [
        ("on-demand", None, None, False, 1, False, "fetch"),
        ("offload", "lru", "none", False, 1, False, "fetch"),
        ("offload", "lru", "pregate", True, 1, False, "fetch"),
    ]


def test_the_comparison_rows_follow_the_users_runs(offload):
    plan = _labels(offload.run_plan(["fetch", "auto"], ["lfu", "lru"], ["pregate"], adaptive_layers=3))
    assert plan[0][0] == "on-demand"
    assert [(ev, miss) for _, ev, _, _, _, _, miss in plan[1:5]] == [
        ("lfu", "fetch"),
        ("lru", "fetch"),
        ("lfu", "auto"),
        ("lru", "auto"),
    ]
    assert plan[5:7] == [
        ("offload", "lru", "pregate", True, 1, False, "fetch"),
        ("offload", "lru", "none", False, 1, False, "fetch"),
    ]
    assert plan[7:] == [  # S = 2 (3 is not below the 3 MoE layers) and adaptive
        ("offload", "lru", "pregate", False, 2, False, "fetch"),
        ("offload", "lru", "pregate", False, 1, True, "fetch"),
    ]
