"""Faults at the command line: every bad input is one line and a non-zero exit,
checked before any work; Ctrl-C / SIGTERM; `run --json` texts; one flag vocabulary; `python -m moeflow`."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moeflow.cli.app import main

REPO = Path(__file__).resolve().parent.parent
PY = [sys.executable, "-m", "moeflow"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny OLMoE checkpoint (8 experts per layer, top-2, 3 MoE layers: 24 routed experts) with a tokenizer."""
    from moeflow.lmtrain.tokenizer import train_tokenizer
    from moeflow.models import tiny_model

    d = tmp_path_factory.mktemp("faults") / "ckpt"
    text = ["the king said to the queen that the night was long", "to be or not to be, that is the question"] * 20
    tok = train_tokenizer(text, vocab_size=200)
    tiny_model("olmoe", num_experts=8, top_k=2).save_pretrained(d)
    tok.save_pretrained(d)
    (d.parent / "p.txt").write_text("the king said\nto be or not\n")
    return d


@pytest.fixture()
def no_load(monkeypatch):
    """Fail the test if anything loads a model (the checks must come first)."""

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr("moeflow.models.load_model", refuse)


def cli(argv, capsys):
    """(exit code, stdout, stderr) of `moeflow argv` in this process."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def one_line_error(argv, capsys, *needles, code=2):
    c, _, err = cli(argv, capsys)
    assert c == code, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("Loading weights")]  # transformers' bar
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in err, (n, err)
    return err


# ---- item 4: --device checked before anything loads -------------------------------------------------


def test_unusable_device_is_one_line_before_loading(ckpt, tmp_path, capsys, no_load):
    p = ckpt.parent / "p.txt"
    # cuda:99 exists nowhere: "CUDA is not available" on a CPU machine, "has N CUDA device(s)" on a GPU one
    for argv in (
        ["run", "-m", ckpt, "-p", p, "--device", "cuda:99"],
        ["trace", "-m", ckpt, "-p", "nosuch-set", "-o", tmp_path / "t", "--device", "cuda:99"],
        ["calibrate", "-m", ckpt, "--device", "cuda:99", "-o", tmp_path / "c.json"],
    ):
        err = one_line_error(argv, capsys, "--device cuda:99")
        assert ("CUDA is not available" in err) or ("CUDA device(s)" in err)
    one_line_error(["run", "-m", ckpt, "-p", p, "--device", "banana"], capsys, "not a device")
    assert not (tmp_path / "t").exists() and not (tmp_path / "c.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_cuda(ckpt, capsys, no_load):
    one_line_error(
        ["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--device", "cuda"], capsys, "CUDA is not available", "--device cpu"
    )


# ---- item 4 / 5: bad values, each one line, before any work ----------------------------------------


def test_run_refuses_bad_values_before_loading(ckpt, capsys, no_load):
    base = ["run", "-m", ckpt, "-p", ckpt.parent / "p.txt"]
    one_line_error([*base, "--prefetch-opt", "overfetch=abc"], capsys, "overfetch='abc'")
    one_line_error([*base, "-f", "pregate:overfetch=abc"], capsys, "overfetch='abc'")
    one_line_error([*base, "--threads", "0"], capsys, "--threads must be >= 1")
    one_line_error(
        [*base, "--min-new-tokens", "7", "--max-new-tokens", "6"], capsys, "--min-new-tokens 7", "--max-new-tokens (6)"
    )
    one_line_error([*base, "-c", "abc"], capsys, "--capacity 'abc' not understood")
    one_line_error([*base, "-c", "0"], capsys, "--capacity '0' gives no expert slot")
    one_line_error([*base, "--max-prompt-tokens", "0"], capsys, "--max-prompt-tokens must be >= 1")
    one_line_error([*base, "--link", "cuda"], capsys, "--link cuda needs --device cuda")
    one_line_error([*base, "--threads", "abc"], capsys, "--threads")  # click's own parse error: one line too


def test_simulate_refuses_bad_values(ckpt, tmp_path, capsys, no_load):
    missing = tmp_path / "no-trace"  # the values are checked before the trace is even opened
    base = ["simulate", "-t", missing]
    one_line_error([*base, "-c", "abc"], capsys, "--capacity 'abc'")
    one_line_error([*base, "-c", "0"], capsys, "--capacity '0'")
    one_line_error([*base, "-e", "nope"], capsys, "unknown eviction policy 'nope'")
    one_line_error([*base, "-f", "pregate:overfetch=abc"], capsys, "overfetch='abc'")
    one_line_error([*base, "-f", "pregate", "--prefetch-opt", "overfetch=abc"], capsys, "overfetch='abc'")
    one_line_error([*base, "-e", "lru2:high_fraction=x"], capsys, "high_fraction='x'")
    one_line_error([*base, "--limit", "0"], capsys, "--limit must be >= 1")


def test_simulate_refuses_capacity_below_top_k(ckpt, tmp_path, capsys):
    tr = tmp_path / "trace"
    code, _, err = cli(["trace", "-m", ckpt, "-p", ckpt.parent / "p.txt", "-o", tr, "--max-new-tokens", "2", "--json"], capsys)
    assert code == 0, err
    # top-k is 2: a 1-expert cache cannot hold one token's experts of one layer (accepted before this fix)
    one_line_error(["simulate", "-t", tr, "-c", "1"], capsys, "--capacity '1' = 1 experts", "use 2 (top-k")
    code, out, err = cli(["simulate", "-t", tr, "-c", "2", "--json"], capsys)
    assert code == 0 and json.loads(out)["rows"][0]["capacity"] == 2


def test_train_and_eval_refuse_bad_values(tmp_path, capsys):
    t = tmp_path / "no-trace"
    one_line_error(["train", "-t", t, "-o", tmp_path / "p", "--max-s", "0"], capsys, "--max-s must be >= 1")
    one_line_error(["train", "-t", t, "-o", tmp_path / "p", "--threads", "0"], capsys, "--threads must be >= 1")
    one_line_error(["eval", "--predictors", tmp_path, "-t", t, "--max-s", "0"], capsys, "--max-s must be >= 1")
    one_line_error(["eval", "--predictors", tmp_path, "-t", t, "--mass", "0"], capsys, "--mass must be in (0, 1]")
    one_line_error(["trace", "-p", "x.txt", "-o", tmp_path / "t", "--threads", "0"], capsys, "--threads must be >= 1")


def test_out_directory_refused_before_the_work(ckpt, tmp_path, capsys, no_load):
    d = tmp_path / "adir"
    d.mkdir()
    one_line_error(["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--out", d], capsys, f"--out {d}", "file")
    new = f"{tmp_path / 'newdir'}/"  # a folder to be: a file named newdir would be written
    one_line_error(["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--out", new], capsys, "names a folder (it ends with /)")
    assert not (tmp_path / "newdir").exists()


def test_calibrate_out_directory_refused_before_measuring(ckpt, tmp_path, capsys, monkeypatch):
    def no_measure(*a, **k):
        raise AssertionError("measured before --out was checked")

    monkeypatch.setattr("moeflow.stages.calibrate.bandwidth_sweep", no_measure)
    d = tmp_path / "adir"
    d.mkdir()
    one_line_error(["calibrate", "-m", ckpt, "--out", d], capsys, f"--out {d}")


def test_calibration_hints_name_the_calibrate_command(ckpt, tmp_path, capsys, no_load):
    from moeflow.artifacts import read_record
    from moeflow.errors import ArtifactError

    bad = tmp_path / "cal.json"
    bad.write_text("{not json")
    for path in (bad, tmp_path / "missing.json"):
        with pytest.raises(ArtifactError) as e:
            read_record(path, "calibration", 1)
        assert "`moeflow calibrate`" in str(e.value) and "`moeflow calibration" not in str(e.value)
    with pytest.raises(ArtifactError) as e:
        read_record(bad, "predictors", 1)
    assert "`moeflow train`" in str(e.value)


def test_calibration_with_step_size_below_one_is_refused_when_read(ckpt, tmp_path, capsys, monkeypatch):
    cal = tmp_path / "cal.json"
    code, _, err = cli(
        ["calibrate", "-m", ckpt, "-o", cal, "--sizes", "16", "--repeats", "1", "--decode-steps", "1", "--json"], capsys
    )
    assert code == 0, err
    rec = json.loads(cal.read_text())
    rec["initial_s"] = 0
    cal.write_text(json.dumps(rec))
    calls = []
    monkeypatch.setattr("moeflow.stages.run.generate_batch", lambda *a, **k: calls.append(1))
    monkeypatch.setattr("moeflow.stages.session.generate_batch", lambda *a, **k: calls.append(1))  # the warm-up
    one_line_error(
        ["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--calibration", cal], capsys, "step size S = 0", "integer >= 1"
    )
    # another device's calibration (its S and link were measured there), a non-positive bandwidth: refused as tune does
    for change, words in (({"device": "cuda-NVIDIA_H100"}, "of device 'cuda-NVIDIA_H100', not 'cpu'"),
                          ({"bandwidth_bytes_per_s": -5.0}, "no positive bandwidth_bytes_per_s")):  # fmt: skip
        cal.write_text(json.dumps({**rec, "initial_s": 1, **change}))
        one_line_error(["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--calibration", cal], capsys, words)
    assert calls == []
    monkeypatch.undo()
    cal.write_text(json.dumps({**rec, "initial_s": 1, "device": "cpu-emulated-2gbps"}))  # this device, an emulated link
    args = ["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--calibration", cal, "--no-warmup", "--max-new-tokens", "2"]
    code, _, err = cli(args, capsys)
    assert code == 0, err


# ---- item 5: a sweep checks every value before the first run -----------------------------------------


def test_sweep_bad_late_value_fails_before_any_generation(ckpt, tmp_path, capsys, monkeypatch):
    calls = []

    def counting(*a, **k):
        calls.append(1)
        raise AssertionError("generation started before every sweep value was checked")

    monkeypatch.setattr("moeflow.stages.run.generate_batch", counting)

    monkeypatch.setattr("moeflow.stages.session.generate_batch", counting)  # the warm-up
    out = tmp_path / "gen.jsonl"
    base = ["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--sweep", "--threads", "1", "--out", out]
    # the last capacity is below top-k = 2: known only with the model, still refused before the first run
    one_line_error([*base, "--mode", "resident,offload", "-c", "50%,1"], capsys, "--capacity 1 experts is below top-k=2")
    # the last prefetch's option value, the last eviction, the last mode: refused before the model loads
    one_line_error([*base, "-c", "50%", "-f", "none,pregate:overfetch=abc"], capsys, "overfetch='abc'")
    one_line_error([*base, "-e", "lru,nope"], capsys, "unknown eviction policy 'nope'")
    one_line_error([*base, "--mode", "offload,warp"], capsys, "--mode 'warp' unknown")
    # a learned prefetcher whose predictor folder does not exist
    one_line_error([*base, "-f", f"none,router-pf:predictors={tmp_path / 'nope'}"], capsys, "does not exist")
    assert calls == [] and not out.exists()


# ---- item 7: Ctrl-C and SIGTERM -----------------------------------------------------------------------


def test_ctrl_c_prints_interrupted_exits_130_and_writes_nothing(ckpt, tmp_path, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("moeflow.stages.run.generate_batch", interrupted)

    monkeypatch.setattr("moeflow.stages.session.generate_batch", interrupted)  # the warm-up
    out = tmp_path / "gen.jsonl"
    code, _, err = cli(["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--mode", "resident", "--out", out], capsys)
    assert code == 130 and err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no temporary file left behind either


def test_sigterm_becomes_an_exception_exits_143(ckpt, tmp_path, capsys, monkeypatch):
    def terminated(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises in this thread; the sleep never finishes
        raise AssertionError("SIGTERM did not interrupt the stage")

    monkeypatch.setattr("moeflow.stages.run.generate_batch", terminated)

    monkeypatch.setattr("moeflow.stages.session.generate_batch", terminated)  # the warm-up
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "gen.jsonl"
    code, _, err = cli(["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--mode", "resident", "--out", out], capsys)
    assert code == 143 and err.strip().splitlines()[-1] == "terminated" and "Traceback" not in err
    assert not out.exists()
    assert signal.getsignal(signal.SIGTERM) == before  # the CLI restores the old handler


def test_real_sigint_to_python_m_moeflow(ckpt, tmp_path):
    """A real SIGINT to `python -m moeflow run` while it generates: "interrupted", exit 130, no --out file."""
    code = (
        "import signal, sys, time, moeflow.stages.run as m, moeflow.stages.session as s\n"
        # as from a terminal: a job started in the background of a script inherits SIGINT ignored
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "def slow(*a, **k):\n"
        "    print('generating', flush=True); time.sleep(60)\n"
        "m.generate_batch = s.generate_batch = slow\n"
        "from moeflow.__main__ import main\n"
        "main(sys.argv[1:])\n"
    )
    out = tmp_path / "gen.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "run",
            "-m",
            str(ckpt),
            "-p",
            str(ckpt.parent / "p.txt"),
            "--mode",
            "resident",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        for line in proc.stdout:  # wait until it is inside the generation
            if "generating" in line:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert not out.exists()


# ---- item 8: run --json texts, --column, one vocabulary, python -m moeflow ---------------------------


def test_run_json_carries_each_prompts_text(ckpt, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "gen.jsonl"
    code, stdout, err = cli(
        [
            "run",
            "-m",
            ckpt,
            "-p",
            ckpt.parent / "p.txt",
            "--max-new-tokens",
            "4",
            "--sweep",
            "--mode",
            "resident,offload",
            "-c",
            "50%",
            "-f",
            "none",
            "--threads",
            "1",
            "--json",
            "--out",
            out,
        ],
        capsys,
    )
    assert code == 0, err
    res = json.loads(stdout.strip().splitlines()[-1])
    # oracle: greedy generation with the stock transformers model, no moeflow code involved
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    want = []
    for text in ("the king said", "to be or not"):
        ids = tok(text, return_tensors="pt").input_ids
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
        )
        want.append({"prompt": text, "text": tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)})
    assert len(res["runs"]) == 2
    for run in res["runs"]:
        assert [{"prompt": o["prompt"], "text": o["text"]} for o in run["outputs"]] == want
        assert [o["prompt_id"] for o in run["outputs"]] == [json.loads(l)["prompt_id"] for l in out.read_text().splitlines()][:2]


def test_run_column_picks_the_prompt_field(ckpt, tmp_path, capsys):
    csv = tmp_path / "q.csv"
    csv.write_text("id,Question,Other\n1,the king said,zzz\n2,to be or not,yyy\n")
    code, stdout, err = cli(
        ["run", "-m", ckpt, "-p", csv, "--column", "Other", "--mode", "resident", "--max-new-tokens", "1", "--json"], capsys
    )
    assert code == 0, err
    assert [o["prompt"] for o in json.loads(stdout)["runs"][0]["outputs"]] == ["zzz", "yyy"]


def test_one_flag_vocabulary_with_hidden_old_spellings(tmp_path, capsys, monkeypatch):
    seen = {}
    monkeypatch.setattr("moeflow.stages.run.main", lambda cfg: seen.update(run=cfg))
    monkeypatch.setattr("moeflow.stages.simulate.main", lambda cfg: seen.update(sim=cfg) or {"rows": []})
    monkeypatch.setattr("moeflow.stages.train.eval_main", lambda cfg, console=None: seen.update(ev=cfg) or {})

    def cfg_of(key, argv):
        code, _, err = cli(argv, capsys)
        assert code == 0, err
        return seen.pop(key), err

    new, err = cfg_of("run", ["run", "-p", "x.txt", "--capacity", "3", "-c", "10%,25%", "--sweep"])
    assert new.capacities == ("3", "10%", "25%") and err == ""
    old, err = cfg_of("run", ["run", "-p", "x.txt", "--cache-capacity", "3", "--cache-capacity", "10%,25%", "--sweep"])
    assert old == new and "--cache-capacity is now --capacity" in err
    new, _ = cfg_of(
        "sim",
        ["simulate", "-t", "T", "-f", "none", "-f", "pregate:overfetch=1.5,mass=0.9,all-next-layer", "--limit", "3", "--json"],
    )
    assert new.prefetches == ("none", "pregate:overfetch=1.5,mass=0.9", "all-next-layer") and new.max_prompts == 3
    old, err = cfg_of(
        "sim",
        [
            "simulate",
            "-t",
            "T",
            "-p",
            "none",
            "-p",
            "pregate:overfetch=1.5,mass=0.9,all-next-layer",
            "--max-prompts",
            "3",
            "--json",
        ],
    )
    assert old == new and "-p is now --prefetch/-f" in err and "--max-prompts is now --limit/-n" in err
    new, _ = cfg_of("ev", ["eval", "--predictors", "P", "-t", "T", "--json"])
    old, _ = cfg_of("ev", ["eval", "-p", "P", "-t", "T", "--json"])
    assert old == new and new.predictors == "P"
    # -p means prompts wherever it is shown; the old spellings are hidden from --help
    for cmd, gone in (("run", "--cache-capacity"), ("simulate", "--max-prompts"), ("simulate", " -p "), ("eval", " -p ")):
        code, help_text, _ = cli([cmd, "--help"], capsys)
        assert code == 0 and gone not in help_text, (cmd, gone)
    for cmd in ("run", "trace"):
        code, help_text, _ = cli([cmd, "--help"], capsys)
        assert "--prompts" in help_text and " -p " in help_text


def test_python_dash_m_moeflow():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*PY, "--version"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("moeflow ")
    r = subprocess.run(
        [*PY, "run", "--prompt", "x", "--threads", "0"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    assert r.returncode == 2 and r.stderr.strip() == "error: --threads must be >= 1 (got 0)"


# ---- item 9: layering ----------------------------------------------------------------------------------


def test_the_run_stage_does_not_import_the_cli():
    for name in ("run.py", "session.py", "run_config.py"):
        tree = ast.parse((REPO / "moeflow" / "stages" / name).read_text())
        mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in mods if "cli" in m.split(".")], (name, mods)


def test_square_brackets_are_text_not_markup(ckpt, tmp_path, capsys):
    """A prompt like `[INST] ... [/INST]` and a path or message holding brackets are printed as they are: rich's
    markup parser raised on `[/INST]` (a traceback after the generation, the --out file never written)."""
    prompts = tmp_path / "inst.txt"
    prompts.write_text("[INST] the king said [/INST]\n")
    out = tmp_path / "gen.jsonl"
    args = ["run", "-m", ckpt, "-p", prompts, "--max-new-tokens", "2", "--threads", "1", "--no-warmup", "--no-progress"]
    code, stdout, err = cli([*args, "--out", out], capsys)
    assert code == 0, err
    assert "[INST] the king said [/INST]" in stdout and json.loads(out.read_text().splitlines()[0])["prompt"]
    one_line_error(["inspect", tmp_path / "a[/x]b"], capsys, "a[/x]b does not exist")
    one_line_error(["inspect", tmp_path / "[bold]"], capsys, "[bold] does not exist")
    tr = tmp_path / "t[/b]"  # the line after the work names the artifact as it is
    code, stdout, err = cli(["trace", "-m", ckpt, "-p", prompts, "--max-new-tokens", "1", "--no-progress", "--out", tr], capsys)
    assert code == 0 and str(tr) in " ".join((stdout + err).split()).replace(" ", ""), err


def test_simulate_without_model_uses_the_traces_model(ckpt, tmp_path, capsys, monkeypatch):
    """No --model: pregate's routers come from the checkpoint the trace was made with (as tune), not from the
    default model, which refused every trace of another model."""
    tr = tmp_path / "tr"
    code, _, err = cli(["trace", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--max-new-tokens", "3", "--record-hidden",
                        "--threads", "1", "--no-progress", "--out", tr], capsys)  # fmt: skip
    assert code == 0, err
    monkeypatch.delenv("MOEFLOW_MODEL", raising=False)
    code, out, err = cli(["simulate", "--trace", tr, "-c", "50%", "-f", "pregate", "--json", "--no-progress"], capsys)
    assert code == 0, err
    assert json.loads(out)["rows"]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["run", "-m", "{ckpt}", "--prompt", "  "], "--prompt is empty"),
        (["trace", "-m", "{ckpt}", "-p", "{prompts}", "--hidden-dtype", "float32", "--out", "{tmp}/t"], "add --record-hidden"),
        (["calibrate", "-m", "{ckpt}", "--link-latency-us", "5"], "give --link-gbps too"),
        (["trace", "-m", "{ckpt}", "-p", "{prompts}", "--top-p", "0.9", "--out", "{tmp}/t"], "add --temperature > 0"),
        (["calibrate", "-m", "{ckpt}", "--out", "{tmp}/c.json", "--no-write"], "--no-write writes nothing"),
        (["calibrate", "-m", "{ckpt}", "--decode-steps", "0"], "--decode-steps must be >= 1 (got 0)"),
        (["run", "-m", "{ckpt}", "--prompt", "hi", "--adaptive-s", "-f", "none"], "--adaptive-s adapts the prefetch step"),
    ],
)
def test_flags_that_contradict_each_other_are_one_line_before_loading(ckpt, tmp_path, capsys, no_load, argv, words):
    """Accepted silently before: an empty prompt generated from nothing, --hidden-dtype without hidden states was
    recorded in meta.json, a latency without an emulated link and --out with --no-write did nothing, --top-p
    without --temperature traced greedy tokens."""
    subs = {"{ckpt}": str(ckpt), "{prompts}": str(ckpt.parent / "p.txt"), "{tmp}": str(tmp_path)}
    args = [subs.get(a, a.replace("{tmp}", str(tmp_path))) for a in argv]
    one_line_error(args, capsys, words)
    assert not any(tmp_path.iterdir())


def test_debug_shows_the_traceback_and_keeps_the_exit_code(tmp_path, capsys, monkeypatch):
    """MOEFLOW_DEBUG=1 adds the traceback; a script still sees exit 2 for bad input (it saw 1)."""
    monkeypatch.setenv("MOEFLOW_DEBUG", "1")
    code, _, err = cli(["inspect", tmp_path / "nothing"], capsys)
    assert code == 2 and "Traceback (most recent call last)" in err and "ArtifactError" in err, err
    code, _, err = cli(["run", "--no-such-flag"], capsys)
    assert code == 2 and "Traceback" in err, err


def test_capacity_and_step_size_are_checked_before_the_weights_load(ckpt, capsys, no_load):
    """The checkpoint's config decides them (top-k, MoE layers): a large model's load no longer comes first."""
    p = ckpt.parent / "p.txt"
    one_line_error(["run", "-m", ckpt, "-p", p, "-c", "1"], capsys, "below top-k=2")
    one_line_error(["run", "-m", ckpt, "-p", p, "-c", "100"], capsys, "--capacity")
    one_line_error(["run", "-m", ckpt, "-p", p, "-S", "9"], capsys, "-S")
