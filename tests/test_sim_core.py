"""The compiled cache core (`moeflow.runtime.cachecore`) against the Python mechanism it replaces.

Every compiled policy (lru, lfu, least-stale, belady-approx, Belady's MIN) is driven call by call through two
caches, one compiled and one Python (`compiled=False`), on random streams: after every call the victims it
evicted, the slot map and every counter are equal (prefetch proposals with resident, repeated and foreign keys,
a gate budget, low-precision loads with cascade upgrades, prefills in waves, per-layer partitions). Then the
simulator's one-call replay equals its Python replay on a model's trace (`none`, `all-next-layer`, `pregate`),
and the batched pre-gate proposals equal the policy's own `propose`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeflow.policies import EVICTION, PREFETCH, PrefetchRequest
from moeflow.policies.prefetch import PrefetchGate
from moeflow.runtime.cache import ExpertCache
from moeflow.runtime.cachecore import LOG_EVICT
from moeflow.runtime.link import DirectLink
from moeflow.sim import AccessTrace, LayerStep, Pass, record_generate, simulate
from moeflow.sim.belady import Belady
from moeflow.sim.link import InstantLink, ModelledLink
from moeflow.sim.simulator import _Spec
from moeflow.sim.stream import proposals, stream

COMPILED = ("lru", "lfu", "least-stale", "belady-approx", "belady", "next-use")
PYTHON_ONLY = ("fld", "lhu", "score", "lru2")


def _trace(seed: int, *, L: int = 4, E: int = 8, k: int = 2, passes: int = 40) -> AccessTrace:
    """Random routing with skewed popularity; every 8th pass a prefill of several tokens (waves when they
    route to more experts than the capacity)."""
    rng = np.random.default_rng(seed)
    pop = rng.dirichlet(np.full(E, 0.5), size=L)  # [L, E]
    acc = AccessTrace(tuple(range(0, 2 * L, 2)), E, k)  # decoder layers 0, 2, 4, ...
    for p in range(passes):
        T = int(rng.integers(3, 7)) if p % 8 == 0 else 1
        steps = [
            LayerStep(layer, np.stack([rng.choice(E, k, replace=False, p=pop[r]) for _ in range(T)]))
            for r, layer in enumerate(acc.moe_layers)
        ]
        acc.passes.append(Pass(0 if p % 8 == 0 else 1, p // 8, steps))
    return acc


def _policy(name, acc: AccessTrace):
    """A policy by name, or by (name, options)."""
    if isinstance(name, tuple):
        return EVICTION.create(name[0], **name[1])
    return Belady(acc) if name == "belady" else EVICTION.create(name)


def _evictions(cache: ExpertCache) -> list:
    """The keys `cache` evicts, in order (a hook on its Python or compiled mechanism)."""
    out: list = []
    if cache.core is None:
        evict = cache._evict

        def hook(s: int) -> None:
            out.append(cache.slots[s].key)
            evict(s)

        cache._evict = hook  # type: ignore[method-assign]
    else:
        apply, core = cache._core_apply, cache.core
        E, layers = cache.spec.num_experts, cache.spec.moe_layers

        def hook_core() -> None:
            out.extend((layers[k // E], k % E) for op, _, k, _ in core.records() if op == LOG_EVICT)
            apply()

        cache._core_apply = hook_core  # type: ignore[method-assign]
    return out


def _drive(name, acc: AccessTrace, capacity: int, *, per_layer: bool, seed: int, compiled: bool, check=None):
    """The simulator's call order over `acc` with random prefetches, gate budgets, low-precision misses and
    cascade upgrades; returns one snapshot (counters, slot map, evictions so far) per call (`check(cache)`
    runs after each call)."""
    rng = np.random.default_rng(seed)
    spec = _Spec(acc.moe_layers, acc.num_experts, acc.top_k, 1000)
    gate = PrefetchGate(False, budget=2000)  # at most two copies per prefetch call: refusals too
    cache = ExpertCache(
        None,
        capacity,
        link=InstantLink(),
        eviction=_policy(name, acc),
        spec=spec,
        gate=gate,
        per_layer=per_layer,
        compiled=compiled,
    )
    assert (cache.core is not None) == compiled
    evicted = _evictions(cache)
    snaps = []

    def snap(what: str) -> None:
        snaps.append((what, cache.counters.to_dict(), dict(cache.slot_of), list(evicted), cache.time))
        if check is not None:
            check(cache)

    wcap = cache.part_capacity
    for pass_id, p in enumerate(acc.passes):
        cache.mark_phase(new_generation=p.phase == 0)
        cache.begin_pass(pass_id)
        cache.upgrade = bool(rng.random() < 0.5)
        for step in p.steps:
            cache.begin_layer(step.layer)
            experts = sorted(set(step.indices.reshape(-1).tolist()))
            scores = {e: 1.0 for e in experts}
            bits = {e: 4 for e in experts if rng.random() < 0.2}
            waves = [experts] if len(experts) <= wcap else cache.plan_waves(step.layer, experts, wcap)
            slots = cache.demand(step.layer, waves[0], scores, bits) if len(waves) == 1 else None
            snap("demand")
            reqs = [
                PrefetchRequest((int(l), int(e)), priority=float(rng.random()))
                for l, e in zip(rng.choice([*acc.moe_layers, 99], 6), rng.integers(0, acc.num_experts + 1, 6))
            ]
            cache.prefetch(reqs, step.layer)
            snap("prefetch")
            if slots is not None:
                cache.release(slots)
            else:
                for wave in waves:
                    cache.release(cache.demand(step.layer, wave, scores))
            snap("release")
    return snaps


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("name", COMPILED)
def test_kernel_equals_python_call_by_call(name, per_layer):
    for seed in (0, 1):
        acc = _trace(seed)
        for capacity in (8, 12) if per_layer else (3, 6, 13):
            py = _drive(name, acc, capacity, per_layer=per_layer, seed=seed, compiled=False)
            core = _drive(name, acc, capacity, per_layer=per_layer, seed=seed, compiled=True)
            assert len(py) == len(core)
            for i, (a, b) in enumerate(zip(py, core)):
                assert a == b, (name, capacity, seed, i, a[0])
            last = py[-1][1]
            assert last["evictions"] > 0 and last["prefetch_issued"] > 0 and last["prefetch_refused"] > 0
            assert last["lowbit_loads"] > 0 and last["upgrades"] > 0


def _state(cache: ExpertCache):
    """The compiled core's state: (header helpers, per-key columns [K, NPK], slot of each key, pinned or just
    issued per slot)."""
    from moeflow.runtime import cachecore_layout as lay

    core = cache.core
    assert core is not None
    I, st = core.I, core.st
    busy = (st.pin != 0) | (st.prot != 0)  # [C]
    return lay, I, st.pk, st.sof, busy


def _lfu_buckets_hold(cache: ExpertCache) -> None:
    """lfu's count buckets: per part by ascending count, linked both ways from its first to its last bucket,
    each of keys of that count by ascending tick, counting its keys that are neither pinned nor just issued;
    every resident key in one, the free buckets the rest."""
    lay, I, pk, sof, busy = _state(cache)
    bk = I[I[lay.O_BK] : I[lay.O_BK] + 6 * (I[lay.H_C] + 2)].reshape(-1, 6)  # [C + 2, 6]
    placed, nb, parts = [], 0, int(I[lay.H_PARTS])
    for part in range(parts):
        b, last, prev = int(I[I[lay.O_BKH] + part]), -1, -1
        while b >= 0:
            count, k, ncand, nb = int(bk[b, 0]), int(bk[b, 1]), 0, nb + 1
            assert count > last and k >= 0 and bk[b, 3] == prev
            prev = b
            ticks = []
            while k >= 0:
                assert pk[k, lay.PK_CNT] == count and pk[k, lay.PK_BKT] == b and sof[k] >= 0
                ncand += not busy[sof[k]]
                ticks.append(int(pk[k, lay.PK_LAST]))
                placed.append(k)
                k = int(pk[k, lay.PK_NEXT])
            assert ticks == sorted(ticks) and bk[b, 5] == ncand
            last, b = count, int(bk[b, 4])
        assert I[I[lay.O_BKH] + parts + part] == prev  # the part's last bucket
    assert sorted(placed) == sorted(np.flatnonzero(sof >= 0).tolist())
    assert nb + I[I[lay.O_PG] + lay.PG_NBFREE] == I[lay.H_C] + 2


@pytest.mark.parametrize("per_layer", [False, True])
def test_lfu_count_buckets_stay_ordered(per_layer):
    """lfu's victim structure, checked after every call: count buckets in ascending order, keys by tick
    within each, pinned and just issued keys kept in place but not counted as candidates."""
    acc = _trace(3)
    for capacity in (8, 12) if per_layer else (3, 6, 13):
        snaps = _drive("lfu", acc, capacity, per_layer=per_layer, seed=3, compiled=True, check=_lfu_buckets_hold)
        assert snaps[-1][1]["evictions"] > 0


def _belady_heap_holds(cache: ExpertCache) -> None:
    """Belady's heap: every candidate key (resident, neither pinned nor just issued) and no evicted one, each
    once, a candidate with its own entry (a pinned or just issued key's may be the one it had), in heap order,
    at the position O_HPOS names; every key out of the heap has no position (-1)."""
    lay, I, pk, sof, busy = _state(cache)
    n, K = int(I[I[lay.O_PG] + lay.PG_HSIZE]), int(I[lay.H_K])
    heap = I[I[lay.O_HEAP] : I[lay.O_HEAP] + 3 * n].reshape(-1, 3)  # [n, 3] (a, b, key)
    hpos = I[I[lay.O_HPOS] : I[lay.O_HPOS] + K]  # [K]
    keys = heap[:, 2].tolist()
    resident = np.flatnonzero(sof >= 0)  # [R]
    cands = resident[~busy[sof[resident]]].tolist()
    assert len(set(keys)) == len(keys) and set(cands) <= set(keys) <= set(resident.tolist())
    assert (hpos[resident] >= 0).sum() == n
    for i, (a, b, k) in enumerate(heap.tolist()):
        assert hpos[k] == i and (busy[sof[k]] or (a, b) == (pk[k, lay.PK_HA], pk[k, lay.PK_HB]))
        if i:
            assert tuple(heap[(i - 1) // 2, :2].tolist()) < (a, b)
    assert (hpos[sof < 0] == -1).all()


@pytest.mark.parametrize("per_layer", [False, True])
def test_belady_heap_holds_every_candidate(per_layer):
    """Belady's victim structure, checked after every call (the same victims as Python's:
    test_kernel_equals_python_call_by_call)."""
    acc = _trace(4)
    for capacity in (8, 12) if per_layer else (3, 6, 13):
        snaps = _drive("belady", acc, capacity, per_layer=per_layer, seed=4, compiled=True, check=_belady_heap_holds)
        assert snaps[-1][1]["evictions"] > 0


@pytest.mark.parametrize(
    "opts", [{"decay": 1.0, "recency": False}, {"proposals": False, "shrink": 0.0}, {"decay": 0.5, "shrink": 20.0}]
)
def test_next_use_kernel_equals_python_with_its_options(opts):
    """next-use's options reach its twin: same victims with the frequency alone, without proposals, etc."""
    acc = _trace(2, E=12)
    for capacity in (4, 9):
        py = _drive(("next-use", opts), acc, capacity, per_layer=False, seed=2, compiled=False)
        core = _drive(("next-use", opts), acc, capacity, per_layer=False, seed=2, compiled=True)
        for i, (a, b) in enumerate(zip(py, core)):
            assert a == b, (opts, capacity, i, a[0])
        assert py[-1][1]["evictions"] > 0


def test_next_use_row_sum_is_numpys():
    """The twin's mean share sums a layer's uses in numpy's pairwise order (blocks of 8 accumulators, halves
    above 128), so its floats are the Python policy's: equal to `ndarray.sum` to the last bit."""
    from numba import njit

    from moeflow.policies.next_use_sums import row_sum as _row_sum

    row_sum = njit(lambda F, o, n: _row_sum(F, o, n))
    rng = np.random.default_rng(0)
    sequential_differs = 0
    for n in [*range(1, 40), 63, 64, 127, 128, 129, 200, 255, 256, 257, 300, 511, 700]:
        a = rng.random(n + 3) * rng.choice([1.0, 1e-3, 1e5], n + 3)
        assert row_sum(a, 3, n) == a[3:].sum(), n
        seq = 0.0
        for x in a[3:].tolist():
            seq += x
        sequential_differs += seq != a[3:].sum()
    assert sequential_differs > 0  # the order matters: a plain loop would not be the same floats


def test_compiled_core_only_where_it_is_the_same_mechanism():
    acc = _trace(0)
    spec = _Spec(acc.moe_layers, acc.num_experts, acc.top_k, 1000)

    def core(policy, link=None, **kw):
        return ExpertCache(None, 6, link=link or InstantLink(), eviction=policy, spec=spec, **kw).core is not None

    for name in COMPILED:
        assert core(_policy(name, acc)) and core(_policy(name, acc), DirectLink()), name
        assert not core(_policy(name, acc), ModelledLink(10.0)), name  # copies in flight: the Python mechanism
        assert not core(_policy(name, acc), compiled=False)
    for name in PYTHON_ONLY:
        assert not core(EVICTION.create(name)), name
    assert {n for n in EVICTION if EVICTION.create(n).kernel} == set(COMPILED) - {"belady"}  # every kernel is checked here
    assert not core(EVICTION.create("least-stale", right="farthest"))  # the study variant has no kernel

    class Forwarding:  # forwards every attribute, is not an EvictionPolicy subclass: its own events count
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, a):
            return getattr(self.inner, a)

    assert not core(Forwarding(EVICTION.create("lru")))
    with pytest.raises(ValueError, match="not instant"):
        core(EVICTION.create("lru"), ModelledLink(10.0), compiled=True)


@pytest.fixture(scope="module")
def model_acc(tiny_models):
    model = tiny_models("olmoe")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (int(n),), generator=g) for n in (5, 9, 7)]
    return model, record_generate(model, prompts, max_new_tokens=10)


def _same(a, b) -> None:
    skip = {"seconds", "cpu_s", "prepare_s", "engine", "accesses_per_s"}
    da, db = a.to_dict(), b.to_dict()
    assert {k: v for k, v in da.items() if k not in skip} == {k: v for k, v in db.items() if k not in skip}


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_replay_equals_python_replay(model_acc, name):
    from moeflow.moe import get_adapter

    model, acc = model_acc
    logits = get_adapter(model).router_logits
    total = len(acc.moe_layers) * acc.num_experts
    for prefetch in ["none", ("all-next-layer", {"budget": 2 * acc.expert_bytes or 2}), ("pregate", {"overfetch": 1.5})]:
        for capacity, per_layer, phase in ((2, False, 1), (total // 4, False, None), (len(acc.moe_layers) * 3, True, 1)):
            kw = dict(lookahead=2, predict_logits=logits, per_layer=per_layer, count_phase=phase)
            py = simulate(acc, capacity, _policy(name, acc), prefetch, compiled=False, **kw)
            fast = simulate(acc, capacity, _policy(name, acc), prefetch, compiled=True, **kw)
            assert (py.engine, fast.engine) == ("python", "compiled")
            _same(py, fast)
            assert fast.evictions > 0 and fast.replayed_accesses == py.replayed_accesses > 0
            assert prefetch == "none" or capacity == acc.top_k or fast.counters.prefetch_issued > 0  # top-k: all pinned


def test_waves_replay_equally(model_acc):
    """Prefills routing more experts than the cache holds run in waves, resident experts first."""
    _, acc = model_acc
    prefill = max(len(set(s.indices.reshape(-1).tolist())) for p in acc.passes for s in p.steps)
    capacity = acc.top_k + 1
    assert prefill > capacity
    for name in COMPILED:
        _same(
            simulate(acc, capacity, _policy(name, acc), compiled=False),
            simulate(acc, capacity, _policy(name, acc), compiled=True),
        )


def test_batched_pregate_equals_the_policys_propose(model_acc):
    from moeflow.moe import get_adapter
    from moeflow.sim.stream import _sequential

    model, acc = model_acc
    logits = get_adapter(model).router_logits
    for opts in ({"overfetch": 1.0}, {"overfetch": 2.0}, {"mass": 0.6}):
        batched = proposals(acc, PREFETCH.create("pregate", **opts), 3, logits, cache=False)
        one_by_one = _sequential(acc, PREFETCH.create("pregate", **opts), 3, logits)
        assert np.array_equal(batched.off, one_by_one.off) and np.array_equal(batched.keys, one_by_one.keys), opts
        assert len(batched.keys) > 0


def test_stream_is_the_engines_access_order(model_acc):
    _, acc = model_acc
    st = stream(acc)
    from moeflow.runtime.counters import needed_experts

    j = 0
    for p, ps in enumerate(acc.passes):
        assert st.pass_off[p + 1] - st.pass_off[p] == len(ps.steps)
        for s in ps.steps:
            flat = torch.as_tensor(s.indices.reshape(-1)).long()
            want, _ = needed_experts(flat, torch.ones(flat.shape))
            assert st.experts[st.exp_off[j] : st.exp_off[j + 1]].tolist() == want
            j += 1
    two = st.repeat(2)
    assert two.phase.tolist() == st.phase.tolist() * 2 and two.experts.tolist() == st.experts.tolist() * 2
    assert two.exp_off[-1] == 2 * st.accesses and two.pass_off[-1] == 2 * len(st.step_rank)


@pytest.mark.parametrize("compiled", [False, True])
def test_every_slot_pinned_is_refused_in_both(compiled):
    acc = _trace(0)
    spec = _Spec(acc.moe_layers, acc.num_experts, acc.top_k, 1000)
    cache = ExpertCache(None, 2, link=InstantLink(), eviction=EVICTION.create("lru"), spec=spec, compiled=compiled)
    cache.begin_pass(0)
    cache.demand(0, [0, 1], {})  # not released: both slots pinned
    assert cache.prefetch([PrefetchRequest((2, 0))], 0) == 0  # a prefetch finds no victim: skipped
    with pytest.raises(RuntimeError, match="no evictable slot"):
        cache.demand(2, [0], {})


def test_stream_of_repeated_passes_is_the_copies(model_acc):
    """A trace whose pass objects repeat (a benchmark's copies) is prepared once per distinct pass and gathered:
    its stream and its batched pre-gate proposals are those of the copies, in order."""
    from moeflow.moe import get_adapter

    model, acc = model_acc
    logits = get_adapter(model).router_logits
    n = 3
    rep = AccessTrace(acc.moe_layers, acc.num_experts, acc.top_k, acc.passes * n, acc.expert_bytes)
    one, many = stream(acc), stream(rep)
    want = one.repeat(n)
    for f in ("phase", "tokens", "pass_off", "step_rank", "exp_off", "experts"):
        assert np.array_equal(getattr(many, f), getattr(want, f)), f
    pf = PREFETCH.create("pregate", overfetch=1.5)
    p1, pn = proposals(acc, pf, 2, logits, cache=False), proposals(rep, pf, 2, logits, cache=False)
    p_want = p1.repeat(n)
    assert len(p1.keys) > 0
    assert np.array_equal(pn.off, p_want.off) and np.array_equal(pn.keys, p_want.keys)


def test_every_core_source_stamps_every_kernel(tmp_path, monkeypatch):
    """numba stamps a cached kernel with its own file; the core's kernels inline functions of every
    `cachecore*` module and of next-use's shared float routines, so their stamp digests all of them: an edit to
    any one recompiles every kernel."""
    import shutil

    from moeflow.runtime import cachecore_layout as lay
    from moeflow.runtime.cachecore import k_call, k_replay

    for kernel in (k_call, k_replay):
        if not hasattr(kernel._cache, "_impl"):  # no writable cache location: compiled per process, nothing stale
            pytest.skip("numba has no cache location here")
        locator = kernel._cache._impl.locator
        assert locator.get_source_stamp() == lay._core_stamp(), kernel
    for p in [*sorted(lay._HERE.glob("cachecore*.py")), *lay._SHARED]:
        shutil.copy(p, tmp_path / p.name)
    monkeypatch.setattr(lay, "_HERE", tmp_path)
    monkeypatch.setattr(lay, "_SHARED", tuple(tmp_path / p.name for p in lay._SHARED))
    monkeypatch.setattr(lay, "_STAMP", [])
    before = lay._core_stamp()
    for name in ("cachecore_ba.py", "cachecore_struct.py", "next_use_sums.py"):
        (tmp_path / name).write_text((tmp_path / name).read_text() + "\n# edited\n")
        monkeypatch.setattr(lay, "_STAMP", [])
        after = lay._core_stamp()
        assert after != before, name
        before = after


def test_begin_layer_rides_on_the_next_kernel_call():
    """The runtime's `begin_layer` costs no kernel call of its own: the next call starts the layer first."""
    from moeflow.runtime import cachecore as cc
    from moeflow.runtime.cachecore_layout import PG_STEP

    acc = _trace(0)
    spec = _Spec(acc.moe_layers, acc.num_experts, acc.top_k, 1000)
    cache = ExpertCache(None, 6, link=InstantLink(), eviction=_policy("belady", acc), spec=spec)
    core = cache.core
    assert core is not None
    ops: list = []
    call = core._call
    core._call = lambda *a: (ops.append(a[3]), call(*a))[1]
    cache.begin_pass(0)
    cache.begin_layer(acc.moe_layers[0])
    assert ops == [cc.OP_BEGIN_PASS] and core.st.pg[PG_STEP] == -1
    cache.demand(acc.moe_layers[0], [0, 1], {})
    assert ops == [cc.OP_BEGIN_PASS, cc.OP_DEMAND] and core.st.pg[PG_STEP] == 0
