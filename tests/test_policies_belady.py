"""`next-use`: evict the expert with the largest expected time to next use, from probabilities calibrated online.

Hand-made access sequences driven through the EvictionPolicy events (as the cache reports them in the runtime
and the simulator); the simulator on a skewed trace (frequency pays); runtime exactness is the keystone's
(tests/test_runtime_exact.py runs every registered eviction policy, tests/test_sim_equiv.py compares it with
the simulator)."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.errors import ConfigError
from moeflow.policies import EVICTION
from moeflow.policies.base import Candidates
from moeflow.sim import AccessTrace, LayerStep, Pass, belady, simulate

from .test_learned_eviction import _drive, _pos


def test_keeps_the_frequent_expert_and_the_nearest_layer():
    # (1,0) every pass, (1,1) in one pass of ten; (2,0) and (0,0) every pass
    def schedule(p, l):
        return {0: [0], 1: [0] + ([1] if p == 2 else []), 2: [0]}.get(l, [])

    pol = EVICTION.create("next-use")
    pos = _drive(pol, schedule, 10, stop=(9, 2))  # after layer 2 of pass 9: layers 0, 1, 2 next run in pass 10
    assert pol.victim([(1, 0), (1, 1)], pos) == (1, 1)  # the rare one
    t = pol.expected_next_use(pos)
    assert t[1, 1] > t[1, 0] > t[0, 0]  # equally frequent: layer 0 runs before layer 1
    assert pol.victim([(0, 0), (1, 0), (2, 0)], pos) == (2, 0)  # the layer just run is needed last


def test_recency_is_learned_from_the_run():
    # sticky routing in layer 0: expert b = (0,1) is used in passes 0-14, then a = (0,0) in 15-25; at pass 25
    # b has more uses (15 to 11) but a, just used, is the one used next
    def schedule(p, l):
        return [1 if p < 15 else 0] if l == 0 else [0]

    def victim(**opts):  # decay 1: frequency over the whole run (a decayed count would favour a already)
        pol = EVICTION.create("next-use", decay=1.0, **opts)
        pos = _drive(pol, schedule, 26, stop=(25, 1))
        return pol, pol.victim([(0, 0), (0, 1)], pos)

    pol, v = victim()
    used, seen = (pol.rec_used - 1).sum(0), (pol.rec_seen - 2).sum(0)  # outcomes without the prior, by recency
    assert used[1] / seen[1] > 0.8 > 0.2 > used[0] / seen[0]  # reuse after a use, almost never after none
    assert v == (0, 1)  # b goes: its run ended
    assert victim(recency=False)[1] == (0, 0)  # by frequency alone a (fewer uses) goes


def test_proposals_are_calibrated():
    # layer 3 uses expert 1 or 2 (alternating passes); the prefetcher proposes the right one two layers ahead
    def schedule(p, l):
        return [1 + p % 2] if l == 3 else [0]

    def good(p, r):  # after layer 1: the layers 2 and 3 ahead
        return [(2, 0), (3, 1 + p % 2)] if r == 1 else []

    # recency off: the alternation would teach the recency table the same answer
    pol = EVICTION.create("next-use", recency=False)
    pos = _drive(pol, schedule, 21, stop=(20, 1), proposals=good)  # pass 20 proposed (3,1)
    pp = pol.prop_used / pol.prop_seen
    assert pp[1] > 0.8 > 0.2 > pp[0]  # proposed: used; resident, not proposed: not used
    assert pol.victim([(3, 1), (3, 2)], pos) == (3, 2)
    off = EVICTION.create("next-use", recency=False, proposals=False)
    pos = _drive(off, schedule, 21, stop=(20, 1), proposals=good)
    assert off.victim([(3, 1), (3, 2)], pos) == (3, 1)  # 10 uses each: the least recently used


def test_candidates_view_and_plain_sequence_agree():
    def schedule(p, l):
        return [p % 3, 3 + p % 2] if l in (0, 2) else [p % 5]

    pol = EVICTION.create("next-use")
    pos = _drive(pol, schedule, 12, stop=(11, 1))
    keys = list(pol._last)  # every tracked key
    slot_of = {k: i for i, k in enumerate(keys)}

    class _Slot:
        def __init__(self, key):
            self.key, self.pinned = key, key == keys[0]

    view = Candidates(slot_of, [_Slot(k) for k in keys])
    assert pol.victim(view, pos) == pol.victim(keys[1:], pos)


def _skewed(passes: int, seed: int) -> AccessTrace:
    """2 layers x 16 experts, top-2: Zipf-like popularity, one token per pass (a decode trace)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, 17) ** 1.2
    p /= p.sum()
    out = []
    for _ in range(passes):
        steps = [LayerStep(l, rng.choice(16, size=(1, 2), replace=False, p=p)) for l in (0, 1)]
        out.append(Pass(1, 0, steps))
    return AccessTrace((0, 1), 16, 2, out)


def test_fewer_transfers_than_lru_on_a_skewed_trace():
    acc = _skewed(400, 0)
    nu, lru, mn = (simulate(acc, 8, "next-use").loads, simulate(acc, 8, "lru").loads, belady(acc, 8).loads)
    assert mn <= nu < lru


def test_options():
    for bad in ({"decay": 0.0}, {"decay": 1.5}, {"shrink": -1.0}):
        with pytest.raises(ConfigError):
            EVICTION.create("next-use", **bad)
    with pytest.raises(RuntimeError):
        EVICTION.create("next-use").victim([], _pos(0, 0))


@pytest.mark.parametrize("opts", [{}, {"recency": False}, {"proposals": False, "shrink": 0.0}, {"decay": 1.0}])
def test_compiled_scores_are_the_reference_floats(opts):
    """A victim among the cache's candidates scores the resident keys in one compiled call: bit for bit the numpy
    `expected_next_use`, and the same victim as the reference scan over a plain list (copies in flight, so some
    residents are not candidates)."""
    from .test_sim_core import _trace

    acc = _trace(3, E=12)
    pol = EVICTION.create("next-use", **opts)
    victim, seen = pol.victim, []

    def checked(cands, pos):
        keys, far = pol._victim_order(pos)  # [n], [n]
        assert far.tolist() == pol.expected_next_use(pos).ravel()[keys].tolist()
        v = victim(cands, pos)
        assert v == victim(list(cands), pos)
        seen.append(len(cands) < len(keys))
        return v

    pol.victim = checked  # type: ignore[method-assign]
    simulate(acc, 6, pol, "all-next-layer", link="emulated:0.05,100")
    assert len(seen) > 50 and any(seen)  # victims, some while a resident key was not a candidate


def test_next_use_victim_order_is_cached_with_a_stamp_of_both_its_sources(tmp_path, monkeypatch):
    """next-use's compiled victim order is cached on disk (not compiled in every `moeflow run`), stamped with its
    own file and the shared float routines it inlines: an edit to either recompiles it."""
    import shutil

    from moeflow.policies import next_use as nu
    from moeflow.runtime.cachecore import k_call

    if not hasattr(k_call._cache, "_impl"):  # the cache core compiles per process too: no cache location here
        pytest.skip("numba has no cache location here")
    kernel = nu._victim_order
    assert hasattr(kernel._cache, "_impl"), "next-use's victim order is compiled in every process"
    assert kernel._cache._impl.locator.get_source_stamp() == nu._stamp()
    copies = []
    for p in nu._SOURCES:
        shutil.copy(p, tmp_path / p.name)
        copies.append(tmp_path / p.name)
    monkeypatch.setattr(nu, "_SOURCES", tuple(copies))
    monkeypatch.setattr(nu, "_STAMP", [])
    before = nu._stamp()
    for c in copies:
        c.write_text(c.read_text() + "\n# edited\n")
        monkeypatch.setattr(nu, "_STAMP", [])
        after = nu._stamp()
        assert after != before, c.name
        before = after


def test_next_use_counts_are_views_of_what_the_victim_order_reads():
    """The calibration counts are updated in place, through views of the two arrays `_victim_order` reads (no
    per-victim stacking): rebinding one of them would hand the compiled order stale counts."""
    from moeflow.policies.next_use import NextUse

    nu = NextUse()
    for name, base in (("rec_used", nu._rec), ("rec_seen", nu._rec), ("prop_used", nu._pp), ("prop_seen", nu._pp)):
        assert np.shares_memory(getattr(nu, name), base), name
    nu.rec_seen += 1.0
    assert np.array_equal(nu._rec.reshape(2, -1)[1], nu.rec_seen.ravel())
