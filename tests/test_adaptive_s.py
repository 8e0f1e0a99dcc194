"""ExpertFlow's adaptive step size as the paper defines it, driven by synthetic PassStats sequences.

S = N_e E_s / (C_s T_l), clamped, then stall feedback (late copies) raises it and overfetch feedback
(prefetches evicted unused) lowers it; it settles, respects cache occupancy, and never settles at the
minimum when a larger S is faster."""

from __future__ import annotations

import pytest
import torch

from moeflow.calibrate.stepsize import cumulative_distance, mean_pairwise_distance, occupancy_limit, s_formula
from moeflow.runtime.adaptive_s import StepSizeController
from moeflow.runtime.cache import CacheCounters
from moeflow.runtime.engine import PassStats

MS = 1e-3


def _stats(
    pass_id=1,
    *,
    s=1,
    late=0,
    wasted=0,
    wall=10 * MS,
    compute=8 * MS,
    layers=8,
    accesses=16,
    predicted=0,
    new=0,
    transfer_bytes=0,
    transfer_s=0.0,
    decode=True,
    token_ids=None,
    loads=0,
) -> PassStats:
    c = CacheCounters(accesses=accesses, hits=accesses, late=late, prefetch_unused_evicted=wasted, loads=loads)
    return PassStats(
        pass_id=pass_id,
        tokens=1,
        wall_s=wall,
        stall_s=0.0,
        counters=c,
        transfer_s=transfer_s,
        transfer_bytes=transfer_bytes,
        lookahead=s,
        decode=decode,
        compute_s=compute,
        moe_layers_run=layers,
        predicted=predicted,
        predicted_new=new,
        token_ids=token_ids,
    )


# ---- hand-computed formula values -------------------------------------------------------------------


def test_formula_hand_values():
    # N_e=2 experts x 3 MB at 1 GB/s = 6 ms of copies per layer; T_l = 2 ms -> S = 3
    assert s_formula(2, 3e6, 1e9, 2e-3) == pytest.approx(3.0)
    c = StepSizeController(initial_s=1, max_s=8, expert_bytes=3e6, bandwidth=1e9, layer_time_s=2e-3, experts_per_layer=2)
    assert c.formula_s() == pytest.approx(3.0) and c.s == 3  # starts at the clamped formula, no bias
    c2 = StepSizeController(initial_s=1, max_s=2, expert_bytes=3e6, bandwidth=1e9, layer_time_s=2e-3, experts_per_layer=2)
    assert c2.s == 2 and c2.bias == 0  # clamped first: the bias is relative to the clamped value


def test_n_e_and_t_l_come_from_pass_stats():
    c = StepSizeController(initial_s=1, max_s=8, expert_bytes=1e6, bandwidth=1e9, layer_time_s=5e-3, experts_per_layer=8, ema=1.0)
    assert c.formula_s() == pytest.approx(8 * 1e6 / (1e9 * 5e-3))  # 1.6 from the calibration (top-k = 8)
    # 4 MoE layers ran in 8 ms of compute -> T_l = 2 ms; 12 proposed experts were not resident -> N_e = 3
    c.on_pass(_stats(compute=8 * MS, layers=4, accesses=8, predicted=20, new=12))
    assert c.layer_time_s == pytest.approx(2e-3)
    assert c.n_e_value() == pytest.approx(3.0)
    assert c.formula_s() == pytest.approx(3 * 1e6 / (1e9 * 2e-3))  # 1.5 -> S = 2
    assert c.s == 2
    # the link is slower than calibrated: 1 MB in 4 ms (0.25 GB/s) -> 3 MB / 0.25 GB/s / 2 ms = 6
    c.on_pass(_stats(compute=8 * MS, layers=4, accesses=8, predicted=20, new=12, transfer_bytes=1_000_000, transfer_s=4e-3))
    assert c.bandwidth == pytest.approx(2.5e8) and c.formula_s() == pytest.approx(6.0) and c.s == 6


def test_t_l_excludes_bookkeeping():
    # wall 30 ms of which only 8 ms is compute: T_l uses compute_s, not wall - stall
    c = StepSizeController(initial_s=1, max_s=8, ema=1.0)
    c.on_pass(_stats(wall=30 * MS, compute=8 * MS, layers=8))
    assert c.layer_time_s == pytest.approx(1e-3)
    c.on_pass(_stats(wall=30 * MS, compute=0.0, layers=8))  # not measured: the estimate stays
    assert c.layer_time_s == pytest.approx(1e-3)


def test_hysteresis_at_an_integer_boundary():
    c = StepSizeController(initial_s=1, max_s=8, expert_bytes=1e6, bandwidth=1e9, layer_time_s=1e-3, experts_per_layer=2.0)
    assert c.s == 2
    c.experts_per_layer = 2.05  # formula 2.05: within the hysteresis, S stays 2
    c._recompute("test")
    assert c.s == 2
    c.experts_per_layer = 2.5
    c._recompute("test")
    assert c.s == 3
    c.experts_per_layer = 1.95  # just below 2: stays 3 until it falls below 2 - hysteresis
    c._recompute("test")
    assert c.s == 3
    c.experts_per_layer = 1.5
    c._recompute("test")
    assert c.s == 2


# ---- feedback ----------------------------------------------------------------------------------------


def test_s_rises_when_copies_stall():
    c = StepSizeController(initial_s=1, max_s=4, stall_threshold=4)
    c.on_pass(_stats(s=1, late=3))
    assert c.s == 1  # below the threshold
    c.on_pass(_stats(s=1, late=1))
    assert c.s == 2 and c.stalls == 0
    for _ in range(10):
        c.on_pass(_stats(s=c.s, late=8))
    assert c.s == 4  # clamped at max_s, no wind-up beyond it
    assert c.bias == 3


def test_s_falls_when_prefetches_are_wasted():
    c = StepSizeController(initial_s=4, max_s=4, overfetch_threshold=8)
    assert c.s == 4
    c.on_pass(_stats(s=4, wasted=8))
    assert c.s == 3
    for _ in range(10):
        c.on_pass(_stats(s=c.s, wasted=8))
    assert c.s == 1  # clamped at min_s
    c.on_pass(_stats(s=1, late=4))
    assert c.s == 2  # no wind-up: one stall round is enough to go up again


def test_ready_hits_are_not_overfetch():
    # ExpertFlow's "already loaded" hits are what prefetch is for; only wasted copies lower S
    c = StepSizeController(initial_s=3, max_s=4, overfetch_threshold=8)
    for _ in range(20):
        c.on_pass(_stats(s=c.s, accesses=64))
    assert c.s == 3


def test_occupancy_caps_s():
    # 12 slots; the running layer needs 4, 4 experts predicted per layer -> only S = 2 fits
    assert occupancy_limit(12, 4, 4) == 2 and occupancy_limit(12, 4, 0) > 100
    c = StepSizeController(initial_s=1, max_s=6, stall_threshold=1, capacity=12, ema=1.0)
    for _ in range(10):
        c.on_pass(_stats(s=c.s, late=4, layers=4, accesses=16, predicted=16, new=4))
    assert c.occupancy_s() == 2 and c.s == 2
    # the formula alone would ask for more; occupancy still wins
    c.expert_bytes, c.bandwidth, c.layer_time_s = 1e6, 1e8, 1e-3
    c._recompute("test")
    assert c.formula_s() > 2 and c.s == 2


# ---- settling in a simulated link/compute regime -------------------------------------------------------


def _regime(load_layers: float, overhead_per_s: float = 0.05, waste_per_s: float = 0.1, layers: int = 8, n_e: int = 2):
    """A decode pass at S: each layer's N_e copies take `load_layers` layer times; a copy issued S layers
    ahead stalls for max(0, load_layers - S) layer times. Predicting further ahead costs `overhead_per_s`
    of a layer per S and wastes `waste_per_s * S` of the copies."""

    def run(s: int, pid: int) -> PassStats:
        stall = max(0.0, load_layers - s) * MS
        wall = layers * (MS + stall + overhead_per_s * s * MS)
        late = layers * n_e if stall > 0 else 0
        wasted = round(waste_per_s * s * layers * n_e)
        return _stats(
            pid,
            s=s,
            late=late,
            wasted=wasted,
            wall=wall,
            compute=layers * MS,
            layers=layers,
            accesses=layers * n_e,
            predicted=layers * n_e,
            new=layers * n_e,
        )

    def tpot(s: int) -> float:
        return run(s, 0).wall_s

    return run, tpot


def _drive(c: StepSizeController, run, passes: int) -> list[int]:
    used = []
    for pid in range(passes):
        s = c.s
        used.append(s)
        c.on_pass(run(s, pid))
    return used


@pytest.mark.parametrize("load_layers", [1.5, 2.5, 3.5])
def test_settles_at_the_fastest_s_not_the_minimum(load_layers):
    run, tpot = _regime(load_layers)
    c = StepSizeController(initial_s=1, max_s=6, stall_threshold=4, overfetch_threshold=8)
    used = _drive(c, run, 200)
    tail = used[-150:]
    assert len(set(tail)) == 1, f"did not settle: {tail}"
    best = min(range(1, 7), key=tpot)
    assert tail[0] == best and tail[0] > 1  # stalls persist at S=1, so it never settles there
    assert tpot(tail[0]) < tpot(1)


def test_no_cycle_from_a_biased_start():
    # the old controller: initial S 3 with ceil(formula) = 6 > max_s gave bias -3 and S cycled 3 -> 1 -> 2 -> 3
    run, _ = _regime(2.5)
    c = StepSizeController(
        initial_s=3,
        max_s=3,
        expert_bytes=6e6,
        bandwidth=1e9,
        layer_time_s=1e-3,
        experts_per_layer=1,
        stall_threshold=4,
        overfetch_threshold=8,
    )
    assert c.s == 3
    used = _drive(c, run, 200)
    moves = [b - a for a, b in zip(used, used[1:]) if a != b]
    assert all(abs(m) == 1 for m in moves)  # one step at a time
    assert len(set(used[-150:])) == 1 and used[-1] == 3
    assert len(moves) <= 6


def test_cost_memory_is_forgotten():
    run, _ = _regime(2.5)
    c = StepSizeController(initial_s=1, max_s=6, memory_passes=20)
    _drive(c, run, 60)
    assert c.refused > 0
    assert all(c.passes - k.seen <= 20 for s, k in c.cost.items() if s == c.s)


# ---- Dist(t) ------------------------------------------------------------------------------------------


def test_semantic_diversity_hand_values():
    v = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 4.0]])  # pairwise 5, 3, 4
    assert cumulative_distance(v) == pytest.approx(12.0)
    assert mean_pairwise_distance(v) == pytest.approx(4.0)
    assert cumulative_distance(v[:1]) == 0.0


def test_n_e_forecast_follows_diversity():
    c = StepSizeController(initial_s=1, max_s=8)
    for d in [1.0, 2.0, 3.0, 1.5, 2.5, 0.5]:
        c.observe_new_experts(1.0 + 2.0 * d, d)  # more diverse windows need more new experts
    c.observe_new_experts(1.0 + 2.0 * 4.0, 4.0)
    assert c.n_e_value() == pytest.approx(9.0, rel=1e-6)
    c.observe_new_experts(1.0 + 2.0 * 0.25, 0.25)
    assert c.n_e_value() == pytest.approx(1.5, rel=1e-6)


def test_on_pass_computes_dist_from_embeddings():
    emb = torch.nn.Embedding(10, 2)
    with torch.no_grad():
        emb.weight.zero_()
        emb.weight[1] = torch.tensor([3.0, 4.0])
    c = StepSizeController(initial_s=1, max_s=4, embed=emb, dist_window=3)
    c.on_pass(_stats(token_ids=torch.tensor([0])))
    assert c.dist is None  # one token: no pair yet
    c.on_pass(_stats(token_ids=torch.tensor([1])))
    assert c.dist == pytest.approx(5.0)
    c.on_pass(_stats(token_ids=torch.tensor([0])))  # window [0,1,0]: 5 + 0 + 5 over 3 pairs
    assert c.dist == pytest.approx(10.0 / 3)


# ---- the engine feeds it ------------------------------------------------------------------------------


def test_engine_pass_stats_feed_the_controller(tiny_models):
    from moeflow.moe import get_adapter
    from moeflow.runtime.generate import build_engine, generate_one
    from moeflow.runtime.link import DirectLink

    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    prompt = torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(7))
    ref, _ = generate_one(model, prompt, None, max_new_tokens=6, min_new_tokens=6)
    cap = spec.total_experts // 2
    eng = build_engine(model, mode="offload", link=DirectLink(), capacity=cap, eviction="lru", prefetch="pregate")
    seen: list[PassStats] = []
    with eng:
        c = StepSizeController(initial_s=1, max_s=max(1, spec.num_moe_layers - 1))
        detach = c.attach(eng)
        eng.observers.append(seen.append)
        out, _ = generate_one(model, prompt, eng, max_new_tokens=6, min_new_tokens=6)
        detach()
    assert torch.equal(out, ref)
    assert not seen[0].decode and all(st.decode for st in seen[1:])
    assert all(st.moe_layers_run == spec.num_moe_layers and 0 < st.compute_s <= st.wall_s for st in seen)
    # decode passes count the policy's proposals (N_e); the staged prefill stages from its pre-gate instead and
    # proposes after its last MoE layer only (nothing after it): the controller reads decode passes alone
    assert all(st.predicted > 0 and 0 <= st.predicted_new <= st.predicted for st in seen[1:])
    assert c.layer_time_s is not None and c.n_e is not None and c.dist is not None
    assert c.capacity == spec.total_experts // 2
