"""Traffic-aware prefetch: misses first on the link, stale prefetches cancelled, the admission gate, exactness.

The emulated link (fake clock) and the simulator's modelled link run the same `PrioritySchedule`, so one
script of submits, cancels, promotions and clock steps gives identical schedules on both.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from moeflow.policies import EVICTION
from moeflow.policies.base import PrefetchRequest
from moeflow.policies.prefetch import PrefetchGate
from moeflow.runtime.cache import ExpertCache
from moeflow.runtime.link import EmulatedLink
from moeflow.sim.link import ModelledLink

from .test_runtime_link import FakeClock

NBYTES = 1_000_000  # at 0.1 GB/s: 10 ms per transfer


class _Emu:
    """EmulatedLink on a fake clock, driven like the modelled link (advance = compute)."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.link = EmulatedLink(0.1, clock=self.clock, sleep=self.clock.sleep)
        self.src = torch.zeros(NBYTES // 4)

    def submit(self, demand: bool):
        return self.link.submit(self.src, torch.empty_like(self.src), demand=demand)

    def advance(self, dt: float) -> None:
        self.clock.advance(dt)


class _Mod:
    def __init__(self) -> None:
        self.link = ModelledLink(0.1)

    def submit(self, demand: bool):
        return self.link.submit_nbytes(NBYTES, demand=demand)

    def advance(self, dt: float) -> None:
        self.link.advance(dt)


def _script(drv) -> dict:
    """Three prefetches queued at t=0, a demand at 5 ms, a second demand, a cancel, a promotion, waits."""
    link = drv.link
    p = [drv.submit(False) for _ in range(3)]  # P0 0-10 ms (starts at once), P1 10-20, P2 20-30
    drv.advance(0.005)
    d1 = drv.submit(True)  # after the started P0, ahead of P1 and P2
    d2 = drv.submit(True)  # after d1 (demand FIFO), still ahead of the prefetches
    after_demands = [t.due for t in (*p, d1, d2)]
    started_cancel = link.cancel(p[0])  # started: stays
    queued_cancel = link.cancel(p[2])  # queued: withdrawn, nothing behind it
    p3 = drv.submit(False)  # appended after P1
    drv.advance(0.001)
    link.promote(p3)  # needed now: jumps ahead of P1
    after_promote = [t.due for t in (p[1], p3)]
    stall = link.wait(d1)
    link.drain()
    return {
        "after_demands": after_demands,
        "cancel": (started_cancel, queued_cancel),
        "after_promote": after_promote,
        "stall": stall,
        "bytes": link.bytes,
        "submitted": link.submitted_bytes,
        "transfers": link.transfers,
    }


def test_demand_overtakes_queued_prefetches_identically():
    emu, mod = _Emu(), _Mod()
    a, b = _script(emu), _script(mod)
    emu.link.close()
    # P0 keeps its slot (started); d1 10-20 ms, d2 20-30 ms; P1 and P2 pushed back to 30-40 and 40-50 ms
    assert a["after_demands"] == pytest.approx([0.010, 0.040, 0.050, 0.020, 0.030])
    assert a["cancel"] == (False, True)
    assert a["after_promote"] == pytest.approx([0.050, 0.040])  # p3 (promoted) 30-40 ms, P1 40-50 ms
    assert a["stall"] == pytest.approx(0.020 - 0.006)
    assert a["bytes"] == a["submitted"] == 5 * NBYTES and a["transfers"] == 5  # the cancelled one moved nothing
    for k in a:  # identical schedules on both links
        assert a[k] == pytest.approx(b[k]), k


def test_demand_fifo_unchanged_without_prefetch():
    for drv in (_Emu(), _Mod()):
        ts = [drv.submit(True) for _ in range(3)]
        assert [t.due for t in ts] == pytest.approx([0.010, 0.020, 0.030])
        drv.link.close()


@dataclass(frozen=True)
class _Spec:
    moe_layers: tuple[int, ...] = (0, 1, 2)
    num_experts: int = 8
    top_k: int = 2
    expert_bytes: int = NBYTES

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def total_experts(self) -> int:
        return len(self.moe_layers) * self.num_experts


def _cache(gate: PrefetchGate | None, capacity: int = 12) -> ExpertCache:
    return ExpertCache(None, capacity, link=ModelledLink(0.1), eviction=EVICTION.create("lru"), spec=_Spec(), gate=gate)


@pytest.mark.parametrize("cancel", [True, False])
def test_stale_prefetches_cancelled_when_routing_is_known(cancel):
    cache = _cache(PrefetchGate(False, cancel=cancel))
    link = cache.link
    cache.begin_pass(0)
    cache.begin_layer(0)
    slots0 = cache.route(0, [0, 1], {0: 0.5, 1: 0.5}, 8)  # two demand loads: 0-10, 10-20 ms
    assert cache.prefetch([PrefetchRequest((1, e), priority=1.0 - e / 10) for e in (2, 3, 4)], 0) == 3  # 20-50 ms
    cache.wait(slots0)  # 20 ms: the first prefetch (1,2) starts now, (1,3) and (1,4) are queued
    link.advance(0.001)
    cache.release(slots0)
    cache.begin_layer(1)
    slots1 = cache.route(1, [2, 5], {2: 0.5, 5: 0.5}, 8)
    c = cache.counters
    if cancel:
        assert c.prefetch_cancelled == 2
        assert not cache.resident((1, 3)) and not cache.resident((1, 4))
        assert c.loads == 2 + 3 - 2 + 1  # demand (0,0),(0,1); prefetches 3 issued, 2 cancelled; demand (1,5)
    else:
        assert c.prefetch_cancelled == 0 and cache.resident((1, 3)) and cache.resident((1, 4))
        assert c.loads == 6
    assert c.hits == 1 and c.late == 1 and c.misses == 3  # (1,2) in flight; (1,5) a miss
    assert c.prefetch_issued == 3
    cache.wait(slots1)
    cache.release(slots1)
    link.drain()
    assert link.bytes == link.submitted_bytes == c.bytes_moved == c.loads * NBYTES
    assert len(cache.slot_of) == c.loads - c.evictions


def test_gate_refuses_low_confidence_on_a_busy_link_admits_high():
    link = ModelledLink(0.1)  # 10 ms per expert
    gate = PrefetchGate(True)
    gate.begin(link, NBYTES, 0, 0)
    assert gate.admit(PrefetchRequest((1, 0), confidence=0.9), 1)  # idle link, likely: admitted
    assert not gate.admit(PrefetchRequest((1, 1), confidence=0.3), 1)  # p < 1/2 never pays on its own
    link.submit_nbytes(NBYTES)  # busy: 5 ms of backlog after this demand load is half done
    link.advance(0.005)
    gate.begin(link, NBYTES, 0, 0)
    assert not gate.admit(PrefetchRequest((1, 2), confidence=0.6), 1)  # late by 5 ms: gain 0.6*5 < cost 0.4*10
    assert gate.admit(PrefetchRequest((1, 3), confidence=0.95), 1)
    assert gate.refused == 2 and gate.admitted == 2
    off = PrefetchGate(False)  # gate=off admits everything
    off.begin(link, NBYTES, 0, 0)
    assert off.admit(PrefetchRequest((1, 4), confidence=0.0), 1)


def test_gate_in_the_cache_and_budget():
    cache = _cache(PrefetchGate(True))
    cache.begin_pass(0)
    cache.begin_layer(0)
    cache.route(0, [0, 1], {0: 0.5, 1: 0.5}, 8)  # 20 ms of demand loads queued
    reqs = [PrefetchRequest((1, e), priority=1.0, confidence=p) for e, p in ((2, 0.99), (3, 0.2))]
    cache.prefetch(reqs, 0)
    assert cache.counters.prefetch_refused == 2  # 20 ms backlog, lead unknown: too late for either
    idle = _cache(PrefetchGate(True, budget=NBYTES))  # one expert per layer
    idle.begin_pass(0)
    idle.prefetch([PrefetchRequest((1, e), priority=1.0 - e / 10, confidence=0.99) for e in (2, 3)], 0)
    assert idle.counters.prefetch_issued == 1 and idle.counters.prefetch_refused == 1
    with pytest.raises(Exception, match="budget"):
        PrefetchGate(True, budget="lots")


def test_policy_options_reach_the_gate():
    from moeflow.policies import PREFETCH
    from moeflow.policies.parse import build_policy

    pg = build_policy(PREFETCH, "pregate")
    assert pg.gate.enabled and pg.gate.cancel_stale
    off = build_policy(PREFETCH, "pregate:gate=off,cancel=off,budget=auto")
    assert not off.gate.enabled and not off.gate.cancel_stale and off.gate.budget == "auto"
    assert not build_policy(PREFETCH, "all-next-layer").gate.enabled


@pytest.mark.parametrize("opts", [{}, {"gate": "off", "weight": 0.0}])
def test_offloaded_generation_exact_with_gate_and_cancellation(tiny_models, opts):
    from moeflow.moe import get_adapter
    from moeflow.runtime.generate import build_engine, generate_one

    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 250, (1, 6), generator=g)
    ref, _ = generate_one(model, prompt, None, max_new_tokens=8, min_new_tokens=8)
    gbps = spec.expert_bytes / 2e-3 / 1e9  # 2 ms per expert: prefetches queue behind demand loads
    for cap in (spec.top_k, spec.total_experts // 4, spec.total_experts // 2):
        eng = build_engine(
            model, mode="offload", link=EmulatedLink(gbps), capacity=cap, eviction="lru", prefetch="pregate", prefetch_opts=opts
        )
        with eng:
            out, m = generate_one(model, prompt, eng, max_new_tokens=8, min_new_tokens=8)
            eng.link.drain()
            assert eng.link.bytes == eng.link.submitted_bytes == m.counters.bytes_moved
        assert torch.equal(out, ref), f"C={cap} {opts}: {out.tolist()} != {ref.tolist()}"
        c = m.counters
        assert c.loads == c.demand_loads + c.prefetch_issued - c.prefetch_cancelled
