"""What users read: `--no-progress` on every command that draws progress, simulate's `cpu_s` / `prepare_s`, the
precision of tune's and simulate's tables, what an interrupted trace says it kept, a config.json transformers
refuses in one line."""

from __future__ import annotations

import io
import json
import re
from typing import Any

import pytest
from rich.console import Console

from moeflow.cli.app import _register, main
from moeflow.errors import ConfigError
from tests.test_predict import tiny_setup  # noqa: F401  (a tiny OLMoE checkpoint and a trace of it with router inputs)

_register()

PROGRESS_COMMANDS = ("trace", "train", "calibrate", "run", "simulate", "tune")  # each calls moeflow.progress.progress


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    got = capsys.readouterr()
    return int(e.value.code or 0), got.out, got.err


@pytest.fixture
def prompt_lines(monkeypatch):
    """Plain progress lines from the first update on (not after 2 s), so short test runs print some."""
    import moeflow.progress as mp

    monkeypatch.setattr(mp, "QUIET_S", 0.0)
    monkeypatch.setattr(mp, "MIN_GAP_S", 0.0)


# ---- --no-progress -------------------------------------------------------------------------------


def _stage_args(name: str, tmp_path) -> list[str]:
    return {
        "trace": ["--prompts", "p.txt", "--out", str(tmp_path / "t")],
        "train": ["--trace", str(tmp_path), "--out", str(tmp_path / "o")],
        "calibrate": ["--no-write"],
        "run": ["--prompt", "hi"],
        "simulate": ["--trace", str(tmp_path)],
        "tune": ["--trace", str(tmp_path)],
    }[name]


@pytest.mark.parametrize("name", PROGRESS_COMMANDS)
def test_no_progress_reaches_the_stage_config(name, tmp_path, monkeypatch, capsys):
    """Every command that draws progress takes `--no-progress` and hands `progress=False` to its stage; without it,
    progress is on (text output)."""
    import importlib

    stage = importlib.import_module(f"moeflow.stages.{name}")
    seen = []

    def stub(cfg, *a, **k):
        seen.append(cfg)
        raise ConfigError("stub")

    monkeypatch.setattr(stage, "main", stub)
    for flags, want in (([], True), (["--no-progress"], False)):
        code, _, err = _cli([name, *_stage_args(name, tmp_path), *flags], capsys)
        assert code == 2 and "stub" in err, err
        assert seen[-1].progress is want, (name, flags)


def test_commands_without_progress_do_not_offer_the_flag():
    """eval, quality, retrain, ep and gps draw no progress: no flag that would do nothing."""
    from typer.main import get_command

    from moeflow.cli.app import app

    group = get_command(app)
    for name, cmd in group.commands.items():  # type: ignore[attr-defined]
        opts = {o for p in cmd.params for o in p.opts}
        assert ("--no-progress" in opts) is (name in PROGRESS_COMMANDS), name


def _train_argv(setup, out) -> list[str]:
    _, trace, _ = setup
    root = trace.parent
    argv = ["train", "--trace", str(trace), "--model", str(root / "model"), "--max-s", "2", "--forest-trees", "4"]
    return [*argv, "--forest-samples", "2000", "--threads", "1", "--only", "router-pf", "--out", str(out)]


def test_train_no_progress_silences_the_progress_lines(tiny_setup, tmp_path, prompt_lines, capsys):  # noqa: F811
    code, _, err = _cli(_train_argv(tiny_setup, tmp_path / "a"), capsys)
    assert code == 0, err
    assert re.search(r"^train: .*elapsed$", err, re.M), err
    code, _, err = _cli([*_train_argv(tiny_setup, tmp_path / "b"), "--no-progress"], capsys)
    assert code == 0, err
    assert "elapsed" not in err and not re.search(r"^train: ", err, re.M), err


def test_simulate_no_progress_silences_the_progress_lines(tiny_setup, prompt_lines, capsys):  # noqa: F811
    _, trace, _ = tiny_setup
    argv = ["simulate", "-t", str(trace), "-c", "2,4,8", "-e", "lru,lfu", "-f", "none"]
    code, out, err = _cli(argv, capsys)
    assert code == 0, err
    assert re.search(r"^simulate: simulating \d+/9 configs .*elapsed$", err, re.M), err
    code, out, err = _cli([*argv, "--no-progress"], capsys)
    assert code == 0, err
    assert "simulate:" not in err and "elapsed" not in err, err
    assert "lru+none" in out  # the table itself is still printed


def test_run_no_progress_silences_the_progress_lines(tiny_checkpoint, tmp_path, prompt_lines, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no calibration here: S = 1, one warning line
    argv = ["run", "-m", str(tiny_checkpoint), "--prompt", "the king said", "--prompt", "to be or not"]
    argv += ["--max-new-tokens", "2", "--no-warmup", "--threads", "1", "-c", "50%"]
    code, _, err = _cli(argv, capsys)
    assert code == 0, err
    assert re.search(r"^run: .*\d+/2 prompts .*elapsed$", err, re.M), err
    code, out, err = _cli([*argv, "--no-progress"], capsys)
    assert code == 0, err
    assert "elapsed" not in err and not re.search(r"^run: ", err, re.M), err
    assert "the king said" in out


# ---- simulate --json: cpu_s and prepare_s -----------------------------------------------------------


def test_simulate_json_rows_carry_cpu_and_prepare_seconds(tiny_setup, capsys):  # noqa: F811
    _, trace, _ = tiny_setup
    argv = ["simulate", "-t", str(trace), "-c", "4", "-e", "lru", "-f", "none", "--json"]
    for link, compiled in (("instant", True), ("emulated:10", False)):
        code, out, err = _cli([*argv, "--link", link], capsys)
        assert code == 0, err
        rows = {r["eviction"]: r for r in json.loads(out)["rows"]}
        assert set(rows) == {"lru", "belady"}
        for r in rows.values():
            assert r["cpu_s"] > 0 and r["accesses_per_s"] > 0
        # the compiled replay prepares its stream and kernels first; a replay call by call (a modelled link) does not
        assert (rows["lru"]["prepare_s"] > 0) is compiled and rows["lru"]["prepare_s"] >= 0


# ---- table precision ----------------------------------------------------------------------------------


def _render(table) -> str:
    buf = io.StringIO()
    Console(file=buf, width=200).print(table)
    return buf.getvalue()


def test_simulate_table_prints_stall_like_its_neighbours_and_no_precision_without_prefetches():
    from moeflow.cli.simulate import table

    def row(prefetch: str, loads: int, precision: float) -> dict:
        return {
            "capacity": 4,
            "eviction": "lru",
            "prefetch": prefetch,
            "hit_rate": 0.5,
            "collisions": 3,
            "loads_per_token": 1.25,
            "prefetch_loads": loads,
            "prefetch_precision": precision,
            "prefetch_recall": 0.4 if loads else 0.0,
            "stall_s": 12.00149,
        }

    res = {
        "trace": "t",
        "passes": 3,
        "phase": "decode",
        "replayed_passes": 5,
        "tokens": 3,
        "working_set": 4.0,
        "total_experts": 32,
        "link": "modelled 1 GB/s",
        "accesses_per_s": 1e6,
        "rows": [row("none", 0, 0.0), row("pregate", 7, 0.5)],
    }
    text = _render(table(res))
    none_line = next(line for line in text.splitlines() if "lru+none" in line)
    pregate_line = next(line for line in text.splitlines() if "lru+pregate" in line)
    assert "12.001" in none_line and "12.0015" not in text
    assert re.search(r"\│\s+-\s+\│\s+0\.00\s+\│", none_line), none_line  # pf prec "-", recall 0.00
    assert "0.50" in pregate_line and " - " not in pregate_line


def test_tune_cost_model_title_has_three_significant_figures():
    from moeflow.tune.search import CostModel, sig3

    cost = CostModel(
        gbps=0.0599731, latency_s=124.528e-6, expert_bytes=1, layer_time_s=0.0, num_moe_layers=2, calibration={"engine_time": {}}
    )
    assert cost.describe().startswith("modelled 0.06 GB/s, 125 us;")
    assert [sig3(x) for x in (12.3456, 1.0, 25.0, 0.001234, 999.6, 12345.0, 0.0)] == [
        "12.3",
        "1",
        "25",
        "0.00123",
        "1000",
        "12300",
        "0",
    ]


# ---- an interrupted trace says what it kept -----------------------------------------------------


def test_trace_stopped_by_sigterm_says_how_many_prompts_it_holds(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """SIGTERM at the third prompt: the trace keeps the whole windows before it, and the line says how many prompts
    it holds and that the same command resumes."""
    import moeflow.stages.trace as trace_mod
    from moeflow.cli.app import Terminated

    prompts = tmp_path / "p.txt"
    prompts.write_text("one two\nthree four\nfive six\nseven eight\n")
    out = tmp_path / "tr"
    argv = ["trace", "-m", str(tiny_checkpoint), "-p", str(prompts), "-o", str(out), "--max-new-tokens", "2", "-b", "1"]
    real, calls = trace_mod.trace_one, []

    def stopped_at_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise Terminated()  # what SIGTERM raises in the main thread under the CLI
        return real(*a, **k)

    monkeypatch.setattr(trace_mod, "trace_one", stopped_at_third)
    code, _, err = _cli([*argv, "--json"], capsys)
    assert code == 143
    lines = err.strip().splitlines()
    assert lines[-1] == "terminated"
    note = " ".join(lines[:-1])
    assert f"{out} kept the 2 prompts this run finished" in note and "holds 2 in all" in note, err
    assert "2 of this command's 4 prompts are left: run the same command again to resume" in note, err
    monkeypatch.setattr(trace_mod, "trace_one", real)
    code, stdout, err = _cli([*argv, "--json"], capsys)
    assert code == 0, err
    res = json.loads(stdout.strip().splitlines()[-1])
    assert res["prompts_skipped"] == 2 and res["prompts_added"] == 2 and res["trace_prompts"] == 4


def test_stopped_note_before_anything_was_kept(tmp_path):
    from types import SimpleNamespace

    from moeflow.data import Prompt
    from moeflow.stages.trace import stopped_note

    w: Any = SimpleNamespace(out=tmp_path / "tr", added_prompts=0, meta={})
    assert stopped_note(w, [Prompt("a", "a", "t")]) is None  # stopped before the trace was opened: nothing to say
    w.meta = {"prompt_ids": []}
    assert "holds none: run the same command again" in stopped_note(w, [Prompt("a", "a", "t")])


# ---- a config.json transformers refuses ---------------------------------------------------------


def test_invalid_config_json_is_one_line_with_transformers_reason(tmp_path, capsys):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    code, _, err = _cli(["run", "-m", str(d), "--prompt", "hi"], capsys)
    assert code == 2
    assert err.startswith("error: ") and err.strip().count("\n") == 0, err
    assert (
        f"transformers could not read {d / 'config.json'}: The hidden size (8) is not a multiple of the number of "
        "attention heads (32); fix or re-save the checkpoint" in " ".join(err.split())
    ), err
    assert "StrictDataclass" not in err and "validator" not in err
    code, _, err2 = _cli(["ep", "-m", str(d), "--prompt", "hi"], capsys)  # `moeflow ep` reads the config itself
    assert code == 2 and err2.strip().count("\n") == 0 and "transformers could not read" in err2, err2


def test_simulate_table_shows_no_hit_rate_for_a_host_only_row():
    """A miss=cpu row whose cache saw no access (nothing prefetched) has no hit rate, not 0.000."""
    from moeflow.cli.simulate import table

    base = {"capacity": 4, "eviction": "lru", "prefetch": "none", "collisions": 0, "loads_per_token": 0.0}
    base.update(prefetch_loads=0, prefetch_precision=None, prefetch_recall=0.0, stall_s=0.0)
    rows = [
        {**base, "miss": "fetch", "hit_rate": 0.25, "hits": 1, "misses": 3, "host_misses": 0},
        {**base, "miss": "cpu", "hit_rate": 0.0, "hits": 0, "misses": 0, "host_misses": 4},
    ]
    res = {"trace": "t", "passes": 1, "phase": "decode", "replayed_passes": 1, "tokens": 1, "working_set": 4.0}
    res.update(total_experts=32, link="instant", accesses_per_s=1e6, rows=rows)
    text = _render(table(res))
    host_line = next(line for line in text.splitlines() if "miss=cpu" in line and "lru" in line)
    assert "0.000" not in host_line and re.search(r"│\s+-\s+│", host_line), host_line
    assert "0.250" in text and "not a cache access" in text


def test_tune_table_shows_no_hit_rate_for_a_host_only_row():
    """A miss=cpu candidate whose cache saw no access has `-` for its hit rate, as `moeflow simulate` shows it."""
    from moeflow.cli.tune import table

    def row(label: str, miss: str, ratio: float | None) -> dict:
        return {"rank": 1, "label": label, "miss": miss, "predicted_tpot_s": 0.01, "hit_rate": 0.0, "ratio_to_bound": ratio}

    rows = [
        {**row("lru+none miss=cpu", "cpu", None), "bytes_per_token": 0.0},
        {**row("lru+none", "fetch", 1.5), "rank": 2, "bytes_per_token": 1e6},
    ]
    res = {"trace": "t", "capacity": 4, "total_experts": 32, "budget": "25%", "cost_model": "m", "candidates": 2}
    res.update(rounds=[{"candidates": 2, "prompts": 1}], bound_tpot_s=0.005, seconds=1.0, ranked=rows)
    text = _render(table(res))
    host = next(line for line in text.splitlines() if "miss=cpu" in line and "lru" in line)
    fetch = next(line for line in text.splitlines() if "lru+none " in line and "miss" not in line)
    assert "0.000" not in host and "0.000" in fetch, text
