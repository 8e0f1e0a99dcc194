"""The victim-aware prefetch gate (`victim=on`): a copy is refused when the eviction policy expects its victim to be
used no later than the proposal (`EvictionPolicy.reuse_steps`)."""

from __future__ import annotations

import pytest

from moeflow.errors import ConfigError
from moeflow.policies import EVICTION, PREFETCH
from moeflow.policies.base import PrefetchRequest
from moeflow.policies.eviction import LRU
from moeflow.policies.prefetch import PrefetchGate
from moeflow.runtime.cache import ExpertCache
from moeflow.sim import simulate, synthetic
from moeflow.sim.link import InstantLink
from moeflow.sim.simulator import _Spec

SPEC = _Spec(moe_layers=(0, 1, 2), num_experts=4, top_k=1, expert_bytes=1000)


class _Told(LRU):
    """LRU victims, next uses as told (steps per key; None: unknown)."""

    kernel = None

    def __init__(self, steps: dict | None) -> None:
        super().__init__()
        self.steps = steps
        self.asked: list = []

    def reuse_steps(self, key, pos, p=None):
        self.asked.append((key, p))
        return None if self.steps is None else self.steps[key]


def _full_cache(steps: dict | None, victim: bool):
    """Capacity 2, holding (0,0) then (0,1) (LRU victim: (0,0)), at layer 0 of pass 1."""
    ev = _Told(steps)
    cache = ExpertCache(None, 2, link=InstantLink(), eviction=ev, spec=SPEC, gate=PrefetchGate(False, victim=victim))
    cache.begin_pass(0)
    cache.begin_layer(0)
    cache.release(cache.route(0, [0, 1], {0: 0.5, 1: 0.5}, 8))
    cache.begin_pass(1)
    cache.begin_layer(0)
    cache.release(cache.route(0, [1], {1: 1.0}, 8))
    return cache, ev


def test_keeps_a_victim_needed_sooner():
    cache, ev = _full_cache({(0, 0): 3.0, (2, 3): 8.0}, victim=True)
    assert cache.prefetch([PrefetchRequest((2, 3), confidence=0.7)], 0) == 0
    assert cache.resident((0, 0)) and not cache.resident((2, 3))
    assert cache.counters.prefetch_refused == 1 and cache.gate.victim_refused == 1 and cache.gate.admitted == 0
    assert ev.asked == [((0, 0), None), ((2, 3), 0.7)]  # the victim's own estimate; the proposal's at its confidence


@pytest.mark.parametrize("steps, victim", [({(0, 0): 9.0, (2, 3): 8.0}, True), (None, True), ({(0, 0): 3.0, (2, 3): 8.0}, False)])
def test_admits_when_the_proposal_is_sooner_unknown_or_off(steps, victim):
    cache, _ = _full_cache(steps, victim)
    assert cache.prefetch([PrefetchRequest((2, 3), confidence=0.7)], 0) == 1
    assert cache.resident((2, 3)) and not cache.resident((0, 0))
    assert cache.counters.prefetch_refused == 0 and cache.gate.admitted == 1


def test_refusal_returns_the_budget():
    gate = PrefetchGate(False, budget=1000, victim=True)  # one copy per call
    cache = ExpertCache(
        None, 2, link=InstantLink(), eviction=_Told({(0, 0): 3.0, (0, 1): 50.0, (2, 2): 8.0, (2, 3): 9.0}), spec=SPEC, gate=gate
    )
    cache.begin_pass(0)
    cache.begin_layer(0)
    cache.release(cache.route(0, [0, 1], {0: 0.5, 1: 0.5}, 8))
    # (2,2) refused for its victim (0,0): the budget it took is back, so (2,3) is admitted, and refused for (0,0) too
    assert cache.prefetch([PrefetchRequest((2, 2), priority=2.0), PrefetchRequest((2, 3), priority=1.0)], 0) == 0
    assert gate.victim_refused == 2 and gate._left == 1
    cache.eviction.steps[(0, 0)] = 99.0  # now needed later than both: (2,2) is copied and takes the one-copy budget
    assert cache.prefetch([PrefetchRequest((2, 2), priority=2.0), PrefetchRequest((2, 3), priority=1.0)], 0) == 1
    assert gate.refused == 3 and gate.admitted == 1  # (2,3): over the budget


def test_victim_gate_never_runs_the_compiled_core():
    lru = EVICTION.create("lru")  # a policy with a compiled kernel
    assert ExpertCache(None, 4, link=InstantLink(), eviction=lru, spec=SPEC, gate=PrefetchGate(True)).core is not None
    on = ExpertCache(
        None, 4, link=InstantLink(), eviction=EVICTION.create("lru"), spec=SPEC, gate=PrefetchGate(True, victim="on")
    )
    assert on.core is None
    on.gate.begin(on.link, SPEC.expert_bytes, 0, 0)
    assert on.gate.quota() is None


def test_simulator_replays_it_call_by_call_and_it_saves_copies():
    acc = synthetic(80, moe_layers=(0, 1, 2, 3), num_experts=8, top_k=2, seed=1, skew=1.2)
    on = ("all-next-layer", {"victim": "on"})
    st = simulate(acc, 10, "next-use", on)
    ref = simulate(acc, 10, "next-use", on, compiled=False)
    off = simulate(acc, 10, "next-use", "all-next-layer")
    assert st.engine == "python"
    assert (st.loads, st.hits, st.prefetch_loads) == (ref.loads, ref.hits, ref.prefetch_loads)
    assert st.prefetch_loads < off.prefetch_loads and st.loads < off.loads
    assert st.counters.prefetch_refused > 0 == off.counters.prefetch_refused
    with pytest.raises(ValueError, match="no compiled replay"):
        simulate(acc, 10, "belady-approx", on, compiled=True)


@pytest.mark.parametrize("name", ["next-use", "belady-approx"])
def test_reuse_steps_follow_the_policy(name):
    acc = synthetic(30, moe_layers=(0, 1, 2, 3), num_experts=8, top_k=2, seed=2, skew=1.0)
    pol = EVICTION.create(name)
    simulate(acc, 12, pol, "none", compiled=False)
    from moeflow.policies.base import Position

    pos = Position(pass_id=30, layer=1, layer_rank=1, time=0)
    for key in [(0, 3), (2, 5), (3, 0)]:
        t = pol.reuse_steps(key, pos)
        own = pol.expected_next_use(pos)[key] if name == "next-use" else pol.expected_next_use(key, pos)
        assert t == pytest.approx(float(own))
        d = (key[0] - 1 - 1) % 4 + 1  # steps until its layer runs next
        assert pol.reuse_steps(key, pos, p=1.0) == pytest.approx(d)  # certain at its layer's next run
        assert d < pol.reuse_steps(key, pos, p=0.5) < pol.reuse_steps(key, pos, p=0.1)
    assert EVICTION.create("lru").reuse_steps((0, 0), pos) is None


def test_option():
    assert PREFETCH.create("pregate", victim="on").gate.victim
    assert not PREFETCH.create("pregate").gate.victim
    assert PREFETCH.create("all-next-layer", victim=True).gate.victim
    with pytest.raises(ConfigError, match="victim"):
        PREFETCH.create("pregate", victim="maybe")
