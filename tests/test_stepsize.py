"""ExpertFlow's adaptive step size: stalls (late copies) raise S, overfetch (wasted prefetches) lowers it, bounds hold,
and observed bandwidth moves S through the formula S = N_e E_s / (C_s T_l)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moeflow.calibrate.stepsize import ceil_s, initial_step_size, s_formula
from moeflow.runtime.adaptive_s import StepSizeController


def test_stalls_raise_and_overfetch_lowers_within_bounds():
    c = StepSizeController(initial_s=2, min_s=1, max_s=3, stall_threshold=3, overfetch_threshold=5)
    assert c.s == 2
    c.observe_access(stalled=True, n=2)
    assert c.s == 2  # below the threshold
    c.observe_access(stalled=True)
    assert c.s == 3 and c.stalls == 0  # counter reset, S + 1
    c.observe_access(stalled=True, n=30)
    assert c.s == 3  # clamped at max_s
    c.observe_access(stalled=False, n=5)
    assert c.s == 2  # no wind-up: one overfetch round is enough to come down
    c.observe_access(stalled=False, n=50)
    assert c.s == 1  # clamped at min_s
    assert [w for w, _ in c.history] == ["init", "stall", "overfetch", "overfetch"]


def test_formula_and_bandwidth_updates():
    # N_e=4 experts of 1 MB, T_l=1 ms: at 2 GB/s a layer's experts take 2 ms -> S = 2
    c = StepSizeController(initial_s=2, max_s=8, expert_bytes=1e6, bandwidth=2e9, layer_time_s=1e-3, experts_per_layer=4, ema=1.0)
    assert c.formula_s() == pytest.approx(2.0) and c.s == 2
    c.observe_transfer(nbytes=1e6, seconds=1e-3)  # observed 1 GB/s -> 4 ms per layer -> S = 4
    assert c.s == 4
    c.observe_transfer(nbytes=8e6, seconds=1e-3)  # 8 GB/s -> 0.5 layers -> S = 1
    assert c.s == 1
    c.observe_access(stalled=True, n=c.stall_threshold)  # the stall bias survives the next recompute
    assert c.s == 2
    c.observe_layer_time(1e-3)
    assert c.s == 2


def test_on_pass_reads_engine_stats_and_drives_lookahead():
    from moeflow.runtime.cache import CacheCounters

    c = StepSizeController(initial_s=1, max_s=3, stall_threshold=2, overfetch_threshold=100)
    engine = SimpleNamespace(lookahead=1, observers=[], spec=SimpleNamespace(num_layers=4))
    detach = c.attach(engine)
    # two prefetches still in flight when their layer needed them (late) = a stall step; ready hits and
    # demand misses are not stalls of the prefetch horizon, nor overfetch
    stats = SimpleNamespace(
        counters=CacheCounters(accesses=4, hits=3, misses=1, late=2),
        transfer_bytes=0,
        transfer_s=0.0,
        tokens=1,
        wall_s=0.01,
        stall_s=0.005,
    )
    for obs in engine.observers:
        obs(stats)
    assert c.s == 2 and engine.lookahead == 2
    assert c.overfetches == 0 and c.stalls == 0
    detach()
    assert engine.observers == []


def test_bad_bounds_and_mass_set():
    with pytest.raises(ValueError):
        StepSizeController(initial_s=1, min_s=3, max_s=2)
    import torch

    from moeflow.moe.sets import mass_mask

    p = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25]])
    # mass before each expert (descending): row 0: 0, .7, .9, 1 -> 2 kept; row 1: 0, .25, .5, .75 -> 4 kept
    assert mass_mask(p, 0.85).tolist() == [[True, True, False, False], [True, True, True, True]]


def test_one_s_formula_for_calibration_and_controller():
    # N_e=2 experts of 3 MB at 1 GB/s = 6 ms of copies per layer, T_l = 2 ms -> S = 3 (exactly, float noise ignored)
    assert s_formula(2, 3e6, 1e9, 2e-3) == pytest.approx(3.0)
    assert ceil_s(3.0000000000004) == 3 and ceil_s(3.01) == 4 and ceil_s(0.2) == 1
    assert initial_step_size(2, 3e6, 1e9, 2e-3, num_moe_layers=8) == (3, pytest.approx(3.0))
    assert initial_step_size(2, 3e6, 1e9, 2e-3, num_moe_layers=3)[0] == 2  # clamped to L - 1
    c = StepSizeController(initial_s=1, max_s=8, expert_bytes=3e6, bandwidth=1e9, layer_time_s=2e-3, experts_per_layer=2, ema=1.0)
    assert c.s == 3  # the clamped formula, not initial_s minus a bias
    c.observe_transfer(nbytes=3e6, seconds=3e-3)  # still 1 GB/s: the formula gives 3
    assert c.formula_s() == pytest.approx(3.0) and c.s == 3
    c.observe_transfer(nbytes=3e6, seconds=6e-3)  # 0.5 GB/s -> formula 6 -> S = 6
    assert c.formula_s() == pytest.approx(6.0) and c.s == 6


def test_run_caps_adaptive_s_at_a_learned_prefetchers_trained_horizon():
    """`moeflow run --adaptive-s` with a learned prefetcher: S never exceeds the predictor's trained max S
    (the prefetcher cannot look further), while pre-gate keeps the full [1, L_moe - 1] range."""
    from types import SimpleNamespace

    from moeflow.stages.session import run_hooks

    def controller_max_s(horizon):
        engine = SimpleNamespace(
            prefetcher=SimpleNamespace(horizon=horizon),
            observers=[],
            lookahead=1,
            spec=SimpleNamespace(num_layers=12),
            model=None,
        )
        cfg = SimpleNamespace(adaptive_s=True, speculative=False)
        with run_hooks(cfg, None, SimpleNamespace(num_moe_layers=12, num_layers=12), engine, None, 11):
            (on_pass,) = engine.observers
            return on_pass.__self__.max_s, engine.lookahead

    assert controller_max_s(4) == (4, 4)  # the prefetcher's declared horizon (a learned one: its trained S)
    assert controller_max_s(None) == (11, 11)


def test_requested_step_size_refuses_s_beyond_the_model():
    from moeflow.errors import ConfigError
    from moeflow.runtime.adaptive_s import requested_step_size

    with pytest.raises(ConfigError, match=r"^-S 20: olmoe-deep has 12 MoE layers, so S can be 1\.\.11$"):
        requested_step_size(20, None, 12, "olmoe-deep")
    assert requested_step_size(11, {"initial_s": 3}, 12, "m") == (11, "-S")
    assert requested_step_size(2, None, 12, "m", "--config t.json") == (2, "--config t.json")  # the file's S
    assert requested_step_size(None, {"initial_s": 3}, 12, "m") == (3, "calibration")
    assert requested_step_size(None, {"initial_s": 15}, 12, "m") == (11, "calibration's S=15 clamped to 11")
    assert requested_step_size(None, None, 12, "m") == (1, "default")


def test_the_step_size_reported_is_the_one_used():
    """A learned predictor trained for S <= 4 runs at S = 4 when 11 is asked (the engine's S is set to it, so
    s_history holds it) and says why; a policy's own lookahead wins; no prefetch uses no S; adaptive S is a range."""
    from moeflow.runtime.adaptive_s import prefetch_step_size
    from moeflow.stages.run import adaptive_summary
    from moeflow.stages.session import NO_PREFETCH, use_step_size

    forest = SimpleNamespace(name="forest", proposes=True, lookahead=None, horizon=4)
    assert prefetch_step_size(forest, 3) == (3, None)
    used, why = prefetch_step_size(forest, 11)
    assert used == 4 and "trained for S <= 4" in why
    engine = SimpleNamespace(prefetcher=forest, lookahead=11)
    rep = use_step_size(engine, 11, adaptive=False)
    assert rep["lookahead"] == 4 and rep["lookahead_requested"] == 11 and engine.lookahead == 4
    assert rep["lookahead_note"].endswith("S=11 runs as S=4")
    own = SimpleNamespace(prefetcher=SimpleNamespace(name="pregate", proposes=True, lookahead=2, horizon=None), lookahead=5)
    assert use_step_size(own, 5, adaptive=False)["lookahead"] == 2 and own.lookahead == 2
    plain = SimpleNamespace(name="pregate", proposes=True, lookahead=None, horizon=None)
    assert use_step_size(SimpleNamespace(prefetcher=plain, lookahead=3), 3, False) == {"lookahead": 3}
    none = use_step_size(SimpleNamespace(prefetcher=SimpleNamespace(name="none", proposes=False), lookahead=3), 3, False)
    assert none["lookahead"] is None and none["lookahead_note"] == NO_PREFETCH
    assert use_step_size(None, 3, False)["lookahead"] is None  # resident: no engine
    ad = use_step_size(SimpleNamespace(prefetcher=forest, lookahead=4), 11, adaptive=True)
    assert ad["lookahead"] is None and "lookahead_adaptive" in ad and "adaptive S stays in 1..4" in ad["lookahead_note"]
    assert adaptive_summary([2, 3, 4, 3]) == {"min": 2, "max": 4, "mean": 3.0, "passes": 4} and adaptive_summary([]) is None


def test_run_reports_and_refuses_s(tiny_models, tmp_path, capsys):
    """`moeflow run -S 5` on a 3-MoE-layer model: one line, before any generation; `-S 2` with a policy of its own
    lookahead=1 reports S = 1 (and `s_history` holds it) with the S asked for and why."""
    import json

    from moeflow.cli.app import main
    from tests.test_trace import tiny_tokenizer

    ck = tmp_path / "ck"
    tiny_models("olmoe").save_pretrained(ck)
    tiny_tokenizer().save_pretrained(ck)
    common = ["run", "-m", str(ck), "--prompt", "hello there", "--max-new-tokens", "4", "--threads", "1", "--no-warmup"]
    with pytest.raises(SystemExit) as e:
        main([*common, "-S", "5"])
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert "-S 5: ck has 3 MoE layers, so S can be 1..2" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main([*common, "-S", "2", "--sweep", "-f", "pregate:lookahead=1,pregate", "--json"])
    assert e.value.code == 0
    runs = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"]
    own, plain = runs
    assert own["lookahead"] == 1 and own["lookahead_requested"] == 2 and "own lookahead=1" in own["lookahead_note"]
    assert set(own["metrics"]["s_history"]) == {1}
    assert plain["lookahead"] == 2 and "lookahead_requested" not in plain and set(plain["metrics"]["s_history"]) == {2}
