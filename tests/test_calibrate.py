"""Calibration: the step-size formula, the regime solver, the JSON round trip and a quick CLI run."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moeflow.calibrate import (
    copy_share,
    copy_share_bandwidth,
    initial_step_size,
    load_calibration,
    parse_regime,
    specmd_bandwidth,
    write_calibration,
)
from moeflow.calibrate.io import KIND, SCHEMA, calibration_path, device_name
from moeflow.calibrate.measure import fit_latency
from moeflow.errors import ArtifactError, ConfigError


def test_step_size_formula():
    # 4 experts x 1 MB at 1 GB/s = 4 ms of copy per layer, 1.5 ms of compute per layer -> 2.67 -> S = 3
    s, raw = initial_step_size(4, 1e6, 1e9, 1.5e-3, num_moe_layers=16)
    assert raw == pytest.approx(4e6 / (1e9 * 1.5e-3)) and s == 3
    assert initial_step_size(4, 1e6, 1e9, 1.5e-3, num_moe_layers=3)[0] == 2  # clamped to L-1
    assert initial_step_size(1, 1e3, 1e9, 1e-3, num_moe_layers=8) == (1, pytest.approx(1e-3))  # at least 1
    assert initial_step_size(2, 1e6, 1e9, 1e-3, num_moe_layers=8)[0] == 2  # exactly 2.0 stays 2
    with pytest.raises(ConfigError):
        initial_step_size(2, 1e6, 0.0, 1e-3, num_moe_layers=8)


def test_regime_solver():
    B, tc = 16 * 2e6, 0.010  # 32 MB per token on demand, 10 ms of compute
    # copies 85% of TPOT: B/bw = 0.85/0.15 * 10 ms = 56.67 ms -> bw = 32 MB / 56.67 ms = 564.7 MB/s
    assert copy_share_bandwidth(B, tc, 0.85) == pytest.approx(564_705_882.35, rel=1e-9)
    assert copy_share_bandwidth(B, tc, 0.5) == pytest.approx(3.2e9)  # half: copy time = compute time = 10 ms
    assert copy_share(B, tc, 3.2e9) == pytest.approx(0.5)  # 10 ms copy + 10 ms compute
    assert copy_share(B, tc, 1.6e9) == pytest.approx(2 / 3)  # 20 ms copy + 10 ms compute
    # SpecMD: same per-expert transfer time as a 12.58 MB OLMoE-1B-7B bf16 expert at 5 GB/s (2.516 ms)
    assert specmd_bandwidth(3 * 2048 * 1024 * 2) == pytest.approx(5e9)
    assert specmd_bandwidth(1e6) == pytest.approx(397_364_298.50, rel=1e-9)  # 1 MB in 2.516 ms
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
    rec = {
        "kind": KIND,
        "schema": SCHEMA,
        "model_fingerprint": model_fingerprint(a),
        "initial_s": 2,
        "bandwidth_bytes_per_s": 1e9,
    }
    p = write_calibration(tmp_path / "calibration" / "cpu.json", rec)
    assert not list(p.parent.glob("*.tmp*"))  # atomic: no temp file left
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
    r = CliRunner().invoke(
        app,
        [
            "calibrate",
            "--model",
            str(ck),
            "--out",
            str(out),
            "--sizes",
            "16,64",
            "--repeats",
            "1",
            "--decode-steps",
            "2",
            "--regime",
            "copy-share=0.85",
            "--regime",
            "specmd",
            "--threads",
            "1",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    saved = load_calibration(out, model)
    assert saved["cpu_threads"] == 1  # measured as `moeflow run --threads 1` computes
    assert saved["best_threads"] == 1 and saved["threads_source"] == "--threads"  # --threads: that count only
    assert [r["threads"] for r in saved["thread_sweep"]] == [1]
    assert saved["thread_sweep"][0]["compute_per_token_s"] == saved["compute_per_token_s"]
    # tiny OLMoE: 3 MoE layers, top-2 of 8 experts of 3 x 64 x 32 float32 weights = 24,576 bytes each
    assert saved["expert_bytes"] == 24_576 and saved["experts_per_layer"] == 2
    assert [s["bytes"] for s in saved["sweep"]] == [16_384, 24_576, 65_536]  # --sizes 16,64 KiB + one expert
    assert saved["layer_time_s"] > 0 and saved["expert_time_s"] > 0 and saved["bandwidth_bytes_per_s"] > 0
    # S = N_e E_s / (C_s T_l) with the measured C_s and T_l, rounded up, clamped to [1, 3 - 1]
    raw = 2 * 24_576 / (saved["bandwidth_bytes_per_s"] * saved["layer_time_s"])
    assert saved["s_formula"] == pytest.approx(raw)
    assert saved["initial_s"] == (1 if raw <= 1 else 2)
    share = {g["regime"]: g for g in rec["regimes"]}
    B, tc = 3 * 2 * 24_576, rec["compute_per_token_s"]  # bytes per token on demand, compute
    assert rec["bytes_per_token_on_demand"] == B
    for name, want in (("copy-share=0.85", 0.85), ("specmd", None)):
        t = B / share[name]["bandwidth_bytes_per_s"]  # seconds of copy per token
        assert share[name]["copy_share_on_demand"] == pytest.approx(t / (t + tc))
        if want is not None:
            assert t / (t + tc) == pytest.approx(want)
    # specmd: one 24,576-byte expert in the 2.516 ms an OLMoE-1B-7B expert takes at 5 GB/s
    assert 24_576 / share["specmd"]["bandwidth_bytes_per_s"] == pytest.approx(12_582_912 / 5e9)
    # help carries units; bad flags exit non-zero with one line
    h = CliRunner().invoke(app, ["calibrate", "--help"])
    assert "GB/s" in h.output and "KiB" in h.output
    bad = CliRunner().invoke(app, ["calibrate", "--model", str(ck), "--regime", "warp"])
    assert bad.exit_code != 0 and isinstance(bad.exception, ConfigError) and "unknown --regime 'warp'" in str(bad.exception)


def test_thread_counts_and_best():
    from moeflow.calibrate.measure import best_thread_count, thread_counts

    assert thread_counts(1) == [1] and thread_counts(2) == [1, 2] and thread_counts(6) == [1, 2, 4, 6]
    assert thread_counts(16) == [1, 2, 4, 8, 16]
    rows = [{"threads": 1, "compute_per_token_s": 0.010}, {"threads": 2, "compute_per_token_s": 0.006}]
    assert best_thread_count(rows) == 2
    rows.append({"threads": 4, "compute_per_token_s": 0.0058})  # within 5% of 2 threads: the fewer win
    assert best_thread_count(rows) == 2
    rows.append({"threads": 8, "compute_per_token_s": 0.004})
    assert best_thread_count(rows) == 8


def test_sweep_records_best_threads(tmp_path, tiny_models, monkeypatch):
    """Without --threads (or an environment count) calibrate times decode at 1, 2, ... up to the usable CPUs and
    records the fastest as best_threads, the other compute times at that count; torch's count is restored."""
    import torch

    from moeflow.calibrate.measure import best_thread_count
    from moeflow.stages.calibrate import CalibrateConfig, main

    monkeypatch.delenv("MOEFLOW_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("moeflow.threads.usable_cores", lambda: 2)
    model = tiny_models("olmoe")
    ck = tmp_path / "tiny"
    model.save_pretrained(ck)
    before = torch.get_num_threads()
    cfg = CalibrateConfig(model=str(ck), out=str(tmp_path / "c.json"), sizes_kib=(16,), repeats=1, decode_steps=2)
    rec = main(cfg)
    assert torch.get_num_threads() == before
    sweep = rec["thread_sweep"]
    assert [r["threads"] for r in sweep] == [1, 2] and rec["threads_source"] == "measured"
    assert rec["best_threads"] == best_thread_count(sweep) == rec["cpu_threads"] == rec["threads"]
    at_best = next(r for r in sweep if r["threads"] == rec["best_threads"])
    assert rec["compute_per_token_s"] == at_best["compute_per_token_s"] and rec["layer_time_s"] == at_best["layer_time_s"]
    assert load_calibration(tmp_path / "c.json", model)["best_threads"] == rec["best_threads"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # an environment count pins it, as --threads does
    rec = main(dataclasses.replace(cfg, write=False))
    assert [r["threads"] for r in rec["thread_sweep"]] == [1] and rec["threads_source"] == "OMP_NUM_THREADS"


@pytest.mark.gpu
def test_cli_on_cuda(tmp_path, tiny_models):
    import torch
    from typer.testing import CliRunner

    from moeflow.cli.app import _register, app

    _register()
    ck = tmp_path / "tiny"
    tiny_models("olmoe").save_pretrained(ck)
    r = CliRunner().invoke(
        app,
        [
            "calibrate",
            "--model",
            str(ck),
            "--device",
            "cuda",
            "--out",
            str(tmp_path / "c.json"),
            "--sizes",
            "64,1024",
            "--repeats",
            "2",
            "--decode-steps",
            "2",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["link"] == "cuda" and rec["device"].startswith("cuda-")
    assert rec["device"] == device_name("cuda") and torch.cuda.get_device_name(0).split()[0] in rec["device"]
    assert rec["bandwidth_bytes_per_s"] > 1e8 and rec["layer_time_s"] > 0


def test_split_passes_adds_up_to_the_period():
    """Each decode pass's period (end to end) = per MoE layer attention + router hook + proposal + the experts call
    before its wait (dispatch) and after it, plus the rest (`token_s`); a pass that did not route every MoE layer
    once, in order, is skipped; the copies issued per pass are averaged."""
    from moeflow.calibrate.engine_time import split_passes

    def mark(t0):  # pass start t0; layer l: router hook at +1, +1.5 (0.25 of it the proposal), wait +1.625, end +2
        route = [(l, t0 + 1 + 2 * i, t0 + 1.5 + 2 * i, 0.25) for i, l in enumerate((0, 2))]
        experts = [(l, t0 + 2 + 2 * i, t0 + 1.625 + 2 * i) for i, l in enumerate((0, 2))]
        return {"start": t0, "end": t0 + 5, "route": route, "experts": experts, "loads0": (0, 0), "loads1": (3, 1)}

    passes = [mark(0.0), mark(6.0), mark(13.0), {**mark(20.0), "route": mark(20.0)["route"][:1]}]
    passes[2]["loads1"] = (5, 0)
    passes[1]["waited"] = 0.25  # seconds in the link's waits (inside experts_s)
    out = split_passes(passes, (0, 2))
    assert out["attention_s"] == [1.0, 1.0] and out["route_s"] == [0.25, 0.25] and out["predict_s"] == [0.25, 0.25]
    assert out["dispatch_s"] == [0.125, 0.125] and out["experts_s"] == [0.375, 0.375]
    assert out["passes"] == 2  # the 4th pass routed one layer: skipped
    assert (out["demand_loads"], out["prefetch_loads"]) == (4.0, 0.5)
    assert out["wait_s"] == 0.125  # 0.25 s and none, per pass
    # an experts call that waited for nothing (no wait mark): all of it after the router hook is experts_s
    for p in passes:
        p["experts"] = [(l, t, None) for l, t, _ in p["experts"]]
    out = split_passes(passes, (0, 2))
    assert out["dispatch_s"] == [0.0, 0.0] and out["experts_s"] == [0.5, 0.5]
    # periods 6 and 7 (end to end) less the 4 s the layers took
    assert out["token_s"] == pytest.approx(2.5)
    with pytest.raises(RuntimeError, match="no decode pass"):
        split_passes(passes[:1], (0, 2))


def test_copy_costs_per_copy_over_the_resident_engine():
    """The router hook's extra seconds per demand copy and the proposal's per prefetch copy: a small cache's split
    against the resident one's; none issued (or no extra time) -> 0."""
    from moeflow.calibrate.engine_time import copy_costs

    resident = {"route_s": [1.0, 1.0], "predict_s": {"pregate": [0.5, 0.0]}}
    loaded = {"route_s": [2.0, 1.5], "predict_s": {"pregate": [1.0, 0.25]}, "demand_loads": 3.0, "prefetch_loads": 0.5}
    assert copy_costs(resident, loaded, "pregate") == pytest.approx({"demand_copy_s": 0.5, "prefetch_copy_s": 1.5})
    loaded.update(route_s=[0.5, 0.5], prefetch_loads=0.0)
    assert copy_costs(resident, loaded, "pregate") == {"demand_copy_s": 0.0, "prefetch_copy_s": 0.0}


def test_copy_costs_rest_of_the_pass_per_demand_copy_waits_left_out():
    """`miss_host_s`: attention, dispatch, experts (its 3 s of waits for copies left out) and token_s of the small
    cache's pass (6 s) against the resident pass's (4 s), over its 2 demand copies; the router hook's extra is
    `demand_copy_s`, not counted again; a pass that copies no slower -> 0."""
    from moeflow.calibrate.engine_time import copy_costs

    resident = {"route_s": [1.0, 1.0], "predict_s": {"none": [0.0, 0.0]}, "attention_s": [1.0, 1.0]}
    resident.update(dispatch_s=[0.0, 0.0], experts_s=[0.5, 0.5], token_s=1.0)
    loaded = {"route_s": [2.0, 1.0], "predict_s": {"none": [0.0, 0.0]}, "attention_s": [1.5, 1.0], "demand_loads": 2.0}
    loaded.update(dispatch_s=[0.0, 0.0], experts_s=[3.0, 2.0], token_s=1.5, wait_s=3.0)
    assert copy_costs(resident, loaded, "none") == pytest.approx(
        {"demand_copy_s": 0.5, "prefetch_copy_s": 0.0, "miss_host_s": 1.0}
    )
    loaded.update(wait_s=5.0)
    assert copy_costs(resident, loaded, "none")["miss_host_s"] == 0.0


def test_median_of_rounds_drops_a_preempted_round():
    """Element-wise medians over rounds (lists, nested dicts, numbers); a round 10x slower does not move them."""
    from moeflow.calibrate.engine_time import median_of

    rounds = [{"a": [1.0, 2.0], "p": {"x": [3.0]}, "t": 1.0, "n": "k"} for _ in range(2)]
    rounds.append({"a": [10.0, 20.0], "p": {"x": [30.0]}, "t": 10.0, "n": "k"})
    assert median_of(rounds) == {"a": [1.0, 2.0], "p": {"x": [3.0]}, "t": 1.0, "n": "k"}


def test_wait_lateness_spreads_every_extra_stall_over_the_waits_that_slept():
    """(entry, due, return): a wait that slept 1 s and returned 0.5 s late, one entered after its copy was due that
    still stalled 0.25 s (the copy not made yet), one that returned at once: 0.75 s over the one wait that slept."""
    from moeflow.calibrate.engine_time import wait_lateness

    assert wait_lateness([(0.0, 1.0, 1.5), (2.0, 1.75, 2.25), (3.0, 2.0, 3.0)]) == (0.75, 1)
    assert wait_lateness([(3.0, 2.0, 3.0)]) == (0.0, 0)


def test_calibration_records_engine_and_link_time(tmp_path, tiny_models):
    """`moeflow calibrate --link-gbps` records what `moeflow simulate --calibrated-time` reads: the engine's decode
    pass split per MoE layer (pregate's proposal too) and the emulated link's submit and wake seconds."""
    from moeflow.sim.timemodel import TimeModel
    from moeflow.stages.calibrate import CalibrateConfig, main

    model = tiny_models("olmoe")
    ck = tmp_path / "tiny"
    model.save_pretrained(ck)
    cfg = CalibrateConfig(model=str(ck), link_gbps=0.002, sizes_kib=(16,), repeats=1, decode_steps=3, write=False, threads=1)
    rec = main(cfg)
    et, lt = rec["engine_time"], rec["link_timing"]
    from moeflow.moe import get_adapter

    n = get_adapter(model).spec.num_moe_layers
    for k in ("attention_s", "route_s", "dispatch_s", "experts_s"):
        assert len(et[k]) == n and min(et[k]) >= 0 and max(et[k]) > 0, k
    assert len(et["predict_s"]["pregate"]) == n and et["token_s"] >= 0 and et["passes"] == 3
    assert lt["submit_s"] > 0 and lt["wake_s"] >= 0 and lt["bytes"] == rec["expert_bytes"]
    # the small cache's run copied: per-copy engine seconds measured from it
    assert lt["demand_loads"] > 0 and lt["demand_copy_s"] >= 0 and lt["prefetch_copy_s"] >= 0
    assert lt["slept_waits"] > 0 and lt["engine_wake_s"] >= 0 and lt["miss_host_s"] >= 0
    assert et["rounds"] == 3 and et["prompt_len"] == 16  # --engine-rounds, --prompt-tokens defaults
    tm = TimeModel.from_calibration(rec, "pregate")
    assert tm.pass_s(n, True) > tm.pass_s(n, False) > 0
    assert main(CalibrateConfig(model=str(ck), sizes_kib=(16,), repeats=1, decode_steps=3, write=False))["link_timing"] is None


def test_prompt_tokens_and_engine_rounds_flags():
    """`--prompt-tokens` and `--engine-rounds` reach the config; below 1 is refused in one line naming them."""
    from moeflow.cli.calibrate import build_config
    from moeflow.stages.calibrate import CalibrateConfig

    cfg = build_config(model="m", prompt_tokens=40, engine_rounds=5)
    assert (cfg.prompt_tokens, cfg.engine_rounds) == (40, 5)
    for bad, flag in (({"prompt_tokens": 0}, "--prompt-tokens"), ({"engine_rounds": 0}, "--engine-rounds")):
        with pytest.raises(ConfigError, match=rf"^{flag} must be >= 1 \(got 0\)$"):  # the one flag, its value
            CalibrateConfig(model="m", **bad)


def test_host_costs_per_host_computed_expert_and_per_split_call():
    """`host_miss_s`: the router hook's and the rest of the pass's extra seconds (waits for copies and the proposal
    left out) of a cache nothing fills, per host-computed expert; `host_split_s`: a prefetched cache's extra seconds
    less its host experts' share, per call that split; none -> 0."""
    from moeflow.calibrate.engine_time import host_costs

    resident = {"route_s": [1.0, 1.0], "attention_s": [1.0, 1.0], "experts_s": [1.0, 1.0], "token_s": 1.0}
    alone = {"route_s": [1.5, 1.5], "attention_s": [1.0, 1.0], "experts_s": [3.0, 2.0], "token_s": 1.0}
    alone.update(wait_s=1.0, predict_s=[9.0, 9.0], host_misses=2.0)  # 1 s of route + 3 - 1 s of the rest
    split = {"route_s": [1.0, 1.0], "attention_s": [1.0, 1.0], "experts_s": [4.0, 1.0], "token_s": 1.0}
    split.update(host_misses=1.0, split_calls=0.5)  # 3 s extra: 1.5 s for its host expert, 1.5 s over half a call
    got = host_costs(resident, alone, split)
    assert got == pytest.approx({"host_miss_s": 1.5, "host_split_s": 3.0, "host_misses": 2.0, "host_split_calls": 0.5})
    alone["host_misses"], split["split_calls"] = 0.0, 0.0
    assert host_costs(resident, alone, split)["host_miss_s"] == 0.0
    assert host_costs(resident, alone, split)["host_split_s"] == 0.0


def test_calibration_on_the_cpu_measures_the_host_miss_cost(tiny_checkpoint, tmp_path):
    """A CPU calibration with an emulated link times miss policy cpu too: its copy record has host_miss_s and
    host_split_s and what they were measured over: host-computed experts per pass (> 0: the small cache nothing
    fills misses) and split calls per pass (> 0: the one pregate fills has experts in slots beside host ones)."""
    from moeflow.calibrate.engine_time import engine_rounds
    from moeflow.models import load_model
    from moeflow.moe import get_adapter
    from moeflow.runtime.link import EmulatedLink

    model, _ = load_model(str(tiny_checkpoint), dtype="float32", device="cpu", tokenizer=False)
    ad = get_adapter(model)
    _, copies = engine_rounds(model, ad, 6, "cpu", lambda: EmulatedLink(1.0, 0.0), rounds=1, prompt_len=8)
    assert copies is not None and copies["host_misses"] > 0 and isinstance(copies["host_miss_s"], float)
    assert copies["host_split_calls"] > 0 and isinstance(copies["host_split_s"], float)  # prefetches filled the cache
    _, none = engine_rounds(model, ad, 6, "cpu", None, rounds=1, prompt_len=8)
    assert none is None


def test_the_calibration_table_shows_the_host_terms_when_measured():
    """`moeflow calibrate`'s table has the cpu miss row only where the calibration measured it."""
    from moeflow.cli.calibrate import _host_rows

    assert _host_rows({}) == [] and _host_rows({"submit_s": 1e-5}) == []
    ((label, value),) = _host_rows({"host_miss_s": 8e-5, "host_split_s": 8.4e-4})
    assert "--miss cpu" in label and value == "+0.080 ms / +0.840 ms"
