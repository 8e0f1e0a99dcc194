"""`benchmarks/gpu_check.py` (`make gpu-check`) on CPU: the no-CUDA answer, and the table / JSON line it builds
from its steps (the subprocesses replaced by canned outputs)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # its dataclass looks its module up
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["gpu_check"]
        raise
    return mod


def test_no_cuda_says_so_and_exits_0(gc, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.main([]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "no CUDA device: gpu-check skipped"
    assert json.loads(lines[-1])["cuda"] is False


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1"
skipped="2" tests="10"><testcase classname="tests.test_gpu_paths" name="test_a"><failure message="x"/></testcase>
</testsuite></testsuites>"""


def _fake_cuda(gc, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_steps_become_one_table_and_one_json_line(gc, monkeypatch, capsys, tmp_path):
    _fake_cuda(gc, monkeypatch)
    monkeypatch.setattr(gc, "accepts_flag", lambda script, flag: True)  # as if cpu_vs_fetch.py took --device
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    calls: list[list[str]] = []

    def runner(cmd, timeout_s, log):
        calls.append(cmd)
        script = Path(cmd[1]).name if cmd[1] != "-m" else "pytest"
        if script == "pytest":
            xml = next(c.split("=", 1)[1] for c in cmd if c.startswith("--junitxml="))
            Path(xml).write_text(JUNIT)
            return 1, "", 2.0
        if script == "engine_overhead.py":
            line = {
                "ratio": 1.5,
                "tpot_ms_median": {"engine": 54.0, "resident": 36.0},
                "misses": 0,
                "resident_decode_impl": "batched_mm",
            }
            return 0, "table\n" + json.dumps(line) + "\n", 3.0
        if script == "offload.py":
            runs = [{"run": "on-demand", "tpot_s": 0.08, "exact": True}, {"run": "lru+pregate", "tpot_s": 0.05, "exact": False}]
            return 0, json.dumps({"resident_tpot_s": 0.03, "runs": runs}) + "\n", 4.0
        if script == "cpu_vs_fetch.py":
            return None, "", 9.0  # over its time limit
        if script == "prefill.py":
            line = {"exact": True, "ttft_bound_ratio": {"serial": {"8": 2.5, "64": 1.9}, "staged": {"8": 2.0, "64": 1.25}}}
            return 0, json.dumps(line) + "\n", 5.0
        raise AssertionError(cmd)

    rc = gc.main(["--model", str(ckpt), "--log-dir", str(tmp_path / "logs")], runner=runner)
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])
    assert rc == 1 and res["cuda"] is True and res["ok"] is False and res["device"] == "Fake GPU"
    by = {c["check"]: c for c in res["checks"]}
    assert list(by) == ["transformers", "pytest -m gpu", "engine overhead", "offload cuda link", "host compute", "prefill"]
    assert by["transformers"]["status"] == "ok"
    t = by["pytest -m gpu"]
    assert t["status"] == "fail" and (t["result"]["passed"], t["result"]["failed"], t["result"]["skipped"]) == (7, 1, 2)
    assert "tests.test_gpu_paths::test_a" in t["reason"]
    assert by["engine overhead"]["status"] == "ok" and "1.50x" in by["engine overhead"]["figure"]
    assert "resident decodes with batched_mm" in by["engine overhead"]["figure"]
    assert by["offload cuda link"]["status"] == "fail" and "lru+pregate" in by["offload cuda link"]["reason"]
    assert by["host compute"]["status"] == "timeout"
    assert by["prefill"]["status"] == "ok" and by["prefill"]["figure"] == "TTFT serial 1.90x bound, staged 1.25x bound"
    prefill_cmd = next(c for c in calls if c[1].endswith("prefill.py"))
    assert prefill_cmd[-2:] == ["--device", "cuda"]
    engine_cmd = next(c for c in calls if c[1].endswith("engine_overhead.py"))
    assert engine_cmd[2:4] == ["--shape", "olmoe-1b-7b-shape"] and "cuda" in engine_cmd
    offload_cmd = next(c for c in calls if c[1].endswith("offload.py"))
    assert re.search(r"--device cuda --link cuda", " ".join(offload_cmd))
    assert json.loads((tmp_path / "logs" / "gpu-check.json").read_text())["checks"] == res["checks"]
    for row in ("pytest -m gpu", "engine overhead", "prefill"):  # the table
        assert row.split()[0] in out


def test_unsupported_transformers_runs_nothing(gc, monkeypatch, capsys, tmp_path):
    from moeflow.moe import tx_compat

    _fake_cuda(gc, monkeypatch)

    def bad():
        raise tx_compat.TransformersVersionError("transformers 4.0 is outside the tested range; install a version in range")

    monkeypatch.setattr(tx_compat, "check", bad)

    def runner(cmd, timeout_s, log):
        raise AssertionError("nothing runs with an unsupported transformers")

    assert gc.main(["--log-dir", str(tmp_path)], runner=runner) == 1
    out = capsys.readouterr().out
    assert "gpu-check: transformers 4.0 is outside the tested range" in out
    res = json.loads(out.strip().splitlines()[-1])
    assert res["transformers_supported"] is False
    assert [c["status"] for c in res["checks"]] == ["fail"] + ["skip"] * 5


def test_steps_that_cannot_run_are_skip_rows(gc, monkeypatch, capsys, tmp_path):
    """No --device on cpu_vs_fetch.py, no checkpoint, no prefill benchmark: skip rows with reasons, exit 0."""
    _fake_cuda(gc, monkeypatch)
    monkeypatch.setattr(gc, "accepts_flag", lambda script, flag: False)

    def runner(cmd, timeout_s, log):
        if cmd[1] == "-m":
            xml = next(c.split("=", 1)[1] for c in cmd if c.startswith("--junitxml="))
            Path(xml).write_text(JUNIT.replace('failures="1"', 'failures="0"').replace('<failure message="x"/>', ""))
            return 0, "", 1.0
        assert cmd[1].endswith("engine_overhead.py"), cmd
        return 0, json.dumps({"ratio": 1.1, "tpot_ms_median": {"engine": 1.1, "resident": 1.0}, "misses": 0}), 1.0

    rc = gc.main(["--model", str(tmp_path / "none"), "--log-dir", str(tmp_path)], runner=runner)
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    by = {c["check"]: c for c in res["checks"]}
    assert rc == 0 and res["ok"] is True
    assert by["pytest -m gpu"]["figure"] == "8 passed, 0 failed, 2 skipped"
    assert by["host compute"] == {**by["host compute"], "status": "skip", "reason": "cpu_vs_fetch.py has no --device flag"}
    assert by["offload cuda link"]["status"] == "skip" and "no checkpoint" in by["offload cuda link"]["reason"]
    assert by["prefill"]["status"] == "skip"
    # pytest that leaves no junit XML is an error, not a pass
    rc = gc.main(["--log-dir", str(tmp_path), "--no-bench"], runner=lambda cmd, t, log: (5, "", 0.1))
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and res["checks"][1]["status"] == "error"


def test_offload_figure_checks_the_resident_run_against_its_probe(gc):
    """A resident decode 3x slower than the probe that picked its implementation (an H100 run before moeflow turned
    cuDNN's attention off: 127 ms/token against a 42 ms/pass probe) makes every ratio to resident wrong: a fail row."""
    from moeflow.stages.run import RESIDENT_SLACK

    line = {"runs": [{"run": "lru+none", "tpot_s": 0.03, "exact": True}], "resident_experts_impl": "grouped_mm"}
    at = {"resident_impl_probe_s": {"grouped_mm": 0.01}}  # `moeflow run`'s slack is the row's: at it ok, past it a fail
    assert gc.offload_figure({**line, **at, "resident_tpot_s": 0.01 * RESIDENT_SLACK})[0] == gc.OK
    assert gc.offload_figure({**line, **at, "resident_tpot_s": 0.0101 * RESIDENT_SLACK})[0] == gc.FAIL
    ok = gc.offload_figure({**line, "resident_tpot_s": 0.0195, "resident_impl_probe_s": {"grouped_mm": 0.0189}})
    assert ok[0] == gc.OK and "resident/probe 1.03" in ok[1]
    bad = gc.offload_figure({**line, "resident_tpot_s": 0.127, "resident_impl_probe_s": {"grouped_mm": 0.042}})
    assert bad[0] == gc.FAIL and "resident/probe 3.02" in bad[1] and "3.0x slower" in bad[2]
    assert gc.offload_figure(line)[0] == gc.OK  # an older JSON line without the probe: no check


def test_host_figure_names_each_bandwidth_and_lossiness(gc):
    """One bandwidth (a real CUDA link) has no crossover: the figure gives each policy's TPOT, not "never beats"."""
    row = {"gbps": 5.6, "tpot_fetch_s": 0.04, "tpot_cpu_s": 0.013, "tpot_auto_s": 0.012, "auto_over_best": 0.94}
    status, fig, _ = gc.host_figure({"rows": [row], "measured_crossover_gbps": None, "token_identical": False})
    assert status == gc.OK
    assert "fetch 40.00 ms" in fig and "cpu 13.00 ms" in fig and "auto/best 0.94" in fig and "lossy" in fig
    assert "never" not in fig
    assert gc.host_figure({"rows": []})[0] == gc.ERROR


COLLECTION_ERROR = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest"
errors="1" failures="0" skipped="1" tests="4"><testcase classname="" name="tests.test_layering" time="0.000"><error
message="collection failure">ImportError while importing test module '/w/tests/test_layering.py'.
tests/test_layering.py:14: in &lt;module&gt;
    import grimp
E   ModuleNotFoundError: No module named 'grimp'</error></testcase><testcase classname="tests.test_gpu_paths"
name="test_a" time="0.1" /><testcase classname="tests.test_gpu_paths" name="test_b" time="0.1" /><testcase
classname="tests.test_gpu_paths" name="test_c" time="0.1"><skipped message="needs 2 CUDA devices" /></testcase>
</testsuite></testsuites>"""


def test_a_module_not_collected_is_named_apart_and_the_gpu_tests_still_run(gc, tmp_path):
    """A GPU machine without a dev package (import-linter's grimp, as on an H100 here): pytest's junit XML holds a
    collection error; gpu-check names the module and its error apart from failed tests, and asks pytest to go on
    past it (`--continue-on-collection-errors`), so the gpu tests' own results still come."""
    xml = tmp_path / "gpu-tests.xml"
    xml.write_text(COLLECTION_ERROR)
    n = gc.junit_counts(xml)
    assert (n["passed"], n["failed"], n["errors"], n["skipped"]) == (2, 0, 1, 1)
    assert n["failed_tests"] == [] and n["uncollected"] == ["tests.test_layering: ModuleNotFoundError: No module named 'grimp'"]
    status, fig, why = gc.tests_figure(n)
    assert status == "fail" and fig == "2 passed, 0 failed, 1 skipped, 1 module not collected"
    assert why == "not collected: tests.test_layering: ModuleNotFoundError: No module named 'grimp'"
    cmds: list[list[str]] = []

    def runner(cmd, timeout_s, log):
        cmds.append(cmd)
        xml.write_text(COLLECTION_ERROR)
        return 2, "", 1.0

    check = gc.run_tests("python", 60.0, tmp_path, runner)
    assert "--continue-on-collection-errors" in cmds[0] and check.status == "fail" and "grimp" in check.reason
