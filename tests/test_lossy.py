"""One lossy answer per configuration, from the policies' declared capabilities.

For every registered policy of every kind and the device types cpu and cuda (no GPU needed: the command
configs are built, not run), `moeflow run` (`RunConfig.lossy`, what its metrics and --json report),
`moeflow quality` (its rows' `lossy`), `moeflow simulate` (its rows' `lossy`, for the policies it replays)
and the engine (`OffloadEngine.lossy`, on this CPU) agree, and the answer is the expected one: host compute
(`cpu`, `auto`) is bit-identical on a CPU device only. No policy capability is probed on the decode path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import pytest

from moeflow.errors import ConfigError
from moeflow.policies import EVICTION, MISS, PREFETCH, ROUTING
from moeflow.policies.base import MissPolicy
from moeflow.stages.quality import plan as quality_plan
from moeflow.stages.quality_config import QualityConfig
from moeflow.stages.run_config import RunConfig
from moeflow.stages.session import plan_runs
from moeflow.stages.simulate import SimulateConfig

REPO = Path(__file__).resolve().parents[1]
KINDS = {"eviction": EVICTION, "prefetch": PREFETCH, "miss": MISS, "routing": ROUTING}
DEVICES = ("cpu", "cuda")
# the expected answer of every registered policy, by hand: (kind, name) -> (lossy on cpu, lossy on cuda)
LOSSY_ON_EVERY_DEVICE = {
    ("miss", "drop"),
    ("miss", "substitute"),
    ("miss", "fetch-lowest-bit"),
    ("miss", "fetch-priority"),
    ("miss", "cascade"),
    ("routing", "cache-aware"),
    ("routing", "plan-restricted"),
}
HOST_COMPUTE = {("miss", "cpu"), ("miss", "auto")}  # exact on cpu, lossy on cuda


def expected(kind: str, name: str, device: str) -> bool:
    if (kind, name) in LOSSY_ON_EVERY_DEVICE:
        return True
    return (kind, name) in HOST_COMPUTE and device != "cpu"


def every_policy() -> list[tuple[str, str]]:
    return [(kind, name) for kind, reg in KINDS.items() for name in sorted(reg)]


def run_config(kind: str, name: str, device: str, **extra: Any) -> RunConfig:
    """`moeflow run` with `name` as its `kind` policy (learned prefetchers get a predictors folder name: the
    config checks options, not the disk)."""
    kw: dict[str, Any] = dict(model="m", prompt=("hi",), device=device, prefetches=("none",))
    if kind == "eviction":
        kw["evictions"] = (name,)
    elif kind == "prefetch":
        kw["prefetches"] = (name,)
        if PREFETCH[name].needs_model:
            kw["prefetch_opts"] = (("predictors", "unused-dir"),)
    elif kind == "miss":
        kw["miss"] = name
    elif name == "plan-restricted":  # set by --plan casmoe --plan-opt mode=restricted, not --routing
        kw.update(plan="casmoe", plan_opts=(("predictors", "unused-dir"), ("mode", "restricted")))
    else:
        kw["routing"] = name
    return RunConfig(**{**kw, **extra})


def answers(rc: RunConfig, device: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """(run's answers per offload run, quality's offload rows) for one run config."""
    runs = [r for r in plan_runs(rc) if r["mode"] == "offload"]
    qc = QualityConfig(run=rc, misses=(rc.miss,), routings=(rc.routing,))
    rows = [r for r in quality_plan(qc) if r["mode"] == "offload"]
    assert len(runs) == len(rows) >= 1
    return [rc.lossy(device, r) for r in runs], rows


def test_every_registered_policy_is_classified():
    """A new policy must be added to the expectations above (they are the test's truth)."""
    known = LOSSY_ON_EVERY_DEVICE | HOST_COMPUTE
    assert known <= set(every_policy())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,name", every_policy())
def test_run_quality_simulate_agree(kind, name, device):
    rc = run_config(kind, name, device)
    run_answers, rows = answers(rc, device)
    want = expected(kind, name, device)
    for got, row in zip(run_answers, rows):
        assert got.lossy is want, f"run: {kind} {name} on {device}: {got}"
        assert bool(got.reasons) is want
        assert row["lossy"] is want and row["lossy_reasons"] == list(got.reasons), f"quality: {kind} {name} on {device}"
    if kind == "eviction" or (kind == "prefetch" and not PREFETCH[name].needs_model):  # what simulate replays
        sc = SimulateConfig(
            trace="unused",
            evictions=(name,) if kind == "eviction" else ("lru",),
            prefetches=(name,) if kind == "prefetch" else ("none",),
        )
        assert sc.lossy(device) == run_answers[0], f"simulate: {kind} {name} on {device}"


def test_host_compute_is_lossy_on_cuda_only():
    for device, want in (("cpu", False), ("cuda", True)):
        for miss in ("cpu", "auto"):
            rc = run_config("miss", miss, device)
            (got,), (row,) = answers(rc, device)
            assert got.lossy is want and row["lossy"] is want
            if want:
                assert "host" in got.reasons[0] and "cuda" in got.reasons[0]
    assert run_config("miss", "cpu", "cuda:1").lossy("cuda").lossy


def test_option_and_flag_decide_too():
    """cache-aware with lambda = 0 keeps the router's choice (exact); --speculative is lossy with any policy;
    resident and on-demand runs are exact whatever the policies."""
    for device in DEVICES:
        rc = run_config("routing", "cache-aware", device, routing_opts=(("lambda", "0"),))
        (got,), (row,) = answers(rc, device)
        assert not got.lossy and not row["lossy"]
        spec = run_config("prefetch", "router-pf", device, speculative=True)
        (got,), (row,) = answers(spec, device)
        assert got.lossy and row["lossy"] and any("--speculative" in r for r in got.reasons)
        sweep = run_config("miss", "drop", device, modes=("offload", "resident", "on-demand"), sweep=True)
        assert [sweep.lossy(device, r).lossy for r in plan_runs(sweep)] == [True, False, False]
        rows = {r["mode"]: r["lossy"] for r in quality_plan(QualityConfig(run=sweep, misses=("drop",)))}
        assert rows == {"resident": False, "offload": True, "on-demand": False}


@pytest.mark.parametrize("kind,name", [k for k in every_policy() if k[0] in ("miss", "routing")])
def test_engine_agrees_on_this_cpu(tiny_models, kind, name):
    from moeflow.runtime.engine import OffloadEngine
    from moeflow.runtime.link import DirectLink

    if name == "plan-restricted":
        policy = ROUTING.create(name)
    else:
        policy = KINDS[kind].create(name)
    model = tiny_models("olmoe")
    eng = OffloadEngine(model, capacity=8, link=DirectLink(), eviction=EVICTION.create("lru"), **{kind: policy})
    assert eng.lossy is run_config(kind, name, "cpu").lossy("cpu").lossy is expected(kind, name, "cpu")


def test_registries_refuse_an_undeclared_policy():
    class Undeclared:
        name: ClassVar[str] = "test-undeclared"

        def on_miss(self, key, pos, info=None):
            return "fetch"

    with pytest.raises(TypeError, match="must subclass MissPolicy"):
        MISS.register(Undeclared)

    class Declared(MissPolicy):
        name: ClassVar[str] = "test-declared"

        def on_miss(self, key, pos, info=None):
            return "fetch"

    MISS.register(Declared)
    try:
        with pytest.raises(ConfigError, match=r"no option 'foo'; its options: \(none\)"):  # the Protocol's __init__
            MISS.create("test-declared", foo=1)
        assert MISS.create("test-declared").changes_output  # undeclared output change: lossy by default
        assert run_config("miss", "test-declared", "cpu").lossy("cpu").lossy
    finally:
        MISS.pop("test-declared")


PROBE = re.compile(
    r"\b(?:getattr|hasattr)\(\s*(?:self\.|engine\.|eng\.)?"
    r"(?:policy|miss|routing|prefetch|prefetcher|eviction|pf|ms|ev|pol|inner)\b"
)
# the decode path (engine, step, experts call, cache, passes, timing, config), the simulator's replay and quality
SCANNED = [
    *sorted((REPO / "moeflow/runtime").glob("*.py")),
    REPO / "moeflow/sim/simulator.py",
    *sorted((REPO / "moeflow/quality").glob("*.py")),
]


def test_no_capability_probes():
    found = []
    for p in SCANNED:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if PROBE.search(line):
                found.append(f"{p.relative_to(REPO)}:{i}: {line.strip()}")
    assert found == []
    assert PROBE.search('bool(getattr(self.routing, "reroutes", True))') and PROBE.search("hasattr(pf, 'gate')")
