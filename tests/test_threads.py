"""The thread rule (moeflow.threads): --threads, the environment, a calibration's best count, the size
default; every command reports what it chose; plain progress lines when stderr is not a terminal."""

from __future__ import annotations

import io
import json

import pytest
import torch

from moeflow.errors import ConfigError
from moeflow.threads import SMALL_MATRIX, default_threads, env_threads, resolve_threads

SMALL = {"hidden_size": 128, "expert_intermediate_size": 128}  # the project's test model: 16 Ki weights
LARGE = {"hidden_size": 2048, "expert_intermediate_size": 1024}  # OLMoE-1B-7B: 2 Mi weights


def test_rule_order():
    cal = {"best_threads": 3, "path": "calibration/cpu.json"}
    env = {"MOEFLOW_THREADS": "5", "OMP_NUM_THREADS": "6"}
    assert resolve_threads(2, cal, SMALL, environ=env, cores=8).to_dict() == {"threads": 2, "threads_source": "--threads"}
    assert resolve_threads(None, cal, SMALL, environ=env, cores=8).to_dict() == {
        "threads": 5,
        "threads_source": "MOEFLOW_THREADS",
    }
    omp = resolve_threads(None, cal, SMALL, environ={"OMP_NUM_THREADS": "6"}, cores=8)
    assert (omp.n, omp.source) == (6, "OMP_NUM_THREADS")
    c = resolve_threads(None, cal, SMALL, environ={}, cores=8)
    assert (c.n, c.source) == (3, "calibration") and "calibration/cpu.json" in c.why
    assert resolve_threads(None, cal, SMALL, environ={}, cores=2).n == 2  # a calibrated count is capped at the CPUs
    d = resolve_threads(None, {"initial_s": 2}, SMALL, environ={}, cores=8)  # a calibration without best_threads
    assert (d.n, d.source) == (1, "default") and "small model" in d.why
    assert resolve_threads(None, None, LARGE, environ={}, cores=8).to_dict() == {"threads": 8, "threads_source": "default"}
    assert resolve_threads(None, None, None, environ={}, cores=3).n == 3  # no spec: not known to be small
    with pytest.raises(ConfigError, match="--threads must be >= 1"):
        resolve_threads(0, None, SMALL, environ={})


def test_size_default_threshold():
    edge = {"hidden_size": 1024, "expert_intermediate_size": 1024}  # exactly 2^20 weights
    assert 1024 * 1024 == SMALL_MATRIX and default_threads(edge, cores=4)[0] == 4
    assert default_threads({"hidden_size": 1000, "expert_intermediate_size": 1048}, cores=4)[0] == 1  # 1,048,000
    assert default_threads({"hidden_size": 1024, "expert_intermediate_size": 64}, cores=4)[0] == 4  # hidden^2 counts
    from moeflow.models import tiny_config
    from moeflow.moe.adapters import spec_from_config

    assert default_threads(spec_from_config(tiny_config("olmoe")), cores=4)[0] == 1  # a MoESpec works as well


def test_environment_values():
    assert env_threads({}) is None and env_threads({"OMP_NUM_THREADS": ""}) is None
    assert env_threads({"OMP_NUM_THREADS": "4,2"}) == (4, "OMP_NUM_THREADS")  # OpenMP's nested list: the first
    assert env_threads({"OMP_NUM_THREADS": "many"}) is None  # not ours to refuse
    assert env_threads({"MOEFLOW_THREADS": " 3 "}) == (3, "MOEFLOW_THREADS")
    for bad in ("0", "two", "-1"):
        with pytest.raises(ConfigError, match="MOEFLOW_THREADS must be an integer >= 1"):
            env_threads({"MOEFLOW_THREADS": bad})


def _calibration(path, model, **fields):
    from moeflow.artifacts import new_meta
    from moeflow.calibrate.io import KIND, SCHEMA, write_calibration
    from moeflow.moe import model_fingerprint

    rec = new_meta(KIND, SCHEMA, model_fingerprint(model))
    rec.update({"initial_s": 1, **fields})
    write_calibration(path, rec)


def test_calibration_lookup(tmp_path, tiny_models):
    from moeflow.stages.threads import find_thread_calibration

    olmoe, mixtral = tiny_models("olmoe"), tiny_models("mixtral")
    root = tmp_path / "calibration"
    assert find_thread_calibration(olmoe, "cpu", root=root) is None
    _calibration(root / "cpu.json", olmoe)  # an older file: no best_threads
    assert find_thread_calibration(olmoe, "cpu", root=root) is None
    _calibration(root / "cpu-emulated-2gbps.json", olmoe, best_threads=2)
    found = find_thread_calibration(olmoe, "cpu", root=root)
    assert found is not None and found["best_threads"] == 2 and found["path"].endswith("cpu-emulated-2gbps.json")
    assert find_thread_calibration(mixtral, "cpu", root=root) is None  # made for another model: skipped
    (root / "cpu.json").write_text("{not json")  # unreadable: skipped (run reports its own calibration)
    assert find_thread_calibration(olmoe, "cpu", root=root)["best_threads"] == 2
    assert find_thread_calibration(olmoe, "cpu", records=({"best_threads": 4},), root=root)["best_threads"] == 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from moeflow.lmtrain.tokenizer import train_tokenizer
    from moeflow.models import tiny_model

    d = tmp_path_factory.mktemp("tckpt")
    tok = train_tokenizer(["the king said to the queen that the night was long"] * 20, vocab_size=200)
    tiny_model("olmoe", num_experts=8, top_k=2).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _run_json(ckpt, capsys, *more):
    from moeflow.cli.app import main

    try:
        main(["run", "-m", str(ckpt), "--prompt", "the king said", "--max-new-tokens", "2", "--no-warmup", "--json", *more])
    except SystemExit as e:
        assert e.code in (0, None)
    out = capsys.readouterr()
    return json.loads(out.out.strip().splitlines()[-1]), out.err


def test_run_reports_and_uses_the_rule(ckpt, tmp_path, capsys, monkeypatch):
    from moeflow.models import load_model

    monkeypatch.chdir(tmp_path)  # calibration/ is looked up here
    monkeypatch.delenv("MOEFLOW_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    res, err = _run_json(ckpt, capsys)
    assert (res["threads"], res["threads_source"]) == (1, "default")  # a small model, no calibration
    assert "1 thread (default: small model" in err  # the text line
    assert torch.get_num_threads() == before  # restored after the command
    _calibration(tmp_path / "calibration" / "cpu.json", load_model(ckpt)[0], best_threads=2)
    import moeflow.stages.threads as st

    monkeypatch.setattr(st, "idle_cpus", lambda: 8.0)  # a quiet machine
    res, _ = _run_json(ckpt, capsys)
    assert (res["threads"], res["threads_source"]) == (min(2, _cores()), "calibration")
    monkeypatch.setattr(st, "idle_cpus", lambda: 1.1)  # another job holds the second core: capped
    res, err = _run_json(ckpt, capsys)
    assert (res["threads"], res["threads_source"]) == (1, "calibration")
    if _cores() >= 2:
        assert "1 of 2: 1.1 CPUs idle now" in err
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _run_json(ckpt, capsys)[0]["threads_source"] == "OMP_NUM_THREADS"
    monkeypatch.setenv("MOEFLOW_THREADS", "2")
    assert _run_json(ckpt, capsys)[0]["threads"] == 2
    res, _ = _run_json(ckpt, capsys, "--threads", "1")
    assert (res["threads"], res["threads_source"]) == (1, "--threads")


def test_a_calibrated_or_default_count_is_capped_at_the_idle_cpus():
    from moeflow.threads import ThreadChoice, cap_to_idle

    cal = ThreadChoice(2, "calibration", "fastest measured")
    assert cap_to_idle(cal, 1.0) == ThreadChoice(1, "calibration", "fastest measured; 1 of 2: 1.0 CPUs idle now", 1.0)
    assert cap_to_idle(cal, 1.6).n == 2 and cap_to_idle(cal, 1.6).idle == 1.6  # rounded: 1.6 idle CPUs are 2
    assert cap_to_idle(ThreadChoice(8, "default", "all CPUs"), 2.6).n == 3
    assert cap_to_idle(ThreadChoice(8, "default", "all CPUs"), 0.1).n == 1  # at least one
    for explicit in ("--threads", "MOEFLOW_THREADS", "OMP_NUM_THREADS"):  # never capped
        assert cap_to_idle(ThreadChoice(2, explicit, "asked"), 0.2) == ThreadChoice(2, explicit, "asked")
    assert cap_to_idle(ThreadChoice(1, "default", "small"), 0.2).idle is None  # one thread: nothing to cap


def test_apply_threads_caps_only_what_it_chose(tiny_models, monkeypatch):
    import moeflow.stages.threads as st

    monkeypatch.delenv("MOEFLOW_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(st, "idle_cpus", lambda: pytest.fail("idle CPUs measured without a count to cap"))
    model, before = tiny_models("olmoe"), torch.get_num_threads()
    try:
        assert st.apply_threads(2, model, look_up=False).n == 2  # --threads: not measured, not capped
        got = st.apply_threads(None, model, calibration={"best_threads": 2}, cores=2, idle=1.0)
        assert (got.n, got.source, got.idle, torch.get_num_threads()) == (1, "calibration", 1.0, 1)
        got = st.apply_threads(None, model, calibration={"best_threads": 2}, cores=2, idle=2.0)
        assert (got.n, torch.get_num_threads()) == (2, 2)
    finally:
        torch.set_num_threads(before)


def _cores() -> int:
    from moeflow.threads import usable_cores

    return usable_cores()


def test_every_threads_flag_states_the_rule():
    from typer.testing import CliRunner

    from moeflow.cli.app import _register, app

    _register()
    for cmd in ("trace", "train", "eval", "run", "quality"):
        r = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "300"})
        assert r.exit_code == 0 and "MOEFLOW_THREADS" in r.output and "calibrate" in r.output, cmd
    from moeflow.stages.train import EvalConfig, TrainConfig

    assert TrainConfig(trace="t", out="o", model="m").threads is None  # the rule, not a fixed 2
    with pytest.raises(ConfigError, match="--threads must be >= 1"):
        EvalConfig(predictors="p", trace="t", model="m", threads=0)


# ---- progress lines when stderr is not a terminal ------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_plain_progress_lines():
    from moeflow.progress import PlainProgress

    clock, out = _Clock(), io.StringIO()
    p = PlainProgress("simulate", out, clock=clock)
    task = p.add_task("simulate", total=600, unit="configs")
    for i in range(600):
        clock.t = i * 0.1  # 60 s in all
        p.advance(task)
    lines = out.getvalue().splitlines()
    assert lines[0] == "simulate: 60/600 configs (10%), 00:05 elapsed"  # a tenth crossed
    assert lines[-1] == "simulate: 600/600 configs (100%), 00:59 elapsed"
    assert len(lines) == 10
    clock, out = _Clock(), io.StringIO()
    slow = PlainProgress("simulate", out, clock=clock)  # a tenth takes a minute: a line every 10 s
    task = slow.add_task("simulating", total=6000, unit="configs")
    for i in range(300):
        clock.t = i * 0.1
        slow.advance(task)
    assert out.getvalue().splitlines() == [
        "simulate: simulating 101/6000 configs (2%), 00:10 elapsed",
        "simulate: simulating 201/6000 configs (3%), 00:20 elapsed",
    ]
    quick, out2 = PlainProgress("run", io.StringIO(), clock=_Clock()), None
    t = quick.add_task("offload", total=3)
    for _ in range(3):
        quick.advance(t)
    out2 = quick.stream.getvalue()  # type: ignore[union-attr]
    assert out2 == ""  # done within the quiet seconds: nothing
    frac = PlainProgress("train", io.StringIO(), clock=(c := _Clock()))
    t = frac.add_task("fit estimator", total=1.0)
    c.t = 12.0
    frac.update(t, completed=0.4)
    assert frac.stream.getvalue() == "train: fit estimator 40%, 00:12 elapsed\n"  # type: ignore[union-attr]


def test_progress_helper_picks_by_terminal(monkeypatch, capsys):
    from moeflow import progress as mp

    monkeypatch.setattr(mp, "QUIET_S", 0.0)
    monkeypatch.setattr(mp, "is_terminal", lambda console=None: False)
    with mp.progress("simulate") as p:
        assert isinstance(p, mp.PlainProgress)
    with mp.progress("simulate", enabled=False) as p:  # --no-progress / --json: silent either way
        assert not isinstance(p, mp.PlainProgress)
        p.advance(p.add_task("x", total=2), 2)
    monkeypatch.setattr(mp, "is_terminal", lambda console=None: True)
    with mp.progress("simulate") as p:
        assert not isinstance(p, mp.PlainProgress)  # a rich bar
    assert "simulate" not in capsys.readouterr().err


def test_trace_reports_threads_and_simulate_prints_progress_lines(ckpt, tmp_path, capsys, monkeypatch):
    """`trace --json` says which thread count it used; `simulate` with stderr not a terminal writes plain
    progress lines there (here without the quiet seconds, which a test this short never leaves)."""
    from moeflow import progress as mp
    from moeflow.cli.app import main

    monkeypatch.delenv("MOEFLOW_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "p.txt").write_text("the king said\nthe queen said\n")
    trace = tmp_path / "trace"
    args = ["trace", "-m", str(ckpt), "--prompts", str(tmp_path / "p.txt"), "--max-new-tokens", "3", "-o", str(trace)]
    try:
        main([*args, "--json"])
    except SystemExit as e:
        assert e.code in (0, None)
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (res["threads"], res["threads_source"]) == (1, "OMP_NUM_THREADS")
    monkeypatch.setattr(mp, "QUIET_S", 0.0)
    monkeypatch.setattr(mp, "MIN_GAP_S", 0.0)
    try:
        main(["simulate", "-t", str(trace), "-c", "2,4,6", "-e", "lru", "-f", "none", "--no-belady"])
    except SystemExit as e:
        assert e.code in (0, None)
    err = capsys.readouterr().err
    assert "simulate: simulating 3/3 configs (100%)" in err, err


def test_settle_heap_collects_then_freezes(monkeypatch):
    """`settle_heap` collects first (no garbage kept alive by the freeze), then freezes what is alive."""
    import gc

    from moeflow.runtime import timing

    calls: list[str] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "get_freeze_count", lambda: 7)
    assert timing.settle_heap() == 7 and calls == ["collect", "freeze"]


def test_run_settles_the_heap_once_after_the_model_loads(ckpt, capsys, monkeypatch):
    """`moeflow run` freezes the loaded process's objects before it generates (so a full collection never scans
    the model's objects mid-step), once, after the model is loaded."""
    import moeflow.models as models
    import moeflow.stages.session as session

    seen: list[str] = []
    load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: seen.append("load") or load(*a, **k))
    monkeypatch.setattr(session, "settle_heap", lambda: seen.append("settle") or 0)
    res, _ = _run_json(ckpt, capsys)
    assert res and seen == ["load", "settle"]


def test_collect_setup_collects_only_in_a_settled_process():
    """`collect_setup` runs a full collection (cyclic garbage freed) only once the heap was settled: in a process
    that never froze its heap (a test suite attaching many engines) it would scan every object each time."""
    import gc
    import weakref

    from moeflow.runtime import timing

    class Node:
        pass

    def garbage() -> weakref.ref:
        a = Node()
        a.me = a  # a reference cycle: only a collection frees it
        return weakref.ref(a)

    gc.disable()  # no automatic collection between the asserts
    try:
        ref = garbage()
        assert gc.get_freeze_count() == 0 and timing.collect_setup() is False and ref() is not None
        gc.freeze()  # as `settle_heap` leaves a timed process (the suite's autouse fixture unfreezes after)
        ref = garbage()  # made after the freeze, as a setup step's garbage is
        assert timing.collect_setup() is True and ref() is None
    finally:
        gc.enable()


def test_an_engine_collects_its_setup_once_attached(tiny_models, monkeypatch):
    """`OffloadEngine.attach` asks for `collect_setup` once its policies are bound and its hooks are in place (the
    binding's garbage collected then, not in the first timed decode steps), once per attach."""
    from moeflow.runtime import timing
    from moeflow.runtime.generate import build_engine
    from moeflow.runtime.link import DirectLink

    model = tiny_models("olmoe")
    calls: list[bool] = []
    monkeypatch.setattr(timing, "collect_setup", lambda: calls.append(True) or True)
    eng = build_engine(model, mode="offload", link=DirectLink(), capacity=8, prefetch="pregate")
    assert calls == []
    with eng:
        assert calls == [True]
    assert calls == [True]
