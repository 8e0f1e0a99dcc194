"""`moeflow quality` on a tiny saved checkpoint: fetch is exact (perplexity change 0, agreement 1.0), a lossy
configuration is labelled lossy, the --json shape, one line for bad input."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch


@pytest.fixture(scope="module")
def ckpt(ckpt_with):
    text = ["the king said to the queen that the night was long", "to be or not to be, that is the question"] * 3
    return ckpt_with(p_txt="the king said\nto be or not\n", text_txt=" ".join(text))


@pytest.fixture
def lossy_routing():
    """A routing policy that strongly prefers resident experts: it changes the output and says so."""
    from moeflow.policies import ROUTING, RoutingPolicy

    class PreferResident(RoutingPolicy):
        name: ClassVar[str] = "test-prefer-resident"
        changes_output = True
        reroutes: ClassVar[bool] = True

        def bias(self, layer, num_experts, resident):
            return torch.tensor([20.0 if resident((layer, e)) else 0.0 for e in range(num_experts)])

    ROUTING.register(PreferResident)
    yield PreferResident.name
    ROUTING.pop(PreferResident.name)


def _run(args):
    from moeflow.cli.app import main

    try:
        main(args)
    except SystemExit as e:
        return e.code
    return 0


def _args(ckpt, *more):
    return [
        "quality",
        "-m",
        str(ckpt),
        "--prompts",
        str(ckpt.parent / "p.txt"),
        "--max-new-tokens",
        "8",
        "--text",
        str(ckpt.parent / "text.txt"),
        "--ppl-tokens",
        "16",
        "--ppl-windows",
        "2",
        "--task",
        "none",
        "--link",
        "emulated:1,5",
        "--threads",
        "1",
        "--no-warmup",
        "--json",
        *more,
    ]


def test_fetch_exact_and_lossy_labelled(ckpt, capsys, lossy_routing):
    code = _run(_args(ckpt, "--sweep", "--mode", "offload,on-demand", "-c", "2,50%", "--routing", f"standard,{lossy_routing}"))
    assert code == 0
    out = capsys.readouterr()
    res = json.loads(out.out.strip().splitlines()[-1])
    assert res["reference"] == "resident" and res["text"]["tokens"] == 32 and res["task"] == "none"
    runs = res["runs"]
    assert [r["mode"] for r in runs] == ["resident", "offload", "offload", "on-demand", "offload", "offload"]
    for r in runs:
        assert {"run", "lossy", "ppl", "ppl_delta_pct", "agreement", "first_divergence", "tpot_s", "bytes_per_token"} <= set(r)
    exact = [r for r in runs if r["routing"] in (None, "standard")]
    assert len(exact) == 4
    for r in exact:  # fetch (and on-demand, resident): bit-exact
        assert r["lossy"] is False
        assert r["ppl_delta_pct"] == 0.0 and r["ppl"] == runs[0]["ppl"]
        assert r["agreement"] == 1.0 and r["first_divergence"] == 8.0 and r["tf_agreement"] == 1.0
    lossy = [r for r in runs if r["routing"] == lossy_routing]
    assert len(lossy) == 2 and all(r["lossy"] is True for r in lossy)
    assert any(r["ppl_delta_pct"] != 0.0 or r["agreement"] < 1.0 for r in lossy)
    assert "LOSSY" in out.err and "exact" in out.err
    assert runs[1]["bytes_per_token"] > 0 and not runs[0]["bytes_per_token"]


def test_task_at_chance_and_binomial(ckpt, capsys, shared_data):
    from moeflow.quality.measure import above_chance, agreement, final_number

    assert above_chance(20, 40, 0.25) and not above_chance(12, 40, 0.25) and not above_chance(0, 5, 0.0)
    assert final_number("so 3 + 4 = 7 #### 1,200") == "1200" and final_number("it is 42.0 dollars") == "42"
    a, first = agreement([torch.tensor([1, 2, 3]), torch.tensor([5])], [torch.tensor([1, 9, 3]), torch.tensor([5, 6])])
    assert a == 3 / 5 and first == (1 + 1) / 2
    args = _args(ckpt, "--task", "mmlu", "--task-limit", "8", "--ppl-windows", "0", "--data-dir", str(shared_data))
    assert _run(args) == 0
    out = capsys.readouterr()
    runs = json.loads(out.out.strip().splitlines()[-1])["runs"]
    t = runs[0]["task"]
    assert t["name"] == "mmlu" and t["n"] == 8 and t["chance"] == 0.25
    if not t["above_chance"]:  # a random tiny model
        assert "at chance" in out.err
    assert runs[0]["ppl"] is None and runs[1]["task"]["correct"] == t["correct"]


def test_quality_refuses_bad_input(ckpt, capsys):
    assert _run(_args(ckpt, "--miss", "nope")) == 2
    assert "unknown miss policy" in capsys.readouterr().err
    assert _run(_args(ckpt, "--routing", "standard,standard")) == 2
    assert "--sweep" in capsys.readouterr().err
    assert _run(_args(ckpt, "--task", "hellaswag")) == 2
    assert "--task" in capsys.readouterr().err
    assert _run(_args(ckpt, "--text", "/nonexistent.txt")) == 2
    err = capsys.readouterr().err
    assert "--text" in err and len(err.strip().splitlines()) == 1
    assert _run(_args(ckpt, "--speculative")) == 2
    assert "--speculative needs" in capsys.readouterr().err
    for mode in ("resident", "bogus"):  # resident is always the reference: it was accepted and ignored
        assert _run(_args(ckpt, "--mode", mode)) == 2
        assert f"--mode '{mode}': quality compares offload and/or on-demand" in capsys.readouterr().err


def test_policy_opt_flags_reach_the_policies(ckpt, capsys):
    """--routing-opt / --miss-opt as in `moeflow run`: cache-aware with lambda=0 keeps the router's choice (exact,
    bit-identical), an inline option wins over the flag's, and a policy that takes no such option is one line."""
    assert _run(_args(ckpt, "--routing", "cache-aware", "--routing-opt", "lambda=0")) == 0
    runs = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"]
    assert runs[1]["routing"] == "cache-aware" and runs[1]["lossy"] is False and runs[1]["agreement"] == 1.0
    assert _run(_args(ckpt, "--routing", "cache-aware:lambda=0.5", "--routing-opt", "lambda=0")) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"][1]["lossy"] is True
    assert _run(_args(ckpt, "--miss", "fetch", "--miss-opt", "min_rank=2")) == 2
    err = capsys.readouterr().err
    assert "'fetch' has no option 'min_rank'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("mode", ["preload", "restricted"])
def test_casmoe_plan_modes_scored(ckpt, capsys, monkeypatch, tmp_path, mode):
    """`--plan casmoe` as `run` (the stand-in planner of test_plan_run): preload is an exact row, restricted a
    lossy one; every prompt and perplexity window is planned."""
    import numpy as np

    from moeflow.moe import get_adapter
    from moeflow.plan import CascadePlanner
    from moeflow.plan.run import RunPlanner
    from tests.test_plan_run import _ConstEAP

    texts: list[str] = []

    class _Recording(_ConstEAP):
        def predict(self, t):
            texts.extend(t)
            return super().predict(t)

    def load(spec, model):
        s = get_adapter(model).spec
        ep = np.zeros((s.num_moe_layers, s.num_experts), dtype=np.float32)
        ep[:, [1, 4, 6]] = [3.0, 2.0, 1.0]
        return RunPlanner(spec, CascadePlanner(None, _Recording(ep), None), s)

    monkeypatch.setattr(RunPlanner, "load", staticmethod(load))
    (tmp_path / "eap").mkdir()
    opts = ["--plan", "casmoe", "--plan-opt", f"predictors={tmp_path}", "--plan-opt", f"mode={mode}", "--plan-opt", "k=3"]
    assert _run(_args(ckpt, "-c", "50%", *opts)) == 0
    out = capsys.readouterr()
    res = json.loads(out.out.strip().splitlines()[-1])
    ref, row = res["runs"]
    assert row["mode"] == "offload" and row["plan"].startswith(f"casmoe:{mode}") and f"plan=casmoe:{mode}" in row["run"]
    assert len(texts) == 2 + 2 and res["plan"]["mode"] == mode  # two prompts, two windows (their own text)
    assert row["bytes_per_token"] > 0 and row["tpot_s"] is not None
    if mode == "preload":
        assert row["lossy"] is False and "exact" in out.err
        assert row["ppl_delta_pct"] == 0.0 and row["ppl"] == ref["ppl"]
        assert row["agreement"] == 1.0 and row["tf_agreement"] == 1.0
    else:
        assert row["lossy"] is True and res["plan"]["lossy"] is True and "LOSSY" in out.err
        assert row["ppl_delta_pct"] != 0.0 or row["agreement"] < 1.0
    assert _run(_args(ckpt, *opts, "--plan-opt", "update=true")) == 2
    assert "update=true" in capsys.readouterr().err


def test_dppl_interval_hand_computed():
    """Identical scores: [0, 0], within noise; a constant per-token shift c: exactly exp(c) - 1 at both ends, not
    within noise; a change that goes both ways: an interval around 0; a cell that says so; unpaired scores refused."""
    import math

    from moeflow.quality.measure import dppl_cell, dppl_interval, within_noise

    ref = [[2.0, 1.0, 3.0, 0.5] * 10, [1.5] * 25]  # two windows, 65 scored tokens
    same = dppl_interval(ref, ref)
    assert same == (0.0, 0.0) and within_noise(same) is True
    shifted = [[x + 0.1 for x in w] for w in ref]
    lo, hi = dppl_interval(shifted, ref)
    assert lo == pytest.approx(100 * math.expm1(0.1)) and hi == pytest.approx(100 * math.expm1(0.1))
    assert within_noise((lo, hi)) is False
    mixed = [[x + (0.2 if i % 2 else -0.2) for i, x in enumerate(w)] for w in ref]
    ci = dppl_interval(mixed, ref, block=1)  # token by token: +0.2 and -0.2 nats alternate
    assert ci is not None and ci[0] < 0 < ci[1] and within_noise(ci) is True
    assert dppl_interval(mixed, ref, block=1) == ci  # a fixed seed: the same interval each time
    assert dppl_cell(8.5, (-3.1, 19.0)) == "+8.50 [-3.10, +19.00] within noise"
    assert dppl_cell(8.5, (2.0, 19.0)) == "+8.50 [+2.00, +19.00]" and dppl_cell(None, None) == "-"
    assert dppl_interval([], []) is None and within_noise(None) is None
    with pytest.raises(ValueError, match="same windows"):
        dppl_interval([[1.0, 2.0]], [[1.0]])


def test_quality_gives_each_dppl_an_interval(ckpt, capsys, lossy_routing):
    """Every configuration's perplexity change vs resident comes with its 95% interval and a within-noise flag
    (exact ones: [0, 0]); the table prints them; the per-token NLLs stay out of --json."""
    code = _run(_args(ckpt, "--sweep", "-c", "2", "--routing", f"standard,{lossy_routing}"))
    assert code == 0
    out = capsys.readouterr()
    runs = json.loads(out.out.strip().splitlines()[-1])["runs"]
    for r in runs:
        assert "ppl_token_nll" not in r
        lo, hi = r["dppl_ci95"]
        assert lo <= hi and r["dppl_within_noise"] == (lo <= 0 <= hi)
        if not r["lossy"]:
            assert (lo, hi) == (0.0, 0.0) and r["dppl_within_noise"] is True
    lossy = next(r for r in runs if r["lossy"])
    assert lossy["dppl_ci95"][0] <= lossy["ppl_delta_pct"] <= lossy["dppl_ci95"][1]
    assert "95% interval" in " ".join(out.err.split())
    assert "within noise" in out.err


def test_fidelity_recommends_nothing_inside_the_noise():
    """benchmarks/fidelity.py: a lossy row whose perplexity change is small at its point estimate but whose interval
    reaches past --max-ppl-loss is not recommended; a faster one bounded below it is."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "fidelity.py"
    spec = importlib.util.spec_from_file_location("fidelity_bench", path)
    assert spec is not None and spec.loader is not None
    fid = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fid)
    noisy = {"config": "substitute", "lossy": True, "ppl_delta_pct": -8.5, "dppl_ci95": [-30.0, 25.0], "tpot_gain_pct": 20.0}
    tight = {"config": "fetch-priority", "lossy": True, "ppl_delta_pct": 0.2, "dppl_ci95": [0.1, 0.6], "tpot_gain_pct": 5.0}
    assert fid.recommend([noisy], 1.0) is None
    assert fid.recommend([noisy, tight], 1.0) is tight


def test_quality_warns_when_the_host_rows_could_not_be_page_locked(ckpt, capsys, monkeypatch):
    """As `moeflow run`: a CUDA engine whose store could not page-lock the experts still runs, its speed column is
    slower for it, and the report says so once; each run's JSON has `host_memory` (a CPU engine made to ask here)."""
    import moeflow.runtime.engine as engine_mod
    from moeflow.runtime.store import HostExpertStore

    from .test_load_experts import refuse_page_locking

    refuse_page_locking(monkeypatch)
    monkeypatch.setattr(engine_mod, "HostExpertStore", lambda adapter, pin: HostExpertStore(adapter, pin=True))
    assert _run(_args(ckpt, "--sweep", "--mode", "offload,on-demand", "-c", "50%")) == 0
    out = capsys.readouterr()
    runs = json.loads(out.out.strip().splitlines()[-1])["runs"]
    assert [r["host_memory"] for r in runs] == [None, "pageable", "pageable"]
    assert out.err.count("could not be page-locked") == 1
