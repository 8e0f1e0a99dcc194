"""The pass oracle (`moeflow.sim.oracle`): next-use that knows the rest of the current pass exactly, a reference
between the online policies and Belady's MIN in the simulator."""

from __future__ import annotations

import pytest

from moeflow.errors import ConfigError
from moeflow.policies import EVICTION
from moeflow.sim import belady, simulate, synthetic
from moeflow.sim.oracle import PassOracle, pass_oracle


def _trace():
    return synthetic(60, moe_layers=(0, 1, 2, 3, 4, 5), num_experts=12, top_k=2, tokens=1, seed=3, skew=0.8)


@pytest.mark.parametrize("capacity", [8, 18, 30])
def test_between_belady_and_next_use(capacity):
    acc = _trace()
    b = belady(acc, capacity).loads
    o0 = pass_oracle(acc, capacity).loads
    o1 = pass_oracle(acc, capacity, lookahead_passes=1).loads
    nu = simulate(acc, capacity, "next-use", "none").loads
    assert b <= o1 <= o0 <= nu
    assert o0 < nu or capacity >= 30  # knowing the pass pays where the cache is tight


def _violations(acc, policy, capacity):
    """Victims that the rest of the current pass uses although a candidate it does not use was there."""
    used = PassOracle(acc).used  # [P,L,E]
    bad = []
    inner = policy.victim

    def victim(cands, pos):
        v = inner(cands, pos)
        rank = {l: r for r, l in enumerate(acc.moe_layers)}

        def needed(k):
            r = rank[k[0]]
            return r > pos.layer_rank and bool(used[pos.pass_id, r, k[1]])

        if needed(v) and any(not needed(k) for k in cands):
            bad.append((pos.pass_id, v))
        return v

    policy.victim = victim
    simulate(acc, capacity, policy, "none", compiled=False)
    return len(bad)


def test_exact_within_the_pass():
    acc = _trace()
    assert _violations(acc, EVICTION.create("next-use"), 8) > 0  # an online estimate gets some wrong
    assert _violations(acc, PassOracle(acc), 8) == 0
    assert _violations(acc, PassOracle(acc, lookahead_passes=1), 8) == 0


def test_lookahead_is_0_or_1():
    with pytest.raises(ConfigError, match="lookahead_passes"):
        PassOracle(_trace(), lookahead_passes=2)
