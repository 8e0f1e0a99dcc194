"""`belady-approx`: evict the expert with the longest predicted time to next use.

Hand-made access sequences whose next-use order is known, driven through the EvictionPolicy events
(as the cache reports them in the runtime and the simulator), and runtime exactness: offloaded greedy
generation with it is token-identical to the resident model, like tests/test_runtime_exact.py."""

from __future__ import annotations

import pytest
import torch

from moeflow.moe import get_adapter
from moeflow.policies import EVICTION
from moeflow.policies.base import Position
from moeflow.runtime.generate import build_engine, generate_one
from moeflow.runtime.link import DirectLink

from .conftest import ARCHS
from .test_runtime_exact import NEW, _capacities, prompt  # noqa: F401  (the fixture is reused)

LAYERS = (0, 1, 2, 3)


def _pos(p: int, r: int) -> Position:
    return Position(p, LAYERS[r], r, 0)


def _drive(pol, schedule, passes: int, *, stop: tuple[int, int] | None = None, proposals=None) -> Position:
    """Pass p, layer rank r: access the keys `schedule(p, l)` returns; stop just after layer `stop`'s
    accesses. `proposals(p, r)` -> keys proposed after layer r (on_insert(prefetched)/on_predicted)."""
    seen: set = set()
    for p in range(passes):
        pol.on_pass_start(_pos(p, 0))
        for r, l in enumerate(LAYERS):
            pos = _pos(p, r)
            pol.on_layer_start(pos)
            for e in schedule(p, l):
                key = (l, e)
                if key not in seen:
                    pol.on_insert(key, pos, prefetched=False)
                    seen.add(key)
                pol.on_access(key, pos, score=0.5)
            for key in proposals(p, r) if proposals else []:
                if key in seen:
                    pol.on_predicted(key, pos)
                else:
                    pol.on_insert(key, pos, prefetched=True)
                    seen.add(key)
            if stop == (p, r):
                return pos
    return _pos(passes, 0)


def test_evicts_the_expert_needed_last():
    # every pass: (0,0) and (2,0) and (3,0); (0,1) every 4th pass (0, 4, 8, ...); (3,1) every 2nd pass
    def schedule(p, l):
        out = {0: [0], 2: [0], 3: [0]}.get(l, [])
        if l == 0 and p % 4 == 0:
            out = [*out, 1]
        if l == 3 and p % 2 == 0:
            out = [*out, 1]
        return out

    pol = EVICTION.create("belady-approx")
    # stop in pass 9 after layer 1: next uses (layer steps ahead): (2,0): 1, (3,0): 2, (0,0): 3, (3,1): 6 (pass 10),
    # (0,1): 11 (pass 12)
    pos = _drive(pol, schedule, 10, stop=(9, 1))
    cands = [(0, 0), (0, 1), (2, 0), (3, 0), (3, 1)]
    t = {k: pol.expected_next_use(k, pos) for k in cands}
    assert sorted(cands, key=t.get) == [(2, 0), (3, 0), (0, 0), (3, 1), (0, 1)], t
    assert pol.victim(cands, pos) == (0, 1)
    assert pol.victim([(0, 0), (2, 0), (3, 0), (3, 1)], pos) == (3, 1)
    assert pol.victim([(0, 0), (2, 0), (3, 0)], pos) == (0, 0)  # same frequency: farthest layer, as fld
    assert pol.interval[(0, 1)] == pytest.approx(4.0) and pol.interval[(3, 1)] == pytest.approx(2.0)


def test_a_long_unused_expert_is_not_due():
    # (1,5) was used every pass until pass 3 and never since: its age (6 passes) outweighs its short interval
    def schedule(p, l):
        return {1: [0] + ([5] if p <= 3 else []), 2: [0] + ([1] if p % 3 == 0 else [])}.get(l, [])

    pol = EVICTION.create("belady-approx")
    pos = _drive(pol, schedule, 10, stop=(9, 0))
    assert pol.victim([(1, 0), (1, 5), (2, 1)], pos) == (1, 5)


def test_proposals_are_calibrated_layer_ahead_probabilities():
    # (3,1) and (3,2) are both used every 3rd pass; the prefetcher proposes (3,1) one layer ahead
    # exactly when it will be used, so it learns P(used | proposed 1 ahead) -> 1 and keeps (3,1)
    def schedule(p, l):
        return [1, 2] if (l == 3 and p % 3 == 0) else ([0] if l == 0 else [])

    def good(p, r):
        return [(3, 1)] if (r == 2 and p % 3 == 0) else []

    pol = EVICTION.create("belady-approx")
    pos = _drive(pol, schedule, 25, stop=(24, 2), proposals=good)
    assert pol.p_ahead[1] > 0.9
    assert pol.victim([(3, 1), (3, 2)], pos) == (3, 2)
    assert pol.expected_next_use((3, 1), pos) < 1.5 < 8 < pol.expected_next_use((3, 2), pos)  # next layer vs. a pass away

    # a prefetcher whose proposals are never used (it proposes (3,1) in the passes it is NOT used)
    def bad(p, r):
        return [(3, 1)] if (r == 2 and p % 3 != 0) else []

    pol = EVICTION.create("belady-approx")
    pos = _drive(pol, schedule, 26, stop=(25, 2), proposals=bad)
    assert pol.p_ahead[1] < 0.1
    # a proposal calibrated as (almost) never used says its next run will not use it: (3,1) goes first
    assert pol.expected_next_use((3, 1), pos) > pol.expected_next_use((3, 2), pos)
    assert pol.victim([(3, 1), (3, 2)], pos) == (3, 1)


def test_options_and_registry():
    from moeflow.errors import ConfigError

    assert "belady-approx" in EVICTION
    with pytest.raises(ConfigError):
        EVICTION.create("belady-approx", ema=0.0)
    with pytest.raises(RuntimeError):
        EVICTION.create("belady-approx").victim([], _pos(0, 0))


@pytest.mark.parametrize("arch", ARCHS)
def test_runtime_exact(tiny_models, arch, prompt):  # noqa: F811
    model = tiny_models(arch)
    spec = get_adapter(model).spec
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    for cap in _capacities(spec):
        for pf in ("none", "pregate"):
            eng = build_engine(model, mode="offload", link=DirectLink(), capacity=cap, eviction="belady-approx", prefetch=pf)
            with eng:
                out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
                assert eng.cache.num_resident() <= cap
            assert torch.equal(out, ref), f"{arch} C={cap} belady-approx+{pf}: {out.tolist()} != {ref.tolist()}"
            if cap < spec.total_experts:
                assert m.counters.evictions > 0
