"""Each policy's defining invariant on hand-built event sequences (and pre-gating on a real router)."""

from __future__ import annotations

import pytest
import torch

from moeflow.errors import ConfigError
from moeflow.policies import EVICTION, MISS, PREFETCH, ROUTING, EvictionPolicy, LayerContext, Position, PrefetchPolicy

MOE = (0, 1, 2, 3)


def P(pass_id: int, layer: int, time: int = 0) -> Position:
    return Position(pass_id=pass_id, layer=layer, layer_rank=MOE.index(layer), time=time)


def load(pol, key, pos, score=1.0, prefetched=False):
    pol.on_insert(key, pos, prefetched=prefetched)
    if not prefetched:
        pol.on_access(key, pos, score=score)


def test_registries_and_errors():
    assert set(EVICTION) == {"lru", "lfu", "fld", "score", "lru2", "least-stale", "belady-approx", "lhu", "next-use"}
    assert set(PREFETCH) >= {"none", "pregate", "all-next-layer"}
    assert MISS.create("fetch").on_miss((0, 1), P(0, 0)) == "fetch" and not MISS.create("fetch").changes_output
    assert ROUTING.create("standard").bias(0, 8, lambda k: True) is None
    for n in EVICTION:
        assert isinstance(EVICTION.create(n), EvictionPolicy)
    for n in ("none", "pregate", "all-next-layer"):  # learned prefetchers need a predictors folder
        assert isinstance(PREFETCH.create(n), PrefetchPolicy)
    with pytest.raises(ConfigError, match="choose one of: belady-approx, fld, least-stale"):
        EVICTION.create("mru")
    with pytest.raises(ConfigError, match="no option 'factor'.*overfetch"):
        PREFETCH.create("pregate", factor=2)
    with pytest.raises(ConfigError):
        PREFETCH.create("pregate", percentile=80, mass=0.9)


def test_lru_evicts_least_recently_accessed():
    pol = EVICTION.create("lru")
    for i, k in enumerate([(0, 1), (0, 2), (1, 3)]):
        load(pol, k, P(0, k[0], i))
    pol.on_access((0, 1), P(1, 0, 3), score=1.0)  # (0,2) is now the oldest
    assert pol.victim([(0, 1), (0, 2), (1, 3)], P(1, 1)) == (0, 2)
    pol.on_evict((0, 2))
    assert pol.victim([(0, 1), (1, 3)], P(1, 1)) == (1, 3)


def test_lfu_evicts_least_frequently_accessed_and_remembers_counts():
    pol = EVICTION.create("lfu")
    load(pol, (0, 1), P(0, 0))
    load(pol, (0, 2), P(0, 0))
    for _ in range(3):
        pol.on_access((0, 1), P(0, 0), score=1.0)
    load(pol, (1, 5), P(0, 1))  # newest but least used so far (1 access)
    pol.on_access((0, 2), P(0, 0), score=1.0)  # (0,2): 2 accesses
    assert pol.victim([(0, 1), (0, 2), (1, 5)], P(0, 1)) == (1, 5)
    pol.on_evict((0, 1))  # count history survives eviction
    load(pol, (0, 1), P(1, 0))  # now 5 accesses
    assert pol.victim([(0, 1), (0, 2)], P(1, 0)) == (0, 2)


def test_fld_evicts_the_layer_needed_latest():
    pol = EVICTION.create("fld")
    keys = [(0, 1), (1, 1), (2, 1), (3, 1)]
    for k in keys:
        load(pol, k, P(0, k[0]))
    # running layer 2: layer 3 is next (d=1), then 0 (d=2), then 1 (d=3, the layer just run: farthest)
    assert pol.victim([(0, 1), (1, 1), (3, 1)], P(1, 2)) == (1, 1)
    assert pol.victim([(0, 1), (3, 1)], P(1, 2)) == (0, 1)
    # running layer 0: nothing passed, the farthest ahead is layer 3
    assert pol.victim([(1, 1), (2, 1), (3, 1)], P(1, 0)) == (3, 1)


def test_score_evicts_lowest_accumulated_score():
    pol = EVICTION.create("score")
    load(pol, (0, 1), P(0, 0), score=0.9)
    load(pol, (0, 2), P(0, 0), score=0.5)
    load(pol, (0, 3), P(0, 0), score=0.3)
    pol.on_access((0, 3), P(1, 0), score=0.3)  # 0.6 accumulated: now (0,2) is lowest
    assert pol.victim([(0, 1), (0, 2), (0, 3)], P(1, 1)) == (0, 2)
    load(pol, (1, 7), P(1, 1), prefetched=True)  # prefetched, never routed: score 0
    assert pol.victim([(0, 1), (0, 2), (0, 3), (1, 7)], P(1, 1)) == (1, 7)


def test_lru2_evicts_low_tier_first_lru_within_tier():
    pol = EVICTION.create("lru2", high_fraction=0.5)
    for k in [(0, 1), (0, 2), (1, 1), (1, 2)]:
        load(pol, k, P(0, k[0]))
    assert all(pol.tier(k) == "low" for k in [(0, 1), (0, 2), (1, 1), (1, 2)])
    pol.on_access((0, 1), P(1, 0), score=1.0)  # reuse -> high
    assert pol.tier((0, 1)) == "high"
    # (0,1) is the oldest overall but high: the low tier's LRU (0,2) goes first
    pol.on_access((0, 2), P(1, 0), score=1.0)  # (0,2) promoted too: high = {(0,1),(0,2)}
    assert pol.victim([(0, 1), (0, 2), (1, 1), (1, 2)], P(1, 1)) == (1, 1)
    load(pol, (2, 3), P(1, 1), prefetched=True)  # predicted -> high; high cap 2 of 5 -> demote (0,1)
    assert pol.tier((2, 3)) == "high" and pol.tier((0, 1)) == "low"
    assert pol.victim([(0, 1), (0, 2), (1, 1), (1, 2), (2, 3)], P(1, 1)) == (1, 1)
    # only high-tier candidates left: LRU among them
    assert pol.victim([(0, 2), (2, 3)], P(1, 1)) == (0, 2)


def test_least_stale_protects_current_and_is_fifo_by_layer():
    pol = EVICTION.create("least-stale")
    pol.on_pass_start(P(0, 0))
    for k in [(3, 1), (0, 1), (2, 1), (1, 1)]:  # accessed in pass 0 (any order)
        load(pol, k, P(0, k[0]))
    pol.on_pass_start(P(1, 0))  # all four are stale now
    load(pol, (0, 5), P(1, 0))  # current (accessed this pass)
    pol.on_access((2, 1), P(1, 2), score=1.0)  # stale -> current
    load(pol, (3, 6), P(1, 2), prefetched=True)  # selected by prefetching -> current
    assert not pol.is_stale((0, 5)) and not pol.is_stale((2, 1)) and not pol.is_stale((3, 6))
    everything = [(0, 1), (0, 5), (1, 1), (2, 1), (3, 1), (3, 6)]
    order = []
    cands = list(everything)
    while cands:  # drain: stale queue by layer, then current by layer
        v = pol.victim(cands, P(1, 2))
        order.append(v)
        cands.remove(v)
        pol.on_evict(v)
    assert order == [(0, 1), (1, 1), (3, 1), (0, 5), (2, 1), (3, 6)]


def test_least_stale_never_evicts_current_while_stale_exists():
    import random

    rng = random.Random(0)
    pol = EVICTION.create("least-stale")
    resident: set = set()
    for p in range(6):
        pol.on_pass_start(P(p, 0))
        for l in MOE:
            for _ in range(2):
                k = (l, rng.randrange(6))
                if k not in resident:
                    if len(resident) >= 5:
                        v = pol.victim(sorted(resident), P(p, l))
                        stale = [c for c in resident if pol.is_stale(c)]
                        assert not stale or pol.is_stale(v)
                        if stale:
                            assert v[0] == min(c[0] for c in stale)
                        pol.on_evict(v)
                        resident.discard(v)
                    pol.on_insert(k, P(p, l), prefetched=False)
                    resident.add(k)
                pol.on_access(k, P(p, l), score=0.5)


def test_least_stale_prefetch_refresh():
    pol = EVICTION.create("least-stale")
    load(pol, (1, 1), P(0, 1))
    load(pol, (1, 2), P(0, 1))
    pol.on_pass_start(P(1, 0))
    pol.on_predicted((1, 1), P(1, 0))  # proposed again while resident -> current
    assert pol.victim([(1, 1), (1, 2)], P(1, 0)) == (1, 2)


def _tiny_ctx(model, layer_rank: int = 0, lookahead: int = 1):
    from moeflow.moe import RouterTap, get_adapter

    ad = get_adapter(model)
    tap = RouterTap(ad)
    ids = torch.randint(3, 200, (1, 7), generator=torch.Generator().manual_seed(1))
    with tap.attach(), torch.no_grad():
        model(ids)
    l = ad.moe_layers[layer_rank]
    ev = tap.events[l][0]
    ctx = LayerContext(
        pos=P(0, 0),
        layer=l,
        moe_layers=ad.moe_layers,
        num_experts=ad.spec.num_experts,
        top_k=ad.spec.top_k,
        router_input=ev.x,
        logits=ev.logits,
        indices=ev.indices,
        weights=ev.weights,
        predict_logits=ad.router_logits,
        lookahead=lookahead,
    )
    return ad, ctx


def test_pregate_is_next_layer_router_topk_times_overfetch(tiny_models):
    model = tiny_models("olmoe")
    ad, ctx = _tiny_ctx(model)
    nxt = ad.moe_layers[1]
    with torch.no_grad():
        logits = ad.router_logits(nxt, ctx.router_input)  # [T,E]
    for factor, m in [(1.0, ad.spec.top_k), (1.5, 3), (2.0, 4)]:
        want = {(nxt, e) for e in logits.topk(m, dim=-1).indices.flatten().tolist()}
        got = PREFETCH.create("pregate", overfetch=factor).propose(ctx)
        assert {r.key for r in got} == want
        assert [r.priority for r in got] == sorted((r.priority for r in got), reverse=True)
    # the router's own top-k for that layer (without overfetch) is what the layer would choose
    _, idx = ad.select(nxt, logits)
    assert {(nxt, e) for e in idx.flatten().tolist()} == {r.key for r in PREFETCH.create("pregate").propose(ctx)}


def test_pregate_lookahead_and_score_modes(tiny_models):
    model = tiny_models("olmoe")
    ad, ctx = _tiny_ctx(model, lookahead=2)
    got = PREFETCH.create("pregate").propose(ctx)
    layers = {r.key[0] for r in got}
    assert layers == set(ad.moe_layers[1:3])
    first = [r.key[0] for r in got]
    assert first == sorted(first)  # nearer layer first (higher priority)
    # mass=1.0 keeps every expert; a low percentile keeps more than a high one
    allk = PREFETCH.create("pregate", mass=1.0, lookahead=1).propose(ctx)
    assert len(allk) == ad.spec.num_experts
    lo = PREFETCH.create("pregate", percentile=10, lookahead=1).propose(ctx)
    hi = PREFETCH.create("pregate", percentile=90, lookahead=1).propose(ctx)
    assert len(hi) < len(lo) <= ad.spec.num_experts


def test_all_next_layer_is_every_expert_of_the_next_layer_only(tiny_models):
    model = tiny_models("olmoe")
    ad, ctx = _tiny_ctx(model)
    got = PREFETCH.create("all-next-layer").propose(ctx)
    assert sorted(r.key for r in got) == [(ad.moe_layers[1], e) for e in range(ad.spec.num_experts)]
    last = LayerContext(**{**ctx.__dict__, "layer": ad.moe_layers[-1]})
    assert PREFETCH.create("all-next-layer").propose(last) == []
    assert PREFETCH.create("none").propose(ctx) == []
