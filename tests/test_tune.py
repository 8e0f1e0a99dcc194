"""`moeflow tune` (moeflow.tune, stages/tune.py, cli/tune.py) and `moeflow run --config`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moeflow.errors import ArtifactError, MoeflowError
from moeflow.tune.search import Candidate, search
from tests.test_sim import traced  # noqa: F401  (the module fixture: a tiny checkpoint and its --record-hidden trace)


def _app():
    from moeflow.cli.app import _register, app

    _register()
    return app


def _calibration(path: Path, trace: Path, **over) -> Path:
    """A calibration record for the traced model: a slow emulated link (copies stall), 1 ms per MoE layer."""
    from moeflow.trace import Trace

    tr = Trace(trace)
    rec = {
        "kind": "calibration",
        "schema": 1,
        "model_fingerprint": tr.fingerprint,
        "model": str(tr.meta.get("model")),
        "device": "cpu-emulated-0.002gbps",
        "link": "emulated",
        "link_gbps": 0.002,
        "bandwidth_bytes_per_s": 2e6,
        "latency_s": 1e-5,
        "compute_per_token_s": 0.004,
        "layer_time_s": 0.001,
        "expert_bytes": tr.spec.expert_bytes,
        "experts_per_layer": tr.spec.top_k,
        "initial_s": 2,
    }
    rec.update(over)
    path.write_text(json.dumps(rec))
    return path


def _tune(args, catch=True):
    return CliRunner().invoke(_app(), ["tune", *args], catch_exceptions=catch)


class _Stub:
    """An evaluator whose candidates' figures are given: predicted TPOT = tpot[label] on every prefix."""

    def __init__(self, tpot: dict[str, float], prompts: int = 16):
        self.tpot, self.prompts, self.calls = tpot, prompts, []

    def run(self, c, prompts=None):
        self.calls.append((c.label, prompts))
        return {
            "label": c.label,
            "predicted_tpot_s": self.tpot[c.label],
            "bytes_per_token": 1.0,
            "hit_rate": 1 - self.tpot[c.label],
        }


def test_search_ranks_by_predicted_tpot_and_keeps_the_best_through_the_rounds():
    cands = [Candidate("lru", "pregate", s) for s in (1, 2, 3, 4, 5, 6, 7, 8)] + [Candidate("lfu", "none")]
    tpot = {c.label: t for c, t in zip(cands, (0.9, 0.3, 0.5, 0.1, 0.8, 0.7, 0.2, 0.6, 0.4))}
    ev = _Stub(tpot)
    ranked, pruned, plan = search(ev, cands, eta=2)  # type: ignore[arg-type]
    assert len(plan) > 1 and plan[-1][0] == ev.prompts  # rounds end on the whole trace
    got = [r["predicted_tpot_s"] for r in ranked]
    assert got == sorted(got) and ranked[0]["label"] == "lru+pregate S=4"  # by TPOT, not by candidate order
    assert {r["label"] for r in ranked} | {r["label"] for r in pruned} == set(tpot)
    assert max(got) <= min(r["predicted_tpot_s"] for r in pruned)  # pruning kept the best
    full = search(_Stub(tpot), cands, exhaustive=True)[0]  # type: ignore[arg-type]
    assert [r["label"] for r in full] == sorted(tpot, key=tpot.get)


def test_run_config_round_trip_and_bad_files(tmp_path):
    from moeflow.tune.config import read_run_config, run_config, write_run_config

    opts = {
        "capacity": "6",
        "eviction": "lfu",
        "prefetch": "pregate",
        "lookahead": 2,
        "adaptive_s": False,
        "miss": "fetch",
        "link": "emulated:0.5",
        "calibration": None,
    }
    rec = run_config("/m", "abc", opts, {"predicted_tpot_s": 0.1})
    p = write_run_config(tmp_path / "c.json", rec)
    assert read_run_config(p) == json.loads(json.dumps(rec))
    (tmp_path / "x.json").write_text(json.dumps({"kind": "calibration"}))
    (tmp_path / "y.json").write_text("{nope")
    for bad in ("x.json", "y.json", "missing.json"):
        with pytest.raises(ArtifactError) as e:
            read_run_config(tmp_path / bad)
        assert "\n" not in str(e.value)


def test_tune_ranks_writes_a_config_and_run_applies_it_with_flags_winning(traced, tmp_path, monkeypatch):  # noqa: F811
    ck, tr = traced
    cal = _calibration(tmp_path / "cal.json", tr)
    out = tmp_path / "tuned.json"
    r = _tune(
        [
            "-t",
            str(tr),
            "--calibration",
            str(cal),
            "--model",
            str(ck),
            "-e",
            "lru,lfu",
            "-f",
            "none,pregate",
            "--budget",
            "6",
            "--out",
            str(out),
            "--exhaustive",
            "--json",
        ]
    )
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    ranked = res["ranked"]
    tpots = [x["predicted_tpot_s"] for x in ranked]
    assert tpots == sorted(tpots) and len(ranked) == res["candidates"] and not res["pruned"]
    # S = 1, 2 (the calibration's; the defaults below the 3 MoE layers) and adaptive for pregate, none once; two evictions
    assert len(ranked) == 2 * (1 + 3)
    assert {x["label"] for x in ranked} >= {"lru+pregate S=adaptive", "lfu+pregate S=2", "lru+none"}
    assert all(x["predicted_tpot_s"] >= res["bound_tpot_s"] * (1 - 1e-9) for x in ranked)
    ad = next(x for x in ranked if x["adaptive_s"])  # the controller ran: S within 1 .. MoE layers - 1
    assert ad["lookahead"] is None and 1 <= ad["s_adaptive"]["min"] <= ad["s_adaptive"]["max"] <= 2
    assert Path(res["plot"]).is_file() and Path(res["plot"]).stat().st_size > 0
    rec = json.loads(out.read_text())
    best = ranked[0]
    assert rec["kind"] == "run-config" and rec["options"]["capacity"] == "6"
    assert {k: rec["options"][k] for k in ("eviction", "prefetch", "lookahead", "adaptive_s", "miss")} == {
        k: best[k] for k in ("eviction", "prefetch", "lookahead", "adaptive_s", "miss")
    }
    assert rec["options"]["link"] == "emulated:0.002" and rec["tuned"]["predicted_tpot_s"] == best["predicted_tpot_s"]

    # run --config applies the file; flags given on the command line win
    import moeflow.stages.run as run_stage

    seen = []
    monkeypatch.setattr(run_stage, "main", lambda cfg: seen.append(cfg))
    a = CliRunner().invoke(_app(), ["run", "--config", str(out), "--prompt", "hi"])
    assert a.exit_code == 0, a.output
    cfg = seen[-1]
    assert cfg.model == str(Path(ck).resolve()) and cfg.capacities == ("6",) and cfg.link == "emulated:0.002"
    assert (cfg.evictions, cfg.prefetches, cfg.lookahead, cfg.adaptive_s) == (
        (best["eviction"],),
        (best["prefetch"],),
        best["lookahead"],
        best["adaptive_s"],
    )
    assert cfg.calibration == str(cal.resolve()) and cfg.config_fingerprint == rec["model_fingerprint"]
    assert {"capacity", "eviction", "prefetch", "link"} <= set(cfg.config_keys)  # what the file set (S's source)
    other = "lfu" if best["eviction"] == "lru" else "lru"
    b = CliRunner().invoke(_app(), ["run", "--config", str(out), "--prompt", "hi", "-e", other, "-c", "10", "--link", "direct"])
    assert b.exit_code == 0, b.output
    cfg = seen[-1]
    assert (cfg.evictions, cfg.capacities, cfg.link) == ((other,), ("10",), "direct")
    assert cfg.prefetches == (best["prefetch"],)  # not given: the file's
    assert "prefetch" in cfg.config_keys and not {"eviction", "capacity", "link"} & set(cfg.config_keys)


def test_run_config_of_another_model_is_refused(tiny_models, tmp_path):
    from moeflow.moe import model_fingerprint
    from moeflow.stages.run_config import RunConfig, apply_config_file, check_config_model
    from moeflow.tune.config import OPTIONS, run_config, write_run_config

    m = tiny_models("olmoe")
    path = str(write_run_config(tmp_path / "c.json", run_config("/models/other", "0123", dict.fromkeys(OPTIONS), {})))
    check_config_model(RunConfig(model="m", prompt=("x",), config_fingerprint=model_fingerprint(m)), m)
    cfg = RunConfig(**apply_config_file(path, {"model": "m", "prompt": ("x",)}, {"model", "prompt"}))
    assert cfg.model == "m" and cfg.config_fingerprint == "0123"
    with pytest.raises(MoeflowError) as e:
        check_config_model(cfg, m)
    assert "another model, /models/other" in str(e.value) and "\n" not in str(e.value)


def test_bad_inputs_give_one_line_and_write_nothing(traced, tmp_path, tiny_models):  # noqa: F811
    from moeflow.trace import Trace

    ck, tr = traced
    spec = Trace(tr).spec
    good = _calibration(tmp_path / "cal.json", tr)
    other_ck = tmp_path / "other"
    tiny_models("mixtral").save_pretrained(other_ck)
    from moeflow.models import load_model
    from moeflow.moe import model_fingerprint

    other_fp = model_fingerprint(load_model(other_ck, tokenizer=False)[0])
    other_cal = _calibration(tmp_path / "c_other.json", tr, model_fingerprint=other_fp)
    cases = {
        "below top-k": (["--budget", str(spec.top_k - 1), "--calibration", str(good)], f"at least {spec.top_k}"),
        # --model's own calibration beside a trace of another model: the trace is what is wrong, said first
        "other model's trace, its calibration": (
            ["--model", str(other_ck), "--calibration", str(other_cal)],
            f"trace at {tr} was made for another",
        ),
        # the trace against --model comes first: a calibration is then compared with the trace's model, and says so
        "other model's trace": (["--model", str(other_ck), "--calibration", str(good)], f"trace at {tr} was made for another"),
        "other model's calibration": (
            ["--calibration", str(_calibration(tmp_path / "c1.json", tr, model_fingerprint="0123"))],
            "(fingerprint 0123), not the trace's model",
            "pass --model",
        ),
        "other device's calibration": (
            ["--calibration", str(_calibration(tmp_path / "c2.json", tr, device="cuda-NVIDIA_H100"))],
            "of device 'cuda-NVIDIA_H100'",
        ),
        "calibration of another link": (["--calibration", str(good), "--link", "emulated:8"], "not 'cpu-emulated-8gbps'"),
        "unreplayable prefetch": (["--calibration", str(good), "-f", "pregate:percentile=80"], "its own history"),
        "learned prefetch": (  # not run's --prefetch-opt, which tune does not have
            ["--calibration", str(good), "-f", "forest"],
            "tune cannot replay prefetch policy 'forest' (it needs the running model",
            "needs --prefetch-opt",
        ),
        "S beyond the model": (["--calibration", str(good), "-S", "99"], f"so S can be 1..{spec.num_moe_layers - 1}"),
        "cuda without a GPU": (["--calibration", str(good), "--device", "cuda"], "CUDA is not available on this machine"),
    }
    for name, (args, words, *absent) in cases.items():
        if name == "cuda without a GPU" and torch.cuda.is_available():
            continue
        out = tmp_path / f"{name.replace(' ', '_')}.json"
        r = _tune(["-t", str(tr), "--model", str(ck), "--out", str(out), *args])
        assert r.exit_code != 0 and isinstance(r.exception, MoeflowError), (name, r.output)
        msg = str(r.exception)
        assert words in msg and "\n" not in msg, (name, msg)
        assert not any(a in msg for a in absent), (name, msg)
        assert not out.exists() and not out.with_suffix(".png").exists(), name
    # the plot beside --out: never --out itself, never a file or folder that is not a moeflow plot (even with --force)
    base = ["-t", str(tr), "--model", str(ck), "--calibration", str(good), "--force"]
    mine = tmp_path / "notes.png"
    mine.write_text("my notes")
    (tmp_path / "dir.png").mkdir()
    for out, words in (
        (tmp_path / "cfg.png", "would be replaced by its own plot"),
        (tmp_path / "notes.json", "not a moeflow plot"),
        (tmp_path / "dir.json", "is a folder"),
    ):
        r = _tune([*base, "--out", str(out)])
        assert r.exit_code != 0 and words in str(r.exception) and "\n" not in str(r.exception), (out, r.output)
        assert not out.exists() or out.is_dir()
    assert mine.read_text() == "my notes"


def test_table_replay_is_pregates_replay(traced):  # noqa: F811
    """`TablePrefetch` proposes what `pregate` proposes: the same counters on the modelled link at each S."""
    from moeflow.models import load_model
    from moeflow.moe import get_adapter
    from moeflow.policies import PREFETCH
    from moeflow.sim.access import from_trace
    from moeflow.sim.simulator import simulate
    from moeflow.stages.simulate import _router_predictor
    from moeflow.trace import Trace
    from moeflow.tune.replay import PregateTable, TablePrefetch

    ck, tr = traced
    acc = from_trace(Trace(tr), with_router_input=True)
    model, _ = load_model(ck)
    pred = _router_predictor(get_adapter(model))
    table = PregateTable.build(acc, PREFETCH.create("pregate"), 2, pred)
    kw = dict(link="emulated:0.002", layer_time_s=1e-3, count_phase=1)
    for s in (1, 2):
        want = simulate(acc, 6, "lru", "pregate", lookahead=s, predict_logits=pred, **kw)
        got = simulate(acc, 6, "lru", TablePrefetch(table, PREFETCH.create("pregate").gate, lambda s=s: s), lookahead=s, **kw)
        assert want.prefetch_loads > 0
        assert (got.hits, got.prefetch_loads, got.late, got.stall_s) == (want.hits, want.prefetch_loads, want.late, want.stall_s)


def test_tune_predicts_the_tpot_simulate_predicts(traced, tmp_path):  # noqa: F811
    """One time model: with a calibration's engine_time and link_timing, tune's predicted TPOT of a configuration is
    `moeflow simulate --calibrated-time`'s on the same modelled link (fixed S; pregate replayed from tune's table)."""
    from moeflow.trace import Trace

    ck, tr = traced
    L = Trace(tr).spec.num_moe_layers
    et = {
        "attention_s": [1e-4 * (1 + r) for r in range(L)],
        "route_s": [3e-5] * L,
        "experts_s": [6e-4 + 1e-4 * r for r in range(L)],
        "token_s": 2e-4,
        "predict_s": {"pregate": [4e-5] * L},
        "dispatch_s": [2e-4] * L,
    }
    lt = {"submit_s": 2e-5, "wake_s": 3e-5, "demand_copy_s": 5e-5, "prefetch_copy_s": 7e-5}
    cal = _calibration(tmp_path / "cal.json", tr, engine_time=et, link_timing=lt)
    args = ["-t", str(tr), "--calibration", str(cal), "--model", str(ck), "-e", "lru", "-f", "none,pregate"]
    r = _tune([*args, "-S", "1", "-S", "2", "--no-adaptive", "--budget", "6", "--exhaustive", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["time_model"] == "calibration engine_time"
    rows = {x["label"]: x for x in res["ranked"]}
    for label, pf, s in (("lru+none", "none", 1), ("lru+pregate S=1", "pregate", 1), ("lru+pregate S=2", "pregate", 2)):
        sim_args = ["-t", str(tr), "-c", "6", "-e", "lru", "-f", pf, "--lookahead", str(s), "--link", res["link"]]
        sim_args += ["--calibration", str(cal), "--calibrated-time", "--model", str(ck), "--no-belady", "--json"]
        sim = CliRunner().invoke(_app(), ["simulate", *sim_args])
        assert sim.exit_code == 0, sim.output
        (row,) = json.loads(sim.stdout.strip().splitlines()[-1])["rows"]
        assert rows[label]["predicted_tpot_s"] == pytest.approx(row["predicted_tpot_s"], rel=1e-12), label
        assert rows[label]["predicted_tpot_s"] >= res["bound_tpot_s"]


def test_candidates_view_leaves_out_excluded_slots():
    """The cache's eviction candidates on a modelled link (tune's replays): every unpinned slot but the excluded
    ones (copies in flight, slots a prefetch call filled), as membership, iteration in slot order and truth; each
    policy's victim through the view is its victim over the same keys listed."""
    from moeflow.policies import EVICTION, Position
    from moeflow.policies.base import Candidates

    class _Slot:
        def __init__(self, key, pinned=False):
            self.key, self.pinned = key, pinned

    keys = [(1, e) for e in range(6)]
    slots = [_Slot(k, pinned=i == 1) for i, k in enumerate(keys)]
    slot_of = {k: i for i, k in enumerate(keys)}
    view = Candidates(slot_of, slots, exclude={0, 4})
    want = [keys[2], keys[3], keys[5]]
    assert list(view) == want and len(view) == 3 and bool(view)
    assert [k in view for k in keys] == [k in want for k in keys]
    assert not Candidates(slot_of, slots, exclude=set(range(6)))
    pos = Position(3, 1, 0, 40)
    for name in ("lru", "lfu", "least-stale"):
        pol = EVICTION.create(name)
        for t, k in enumerate(keys[::-1] + keys[2:4]):  # insert, then touch two
            pol.on_insert(k, Position(0, 1, 0, t), prefetched=False)
            pol.on_access(k, Position(0, 1, 0, t), score=1.0)
        fresh = Candidates(slot_of, slots, exclude={0, 4})
        assert pol.victim(fresh, pos) == pol.victim(list(want), pos), name


def test_cost_model_time_model_with_and_without_engine_time():
    """A calibration without engine_time: layer_time_s per MoE layer and the rest of compute_per_token_s once per
    pass, so a pass without stalls takes the compute per token; with it: the simulator's `from_calibration`."""
    from moeflow.sim.timemodel import TimeModel
    from moeflow.tune.search import CostModel

    cal = {"compute_per_token_s": 0.03, "layer_time_s": 0.002}
    cost = CostModel(gbps=0.03, latency_s=3e-4, expert_bytes=196608, layer_time_s=0.002, num_moe_layers=12, calibration=cal)
    tm = cost.time_model("pregate")
    assert not cost.engine_time and tm.pass_s(12, True) == pytest.approx(0.03) and tm.experts_s == (0.002,)
    assert TimeModel.from_compute(0.01, 0.002, 12).token_s == 0.0  # never negative
    et = {"attention_s": [1e-4], "route_s": [2e-5], "experts_s": [5e-4], "token_s": 1e-3, "predict_s": {"pregate": [3e-5]}}
    full = {**cal, "engine_time": et, "link_timing": {"submit_s": 1e-5, "wake_s": 2e-5}}
    cost = CostModel(gbps=0.03, latency_s=3e-4, expert_bytes=196608, layer_time_s=0.002, num_moe_layers=12, calibration=full)
    assert cost.engine_time and cost.time_model("pregate:overfetch=2") == TimeModel.from_calibration(full, "pregate")
    link = cost.link(cost.time_model("none"))
    assert (link.submit_s, link.wake_s, link.prefetch_submit_s) == (1e-5, 2e-5, 1e-5)
    full["link_timing"].update(demand_copy_s=4e-5, prefetch_copy_s=6e-5)  # the engine's host time per copy
    link = cost.link(cost.time_model("pregate"))
    assert (link.submit_s, link.prefetch_submit_s) == (4e-5, 6e-5)


def test_tune_finds_the_one_emulated_calibration(traced, tmp_path, monkeypatch):  # noqa: F811
    """Without --link and --calibration, tune reads calibration/cpu.json, else the one file `moeflow calibrate
    --link-gbps X` wrote (the README's order); two of them are refused in one line."""
    from moeflow.stages.tune import TuneConfig, read_calibration
    from moeflow.trace import Trace

    _, trp = traced
    tr = Trace(trp)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "calibration").mkdir()
    cfg = TuneConfig(trace=str(trp))
    with pytest.raises(MoeflowError, match="found none at calibration/cpu.json"):
        read_calibration(cfg, tr)
    one = _calibration(tmp_path / "calibration" / "cpu-emulated-0.002gbps.json", trp)
    cal, path, link, _ = read_calibration(cfg, tr)
    assert cal["device"] == "cpu-emulated-0.002gbps"
    assert Path(path).resolve() == one.resolve() and link.startswith("emulated:0.002")
    _calibration(tmp_path / "calibration" / "cpu-emulated-8gbps.json", trp, device="cpu-emulated-8gbps")
    with pytest.raises(MoeflowError, match="several calibrations of cpu") as e:
        read_calibration(cfg, tr)
    assert "\n" not in str(e.value)


def test_tune_searches_the_host_miss_policy_where_the_calibration_measured_it(traced, tmp_path):  # noqa: F811
    """On a CPU device with a calibration that measured `host_miss_s`, the miss dimension is fetch and cpu; a cpu
    row's predicted TPOT is `moeflow simulate --miss cpu --calibrated-time`'s and it has no ratio to the bound
    (it copies nothing for a miss). Without `host_miss_s`: fetch only, with a note saying why."""
    from moeflow.trace import Trace

    ck, tr = traced
    L = Trace(tr).spec.num_moe_layers
    et = {
        "attention_s": [1e-4] * L,
        "route_s": [3e-5] * L,
        "experts_s": [6e-4] * L,
        "token_s": 2e-4,
        "predict_s": {"pregate": [4e-5] * L},
        "dispatch_s": [2e-4] * L,
    }
    lt = {"submit_s": 2e-5, "wake_s": 3e-5, "demand_copy_s": 5e-5, "prefetch_copy_s": 7e-5, "host_miss_s": 4e-4}
    cal = _calibration(tmp_path / "cal.json", tr, engine_time=et, link_timing=lt)
    lt["host_split_s"] = 9e-4
    cal = _calibration(tmp_path / "cal.json", tr, engine_time=et, link_timing=lt)
    args = ["-t", str(tr), "--calibration", str(cal), "--model", str(ck), "-e", "lru", "-f", "none,pregate", "-S", "1"]
    args += ["--no-adaptive", "--budget", "6", "--exhaustive", "--json"]
    r = _tune(args)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    rows = {x["label"]: x for x in res["ranked"]}
    fetch_rows = {"lru+none", "lru+pregate S=1", "lru+pregate S=2"}  # S=2: the calibration's
    assert set(rows) == fetch_rows | {f"{x} miss=cpu" for x in fetch_rows}
    host = rows["lru+none miss=cpu"]
    assert host["miss"] == "cpu" and host["ratio_to_bound"] is None and host["host_misses_per_token"] > 0
    assert host["bytes_per_token"] == 0 and rows["lru+none"]["ratio_to_bound"] >= 1
    assert rows["lru+pregate S=1 miss=cpu"]["bytes_per_token"] > 0  # prefetches fill the cache: calls split
    for label, pf in (("lru+none miss=cpu", "none"), ("lru+pregate S=1 miss=cpu", "pregate")):
        sim_args = ["-t", str(tr), "-c", "6", "-e", "lru", "-f", pf, "--miss", "cpu", "--link", res["link"]]
        sim_args += ["--lookahead", "1", "--calibration", str(cal), "--calibrated-time", "--model", str(ck)]
        sim = CliRunner().invoke(_app(), ["simulate", *sim_args, "--no-belady", "--json"])
        assert sim.exit_code == 0, sim.output
        (row,) = json.loads(sim.stdout.strip().splitlines()[-1])["rows"]
        assert rows[label]["predicted_tpot_s"] == pytest.approx(row["predicted_tpot_s"], rel=1e-12), label
        assert row["host_misses"] > 0 and row["miss"] == "cpu" and row["lossy"] is False
    no_clock = ["-t", str(tr), "-c", "6", "-f", "none", "--miss", "cpu", "--link", res["link"], "--json"]
    bad = CliRunner().invoke(_app(), ["simulate", *no_clock])
    assert bad.exit_code != 0 and "--calibrated-time" in str(bad.exception or bad.output)

    lt["host_miss_s"] = 0.0  # measured within the noise (clamped): searched, with a note
    cal = _calibration(tmp_path / "cal.json", tr, engine_time=et, link_timing=lt)
    clamped = json.loads(_tune(args).stdout.strip().splitlines()[-1])
    assert any(x["miss"] == "cpu" for x in clamped["ranked"]) and any("host_miss_s 0" in n for n in clamped["notes"])
    assert not any("host_miss_s 0" in n for n in res["notes"])
    del lt["host_miss_s"], lt["host_split_s"]
    cal = _calibration(tmp_path / "cal2.json", tr, engine_time=et, link_timing=lt)
    r = _tune(
        ["-t", str(tr), "--calibration", str(cal), "--model", str(ck), "-e", "lru", "-f", "none", "--budget", "6", "--json"]
    )
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert [x["label"] for x in res["ranked"]] == ["lru+none"]
    assert any("host_miss_s" in n and "miss cpu not searched" in n for n in res["notes"])
    sim_args[sim_args.index(str(tmp_path / "cal.json"))] = str(cal)
    sim = CliRunner().invoke(_app(), ["simulate", *sim_args, "--no-belady", "--json"])
    assert sim.exit_code != 0 and "host_miss_s" in str(sim.exception or sim.output)


def test_simulate_refuses_a_miss_policy_it_does_not_replay(traced):  # noqa: F811
    _, tr = traced
    sim = CliRunner().invoke(_app(), ["simulate", "-t", str(tr), "-f", "none", "--miss", "auto", "--json"])
    assert sim.exit_code != 0
    assert "simulate replays fetch and cpu" in str(sim.exception or sim.output)
