"""`moeflow retrain`: unchanged on a second run, the lock (exit 75, stale take-over), kill -9 mid-train,
a worse model rejected, promotion through the predictor folder's symlink, keep N versions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeflow.cli.app import main
from moeflow.locks import lock_path
from moeflow.stages.retrain import retrain_lock

from .test_trace import tiny_tokenizer

PROMPTS = [f"prompt number {i}: the quick brown fox {i * 7} jumps" for i in range(12)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_models):
    d = tmp_path_factory.mktemp("ckpt") / "olmoe-tiny"
    tiny_models("olmoe").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def setup(root: Path, checkpoint: Path, n: int = 8, margin: float = 1.0, keep: int = 3) -> Path:
    (root / "prompts.txt").write_text("\n".join(PROMPTS[:n]) + "\n")
    cfg = root / "retrain.toml"
    cfg.write_text(
        f"""
model = "{checkpoint}"
trace = "trace"
predictors = "pred"
only = ["frequency", "token-id", "pregate"]
holdout = 0.25
margin = {margin}
keep = {keep}
log = "retrain.log"
status = "status.json"

[[prompts]]
source = "prompts.txt"

[trace_options]
max_new_tokens = 3
record_hidden = true
threads = 1

[train_options]
max_s = 1
threads = 1
"""
    )
    return cfg


def add_prompts(root: Path, n: int) -> None:
    (root / "prompts.txt").write_text("\n".join(PROMPTS[:n]) + "\n")


def run(cfg: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    try:
        main(["retrain", "--config", str(cfg)])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out + out.err


def status(root: Path) -> dict:
    return json.loads((root / "status.json").read_text())


def test_retrain_twice_is_unchanged_and_reads_promoted(tmp_path, checkpoint, capsys):
    from moeflow.predict.io import read_predictor_meta

    cfg = setup(tmp_path, checkpoint)
    code, out = run(cfg, capsys)
    assert code == 0, out
    st = status(tmp_path)
    assert st["outcome"] == "promoted" and st["figures"]["current"] is None and st["prompts_added"] == 8
    pred = tmp_path / "pred"
    assert pred.is_symlink() and pred.resolve().name == st["version"]
    meta = read_predictor_meta(pred)  # what `moeflow run` / `eval` read: through the symlink
    assert meta["retrain"]["fingerprint"] == st["fingerprint"]
    code, out = run(cfg, capsys)
    assert code == 0 and "unchanged" in out and "trained on these inputs" in " ".join(out.split()), out
    assert "vs current -" not in out  # the first version had none to compare with: not printed as "-"
    assert status(tmp_path)["outcome"] == "unchanged" and pred.resolve().name == st["version"]
    # new prompts: traced (appended), trained, compared with the current version, promoted; keep = 3 versions
    versions = [st["version"]]
    for n in (10, 12):
        add_prompts(tmp_path, n)
        code, out = run(cfg, capsys)
        assert code == 0, out
        s2 = status(tmp_path)
        assert s2["outcome"] == "promoted" and s2["prompts_added"] == 2 and s2["figures"]["current"] is not None
        assert pred.resolve().name == s2["version"] != versions[-1]
        versions.append(s2["version"])
    add_prompts(tmp_path, 12)
    vroot = tmp_path / ".pred.versions"
    assert sorted(p.name for p in vroot.iterdir() if p.name.startswith("v-")) == sorted(versions)
    lines = (tmp_path / "retrain.log").read_text().splitlines()
    assert [l.split()[3] for l in lines] == ["promoted", "unchanged", "promoted", "promoted"]
    assert not [p for p in vroot.iterdir() if p.name.startswith("tmp-")]


def test_lock_held_exits_75_naming_holder_and_stale_lock_is_taken_over(tmp_path, checkpoint, capsys):
    cfg = setup(tmp_path, checkpoint)
    with retrain_lock(tmp_path / "pred"):  # another "run" holds the flock (a second open file description)
        code, out = run(cfg, capsys)
    assert code == 75, out
    assert f"pid {os.getpid()}" in out and "try again later" in out
    assert not (tmp_path / "status.json").exists()
    # a stale lock: the file names a process that is gone (the kernel dropped its flock when it died)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    lock_path(tmp_path / "pred").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "x"}))
    code, out = run(cfg, capsys)
    assert code == 0, out
    st = status(tmp_path)
    assert st["outcome"] == "promoted" and st["took_over_stale_lock"]["pid"] == dead.pid


def test_kill_9_mid_train_keeps_promoted_version(tmp_path, checkpoint, capsys):
    from moeflow.predict.io import read_predictor_meta

    cfg = setup(tmp_path, checkpoint)
    assert run(cfg, capsys)[0] == 0
    pred = tmp_path / "pred"
    before = pred.resolve()
    add_prompts(tmp_path, 10)
    flag = tmp_path / "training"
    script = (
        "import sys, time, pathlib\n"
        "import moeflow.stages.train as t\n"
        "def slow(*a, **k):\n"
        "    pathlib.Path(sys.argv[2]).write_text('x'); time.sleep(120)\n"
        "t.fit_all = slow\n"
        "from moeflow.cli.app import main\n"
        "main(['retrain', '--config', sys.argv[1]])\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script, str(cfg), str(flag)], cwd=tmp_path)
    try:
        deadline = time.time() + 60
        while not flag.exists():
            assert child.poll() is None and time.time() < deadline, "the child never reached training"
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert pred.resolve() == before and read_predictor_meta(pred)["kind"] == "predictors"
    assert [p for p in (tmp_path / ".pred.versions").iterdir() if p.name.startswith("tmp-")]  # its leftover
    code, out = run(cfg, capsys)  # the lock was released by the kernel; the next run succeeds
    assert code == 0, out
    st = status(tmp_path)
    assert st["outcome"] == "promoted" and pred.resolve().name == st["version"] != before.name
    assert st["prompts_added"] == 0  # the killed run had traced them already
    assert not [p for p in (tmp_path / ".pred.versions").iterdir() if p.name.startswith("tmp-")]


def test_worse_model_is_not_promoted(tmp_path, checkpoint, capsys):
    cfg = setup(tmp_path, checkpoint)
    assert run(cfg, capsys)[0] == 0
    pred = tmp_path / "pred"
    before = pred.resolve()
    add_prompts(tmp_path, 10)
    cfg.write_text(cfg.read_text().replace("margin = 1.0", "margin = -1.0"))  # new must beat current by 1.0: impossible
    code, out = run(cfg, capsys)
    assert code == 0 and "rejected" in out, out
    st = status(tmp_path)
    assert st["outcome"] == "rejected" and st["figures"]["new"] is not None and st["figures"]["current"] is not None
    assert pred.resolve() == before and st["version"] == before.name
    code, out = run(cfg, capsys)  # the same data and margin again: nothing to redo
    assert code == 0 and "unchanged" in out and "rejected a candidate of these same inputs" in " ".join(out.split()), out
    assert status(tmp_path)["figures"] == st["figures"]  # "its figures": the rejected candidate's, not the promoted one's


def test_corrupt_trace_is_failed_logged_and_keeps_promoted(tmp_path, checkpoint, capsys):
    """A run that cannot finish (here: a trace shard flipped on disk) says "failed" in the status file and
    the log, exits non-zero with one line, and leaves the promoted version as it was."""
    cfg = setup(tmp_path, checkpoint)
    code, out = run(cfg, capsys)
    assert code == 0, out
    promoted = status(tmp_path)["version"]
    shard = sorted((tmp_path / "trace").glob("shard-*/data.arrow"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    add_prompts(tmp_path, 10)
    code, out = run(cfg, capsys)
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "is corrupt" in errors[0], out
    st = status(tmp_path)
    assert st["outcome"] == "failed" and "ArtifactError" in st["message"]
    assert (tmp_path / "pred").resolve().name == promoted
    assert (tmp_path / "retrain.log").read_text().splitlines()[-1].split()[3] == "failed"
    assert not [p for p in (tmp_path / ".pred.versions").iterdir() if p.name.startswith("tmp-")]


def test_config_without_a_scored_predictor_is_one_line(tmp_path, checkpoint, capsys):
    """Promotion compares layer-ahead recall: a config that trains only the planner / gps is refused up front."""
    cfg = setup(tmp_path, checkpoint)
    cfg.write_text(cfg.read_text().replace('only = ["frequency", "token-id", "pregate"]', 'only = ["eam", "gps"]'))
    code, out = run(cfg, capsys)
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "layer-ahead predictor" in errors[0], out
    assert not (tmp_path / "trace").exists() and not (tmp_path / "pred").exists()


def test_a_model_path_that_names_no_folder_says_which_key_to_fix(tmp_path, checkpoint, capsys):
    """`model = "models/olmoe"` (relative: from the config's folder) names nothing: the line names the file's
    `model =` (retrain has no --model flag) and the folder it resolved to, before any work."""
    cfg = setup(tmp_path, checkpoint)
    cfg.write_text(cfg.read_text().replace(f'model = "{checkpoint}"', 'model = "models/olmoe"'))
    code, out = run(cfg, capsys)
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1, out
    assert "set `model =`" in errors[0] and str(tmp_path / "models" / "olmoe") in errors[0] and "--model" not in errors[0]
    assert not (tmp_path / "trace").exists()


def test_hidden_state_predictors_without_record_hidden_are_refused_before_tracing(tmp_path, checkpoint, capsys):
    """pregate needs the trace's hidden states: said from the config, before a prompt is traced (a trace without
    them would be left behind, and the next run with record_hidden = true refused to append to it)."""
    cfg = setup(tmp_path, checkpoint)
    cfg.write_text(cfg.read_text().replace("record_hidden = true\n", ""))
    code, out = run(cfg, capsys)
    assert code == 2 and "set record_hidden = true under [trace_options]" in out and "pregate" in out, out
    assert not (tmp_path / "trace").exists() and not (tmp_path / ".pred.versions").exists()


def test_a_bad_option_value_names_the_config_key_not_a_flag(tmp_path, checkpoint, capsys):
    """[trace_options] max_new_tokens = -2 was refused as "--max-new-tokens must be >= 1", a flag retrain does not
    have, and only once tracing began; now when the config is read, under its own key."""
    cfg = setup(tmp_path, checkpoint)
    cfg.write_text(cfg.read_text().replace("max_new_tokens = 3", "max_new_tokens = -2"))
    code, out = run(cfg, capsys)
    assert code == 2 and "retrain config [trace_options]: max_new_tokens must be >= 1 (got -2)" in out, out
    assert "--max-new-tokens" not in out and not (tmp_path / "trace").exists()
