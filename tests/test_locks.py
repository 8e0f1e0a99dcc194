"""The --out lock (`moeflow.locks.out_lock`): one writer per target; the second is refused with exit 75 naming
the holder, or waits with --wait and then re-checks --out; a killed holder's lock is taken over; nothing is
left beside the target."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeflow.errors import ConfigError
from moeflow.locks import EX_TEMPFAIL, LockBusy, lock_path, out_lock

from .test_faults_outputs import _no_work, cli, listing, make_read_only, stage_args, train_args, write_trace

REPO = Path(__file__).resolve().parent.parent

# Holds the lock of argv[1] until its stdin closes; with argv[2], first writes a predictor folder's
# meta.json there (what a writer publishes before it lets go).
HOLDER = """
import json, pathlib, sys
sys.path.insert(0, {repo!r})
from moeflow.locks import out_lock
with out_lock(sys.argv[1], command="moeflow train"):
    print("held", flush=True)
    sys.stdin.read()
    if len(sys.argv) > 2:
        out = pathlib.Path(sys.argv[1])
        out.mkdir()
        (out / "meta.json").write_text(json.dumps({{"kind": "predictors", "schema": 1}}))
"""


def holder(target: Path, publish: bool = False) -> subprocess.Popen:
    """A process holding the lock of `target` (released when its stdin is closed)."""
    argv = [sys.executable, "-c", HOLDER.format(repo=str(REPO)), str(target)] + (["publish"] if publish else [])
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "held\n"
    return p


def release(p: subprocess.Popen) -> None:
    assert p.stdin is not None
    p.stdin.close()
    assert p.wait() == 0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(root, trace): a tiny model in root/model and a trace of it."""
    from moeflow.models import load_model, tiny_model

    root = tmp_path_factory.mktemp("locks")
    tiny_model("olmoe", num_hidden_layers=3).save_pretrained(root / "model")
    model, _ = load_model(str(root / "model"), dtype="float32")
    return root, write_trace(model, root / "trace")


# -- the lock API ------------------------------------------------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    target = tmp_path / "pred"
    p = holder(target)
    try:
        with pytest.raises(LockBusy) as e:
            with out_lock(target):
                raise AssertionError("two writers held one --out")
        msg = str(e.value)
        assert e.value.exit_code == EX_TEMPFAIL == 75 and "\n" not in msg
        assert msg.startswith(f"--out {target} is being written by moeflow train (pid {p.pid} on {socket.gethostname()} since ")
        assert msg.endswith("; pass --wait to wait for it, or choose another --out")
    finally:
        release(p)
    with out_lock(target) as held:
        assert held["took_over"] is None and not held["waited"]
        assert json.loads(lock_path(target).read_text())["pid"] == os.getpid()
    assert listing(tmp_path) == []  # no lock file left beside the target


def test_wait_blocks_until_the_holder_is_done_then_checks_again(tmp_path, monkeypatch):
    import moeflow.locks as locks

    target = tmp_path / "pred"
    p = holder(target)
    said: list[str] = []

    def waiting(message: str) -> None:  # this run now waits: let the holder finish
        said.append(message)
        release(p)

    monkeypatch.setattr(locks, "_waiting", waiting)
    checked: list[int] = []
    with out_lock(target, wait=True, check=lambda: checked.append(json.loads(lock_path(target).read_text())["pid"])) as held:
        assert held["waited"] and p.returncode == 0
        # the holder removed its lock file as it let go: this run holds a new one at the same path
        assert json.loads(lock_path(target).read_text())["pid"] == os.getpid()
    assert checked == [os.getpid()]  # --out checked again, under the lock
    assert len(said) == 1 and f"pid {p.pid}" in said[0] and said[0].startswith("waiting for moeflow train")
    assert listing(tmp_path) == []


def test_a_killed_holder_releases_the_lock_and_the_next_writer_takes_over(tmp_path):
    target = tmp_path / "pred"
    p = holder(target)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert json.loads(lock_path(target).read_text())["pid"] == p.pid  # it could not clean up
    with out_lock(target) as held:
        assert held["took_over"]["pid"] == p.pid
    assert listing(tmp_path) == []


def test_the_lock_removes_the_folders_it_made_and_refuses_an_unwritable_folder(tmp_path, monkeypatch):
    target = tmp_path / "a" / "b" / "pred"
    with out_lock(target) as held:
        assert held["path"] == str(tmp_path / "a" / "b" / ".pred.lock")
    assert listing(tmp_path) == []
    with pytest.raises(ConfigError, match="bad --out"):
        with out_lock(target, check=lambda: (_ for _ in ()).throw(ConfigError("bad --out"))):
            raise AssertionError("the block ran after a failed check")
    assert listing(tmp_path) == []
    with out_lock(target):  # the artifact it was held for stays, the lock goes
        target.mkdir()
    assert listing(tmp_path) == ["a", "a/b", "a/b/pred"]
    ro = tmp_path / "ro"
    ro.mkdir()
    make_read_only(monkeypatch, ro, errno.EROFS)
    with pytest.raises(ConfigError) as e:
        with out_lock(ro / "pred"):
            pass
    assert str(e.value) == f"--out {ro / 'pred'}: cannot write in {ro} (read-only file system); choose a writable --out"


def test_no_out_locks_nothing(tmp_path):
    with out_lock(None) as held, out_lock("") as again:
        assert held["path"] is None and again["path"] is None


# -- every writing command ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command,name", [("train", "pred"), ("calibrate", "cal.json"), ("run", "gen.jsonl"), ("trace", "tr")])
def test_every_writer_is_refused_with_75_while_another_holds_its_out(setup, tmp_path, monkeypatch, capsys, command, name):
    root, trace = setup
    _no_work(monkeypatch)
    out = tmp_path / name
    with out_lock(out, command="moeflow other"):  # another writer (a second open file description: flock refuses it)
        code, err = cli(stage_args(command, root, trace, out), capsys)
    assert code == 75 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"--out {out} is being written by moeflow other (pid {os.getpid()} on " in err and "pass --wait" in err
    assert listing(tmp_path) == []


def test_train_wait_waits_for_the_other_writer_and_never_silently_replaces_it(setup, tmp_path, monkeypatch, capsys):
    import moeflow.locks as locks
    import moeflow.stages.train as train

    root, trace = setup
    out = tmp_path / "pred"
    p = holder(out, publish=True)  # it publishes a predictor folder at --out before it lets go
    monkeypatch.setattr(locks, "_waiting", lambda message: release(p))
    fits: list[int] = []
    real_fit = train.fit_all
    monkeypatch.setattr(train, "fit_all", lambda *a, **k: fits.append(1) or real_fit(*a, **k))
    code, err = cli([*train_args(root, trace, out), "--wait"], capsys)
    assert code == 2 and "already holds a moeflow predictor folder; pass --force to replace it" in err and fits == []
    assert json.loads((out / "meta.json").read_text()) == {"kind": "predictors", "schema": 1}
    p = holder(out)
    code, err = cli([*train_args(root, trace, out), "--wait", "--force"], capsys)
    assert code == 0, err
    assert fits == [1] and json.loads((out / "meta.json").read_text())["predictors"][-1] == "forest"
    assert sorted(x for x in listing(tmp_path) if "/" not in x) == [".pred.versions", "pred"]  # no lock left


def test_two_train_processes_one_out_and_a_crashed_holder(setup, tmp_path, capsys):
    """A real `moeflow train` process holds --out while it fits; a second process is refused (75) naming
    it; after a kill -9 of the first, the next train takes over."""
    root, trace = setup
    out, fitting = tmp_path / "pred", tmp_path / "fitting"
    first_script = (
        "import pathlib, sys, time\n"
        "import moeflow.stages.train as t\n"
        "def slow(*a, **k):\n"
        "    pathlib.Path(sys.argv[1]).write_text('x'); time.sleep(120)\n"
        "t.fit_all = slow\n"
        "from moeflow.cli.app import main\n"
        "main(sys.argv[2:])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen([sys.executable, "-c", first_script, str(fitting), *train_args(root, trace, out)], env=env)
    try:
        deadline = time.time() + 120
        while not fitting.exists():
            assert first.poll() is None and time.time() < deadline, "the first train never reached fitting"
            time.sleep(0.1)
        second = subprocess.run(
            [sys.executable, "-m", "moeflow", *train_args(root, trace, out)], env=env, capture_output=True, text=True
        )
        assert second.returncode == 75, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert lines[0].startswith(
            f"error: --out {out} is being written by moeflow train (pid {first.pid} on {socket.gethostname()} since "
        )
        assert lines[0].endswith("pass --wait to wait for it, or choose another --out") and not out.exists()
        os.kill(first.pid, signal.SIGKILL)
    finally:
        first.kill()
        first.wait()
    code, err = cli(train_args(root, trace, out), capsys)
    assert code == 0, err
    assert json.loads((out / "meta.json").read_text())["kind"] == "predictors"
    assert not lock_path(out).exists()
