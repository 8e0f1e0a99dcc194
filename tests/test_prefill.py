"""The staged prefill path (`moeflow.runtime.prefill`) and the TTFT bound.

Staged prefill is token-identical (and its logits bit-identical) to the resident model down to capacity top-k,
where a layer's experts are computed in chunks; it never pins more slots than the cache holds; it demands a
layer's next wave before computing the current one and stages the next layer's predicted experts, so a cold
prefill already finds experts resident (the serial path finds none); the bound counts the routed experts not
resident when the prefill began, and `moeflow run --json` reports `ttft_bound_ratio` per configuration.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from moeflow.errors import ConfigError
from moeflow.moe import get_adapter
from moeflow.runtime.engine import OffloadEngine
from moeflow.runtime.generate import build_engine, generate_one
from moeflow.runtime.link import DirectLink, EmulatedLink
from moeflow.runtime.metrics import RunMetrics

NEW = 6


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(3, 250, (1, 24), generator=g)  # [1,P]: routes more experts per layer than top-k slots


def _caps(spec) -> list[int]:
    return sorted({spec.top_k, max(spec.top_k, spec.total_experts // 4), spec.total_experts})


@pytest.mark.parametrize("arch", ["olmoe", "mixtral", "qwen3_moe", "gpt_oss"])
def test_staged_prefill_exact_down_to_top_k(tiny_models, arch, prompt):
    model = tiny_models(arch)
    spec = get_adapter(model).spec
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    with torch.no_grad():
        ref_logits = model(prompt).logits
    for cap in _caps(spec):
        for pf in ("none", "pregate"):
            eng = build_engine(model, mode="offload", link=DirectLink(), capacity=cap, eviction="lru", prefetch=pf)
            assert eng is not None and eng.prefill_path == "staged"  # the default
            with eng:
                with torch.no_grad():
                    logits = model(prompt).logits
                chunks = eng._prefill.waves_run if eng._prefill is not None else 0
                out, _ = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
            assert torch.equal(logits, ref_logits), f"{arch} C={cap} {pf}: prefill logits differ"
            assert torch.equal(out, ref), f"{arch} C={cap} {pf}: {out.tolist()} != {ref.tolist()}"
            if cap == spec.top_k:  # a layer routes more experts than the cache holds: computed in chunks
                assert chunks > spec.num_moe_layers


def _pinned_and_resident(model, prompt, cap: int, per_layer: bool) -> list[tuple[int, int]]:
    """(pinned slots, resident experts) after every demand, staged batch and release of a staged generation; the
    cache's count of pinned slots (`_pinned_n`, which spares `_any_candidate` a scan) checked against them."""
    eng = build_engine(
        model, mode="offload", link=EmulatedLink(50.0), capacity=cap, eviction="lru", prefetch="pregate", per_layer=per_layer
    )
    assert eng is not None
    seen: list[tuple[int, int]] = []
    with eng:
        cache = eng.cache
        demand, stage = cache.demand, cache.stage

        def spy(fn):
            def call(*a, **k):
                out = fn(*a, **k)
                pinned = sum(s.pinned for s in cache.slots)
                assert cache._pinned_n == pinned
                seen.append((pinned, cache.num_resident()))
                return out

            return call

        release = cache.release
        cache.demand, cache.stage, cache.release = spy(demand), spy(stage), spy(release)  # type: ignore[method-assign]
        generate_one(model, prompt, eng, max_new_tokens=2, min_new_tokens=2)
    return seen


def test_staged_prefill_never_pins_more_than_the_cache(tiny_models, prompt):
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    for cap, per_layer in ((spec.top_k, False), (spec.top_k * spec.num_moe_layers, True)):
        seen = _pinned_and_resident(model, prompt, cap, per_layer)
        assert seen and all(r <= cap for _, r in seen)
        part = cap // spec.num_moe_layers if per_layer else cap
        assert max(p for p, _ in seen) <= part  # one layer's waves at a time, at most its part


def test_staged_prefill_overlaps_copies_with_compute(tiny_models, prompt):
    """Cold cache: the serial path waits for each wave with nothing else pinned; the staged path demands the next
    wave before one waits (two waves pinned at a wait). With a prefetch policy it also stages the next layer's
    predicted experts; with `none` it copies nothing speculatively."""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    cap = spec.total_experts // 4
    seen = {}
    for path in ("serial", "staged"):
        for pf in ("none", "pregate"):
            opts = {"overfetch": 0.25} if pf == "pregate" else None  # the policy: each token's top-1; staging: top-k
            eng = build_engine(
                model,
                mode="offload",
                link=EmulatedLink(50.0),
                capacity=cap,
                eviction="lru",
                prefetch=pf,
                prefetch_opts=opts,
                prefill=path,
            )
            assert eng is not None
            most = [0]
            with eng:
                cache = eng.cache
                wait = cache.wait

                def spy_wait(slots, _wait=wait, _cache=cache, _most=most):
                    _most[0] = max(_most[0], sum(s.pinned for s in _cache.slots) - len(slots))
                    return _wait(slots)

                cache.wait = spy_wait  # type: ignore[method-assign]
                c0 = cache.counters.copy()
                with torch.no_grad():
                    model(prompt)
                c = cache.counters - c0
                staged = eng._prefill.staged if eng._prefill is not None else 0
            seen[path, pf] = (most[0], staged, c.prefetch_issued)
    assert seen["serial", "none"][0] == 0 and seen["staged", "none"][0] > 0  # the next wave pinned while one waits
    assert seen["staged", "none"][1:] == (0, 0)  # no speculative copy without a prefetch policy
    assert seen["staged", "pregate"][1] > 0 and seen["serial", "pregate"][1] == 0  # the next layer staged


def test_staged_prefill_stages_its_first_layers_at_pass_start(tiny_models, prompt):
    """With a prefetch policy, when the first router runs the staged prefill already copies the first MoE layer's
    experts predicted from the embeddings (and nothing else: the later layers' wait for the first layer's experts
    call, off the path to the first router); when the second router runs, the later layers' are staged too, into
    empty slots only (nothing evicted); the serial path and `none` copy nothing before the first router. The bound
    still counts every routed expert (the staged copies were not resident when the prefill began)."""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    first = spec.moe_layers[0]
    for cap in (spec.num_experts, spec.total_experts):  # one layer's worth, every expert
        seen = {}
        for path, pf in (("staged", "pregate"), ("staged", "none"), ("serial", "pregate")):
            eng = build_engine(
                model, mode="offload", link=EmulatedLink(50.0), capacity=cap, eviction="lru", prefetch=pf, prefill=path
            )
            assert eng is not None
            with eng:
                cache, step = eng.cache, eng.step
                at_router: list[tuple[set, int]] = []
                route = step.route

                def spy(ev, _route=route, _cache=cache, _seen=at_router):
                    if len(_seen) < 2:
                        _seen.append((set(_cache.slot_of), _cache.counters.evictions))
                    return _route(ev)

                step.route = spy  # type: ignore[method-assign]
                with torch.no_grad():
                    model(prompt)
                needed = eng._prefill.needed if eng._prefill is not None else -1
            seen[path, pf] = (at_router[0], needed, at_router)
        (keys, evicted), needed, routers = seen["staged", "pregate"]
        layers = {l for l, _ in keys}
        assert layers == {first} and evicted == 0 and len(keys) <= cap, f"C={cap}: {sorted(keys)}"
        if cap == spec.total_experts:  # room for more than the first layer: the later ones staged by the second router
            keys2, evicted2 = routers[1]
            assert spec.moe_layers[2] in {l for l, _ in keys2} and evicted2 == 0, sorted(keys2)
        assert seen["staged", "none"][0][0] == set() and seen["serial", "pregate"][0][0] == set()
        assert needed == seen["serial", "pregate"][1] == seen["staged", "none"][1] > 0  # the bound's copies


def test_staged_waves_are_runs_of_consecutive_experts(tiny_models):
    """A layer's waves cut its routed experts (sorted by id) into runs of consecutive ones (each wave one slice of
    the sorted rows), at most ceil(still to copy / PIPELINE) still to copy per wave, whatever is ready."""
    from moeflow.runtime.prefill import PIPELINE

    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    now = [0.0]
    link = EmulatedLink(1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    eng = build_engine(model, mode="offload", link=link, capacity=spec.total_experts, eviction="lru", prefetch="none")
    assert eng is not None
    with eng:
        pf, cache, layer, E = eng._prefill, eng.cache, spec.moe_layers[0], spec.num_experts
        assert pf is not None
        cache.stage([(layer, 1), (layer, 5)], layer)
        link.drain()  # virtual time: these two are ready
        cache.stage([(layer, 0), (layer, 2), (layer, 3)], layer)  # in flight
        experts = list(range(E))
        waves = pf.plan(layer, experts)
        g = -(-(E - 2) // PIPELINE)
        assert [e for w in waves for e in w] == experts  # runs of consecutive experts, in order
        assert len(waves) > 1 and all(sum(e not in (1, 5) for e in w) <= g for w in waves)


def _slot_views(model, C: int, seed: int):
    """The first experts module of `model`, a random slot buffer [C,R] of its expert tensors with a strided view per
    tensor (as `ExpertLayout.views`), and the generator that drew it (for the rows)."""
    module = next(m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj"))
    names = ["gate_up_proj" if module.has_gate else "up_proj", "down_proj"]
    names += [n + "_bias" for n in names] if module.has_bias else []
    shapes = {n: getattr(module, n).shape[1:] for n in names}
    sizes = [int(torch.Size(s).numel()) for s in shapes.values()]
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(C, sum(sizes), generator=g, dtype=module.down_proj.dtype)  # [C,R] like the slot buffer
    views, o = {}, 0
    for n, size in zip(names, sizes):
        views[n] = buf[:, o : o + size].unflatten(1, shapes[n])  # [C, ...] strided
        o += size
    return module, views, g


@pytest.mark.parametrize("arch", ["olmoe", "gpt_oss"])
def test_in_place_grouped_call_is_bit_identical(tiny_models, arch):
    """Experts whose slots ascend are read in place (`grouped_experts_in_place`: one group per slot of the span,
    the unused slots empty groups) with the same result as gathering each expert's weights from its slot;
    `slot_span` gives a span only for ascending slots that fill at least half of it."""
    from moeflow.moe.compute import grouped_experts, grouped_experts_in_place
    from moeflow.runtime.prefill import slot_span

    assert slot_span([3, 4, 6, 7]) == (3, 8)
    assert slot_span([4, 3]) is None and slot_span([1, 9]) is None and slot_span([]) is None
    module, views, g = _slot_views(tiny_models(arch), 12, seed=5)
    slots = [2, 3, 5, 6, 7, 9]  # ascending with the experts, with unused slots between
    counts = torch.tensor([3, 0, 5, 1, 4, 2])  # rows per expert (one expert without rows)
    rows = torch.repeat_interleave(torch.tensor(slots), counts)  # [N] slot of each row
    eg = torch.repeat_interleave(torch.tensor([1, 4, 6, 7, 10, 11]), counts)  # [N] expert ids, sorted
    x = torch.randn(int(counts.sum()), module.down_proj.shape[1 if not module.is_transposed else 2], generator=g)
    x = x.to(module.down_proj.dtype)  # [N,H]
    with torch.no_grad():
        ref = grouped_experts(module, x, eg, views, rows, len(slots))
        got = grouped_experts_in_place(module, x, views, rows, (slots[0], slots[-1] + 1))
    assert torch.equal(got, ref)


@pytest.mark.parametrize("arch", ["olmoe", "gpt_oss"])
def test_wave_in_another_slot_order_is_read_in_place_bit_identically(tiny_models, arch):
    """A wave whose slots span densely but do not ascend with its experts (slots taken from evictions in another
    order) is computed in place on its rows taken in slot order and put back: the same result as gathering each
    expert's weights; ascending slots are read in place directly, sparse ones gathered."""
    from moeflow.moe.compute import grouped_experts, grouped_experts_in_place
    from moeflow.runtime.prefill import wave_rows

    module, views, g = _slot_views(tiny_models(arch), 16, seed=7)
    spans: list[tuple[int, int] | None] = []

    class Call:  # the experts call's `_grouped` over `views`
        def _grouped(self, module, x, eg, rows, groups, span=None):
            spans.append(span)
            if span is not None:
                return grouped_experts_in_place(module, x, views, rows, span)
            return grouped_experts(module, x, eg, views, rows, groups)

    counts = torch.tensor([3, 2, 5, 1, 4, 2])  # rows per expert
    eg = torch.repeat_interleave(torch.tensor([1, 4, 6, 7, 10, 11]), counts)  # [N] expert ids, sorted
    x = torch.randn(int(counts.sum()), module.down_proj.shape[1 if not module.is_transposed else 2], generator=g)
    x = x.to(module.down_proj.dtype)  # [N,H]
    for slots, kind in (([9, 3, 5, 2, 7, 6], "sorted"), ([2, 3, 5, 6, 7, 9], "ascending"), ([15, 0, 5, 2, 7, 6], None)):
        rows = torch.repeat_interleave(torch.tensor(slots), counts)  # [N] slot of each row
        spans.clear()
        with torch.no_grad():
            ref = grouped_experts(module, x, eg, views, rows, len(slots))
            got = wave_rows(Call(), module, x, eg, rows, slots)
        assert torch.equal(got, ref), slots
        assert spans == [None if kind is None else (min(slots), max(slots) + 1)], (slots, spans)


def test_staged_prefill_reads_ascending_slots_in_place(tiny_models, prompt, monkeypatch):
    """A cold staged prefill fills the slots in id order, so its waves' grouped calls read the weights in place,
    and the prefill stays bit-identical to the resident model."""
    from moeflow.runtime import experts_call

    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    with torch.no_grad():
        ref_logits = model(prompt).logits
    calls = []
    inner = experts_call.grouped_experts_in_place

    def spy(*a, **k):
        calls.append(a[4])
        return inner(*a, **k)

    monkeypatch.setattr(experts_call, "grouped_experts_in_place", spy)
    eng = build_engine(model, mode="offload", link=DirectLink(), capacity=spec.total_experts, eviction="lru", prefetch="none")
    assert eng is not None
    with eng, torch.no_grad():
        logits = model(prompt).logits
    assert calls and torch.equal(logits, ref_logits)


def test_staged_prefill_computes_landed_waves_in_one_call(tiny_models, prompt, monkeypatch):
    """The demanded waves after the current one whose copies have landed join its grouped call (at most w experts
    each): fewer calls than planned waves, bit-identical logits. Virtual clock; every demanded copy has landed once
    a wave's wait returns (a drain after each wait), so which waves join is deterministic."""
    from moeflow.runtime import prefill

    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    with torch.no_grad():
        ref_logits = model(prompt).logits
    now = [0.0]
    link = EmulatedLink(1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    eng = build_engine(model, mode="offload", link=link, capacity=spec.total_experts, eviction="lru", prefetch="none")
    assert eng is not None
    planned: list[int] = []
    calls: list[int] = []
    rows = prefill.wave_rows

    def spy_rows(call, module, x, eg, r, slots):
        calls.append(len(slots))
        return rows(call, module, x, eg, r, slots)

    monkeypatch.setattr(prefill, "wave_rows", spy_rows)
    with eng, torch.no_grad():
        pf, cache = eng._prefill, eng.cache
        assert pf is not None
        plan, wait = pf.plan, cache.wait

        def spy_plan(layer, experts):
            waves = plan(layer, experts)
            planned.append(len(waves))
            return waves

        def spy_wait(slots):
            stall = wait(slots)
            link.drain()  # every copy issued so far has landed
            return stall

        monkeypatch.setattr(pf, "plan", spy_plan)
        monkeypatch.setattr(cache, "wait", spy_wait)
        logits = model(prompt).logits
    assert torch.equal(logits, ref_logits)
    assert sum(planned) > len(planned)  # the cold layers were planned in several waves
    assert len(calls) == pf.waves_run < sum(planned) and max(calls) <= pf.wave


def test_staged_prefill_skips_a_policy_step_that_can_add_nothing(tiny_models, prompt):
    """With every expert of the later layers in a slot of a cache that holds them all, the prefill's prefetch policy
    step is not run (it could propose only resident experts, and nothing is ever evicted); below full capacity it runs."""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    ref, _ = generate_one(model, prompt, None, max_new_tokens=2, min_new_tokens=2)
    steps = {}
    for cap in (spec.total_experts, spec.total_experts - 1):
        eng = build_engine(model, mode="offload", link=EmulatedLink(50.0), capacity=cap, eviction="lru", prefetch="pregate")
        assert eng is not None
        with eng:
            eng.warm()  # every slot filled
            pf = eng._prefill
            assert pf is not None
            assert pf.step_useless(spec.moe_layers[0]) == (cap == spec.total_experts)
            seen: list[int] = []
            prefetch = eng.step.prefetch

            def spy(layer, *a, _seen=seen, _fn=prefetch, _pf=pf):
                if _pf.prefill:  # the prefill pass's steps (decode passes run theirs as before)
                    _seen.append(layer)
                return _fn(layer, *a)

            eng.step.prefetch = spy  # type: ignore[method-assign]
            out, _ = generate_one(model, prompt, eng, max_new_tokens=2, min_new_tokens=2)
        assert torch.equal(out, ref)
        steps[cap] = seen
    assert not steps[spec.total_experts] and steps[spec.total_experts - 1]


def _half_cache_pregate(model, prompt):
    """`model`'s spec, its stock greedy output for `prompt` (2 new tokens) and an offload engine over a fast emulated
    link with half of its experts cached, lru + pregate."""
    spec = get_adapter(model).spec
    ref, _ = generate_one(model, prompt, None, max_new_tokens=2, min_new_tokens=2)
    eng = build_engine(
        model, mode="offload", link=EmulatedLink(50.0), capacity=spec.total_experts // 2, eviction="lru", prefetch="pregate"
    )
    assert eng is not None
    return spec, ref, eng


def test_staged_prefill_runs_the_policy_step_only_where_nothing_stages_the_next_layer(tiny_models, prompt):
    """Below full capacity the staged prefill stages each next MoE layer from its pre-gate, so the prefetch policy's
    step (which would propose that layer again, at a host cost per layer) runs only after the last MoE layer; the
    next layers are still staged and the output stays exact."""
    model = tiny_models("olmoe")
    spec, ref, eng = _half_cache_pregate(model, prompt)
    with eng:
        pf = eng._prefill
        assert pf is not None
        seen: list[int] = []
        staged: list[int] = []
        prefetch, begin = eng.step.prefetch, pf.begin

        def spy(layer, *a, _fn=prefetch):
            if pf.prefill:
                seen.append(layer)
            return _fn(layer, *a)

        def ended(decode, _fn=begin):
            if pf.prefill:  # the prefill pass just ended: its staged copies
                staged.append(pf.staged)
            return _fn(decode)

        eng.step.prefetch = spy  # type: ignore[method-assign]
        pf.begin = ended  # type: ignore[method-assign]
        out, _ = generate_one(model, prompt, eng, max_new_tokens=2, min_new_tokens=2)
    assert torch.equal(out, ref)
    assert seen == [spec.moe_layers[-1]], seen
    assert staged and staged[0] > 0


def test_staged_prefill_start_copies_the_first_layer_before_predicting_the_rest(tiny_models, prompt):
    """At the pass start the first MoE layer's predicted experts are handed to the link before the later layers'
    predictions are computed (the link starts on them sooner); the device table matches the keys after each batch.
    (One slot short of every expert, a 4-token prompt: a prompt expected to route every expert stages them
    unpredicted where they fit, the next test.)"""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    eng = build_engine(
        model, mode="offload", link=EmulatedLink(50.0), capacity=spec.total_experts - 1, eviction="lru", prefetch="pregate"
    )
    assert eng is not None
    events: list[tuple[str, int]] = []
    with eng:
        pf, cache = eng._prefill, eng.cache
        assert pf is not None
        pregate, stage = pf._pregate, cache.stage

        def table_matches():  # between batches (each writes the device table once, at its end)
            assert cache.table is not None
            for (l, e), s in cache.slot_of.items():
                assert int(cache.table[cache.rank[l], e]) == s
            assert int((cache.table >= 0).sum()) == len(cache.slot_of)

        def spy_pregate(layer, x):
            table_matches()
            events.append(("predict", layer))
            return pregate(layer, x)

        def spy_stage(keys, layer):
            n = stage(keys, layer)
            events.append(("stage", layer))
            return n

        pf._pregate, cache.stage = spy_pregate, spy_stage  # type: ignore[method-assign]
        pf.begin(decode=False)
        with torch.no_grad():
            x = model.get_input_embeddings()(prompt[:, :4])  # [1,4,H]
        pf.start(x)
        table_matches()
        assert {l for l, _ in cache.slot_of} == {spec.moe_layers[0]}  # the later layers: `stage_later`
        pf.stage_later()
        table_matches()
        assert {l for l, _ in cache.slot_of} == set(spec.moe_layers)  # staged one layer at a time
    assert events == [e for l in spec.moe_layers for e in (("predict", l), ("stage", l))], events


def test_staged_prefill_stages_every_expert_unpredicted_when_all_fit_and_all_are_routed(tiny_models, prompt):
    """A cache of every expert and a prompt expected to route every expert of each layer (`_routes_every`: E=8,
    k=2, 8 x 0.75^24 < 0.5): the pass start stages all experts of every layer, layer by layer, without computing
    a pre-gate; a prompt too short for that (4 tokens: 8 x 0.75^4 >= 0.5) predicts each layer's experts; one slot
    short of every expert, the 24-token prompt predicts only the last layer's, the one whose empty slots cannot
    take all its experts (the pre-gate then picks which: the most-routed)."""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    layers = list(spec.moe_layers)
    for ids, cap, every, want in (
        (prompt, spec.total_experts, True, []),
        (prompt[:, :4], spec.total_experts, False, layers),
        (prompt, spec.total_experts - 1, False, layers[-1:]),
    ):
        eng = build_engine(model, mode="offload", link=EmulatedLink(50.0), capacity=cap, eviction="lru", prefetch="pregate")
        assert eng is not None
        with eng:
            pf, cache = eng._prefill, eng.cache
            assert pf is not None
            predicted: list[int] = []
            pregate = pf._pregate

            def spy(layer, x, pregate=pregate, predicted=predicted):
                predicted.append(layer)
                return pregate(layer, x)

            pf._pregate = spy  # type: ignore[method-assign]
            pf.begin(decode=False)
            with torch.no_grad():
                x = model.get_input_embeddings()(ids)  # [1,P,H]
            pf.start(x)
            pf.stage_later()
            assert predicted == want
            if every:
                assert len(cache.slot_of) == spec.total_experts


def test_ttft_bound_counts_the_copies_a_prefill_needs(tiny_models, prompt):
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    _, res = generate_one(model, prompt, None, max_new_tokens=2, min_new_tokens=2)
    assert res.ttft_bound_ratio == 1.0 and res.ttft_bound_source == "resident"
    link = EmulatedLink(5.0, 2e-6)
    eng = build_engine(
        model, mode="offload", link=link, capacity=spec.total_experts, eviction="lru", prefetch="none", prefill="serial"
    )
    assert eng is not None
    with eng:
        _, cold = generate_one(model, prompt, eng, max_new_tokens=2, min_new_tokens=2)
        prefill_accesses = cold.counters.accesses - cold.decode_counters.accesses  # cold and every expert fits: all copied
        _, warm = generate_one(model, prompt, eng, max_new_tokens=2, min_new_tokens=2)
    per = link.transfer_s(eng.store.expert_bytes)
    assert cold.prefill_needed == prefill_accesses > 0
    assert cold.prefill_xfer_s_sum == pytest.approx(cold.prefill_needed * per)
    assert warm.prefill_needed == 0 and warm.prefill_xfer_s_sum == 0  # everything was resident when it began
    assert cold.ttft_bound_source == "compute"  # no resident TTFT given: the engine's own prefill compute
    assert cold.ttft_bound_s == pytest.approx(max(cold.prefill_compute_s_sum, cold.prefill_xfer_s_sum))
    r = res.ttft_s or 0.0
    cold.set_ttft_bound(r)
    assert cold.ttft_bound_source == "resident"
    assert cold.ttft_bound_s == pytest.approx(max(r, cold.prefill_needed * per))
    assert cold.ttft_bound_ratio == pytest.approx((cold.ttft_s or 0.0) / max(r, cold.prefill_needed * per))


def test_ttft_bound_merges_over_batches():
    a = RunMetrics(prompts=2, ttft_s_sum=0.4, prefill_xfer_s_sum=0.3, prefill_compute_s_sum=0.1)
    b = RunMetrics(prompts=1, ttft_s_sum=0.5, prefill_xfer_s_sum=0.05, prefill_compute_s_sum=0.2)
    a.set_ttft_bound(0.1)  # bound per prompt max(0.1, 0.15)
    b.set_ttft_bound(None)  # max(0.2, 0.05)
    t = RunMetrics.total([a, b])
    assert t.ttft_bound_s_sum == pytest.approx(0.15 * 2 + 0.2)
    assert t.ttft_bound_ratio == pytest.approx(0.9 / (0.15 * 2 + 0.2))
    assert t.ttft_bound_source == "mixed" and a.ttft_bound_source == "resident" and b.ttft_bound_source == "compute"
    d = t.to_dict()
    assert d["ttft_bound_ratio"] == t.ttft_bound_ratio and "prefill_xfer_s" in d


def test_prefill_path_refused(tiny_models):
    with pytest.raises(ConfigError, match="--prefill"):
        OffloadEngine(tiny_models("olmoe"), capacity=8, link=DirectLink(), eviction=None, prefill="eager")


def test_emulated_link_batch_copies_on_the_same_schedule():
    now = [0.0]
    link = EmulatedLink(1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    src = [torch.full((250,), float(i)) for i in range(3)]  # 1000 bytes each: 1 us on 1 GB/s
    dst = [torch.zeros(250) for _ in range(3)]
    with link.batch():
        ts = [link.submit(s, d) for s, d in zip(src, dst)]
    assert [t.due for t in ts] == pytest.approx([1e-6, 2e-6, 3e-6])
    link.wait(ts[-1])
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    with link.batch():  # a wait inside a batch hands the held copies over first (no deadlock)
        t = link.submit(src[0], dst[1])
        link.wait(t)
    assert torch.equal(dst[1], src[0])
    link.close()


def test_emulated_link_hands_a_batch_over_as_one():
    """A batch's copies share one `copied` event (set once by the copying thread); a prefetch withdrawn before
    the batch is handed over is not copied."""
    now = [0.0]
    link = EmulatedLink(1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    src = [torch.full((250,), float(i + 1)) for i in range(3)]  # 1000 bytes each: 1 us on 1 GB/s
    dst = [torch.zeros(250) for _ in range(3)]
    with link.batch():
        ts = [link.submit(s, d, demand=False) for s, d in zip(src, dst)]
        assert link.cancel(ts[2])  # not started: withdrawn
    assert len({id(t.copied) for t in ts}) == 1
    link.wait(ts[1])
    assert ts[2].copied.wait(5)
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[1], src[1]) and torch.equal(dst[2], torch.zeros(250))
    one = link.submit(src[0], dst[2])  # outside a batch: its own event
    assert one.copied is not ts[0].copied
    link.close()
    assert link.bytes == link.submitted_bytes == 3000


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from moeflow.lmtrain.tokenizer import train_tokenizer
    from moeflow.models import tiny_model

    d = tmp_path_factory.mktemp("ckpt")
    text = ["the king said to the queen that the night was long", "to be or not to be, that is the question"] * 20
    tok = train_tokenizer(text, vocab_size=200)
    tiny_model("olmoe", num_experts=8, top_k=2).save_pretrained(d)
    tok.save_pretrained(d)
    (d.parent / "p.txt").write_text("the king said to the queen that the night was long\nto be or not\n")
    return d


def test_run_json_reports_ttft_bound_ratio(ckpt, capsys):
    from moeflow.cli.app import main

    args = ["run", "-m", str(ckpt), "--prompts", str(ckpt.parent / "p.txt"), "--max-new-tokens", "3"]
    args += ["--sweep", "--mode", "offload,resident", "-c", "2,100%", "-f", "none", "--link", "emulated:1,5"]
    args += ["--threads", "1", "--json", "--no-warmup", "--miss", "fetch"]  # every miss copied (auto: none on CPU)
    try:
        main(args)
    except SystemExit as e:
        assert e.code in (0, None)
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    runs = res["runs"]
    assert [r["mode"] for r in runs] == ["offload", "offload", "resident"]
    for r in runs:
        assert r["ttft_bound_ratio"] is not None and r["ttft_bound_ratio"] > 0
        assert r["metrics"]["ttft_bound_ratio"] == r["ttft_bound_ratio"]
        assert r["metrics"]["ttft_bound_source"] == "resident"  # the resident run ran last: bounds fixed up after it
    assert runs[-1]["ttft_bound_ratio"] == pytest.approx(1.0)
    assert all(r["metrics"]["prefill_needed_experts"] > 0 for r in runs[:2])


def test_run_config_refuses_an_unknown_prefill_path():
    from moeflow.stages.run_config import RunConfig

    assert RunConfig(model="m", prompt=("p",), prefill="serial").prefill == "serial"
    with pytest.raises(ConfigError, match="--prefill 'eager' unknown"):
        RunConfig(model="m", prompt=("p",), prefill="eager")


def _tickets_by_key(cache) -> dict[tuple[int, int], tuple[float, float, bool]]:
    return {k: (t.start, t.due, t.demand) for k, s in cache.slot_of.items() if (t := cache.slots[s].ticket) is not None}


def test_schedule_add_many_is_add_one_by_one():
    """A block of demand (or prefetch) transfers added at once lands where adding them one by one at the same time
    puts them: after the started and the queued demand transfers, ahead of the queued prefetches (or at the end)."""
    from moeflow.runtime.link import PrioritySchedule, Ticket

    def queue() -> PrioritySchedule:
        q = PrioritySchedule()
        for i, demand in enumerate((True, False, True, False, False)):  # the first one started at t=0
            t = Ticket(100 + i)
            t.busy_s = 1.0 + i
            q.add(t, 0.0 if i == 0 else 0.5, demand=demand)
        return q

    for demand in (True, False):
        one, many = queue(), queue()
        new = [Ticket(7), Ticket(8), Ticket(9)]
        for t in new:
            t.busy_s = 0.25
        for t in new:
            one.add(Ticket(t.nbytes, busy_s=t.busy_s), 0.75, demand=demand)
        many.add_many(new, 0.75, demand=demand)
        assert [(t.nbytes, t.start, t.due, t.demand) for t in one.q] == [(t.nbytes, t.start, t.due, t.demand) for t in many.q]
    assert [t.nbytes for t in many.q][-3:] == [7, 8, 9] and [t.nbytes for t in one.q][:2] == [100, 102]


def test_cache_batch_schedules_as_one_by_one_and_hands_over_once(tiny_models):
    """`cache.batch()`: the same decisions, counters, slots, device table and link schedule as loading one by one
    (a staged prefetch the demand promotes included), with the copies handed to the link in one call per run."""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    first, second = spec.moe_layers[0], spec.moe_layers[1]
    E = spec.num_experts
    seen = []
    for batched in (False, True):
        link = EmulatedLink(1.0, clock=lambda: 0.0, sleep=lambda s: None)  # a still clock: nothing completes
        calls = {"submit": 0, "submit_many": 0}
        submit, submit_many = link.submit, link.submit_many

        def spy_submit(*a, _f=submit, _calls=calls, **k):
            _calls["submit"] += 1
            return _f(*a, **k)

        def spy_many(items, _f=submit_many, _calls=calls, **k):
            _calls["submit_many"] += 1
            return _f(items, **k)

        link.submit, link.submit_many = spy_submit, spy_many  # type: ignore[method-assign]
        eng = build_engine(model, mode="offload", link=link, capacity=spec.total_experts, eviction="lru", prefetch="pregate")
        assert eng is not None
        with eng:
            cache = eng.cache
            cache.begin_pass(1)
            n = cache.stage([(second, e) for e in range(E // 2)], second)  # queued prefetches
            calls0 = dict(calls)
            cache.begin_layer(second)
            with cache.batch() if batched else contextlib.nullcontext():
                slots = cache.demand(second, list(range(E // 4, E)), {e: 0.5 for e in range(E)})  # hits promoted, misses
                slots += cache.demand(first, list(range(E)), {e: 0.5 for e in range(E)})
            assert cache.table is not None
            for (l, e), s in cache.slot_of.items():
                assert int(cache.table[cache.rank[l], e]) == s
            assert int((cache.table >= 0).sum()) == len(cache.slot_of)
            seen.append((n, slots, dict(cache.slot_of), cache.counters.copy(), _tickets_by_key(cache)))
            calls = {k: calls[k] - calls0[k] for k in calls}
            cache.release(slots)
            link._sched.q.clear()  # a still clock: nothing to drain
        if batched:  # the promotions hand over nothing (no miss before them); every miss after them: one run
            assert calls == {"submit": 0, "submit_many": 1}, calls
    assert seen[0] == seen[1]


def test_cache_cut_hands_a_batchs_copies_over_in_parts(tiny_models):
    """`cache.cut()` inside a batch hands the copies held so far to the link at once (a staged prefill cuts after
    each wave, so a link that joins adjacent rows handed over together never joins two waves): two demands with a
    cut between them reach the link as two `submit_many` calls of their own copies, with the same slots and link
    schedule as without the cut (one call)."""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    layer, E = spec.moe_layers[0], spec.num_experts
    seen = []
    for cut in (False, True):
        link = EmulatedLink(1.0, clock=lambda: 0.0, sleep=lambda s: None)  # a still clock: nothing completes
        sizes: list[int] = []
        submit_many = link.submit_many

        def spy_many(items, _f=submit_many, _sizes=sizes, **k):
            _sizes.append(len(items))
            return _f(items, **k)

        link.submit_many = spy_many  # type: ignore[method-assign]
        eng = build_engine(model, mode="offload", link=link, capacity=spec.total_experts, eviction="lru", prefetch="none")
        assert eng is not None
        with eng:
            cache = eng.cache
            cache.begin_pass(1)
            cache.begin_layer(layer)
            scores = {e: 0.5 for e in range(E)}
            with cache.batch():
                slots = cache.demand(layer, list(range(E // 2)), scores)
                if cut:
                    cache.cut()
                slots += cache.demand(layer, list(range(E // 2, E)), scores)
            seen.append((slots, [(t.nbytes, t.start, t.due) for t in link._sched.q]))
            cache.release(slots)
            link._sched.q.clear()
        assert sizes == ([E // 2, E - E // 2] if cut else [E])
    assert seen[0] == seen[1]


def test_staged_batch_deals_its_slots_in_key_order(tiny_models):
    """A staged batch whose victims' slots come in descending order (the least recently used expert in the highest
    slot) still puts its keys in ascending slots, so a wave of consecutive experts reads its weights in place; each
    slot receives its own key's weights, the device table follows, and the same keys are evicted and loaded."""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    first, second = spec.moe_layers[0], spec.moe_layers[1]
    C = spec.num_experts // 2
    eng = build_engine(model, mode="offload", link=EmulatedLink(1e6), capacity=C, eviction="lru", prefetch="pregate")
    assert eng is not None
    with eng:
        cache = eng.cache
        cache.begin_pass(1)
        cache.begin_layer(first)
        assert cache.stage([(first, e) for e in range(C)], first) == C
        cache.link.drain()
        for e in reversed(range(C)):  # the least recently used: the highest expert, in the highest slot
            slots = cache.demand(first, [e], {e: 1.0})
            cache.wait(slots)
            cache.release(slots)
        assert [cache.slot_of[(first, e)] for e in range(C)] == sorted(cache.slot_of[(first, e)] for e in range(C))
        cache.begin_layer(second)
        keys = [(second, e) for e in range(C)]
        loads, evictions = cache.counters.loads, cache.counters.evictions
        assert cache.stage(keys, second) == C
        cache.link.drain()
        slots = [cache.slot_of[k] for k in keys]
        assert slots == sorted(slots)
        assert (cache.counters.loads - loads, cache.counters.evictions - evictions) == (C, C)
        assert set(cache.slot_of) == set(keys)
        assert cache.table is not None and cache.buffer is not None and cache.store is not None
        for (l, e), s in cache.slot_of.items():
            assert int(cache.table[cache.rank[l], e]) == s
            assert torch.equal(cache.buffer[s], cache.store.row(l, e))


def test_router_hooks_run_no_pregate_when_every_expert_is_expected_routed(tiny_models, prompt):
    """Half the experts cached, a prompt expected to route every expert of each layer (E=8, k=2, 24 tokens): the
    router hooks predict every expert of the next layer (staged in id order, as the pre-gate's counts would order
    them when the part holds them all) without computing the pre-gate; a 4-token prompt computes it; both exact."""
    model = tiny_models("olmoe")
    for ids, want_pregate in ((prompt, False), (prompt[:, :4], True)):
        spec, ref, eng = _half_cache_pregate(model, ids)
        with eng:
            pf = eng._prefill
            assert pf is not None
            inside, pregated, counts = [False], [], []
            predict, pregate = pf.predict, pf._pregate

            def spy_predict(layer, x, _f=predict, inside=inside, counts=counts):
                inside[0] = True
                try:
                    out = _f(layer, x)
                finally:
                    inside[0] = False
                if out is not None:
                    counts.append(out.tolist())
                return out

            def spy_pregate(layer, x, _f=pregate, inside=inside, pregated=pregated):
                if inside[0]:
                    pregated.append(layer)
                return _f(layer, x)

            pf.predict, pf._pregate = spy_predict, spy_pregate  # type: ignore[method-assign]
            out, _ = generate_one(model, ids, eng, max_new_tokens=2, min_new_tokens=2)
        assert torch.equal(out, ref)
        assert counts  # the router hooks predicted the next layers
        if want_pregate:
            assert pregated
        else:
            assert pregated == [] and all(c == [1] * spec.num_experts for c in counts)


def test_staged_prefill_applies_each_router_once_per_input(tiny_models, prompt):
    """The pre-gate and the prefetch policy's step both need the next layer's router on a layer's router input:
    it is applied once (the policy's step reuses the logits), and the prefill stays exact."""
    model = tiny_models("olmoe")
    _spec, ref, eng = _half_cache_pregate(model, prompt)
    calls: list[tuple[int, int, tuple[int, ...]]] = []
    kept: list[torch.Tensor] = []  # every input stays alive: no address is reused for another one
    with eng:
        adapter = eng.adapter
        router_logits = adapter.router_logits

        def spy(layer, x):
            kept.append(x)
            calls.append((layer, x.data_ptr(), tuple(x.shape)))
            return router_logits(layer, x)

        adapter.router_logits = spy  # type: ignore[method-assign]
        eng.step.prefetch, prefetch = None, eng.step.prefetch  # type: ignore[assignment]
        steps = [0]

        def counted(*a, _f=prefetch, **k):
            steps[0] += 1
            return _f(*a, **k)

        eng.step.prefetch = counted  # type: ignore[method-assign]
        out, _ = generate_one(model, prompt, eng, max_new_tokens=2, min_new_tokens=2)
    assert torch.equal(out, ref)
    assert steps[0] > 0 and calls  # the policy's step ran
    assert len(calls) == len(set(calls)), calls


def test_staged_experts_call_reads_nothing_back_from_the_device(tiny_models, prompt, monkeypatch):
    """A layer computed in several waves finds each wave's rows from the counts the router hook read with the
    routing (`Routed.ends`): the experts call makes no host read of its own (one device sync fewer per layer on
    CUDA), and the prefill stays exact."""
    from moeflow.runtime.prefill import StagedPrefill

    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    with torch.no_grad():
        ref = model(prompt).logits
    eng = build_engine(model, mode="offload", link=EmulatedLink(50.0), capacity=spec.top_k, eviction="lru", prefetch="none")
    assert eng is not None
    reads = [0]
    compute = StagedPrefill.compute
    tolist = torch.Tensor.tolist

    def counted(self, *a, **k):
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.__setitem__(0, reads[0] + 1) or tolist(t))
        try:
            return compute(self, *a, **k)
        finally:
            monkeypatch.setattr(torch.Tensor, "tolist", tolist)

    monkeypatch.setattr(StagedPrefill, "compute", counted)
    with eng:
        with torch.no_grad():
            logits = model(prompt).logits
        assert eng._prefill is not None and eng._prefill.waves_run > spec.num_moe_layers  # computed in chunks
    assert torch.equal(logits, ref)
    assert reads[0] == 0


@pytest.mark.parametrize("host", [True, False])
def test_cache_batch_writes_the_device_table_with_one_tensor(tiny_models, monkeypatch, host):
    """The table's writes of a `cache.batch()`: on a device, as ONE tensor (one copy, not waited for); on the CPU
    through the table's numpy view, with no tensor made (`host=False` takes the device path on the CPU table)."""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    layer = spec.moe_layers[0]
    eng = build_engine(model, mode="offload", link=EmulatedLink(50.0), capacity=spec.total_experts, eviction="lru")
    assert eng is not None
    made = [0]
    tensor = torch.tensor
    with eng:
        cache = eng.cache
        if not host:
            cache._table_np = None
        cache.begin_pass(1)
        cache.begin_layer(layer)
        with cache.batch():
            slots = cache.demand(layer, list(range(spec.num_experts)), {})
            monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.__setitem__(0, made[0] + 1) or tensor(*a, **k))
        monkeypatch.setattr(torch, "tensor", tensor)
        assert cache.table is not None
        assert cache.table[cache.rank[layer]].tolist() == [cache.slot_of[(layer, e)] for e in range(spec.num_experts)]
        cache.release(slots)
    assert made[0] == (0 if host else 1)


def test_free_room_counts_the_empty_slots_without_a_scan(tiny_models, monkeypatch):
    """`free_room` (asked per MoE layer at every staged prefill's start): the part's empty slots, through stages,
    evictions and withdrawn copies, read from the free list (no walk over the part's slots)."""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    first, second = spec.moe_layers[0], spec.moe_layers[1]
    E = spec.num_experts
    link = EmulatedLink(1.0, clock=lambda: 0.0, sleep=lambda s: None)  # a still clock: nothing completes
    eng = build_engine(model, mode="offload", link=link, capacity=E + E // 2, eviction="lru", prefetch="pregate")
    assert eng is not None
    with eng:
        cache = eng.cache

        def empty() -> int:
            return sum(s.key is None for s in cache.slots)

        part_slots = cache._part_slots
        monkeypatch.setattr(cache, "_part_slots", None)  # a scan of the part's slots would fail here
        cache.begin_pass(1)
        assert cache.free_room(first) == E + E // 2 == empty()
        assert cache.stage([(first, e) for e in range(E)], first) == E
        assert cache.free_room(second) == E // 2 == empty()
        assert cache.cancel_stale(first, list(range(E // 2))) == E // 2  # queued copies withdrawn: their slots empty
        assert cache.free_room(second) == E == empty()
        monkeypatch.setattr(cache, "_part_slots", part_slots)
        link._sched.q.clear()  # a still clock: nothing to drain


def test_staged_prefill_predicts_no_layer_already_in_slots(tiny_models, prompt):
    """A cache holding every expert (warmed): a prefill predicts no layer's experts, neither at the pass start nor
    in a router hook (the pre-gate could stage nothing); the output stays the resident one's."""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    with torch.no_grad():
        ref = model(prompt).logits
    eng = build_engine(
        model, mode="offload", link=EmulatedLink(50.0), capacity=spec.total_experts, eviction="lru", prefetch="pregate"
    )
    assert eng is not None
    with eng:
        pf = eng._prefill
        assert pf is not None
        assert eng.warm() == spec.total_experts
        pregate, predicted = pf._pregate, []

        def spy(layer, x):
            predicted.append(layer)
            return pregate(layer, x)

        pf._pregate = spy  # type: ignore[method-assign]
        with torch.no_grad():
            out = model(prompt).logits
    assert torch.equal(out, ref)
    assert predicted == [], predicted


def test_eviction_asks_only_about_the_slots_its_policy_looks_at(tiny_models):
    """A staged prefill keeps many copies in flight: each acquisition of an evicting cache asks the link about the
    copies of the slots the eviction policy looks at (the LRU victim is a landed one), not about every copy in flight;
    the victims are the same (the least recently used landed experts)."""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    first, second = spec.moe_layers[0], spec.moe_layers[1]
    E = spec.num_experts
    now = [0.0]
    link = EmulatedLink(1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    eng = build_engine(model, mode="offload", link=link, capacity=E + E // 2, eviction="lru", prefetch="pregate")
    assert eng is not None
    with eng:
        cache = eng.cache
        cache.begin_pass(1)
        cache.stage([(first, e) for e in range(E)], first)
        cache.wait([cache.slot_of[(first, e)] for e in range(E)])  # landed (the virtual clock moved on)
        cache.stage([(second, e) for e in range(E // 2)], second)  # in flight: the clock stands still now
        flying = {id(cache.slots[cache.slot_of[(second, e)]].ticket) for e in range(E // 2)}
        asked = [0]
        ready = link.ready

        def spy(t, _ready=ready):
            asked[0] += id(t) in flying
            return _ready(t)

        link.ready = spy  # type: ignore[method-assign]
        cache.begin_layer(second)
        misses = list(range(E // 2, E))
        slots = cache.demand(second, misses, {})  # each miss evicts a landed expert of `first`
        assert sorted(k for k in cache.slot_of if k[0] == first) == [(first, e) for e in range(len(misses), E)]
        assert asked[0] <= len(flying), asked[0]  # not every copy in flight at every acquisition (one by one: 16)
        cache.release(slots)
        link.drain()


def test_evictions_in_a_batch_write_the_device_table_once(tiny_models):
    """Evictions inside a `cache.batch()` go to the device table with its loads, in ONE write at the batch end (not
    one device write per victim), and the table ends as the slot map (-1 for every evicted expert)."""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    first, second = spec.moe_layers[0], spec.moe_layers[1]
    E = spec.num_experts
    eng = build_engine(model, mode="offload", link=EmulatedLink(50.0), capacity=E + E // 2, eviction="lru")
    assert eng is not None

    writes = []  # the table writes (`_write_table` calls), each with its entries
    with eng:
        cache = eng.cache
        assert cache.table is not None
        cache.begin_pass(1)
        cache.begin_layer(first)
        cache.release(cache.demand(first, list(range(E)), {}))
        cache.wait(list(cache.slot_of.values()))
        table = cache.table
        write = cache._write_table
        cache._write_table = lambda r, e: (writes.append(len(r)), write(r, e))[1]  # type: ignore[method-assign]
        cache.begin_layer(second)
        with cache.batch():
            slots = cache.demand(second, list(range(E)), {})  # E // 2 victims of `first`
        del cache._write_table
        assert cache.counters.evictions == E // 2
        assert writes == [E + E // 2]  # one write: E loads of `second`, E // 2 evicted keys of `first`
        for r, l in enumerate(spec.moe_layers):
            assert table[r].tolist() == [cache.slot_of.get((l, e), -1) for e in range(E)]
        cache.release(slots)


def test_router_hook_host_read_on_the_cpu_packs_nothing(tiny_models, monkeypatch):
    """`RouteStep.to_host` with every tensor on the CPU: the packed transfer's values and dtypes (ids long, weights
    float32, bit for bit), counted as one host read, without packing them into one float64 tensor (no `cat`)."""
    model = tiny_models("olmoe")
    eng = build_engine(model, mode="offload", link=EmulatedLink(50.0), capacity=get_adapter(model).spec.total_experts)
    assert eng is not None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8, (5, 2), generator=g)  # [T,k]
    weights = torch.rand(5, 2, generator=g, dtype=torch.float32).to(torch.bfloat16)  # [T,k]
    counts = torch.randint(0, 9, (8,), generator=g)  # [E]
    cats = [0]
    cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: cats.__setitem__(0, cats[0] + 1) or cat(*a, **k))
    with eng:
        syncs = eng.counts.host_syncs
        out = eng.step.to_host([(ids, weights), (counts, counts)])
        assert eng.counts.host_syncs == syncs + 1
    monkeypatch.setattr(torch, "cat", cat)
    assert cats[0] == 0
    for (i, w), (i0, w0) in zip(out, [(ids, weights), (counts, counts)]):
        assert i.dtype == torch.long and w.dtype == torch.float32
        assert torch.equal(i, i0.reshape(-1).to(torch.float64).long())
        assert torch.equal(w, w0.reshape(-1).to(torch.float64).float())


def test_staged_batch_decides_as_the_prefetch_of_its_keys_without_request_objects(tiny_models, monkeypatch):
    """A staged batch (`cache.stage`) of an evicting cache with copies in flight takes the same victims, slots,
    eviction events and counters as the gateless prefetch of the same keys in the same order, without building a
    request per key or going through `prefetch` (its per-key host work in the router hook)."""
    from moeflow.policies.base import PrefetchRequest

    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    first, second, third = spec.moe_layers[0], spec.moe_layers[1], spec.moe_layers[2]
    E = spec.num_experts

    def run(staged: bool):
        now = [0.0]
        link = EmulatedLink(1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
        eng = build_engine(model, mode="offload", link=link, capacity=E + E // 2, eviction="lru", prefetch="pregate")
        assert eng is not None
        events: list[tuple[str, object]] = []
        with eng:
            cache = eng.cache
            ev = cache.eviction
            for name in ("on_insert", "on_evict", "on_predicted"):
                f = getattr(ev, name)
                setattr(ev, name, lambda k, *a, _f=f, _n=name, **kw: (events.append((_n, k)), _f(k, *a, **kw))[1])
            cache.begin_pass(1)
            batches = [
                (first, [(first, e) for e in range(E)]),
                (second, [(second, e) for e in reversed(range(0, E, 2))] + [(second, 4), (first, 1)]),  # resident ones
                (third, [(third, e) for e in range(E // 2)]),  # evicts while `second` is in flight
            ]
            issued = []
            for i, (layer, keys) in enumerate(batches):
                cache.begin_layer(layer)
                if staged:
                    issued.append(cache.stage(keys, layer))
                else:
                    n = len(keys)
                    with cache.batch():
                        reqs = [PrefetchRequest(k, priority=float(n - j)) for j, k in enumerate(keys)]
                        gate, cache.gate = cache.gate, None
                        issued.append(cache.prefetch(reqs, layer))
                        cache.gate = gate
                if i == 0:
                    cache.wait(list(cache.slot_of.values()))  # landed; the later batches stay in flight
            state = (issued, sorted(cache.slot_of), vars(cache.counters).copy(), list(events))
            link.drain()
        return state

    expected = run(staged=False)
    calls = []
    from moeflow.runtime.cache import ExpertCache

    monkeypatch.setattr(ExpertCache, "prefetch", lambda self, *a, **k: calls.append(a) or 0)
    got = run(staged=True)
    assert calls == []  # no request objects through the gated prefetch
    assert got[0] == expected[0] and got[1] == expected[1] and got[3] == expected[3]
    assert got[2] == expected[2]
    assert expected[2]["evictions"] > 0 and any(n == "on_predicted" for n, _ in expected[3])
