"""Device expert cache and engine mechanics: capacity bound, counters, refusals, restore, observers."""

from __future__ import annotations

import pytest
import torch

from moeflow.errors import ConfigError
from moeflow.moe import get_adapter
from moeflow.policies import EVICTION, LayerContext, PrefetchPolicy, PrefetchRequest
from moeflow.policies.parse import opts_dict, parse_capacity, parse_opts
from moeflow.runtime.engine import OffloadEngine
from moeflow.runtime.generate import build_engine, create_policy, generate_one
from moeflow.runtime.link import DirectLink
from moeflow.stages.run_config import RunConfig

NEW = 8


@pytest.fixture(scope="module")
def model():
    from moeflow.models import tiny_model

    return tiny_model("olmoe", num_experts=16, top_k=4, num_hidden_layers=4)  # 64 routed experts


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 250, (1, 10), generator=torch.Generator().manual_seed(3))


class Recorder:
    """Wraps an eviction policy: checks the capacity bound at every insert and records events."""

    def __init__(self, inner, engine_ref):
        self.inner, self.engine_ref = inner, engine_ref
        self.name = inner.name
        self.events: list[str] = []
        self.max_resident = 0

    def __getattr__(self, a):
        return getattr(self.inner, a)

    def on_insert(self, key, pos, *, prefetched):
        cache = self.engine_ref[0].cache
        self.max_resident = max(self.max_resident, cache.num_resident())
        self.events.append("insert")
        self.inner.on_insert(key, pos, prefetched=prefetched)

    def on_evict(self, key):
        self.events.append("evict")
        self.inner.on_evict(key)

    def victim(self, candidates, pos):
        cache = self.engine_ref[0].cache
        for k in candidates:  # only resident, unpinned, not in-flight slots are offered
            s = cache.slot_of[k]
            assert not cache.slots[s].pinned and cache.slots[s].state == "ready"
        return self.inner.victim(candidates, pos)


@pytest.mark.parametrize("ev", ["lru", "least-stale"])
@pytest.mark.parametrize("pf", ["none", "pregate", "all-next-layer"])
def test_capacity_bound_and_counters(model, prompt, ev, pf):
    spec = get_adapter(model).spec
    C = 12
    ref_box: list = []
    rec = Recorder(create_policy(EVICTION, ev), ref_box)
    eng = OffloadEngine(
        model,
        capacity=C,
        link=DirectLink(),
        eviction=rec,
        prefetch=create_policy(__import__("moeflow.policies", fromlist=["PREFETCH"]).PREFETCH, pf),
    )
    ref_box.append(eng)
    passes = []
    eng.observers.append(passes.append)
    with eng:
        _, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
        c = eng.cache.counters
        assert eng.cache.num_resident() <= C
    assert rec.max_resident <= C
    assert c.hits + c.misses == c.accesses
    assert c.misses == c.demand_loads and c.late <= c.hits
    assert c.loads == c.demand_loads + c.prefetch_issued
    assert c.bytes_moved == c.loads * eng.store.expert_bytes
    assert m.link_bytes == c.bytes_moved  # every copy completed and was counted
    assert rec.events.count("insert") == c.loads
    assert rec.events.count("evict") == c.evictions == c.loads - eng.cache.num_resident()
    assert c.prefetch_used <= c.prefetch_issued
    assert c.prefetch_unused_evicted <= c.prefetch_issued - c.prefetch_used
    assert c.collision_misses <= c.misses
    if pf == "none":
        assert c.prefetch_issued == 0
    if pf == "all-next-layer":
        assert c.prefetch_issued > 0
    # per-pass stats add up to the run and there is one per generated token
    assert len(passes) == NEW
    assert sum(p.counters.accesses for p in passes) == c.accesses
    assert sum(sum(p.loads_by_layer.values()) for p in passes) == c.loads
    assert all(p.tokens == (10 if i == 0 else 1) for i, p in enumerate(passes))
    # decode accesses: one per unique expert per layer per token
    assert m.decode_counters.accesses <= (NEW - 1) * spec.top_k * spec.num_moe_layers


def test_capacity_below_topk_refused(model):
    spec = get_adapter(model).spec
    with pytest.raises(ConfigError, match=f"at least {spec.top_k}"):
        build_engine(model, mode="offload", link=DirectLink(), capacity=spec.top_k - 1).attach()
    with pytest.raises(ConfigError, match=f"at least {spec.top_k * spec.num_moe_layers}"):
        build_engine(
            model, mode="offload", link=DirectLink(), capacity=spec.top_k * spec.num_moe_layers - 1, per_layer=True
        ).attach()
    with pytest.raises(ConfigError, match="at most"):
        build_engine(model, mode="offload", link=DirectLink(), capacity=spec.total_experts + 1).attach()
    # a refused engine left the model untouched
    assert model.config._experts_implementation == "grouped_mm"
    assert all(p.numel() > 0 for p in get_adapter(model).per_expert_params(spec.moe_layers[0]).values())


def test_restore_is_exact_and_frees_device(model, prompt):
    ad = get_adapter(model)
    before = {l: {n: p.detach().clone() for n, p in ad.per_expert_params(l).items()} for l in ad.moe_layers}
    eng = build_engine(model, mode="offload", link=DirectLink(), capacity=8, eviction="lru", prefetch="pregate")
    with eng:
        assert model.config._experts_implementation == "moeflow"
        assert eng.store.device_numel() == 0
        assert ad.experts(ad.moe_layers[0])._moeflow_layer == ad.moe_layers[0]
        assert ad.experts(ad.moe_layers[0])._moeflow_owner is eng
        assert eng.cache.buffer.shape[0] == 8
        generate_one(model, prompt, eng, max_new_tokens=2)
    assert model.config._experts_implementation == "grouped_mm"
    assert not hasattr(ad.experts(ad.moe_layers[0]), "_moeflow_owner")
    assert not hasattr(ad.experts(ad.moe_layers[0]), "_moeflow_layer")
    for l in ad.moe_layers:
        for n, p in ad.per_expert_params(l).items():
            assert torch.equal(p, before[l][n]) and p.is_contiguous()


def test_collision_misses_at_topk(model, prompt):
    spec = get_adapter(model).spec
    eng = build_engine(model, mode="offload", link=DirectLink(), capacity=spec.top_k, eviction="lru", prefetch="none")
    with eng:
        _, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
    d = m.decode_counters
    # each layer's demand evicts every other layer: whatever a decode pass needs was evicted earlier in it
    assert d.hits == 0 and d.misses == d.accesses
    assert 0 < d.collision_misses <= d.misses


def test_lookahead_reaches_prefetch_context(model, prompt):
    seen: list[tuple[int, list[int]]] = []

    class Probe(PrefetchPolicy):
        name = "probe"
        needs_residual = True

        def propose(self, ctx: LayerContext):
            seen.append((ctx.lookahead, ctx.next_layers()))
            assert ctx.router_input.shape[-1] == model.config.hidden_size
            assert ctx.residual is not None and ctx.residual.shape == ctx.router_input.shape
            assert ctx.token_ids is not None and ctx.token_ids.numel() == ctx.router_input.shape[0]
            assert ctx.predict_logits(ctx.moe_layers[-1], ctx.router_input).shape[-1] == ctx.num_experts
            return [PrefetchRequest((t, 0), 1.0) for t in ctx.next_layers()]

    eng = OffloadEngine(
        model, capacity=16, link=DirectLink(), eviction=create_policy(EVICTION, "lru"), prefetch=Probe(), lookahead=1
    )
    steps = []
    eng.observers.append(lambda st: setattr(eng, "lookahead", 2) or steps.append(st.lookahead))
    with eng:
        generate_one(model, prompt, eng, max_new_tokens=3)
    assert steps == [1, 2, 2]
    assert {s for s, _ in seen} == {1, 2}
    assert all(len(nl) <= s for s, nl in seen) and any(len(nl) == 2 for _, nl in seen)


def test_parse_capacity_and_opts():
    assert parse_capacity("25%", total_experts=64, expert_bytes=1000) == 16
    assert parse_capacity("10", total_experts=64, expert_bytes=1000) == 10
    assert parse_capacity("64KB", total_experts=64, expert_bytes=1000) == 64
    assert parse_capacity("1KiB", total_experts=64, expert_bytes=512) == 2
    with pytest.raises(ConfigError):
        parse_capacity("lots", total_experts=64, expert_bytes=1000)
    with pytest.raises(ConfigError):
        parse_capacity("150%", total_experts=64, expert_bytes=1000)
    assert opts_dict(parse_opts(["overfetch=1.5", "lookahead=2", "right=farthest"])) == {
        "overfetch": 1.5,
        "lookahead": 2,
        "right": "farthest",
    }
    with pytest.raises(ConfigError, match="--sweep"):
        RunConfig(model="m", prompt=("x",), evictions=("lru", "lfu"))
    with pytest.raises(ConfigError, match="unknown eviction"):
        create_policy(EVICTION, "belady-please")


def test_emulated_link_engine_stalls_and_stays_exact(model, prompt):
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    from moeflow.runtime.link import EmulatedLink

    link = EmulatedLink(gbps=0.05, latency_s=20e-6)  # ~0.5 ms per 24.6 KB expert
    eng = build_engine(model, mode="offload", link=link, capacity=16, eviction="lru", prefetch="pregate")
    with eng:
        out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
    assert torch.equal(out, ref)
    c = m.counters
    assert c.stall_s > 0 and m.stall_share is not None and 0 < m.stall_share < 1
    assert m.link_bytes == c.bytes_moved
    # the link's virtual schedule: each load took exactly 20 us + its bytes at 0.05 GB/s
    assert m.link_busy_s == pytest.approx(c.bytes_moved / 0.05e9 + c.loads * 20e-6, rel=1e-9)
    assert m.effective_gbps < 0.05


def test_prefetch_precision_counts_each_window_own_copies(model):
    """Hand-computed: a copy prefetched during prefill and first used while decoding counts for the
    generation, not for the decode passes; a copy from an earlier generation counts for neither."""
    from moeflow.runtime.cache import ExpertCache
    from moeflow.runtime.metrics import RunMetrics
    from moeflow.sim.link import InstantLink

    spec = get_adapter(model).spec
    cache = ExpertCache(None, spec.total_experts, link=InstantLink(), eviction=None, spec=spec, expert_bytes=1)
    l0, l1 = spec.moe_layers[0], spec.moe_layers[1]

    def use(layer, experts):
        cache.begin_layer(layer)
        cache.release(cache.route(layer, experts, {e: 1.0 for e in experts}, 16))

    def window(c0, c1):
        return c1 - c0

    cache.mark_phase(new_generation=True)
    g0 = cache.counters.copy()
    cache.begin_pass(0)  # prefill: prefetch A=(l1,0), B=(l1,1), X=(l1,2); use A
    assert cache.prefetch([PrefetchRequest((l1, e), priority=1.0) for e in (0, 1, 2)], l0) == 3
    use(l1, [0])
    cache.mark_phase()
    d0 = cache.counters.copy()
    cache.begin_pass(1)  # decode: use B (prefill's copy); prefetch C=(l1,3); use C
    use(l1, [1])
    assert cache.prefetch([PrefetchRequest((l1, 3), priority=1.0)], l0) == 1
    use(l1, [3])
    dec, gen = window(d0, cache.counters), window(g0, cache.counters)
    assert (dec.prefetch_issued, dec.prefetch_used, dec.prefetch_used_prior_phase) == (1, 2, 1)
    m = RunMetrics(counters=gen, decode_counters=dec)
    assert m.decode_prefetch_precision == 1.0  # C of C (used / issued would say 2 / 1)
    assert m.prefetch_precision == 0.75  # A, B, C of A, B, X, C
    assert m.decode_prefetch_recall == 1.0  # both decode accesses were prefetched copies
    cache.mark_phase(new_generation=True)  # a second generation uses X, prefetched by the first
    g1 = cache.counters.copy()
    cache.begin_pass(2)
    use(l1, [2])
    gen2 = window(g1, cache.counters)
    assert (gen2.prefetch_used, gen2.prefetch_used_prior_generation, gen2.prefetch_issued) == (1, 1, 0)
    assert RunMetrics(counters=gen2).prefetch_precision is None  # nothing issued: no precision
    assert RunMetrics.total([m, RunMetrics(counters=gen2)]).prefetch_precision == 0.75


def test_prefetch_precision_at_full_capacity_is_a_share(model):
    """Every expert fits (C = 100%): copies prefetched for one prompt are used by the next one and prefill
    copies while decoding; the precision stays a share in [0, 1] in every window (one prompt, its decode
    passes, the whole run) although used copies outnumber the ones a window issued."""
    from moeflow.runtime.metrics import RunMetrics

    prompts = [torch.randint(3, 250, (1, 2), generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
    spec = get_adapter(model).spec
    eng = build_engine(model, mode="offload", link=DirectLink(), capacity=spec.total_experts, eviction="lru", prefetch="pregate")
    with eng:
        ms = [generate_one(model, p, eng, max_new_tokens=16, min_new_tokens=16)[1] for p in prompts]
    runs = [*ms, RunMetrics.total(ms)]
    for m in runs:
        for p in (m.prefetch_precision, m.decode_prefetch_precision):
            assert p is None or 0.0 <= p <= 1.0
    assert runs[-1].prefetch_precision is not None and runs[-1].decode_prefetch_precision is not None
    windows = [c for m in runs for c in (m.counters, m.decode_counters)]
    assert any(c.prefetch_used > c.prefetch_issued for c in windows)  # the case is exercised


def test_routed_counts_sums_bit_identical_to_unique_path():
    """A prefill's needed experts summed by expert id (`routed_counts`) equal the unique/searchsorted path bit for
    bit (the same float32 additions in row order), with the rows per expert; ids beyond a quarter left unrouted."""
    from moeflow.runtime.counters import needed_experts, routed_counts

    g = torch.Generator().manual_seed(3)
    for E, S in ((32, 1024), (64, 300), (8, 9)):
        flat = torch.randint(0, E - E // 4, (S,), generator=g)  # [S] some experts never routed
        w = torch.rand(S, generator=g) * torch.tensor(1e3).pow(torch.rand(S, generator=g))  # [S] wide range
        experts, scores = needed_experts(flat, w)  # the unique path (no num_experts)
        got_e, got_s, per = routed_counts(flat, w, E)
        assert got_e == experts and list(got_s) == list(scores)
        assert all(torch.tensor(got_s[e]).view(torch.int32) == torch.tensor(scores[e]).view(torch.int32) for e in experts)
        assert per == torch.bincount(flat, minlength=E).tolist() and sum(per) == S
        assert needed_experts(flat, w, E) == (experts, scores)
