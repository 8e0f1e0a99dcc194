"""`moeflow quality` on a tiny saved checkpoint: fetch is exact (perplexity change 0, agreement 1.0), a lossy
configuration is labelled lossy, the --json shape, one line for bad input."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from moeflow.lmtrain.tokenizer import train_tokenizer
    from moeflow.models import tiny_model

    d = tmp_path_factory.mktemp("qckpt")
    text = ["the king said to the queen that the night was long", "to be or not to be, that is the question"] * 20
    tok = train_tokenizer(text, vocab_size=200)
    tiny_model("olmoe", num_experts=8, top_k=2).save_pretrained(d)
    tok.save_pretrained(d)
    (d.parent / "p.txt").write_text("the king said\nto be or not\n")
    (d.parent / "text.txt").write_text(" ".join(text[:6]))
    return d


@pytest.fixture
def lossy_routing():
    """A routing policy that strongly prefers resident experts: it changes the output and says so."""
    from moeflow.policies import ROUTING

    class PreferResident:
        name: ClassVar[str] = "test-prefer-resident"
        exact: ClassVar[bool] = False
        lossy: ClassVar[bool] = True

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
