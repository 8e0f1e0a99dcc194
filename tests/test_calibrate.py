"""Calibration: the step-size formula, the regime solver, the JSON round trip and a quick CLI run."""

from __future__ import annotations

import json
import math

import pytest

from moeflow.calibrate import (copy_share, copy_share_bandwidth, initial_step_size, load_calibration,
                               parse_regime, specmd_bandwidth, write_calibration)
from moeflow.calibrate.io import KIND, SCHEMA, calibration_path, device_name
from moeflow.calibrate.measure import fit_latency
from moeflow.errors import ArtifactError, ConfigError


def test_step_size_formula():
    # 4 experts x 1 MB at 1 GB/s = 4 ms of copy per layer, 1.5 ms of compute per layer -> 2.67 -> S = 3
    s, raw = initial_step_size(4, 1e6, 1e9, 1.5e-3, num_moe_layers=16)
    assert raw == pytest.approx(4e6 / (1e9 * 1.5e-3)) and s == 3
    assert initial_step_size(4, 1e6, 1e9, 1.5e-3, num_moe_layers=3)[0] == 2      # clamped to L-1
    assert initial_step_size(1, 1e3, 1e9, 1e-3, num_moe_layers=8) == (1, pytest.approx(1e-3))  # at least 1
    assert initial_step_size(2, 1e6, 1e9, 1e-3, num_moe_layers=8)[0] == 2        # exactly 2.0 stays 2
    with pytest.raises(ConfigError):
        initial_step_size(2, 1e6, 0.0, 1e-3, num_moe_layers=8)


def test_regime_solver():
    B, tc = 16 * 2e6, 0.010                       # 32 MB per token on demand, 10 ms of compute
    bw = copy_share_bandwidth(B, tc, 0.85)
    assert copy_share(B, tc, bw) == pytest.approx(0.85)
    assert (B / bw) / (B / bw + tc) == pytest.approx(0.85)
    assert copy_share_bandwidth(B, tc, 0.5) == pytest.approx(B / tc)   # half: copy time = compute time
    # SpecMD: same per-expert transfer time as a 12.58 MB OLMoE-1B-7B bf16 expert at 5 GB/s
    assert specmd_bandwidth(3 * 2048 * 1024 * 2) == pytest.approx(5e9)
    assert 3 * 2048 * 1024 * 2 / 5e9 == pytest.approx(1e6 / specmd_bandwidth(1e6))
    assert parse_regime("copy-share=0.85").value == 0.85 and parse_regime("SpecMD").name == "specmd"
    for bad in ("copy-share=1.5", "fast"):
        with pytest.raises(ConfigError):
            parse_regime(bad)


def test_fit_latency_recovers_a_linear_link():
    rows = [{"bytes": n, "seconds": 20e-6 + n / 4e9} for n in (1 << 16, 1 << 20, 1 << 24)]
    lat, bw = fit_latency(rows)
    assert lat == pytest.approx(20e-6, rel=1e-6) and bw == pytest.approx(4e9, rel=1e-6)


def test_json_round_trip_and_refusals(tmp_path, tiny_models):
    from moeflow.moe import model_fingerprint
    a, b = tiny_models("olmoe"), tiny_models("mixtral")
    rec = {"kind": KIND, "schema": SCHEMA, "model_fingerprint": model_fingerprint(a), "initial_s": 2,
           "bandwidth_bytes_per_s": 1e9}
    p = write_calibration(tmp_path / "calibration" / "cpu.json", rec)
    assert not list(p.parent.glob("*.tmp*"))                            # atomic: no temp file left
    assert load_calibration(p, a)["initial_s"] == 2
    with pytest.raises(ArtifactError, match="another model"):
        load_calibration(p, b)
    p.write_text(json.dumps({**rec, "schema": SCHEMA + 1}))
    with pytest.raises(ArtifactError, match="schema"):
        load_calibration(p)
    p.write_text(json.dumps({**rec, "kind": "trace"}))
    with pytest.raises(ArtifactError, match="not a moeflow calibration"):
        load_calibration(p)
    p.write_text("{oops")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        load_calibration(p)
    with pytest.raises(ArtifactError, match="moeflow calibrate"):
        load_calibration(tmp_path / "missing.json")


def test_device_names():
    assert device_name("cpu") == "cpu"
    assert device_name("cpu", 8.0) == "cpu-emulated-8gbps"
    assert calibration_path("cpu-emulated-8gbps").as_posix() == "calibration/cpu-emulated-8gbps.json"


def test_cli_quick_run(tmp_path, tiny_models):
    from typer.testing import CliRunner
    from moeflow.cli.app import _register, app
    _register()
    model = tiny_models("olmoe")
    ck = tmp_path / "tiny"
    model.save_pretrained(ck)
    out = tmp_path / "cal.json"
    r = CliRunner().invoke(app, ["calibrate", "--model", str(ck), "--out", str(out), "--sizes", "16,64",
                                 "--repeats", "1", "--decode-steps", "2", "--regime", "copy-share=0.85",
                                 "--regime", "specmd", "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    saved = load_calibration(out, model)
    from moeflow.moe import get_adapter
    spec = get_adapter(model).spec
    assert saved["expert_bytes"] == spec.expert_bytes and saved["experts_per_layer"] == spec.top_k
    assert [s["bytes"] for s in saved["sweep"]] == sorted({16 * 1024, 64 * 1024, spec.expert_bytes})
    assert saved["layer_time_s"] > 0 and saved["expert_time_s"] > 0 and saved["bandwidth_bytes_per_s"] > 0
    raw = spec.top_k * spec.expert_bytes / (saved["bandwidth_bytes_per_s"] * saved["layer_time_s"])
    assert saved["s_formula"] == pytest.approx(raw)
    assert saved["initial_s"] == max(1, min(spec.num_moe_layers - 1, math.ceil(raw - 1e-9)))
    share = {g["regime"]: g for g in rec["regimes"]}
    assert share["copy-share=0.85"]["copy_share_on_demand"] == pytest.approx(0.85)
    # help carries units; bad flags exit non-zero with one line
    h = CliRunner().invoke(app, ["calibrate", "--help"])
    assert "GB/s" in h.output and "KiB" in h.output
    bad = CliRunner().invoke(app, ["calibrate", "--model", str(ck), "--regime", "warp"])
    assert bad.exit_code != 0


@pytest.mark.gpu
def test_cli_on_cuda(tmp_path, tiny_models):
    import torch
    from typer.testing import CliRunner
    from moeflow.cli.app import _register, app
    _register()
    ck = tmp_path / "tiny"
    tiny_models("olmoe").save_pretrained(ck)
    r = CliRunner().invoke(app, ["calibrate", "--model", str(ck), "--device", "cuda", "--out", str(tmp_path / "c.json"),
                                 "--sizes", "64,1024", "--repeats", "2", "--decode-steps", "2", "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["link"] == "cuda" and rec["device"].startswith("cuda-")
    assert rec["device"] == device_name("cuda") and torch.cuda.get_device_name(0).split()[0] in rec["device"]
    assert rec["bandwidth_bytes_per_s"] > 1e8 and rec["layer_time_s"] > 0
