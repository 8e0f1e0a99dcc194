"""Outputs (corrupt predictor files, --out a folder, pickles): outputs never lose data, are
replaced atomically, and loading a predictor folder never runs code from it. An --out that cannot be written
is refused before any work, and a failed publication leaves nothing beside its target."""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moeflow.artifacts import artifact_kind, atomic_dir
from moeflow.errors import ArtifactError, ConfigError
from moeflow.outputs import check_out

REPO = Path(__file__).resolve().parent.parent


# -- helpers ------------------------------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, bytes]:
    """relative path -> bytes of every file under `folder` (following the top-level link)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def cli(argv: list[str], capsys) -> tuple[int, str]:
    """Run `moeflow` in-process; (exit code, stderr)."""
    from moeflow.cli.app import main

    code: object = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code
    return (0 if code is None else int(code)), capsys.readouterr().err if capsys else ""


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# A writer that rewrites an artifact folder forever: generation n is meta.json {"n": n} plus files
# part-0..3 each holding n, of a few hundred KiB, so a kill lands inside a write often.
WRITER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from moeflow.artifacts import atomic_dir
    out, start, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    kill_at = int(os.environ.get("KILL_AT", "0"))
    if kill_at:                       # die (no clean-up) at the kill_at-th file-system switch
        calls = [0]
        def wrap(fn):
            def f(*a, **k):
                calls[0] += 1
                if calls[0] == kill_at:
                    os._exit(9)
                return fn(*a, **k)
            return f
        for name in ("replace", "rename", "symlink", "rmdir", "unlink"):
            setattr(os, name, wrap(getattr(os, name)))
    n = start
    while count < 0 or n < start + count:
        with atomic_dir(out) as d:
            for i in range(4):
                (d / f"part-{{i}}").write_text(str(n) * 50_000)
            (d / "meta.json").write_text(json.dumps({{"kind": "test", "n": n}}))
        n += 1
    print("done", flush=True)
""").format(repo=str(REPO))


def complete_generation(out: Path) -> int:
    """The generation `out` holds; fails unless it is a complete artifact."""
    assert out.is_dir(), f"{out} is missing"
    n = json.loads((out / "meta.json").read_text())["n"]
    for i in range(4):
        assert (out / f"part-{i}").read_text() == str(n) * 50_000, (n, i)
    return n


def run_writer(tmp_path: Path, out: Path, start: int, count: int, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    return subprocess.run(
        [sys.executable, str(script), str(out), str(start), str(count)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


# -- item 2: atomic replacement ---------------------------------------------------------------------------


def test_a_kill_at_every_step_of_a_replacement_leaves_old_or_new(tmp_path):
    """Deterministic: the writer dies (os._exit, no clean-up) at the 1st, 2nd, ... file-system switch of
    a replacement; after each death `out` is generation 0 or 1, complete. (The old two-rename swap
    left nothing at `out` when killed between its renames.)"""
    out = tmp_path / "art"
    for k in range(1, 40):
        shutil.rmtree(tmp_path / ".art.versions", ignore_errors=True)
        if out.is_symlink() or out.exists():
            out.unlink() if out.is_symlink() else shutil.rmtree(out)
        assert run_writer(tmp_path, out, 0, 1).returncode == 0
        r = run_writer(tmp_path, out, 1, 1, KILL_AT=str(k))
        assert complete_generation(out) in (0, 1), k
        if r.returncode == 0:  # k is past the last switch: the write completed
            assert complete_generation(out) == 1
            break
        assert r.returncode == 9
    else:
        pytest.fail("the writer never completed")
    assert k > 2  # the kills above did land inside the replacement


def test_sigkill_at_random_points_leaves_a_complete_artifact(tmp_path):
    """30 times: a writer rewrites `out` in a loop and is killed with SIGKILL after a random delay;
    `out` is then a complete artifact, never older than the last one seen."""
    out = tmp_path / "art"
    assert run_writer(tmp_path, out, 0, 1).returncode == 0
    script = tmp_path / "writer.py"
    rng = random.Random(0)
    last, start = 0, 1
    for _ in range(30):
        p = subprocess.Popen([sys.executable, str(script), str(out), str(start), "-1"])
        time.sleep(rng.uniform(0.05, 0.4))
        p.send_signal(signal.SIGKILL)
        p.wait()
        n = complete_generation(out)
        assert n >= last
        last, start = n, start + 10_000
    # leftovers of the killed writers are removed by the next write; two versions stay
    assert run_writer(tmp_path, out, start, 1).returncode == 0
    assert complete_generation(out) == start
    left = sorted(p.name for p in (tmp_path / ".art.versions").iterdir())
    assert len(left) == 2 and all(n.startswith("v-") for n in left), left
    assert [p.name for p in tmp_path.iterdir() if ".link-" in p.name] == []


def test_versions_cleanup_keeps_current_and_previous(tmp_path):
    out = tmp_path / "a"
    vroot = tmp_path / ".a.versions"
    targets = []
    for i in range(3):
        with atomic_dir(out) as d:
            (d / "x").write_text(str(i))
        targets.append(os.readlink(out))
    assert (out / "x").read_text() == "2" and out.is_symlink() and not os.path.isabs(targets[-1])
    assert sorted(p.name for p in vroot.iterdir()) == sorted(Path(t).name for t in targets[1:])
    # what dead writers leave behind goes; a live writer's folder in progress stays
    dead = dead_pid()
    (vroot / f"tmp-{time.time_ns():020d}-{dead}").mkdir()
    (vroot / f"v-{time.time_ns():020d}-{dead}").mkdir()
    os.symlink("nowhere", tmp_path / f".a.link-{dead}-1")
    live = vroot / f"tmp-{time.time_ns():020d}-{os.getppid()}"
    live.mkdir()
    with atomic_dir(out) as d:
        (d / "x").write_text("3")
    assert sorted(p.name for p in vroot.iterdir()) == sorted([Path(targets[-1]).name, Path(os.readlink(out)).name, live.name])
    assert not (tmp_path / f".a.link-{dead}-1").is_symlink()
    # a failed write leaves the current artifact and no folder of its own
    with pytest.raises(RuntimeError), atomic_dir(out) as d:
        (d / "x").write_text("4")
        raise RuntimeError("boom")
    assert (out / "x").read_text() == "3"
    assert not [p for p in vroot.iterdir() if p.name.startswith("tmp-") and p != live]


@pytest.mark.parametrize("exchange", [True, False])
def test_a_legacy_real_folder_is_replaced_and_kept_as_previous(tmp_path, monkeypatch, exchange):
    import moeflow.artifacts as art

    if not exchange:
        monkeypatch.setattr(art, "_exchange", lambda a, b: False)  # the documented one-time fallback
    out = tmp_path / "pred"
    out.mkdir()
    (out / "meta.json").write_text('{"kind": "predictors", "n": 0}')
    with atomic_dir(out) as d:
        (d / "meta.json").write_text('{"kind": "predictors", "n": 1}')
    assert out.is_symlink() and json.loads((out / "meta.json").read_text())["n"] == 1
    legacy = [p for p in (tmp_path / ".pred.versions").iterdir() if p.name.endswith("-legacy")]
    assert len(legacy) == 1 and json.loads((legacy[0] / "meta.json").read_text())["n"] == 0


def test_atomic_write_replaces_a_file_in_one_step(tmp_path):
    from moeflow.artifacts import write_json_atomic

    p = tmp_path / "c.json"
    write_json_atomic(p, {"kind": "calibration", "v": 1})
    with pytest.raises(ValueError):
        from moeflow.artifacts import atomic_write

        with atomic_write(p) as f:
            f.write("{half")
            raise ValueError("crash")
    assert json.loads(p.read_text())["v"] == 1 and [q.name for q in tmp_path.iterdir()] == ["c.json"]


# -- item 1: --out rules ------------------------------------------------------------------------------------


def test_check_out_rules(tmp_path):
    trace = tmp_path / "trace"
    trace.mkdir()
    (trace / "meta.json").write_text('{"kind": "trace"}')
    alias = tmp_path / "alias"
    alias.symlink_to(trace)
    inputs = (str(trace), str(tmp_path / "model"))

    def refused(out, match, **kw):
        with pytest.raises(ConfigError, match=match):
            check_out(out, kind="predictors", inputs=inputs, **kw)

    refused(trace, "is the input", force=True)
    refused(alias, "is the input", force=True)  # symlinks resolved
    refused(trace / "pred", "inside the input", force=True)
    refused(alias / "pred", "inside the input", force=True)
    refused(tmp_path, "contains the input", force=True)
    refused(trace / "meta.json", "inside the input", force=True, file=True)
    # an existing thing that is not a predictor folder is never replaced, even with --force
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    refused(tmp_path / "notes", "holds other files", force=True)
    (tmp_path / "f.txt").write_text("mine")
    refused(tmp_path / "f.txt", "is a file", force=True)
    refused(tmp_path / "f.txt" / "sub", "which is a file", force=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "meta.json").write_text('{"kind": "trace"}')
    refused(other, "holds a moeflow trace", force=True)
    # a predictor folder: only with --force; a new path or an empty folder: fine
    pred = tmp_path / "pred"
    pred.mkdir()
    assert check_out(pred, kind="predictors", inputs=inputs) == pred
    (pred / "meta.json").write_text('{"kind": "predictors"}')
    refused(pred, "already holds a moeflow predictor folder; pass --force to replace it")
    assert check_out(pred, kind="predictors", inputs=inputs, force=True) == pred
    assert check_out(tmp_path / "new" / "pred", kind="predictors", inputs=inputs) == tmp_path / "new" / "pred"


def test_check_out_files(tmp_path):
    (tmp_path / "dir").mkdir()
    with pytest.raises(ConfigError, match="is a folder; pass a file path"):
        check_out(tmp_path / "dir", kind="calibration", file=True, force=True)
    (tmp_path / "bin.dat").write_bytes(bytes(range(256)) * 10)
    with pytest.raises(ConfigError, match="not a moeflow calibration"):
        check_out(tmp_path / "bin.dat", kind="calibration", file=True, force=True)
    (tmp_path / "c.json").write_text(json.dumps({"kind": "calibration", "x": 1}, indent=2))
    with pytest.raises(ConfigError, match="pass --force"):
        check_out(tmp_path / "c.json", kind="calibration", file=True)
    assert check_out(tmp_path / "c.json", kind="calibration", file=True, force=True).name == "c.json"
    # JSONL results: the kind is the first line's
    (tmp_path / "r.jsonl").write_text('{"kind": "run-results"}\n{"prompt": 1}\n')
    assert artifact_kind(tmp_path / "r.jsonl") == "run-results" and artifact_kind(tmp_path / "bin.dat") is None
    with pytest.raises(ConfigError, match="holds a moeflow run-results"):
        check_out(tmp_path / "r.jsonl", kind="calibration", file=True, force=True)


# -- a trained predictor folder (tiny model, tiny trace) ------------------------------------------------------


def write_trace(model, out: Path, n: int = 8, length: int = 12, new_tokens: int = 3) -> Path:
    from moeflow.moe import get_adapter, model_fingerprint
    from moeflow.trace.record import RoutingRecorder, generation_kwargs, trace_one
    from moeflow.trace.writer import TraceWriter

    ad = get_adapter(model)
    gen = {
        "max_new_tokens": new_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
        "seed": 0,
        "max_prompt_tokens": 256,
        "do_sample": False,
    }
    kw = generation_kwargs(gen, 0)
    kw.update(min_new_tokens=new_tokens, eos_token_id=None)
    rec = RoutingRecorder(ad, True)
    rng = np.random.default_rng(0)
    with TraceWriter(
        out,
        fingerprint=model_fingerprint(model),
        spec=ad.spec.to_dict(),
        record_hidden=True,
        generation=gen,
        prompt_source="test",
    ) as w:
        for i in range(n):
            rows, _ = trace_one(model, rec, torch.tensor([rng.integers(3, 200, size=length).tolist()]), kw)
            w.add(f"p{i}", rows)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(model, root, trace, predictor folder with router-pf + forest) via `moeflow train`."""
    from moeflow.models import load_model, tiny_model

    root = tmp_path_factory.mktemp("faults")
    tiny_model("olmoe", num_hidden_layers=3).save_pretrained(root / "model")
    model, _ = load_model(str(root / "model"), dtype="float32")
    trace = write_trace(model, root / "trace")
    pred = root / "pred"
    argv = [
        "train",
        "--trace",
        str(trace),
        "--out",
        str(pred),
        "--model",
        str(root / "model"),
        "--only",
        "router-pf",
        "--only",
        "forest",
        "--max-s",
        "2",
        "--forest-trees",
        "3",
        "--forest-samples",
        "800",
        "--json",
    ]
    assert cli(argv, None) == (0, "")
    return model, root, trace, pred


def train_args(root: Path, trace: Path, out: Path) -> list[str]:
    return [
        "train",
        "--trace",
        str(trace),
        "--out",
        str(out),
        "--model",
        str(root / "model"),
        "--only",
        "forest",
        "--max-s",
        "2",
        "--forest-trees",
        "2",
        "--forest-samples",
        "400",
    ]


def test_train_refuses_an_out_that_is_or_holds_its_input_and_leaves_it_intact(trained, capsys):
    _, root, trace, _ = trained
    before = snapshot(trace)
    for out in (trace, trace / "pred", root, root / "model"):
        code, err = cli([*train_args(root, trace, out), "--force"], capsys)
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert "input" in err
    assert snapshot(trace) == before
    # a folder of other files is not replaced, even with --force
    mine = root / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, err = cli([*train_args(root, trace, mine), "--force"], capsys)
    assert code == 2 and "holds other files" in err and (mine / "notes.txt").read_text() == "keep me"


def test_train_replaces_a_predictor_folder_only_with_force(trained, capsys):
    model, root, trace, pred = trained
    out = root / "pred2"
    shutil.copytree(pred, out, symlinks=False)  # a real (legacy-style) predictor folder
    code, err = cli(train_args(root, trace, out), capsys)
    assert code == 2 and "pass --force to replace it" in err
    code, err = cli([*train_args(root, trace, out), "--force"], capsys)
    assert code == 0, err
    assert out.is_symlink() and json.loads((out / "meta.json").read_text())["predictors"][-1] == "forest"
    assert "router-pf" not in json.loads((out / "meta.json").read_text())["predictors"]
    from moeflow.predict.io import load_predictors

    _, loaded = load_predictors(out, model)
    assert loaded["forest"].rf.n_estimators == 2


# -- item 6: loading never runs foreign code --------------------------------------------------------------------


class Payload:
    """Unpickling this creates `marker`: what a malicious forest.joblib would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_the_forest_is_plain_arrays_that_predict_like_scikit_learn():
    from sklearn.ensemble import RandomForestRegressor

    from moeflow.predict.forest_arrays import ArrayForest

    rng = np.random.default_rng(0)
    X = rng.standard_normal((600, 7)).astype(np.float32)
    Y = np.stack([X[:, 0] > 0, X[:, 1] * X[:, 2] > 0.1, np.sin(X[:, 3]) > 0.5], 1).astype(np.float64)
    rf = RandomForestRegressor(n_estimators=5, max_depth=6, min_samples_leaf=2, random_state=0).fit(X, Y)
    af = ArrayForest.from_sklearn(rf)
    Xt = rng.standard_normal((300, 7)).astype(np.float32)
    np.testing.assert_allclose(af.predict(Xt), rf.predict(Xt), rtol=0, atol=1e-12)


def test_a_planted_pickle_is_refused_and_never_run(trained, tmp_path, capsys):
    model, root, trace, pred = trained
    from moeflow.predict.io import load_predictors

    marker = tmp_path / "pwned"
    evil = pickle.dumps(Payload(marker))
    pickle.loads(evil)  # the payload is live: unpickling it runs code
    assert marker.exists()
    marker.unlink()
    folder = tmp_path / "pred"
    shutil.copytree(pred, folder)
    # a legacy forest.joblib (joblib files are pickles) where the forest belongs
    (folder / "forest" / "forest.npz").unlink()
    (folder / "forest" / "forest.joblib").write_bytes(evil)
    with pytest.raises(ArtifactError, match=r"forest\.joblib is a pickle.*re-run `moeflow train`"):
        load_predictors(folder, model, ["forest"])
    code, err = cli(
        ["eval", "--predictors", str(folder), "--trace", str(trace), "--model", str(root / "model"), "--only", "forest"], capsys
    )
    assert code == 2 and "forest.joblib is a pickle" in err and "Traceback" not in err
    # the same bytes under the names moeflow does read
    for rel in ("forest/forest.npz", "forest/embedding.npy", "router-pf/default_vectors.pt"):
        f = folder / rel
        f.write_bytes(evil)
        with pytest.raises(ArtifactError, match=rf"cannot load .*{f.name} \(it is corrupt.*re-run `moeflow train`"):
            load_predictors(folder, model, [rel.split("/")[0]])
        shutil.copy(pred / rel, f)
    assert not marker.exists()


def test_every_torch_load_is_weights_only():
    import re

    calls = []
    for p in (REPO / "moeflow").rglob("*.py"):
        src = p.read_text()
        calls += [(p.name, m.group(0)) for m in re.finditer(r"torch\.load\([^)]*\)", src)]
        assert "joblib.load" not in src and "pickle.load" not in src, p
    assert calls and all("weights_only=True" in c for _, c in calls), calls


# -- item 4: corrupt predictor files ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rel,damage",
    [
        ("forest/forest.npz", "truncate"),
        ("forest/forest.npz", "garbage"),
        ("forest/config.json", "garbage"),
        ("forest/embedding.npy", "truncate"),
        ("router-pf/default_vectors.pt", "truncate"),
        ("router-pf/default_vectors.pt", "garbage"),
        ("router-pf/config.json", "missing"),
    ],
)
def test_a_corrupt_predictor_file_is_one_line_naming_it(trained, tmp_path, rel, damage):
    model, _, _, pred = trained
    from moeflow.predict.io import load_predictors

    folder = tmp_path / "pred"
    shutil.copytree(pred, folder)
    f = folder / rel
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "garbage":
        f.write_bytes(b"\x00\xffnot this\n" * 40)
    else:
        f.unlink()
    with pytest.raises(ArtifactError) as e:
        load_predictors(folder, model)
    msg = str(e.value)
    assert str(f) in msg and "re-run `moeflow train`" in msg and "\n" not in msg


def test_a_corrupt_estimator_is_one_line(trained, tmp_path):
    """estimator.pt: garbage and a state dict of the wrong shape are refused with the file's name."""
    model, _, _, pred = trained
    from moeflow.predict.estimator import Estimator

    folder = tmp_path / "est"
    shutil.copytree(pred / "router-pf", folder)  # default_vectors.pt of this model
    (folder / "config.json").write_text(
        json.dumps({"features": 2, "max_lookahead": 1, "m": 4, "n": 8, "blocks": 1, "context": 2, "pairs": [[1, 1]]})
    )
    torch.save({"A.weight": torch.zeros(3, 3)}, folder / "estimator.pt")
    with pytest.raises(ArtifactError, match=r"estimator\.pt \(it is corrupt.*re-run `moeflow train`"):
        Estimator.load(folder, model)
    (folder / "estimator.pt").write_bytes(pickle.dumps(Payload(tmp_path / "pwned")))
    with pytest.raises(ArtifactError, match=r"estimator\.pt \(it is corrupt"):
        Estimator.load(folder, model)
    assert not (tmp_path / "pwned").exists()


def test_older_input_features_are_refused_in_one_line(trained, tmp_path):
    """A learned predictor's config.json with features of another version (v1, or no "features": older folders)
    is refused, naming the folder and what to re-run, before any other file is read."""
    model, _, _, _ = trained
    from moeflow.predict.estimator import Estimator
    from moeflow.predict.forest import Forest

    for cls, holds in ((Estimator, "an estimator with input features v1"), (Forest, "a forest with features v1")):
        folder = tmp_path / cls.name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"max_lookahead": 1}))
        with pytest.raises(ArtifactError) as e:
            cls.load(folder, model)
        assert str(e.value) == f"{folder} holds {holds}; this moeflow needs v2: re-run `moeflow train`"


# -- calibrate --out ------------------------------------------------------------------------------------------------


def test_calibrate_out_rules_before_any_measurement(trained, tmp_path, monkeypatch, capsys):
    _, root, trace, _ = trained
    import moeflow.stages.calibrate as run

    def no_work(*a, **k):
        raise AssertionError("measured before checking --out")

    monkeypatch.setattr(run, "bandwidth_sweep", no_work)
    meta = (trace / "meta.json").read_bytes()
    args = ["calibrate", "--model", str(root / "model"), "--sizes", "16", "--repeats", "1", "--decode-steps", "1"]
    for out, why in (
        (trace / "meta.json", "holds a moeflow trace"),
        (tmp_path, "is a folder"),
        (root / "model" / "config.json", "is inside the input"),
    ):
        code, err = cli([*args, "--out", str(out), "--force"], capsys)
        assert code == 2 and why in err and "Traceback" not in err, err
    assert (trace / "meta.json").read_bytes() == meta
    # the default path too: a second calibration needs --force
    monkeypatch.chdir(tmp_path)
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "cpu.json").write_text('{"kind": "calibration", "schema": 1}')
    code, err = cli(args, capsys)
    assert code == 2 and "calibration/cpu.json already holds a moeflow calibration; pass --force" in err


# -- an --out that cannot be written: refused before any work, nothing left beside it ---------------------------


def make_read_only(monkeypatch, folder: Path, err: int = errno.EROFS) -> None:
    """Creating a file or folder anywhere under `folder` fails with `err`, as on a read-only mount.

    (Tests run as root, which ignores permission bits, and cannot mount: `os.open(..., O_CREAT)` and
    `os.mkdir` are what every write, temp file, probe and lock goes through.)"""
    blocked = Path(os.path.abspath(folder))
    real_open, real_mkdir = os.open, os.mkdir

    def under(path) -> bool:
        return Path(os.path.abspath(path)).parent.is_relative_to(blocked)

    def fake_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_CREAT and dir_fd is None and under(path):
            raise OSError(err, os.strerror(err), str(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def fake_mkdir(path, mode=0o777, *, dir_fd=None):
        if dir_fd is None and under(path):
            raise OSError(err, os.strerror(err), str(path))
        return real_mkdir(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_check_out_refuses_a_folder_it_cannot_write_in(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    mnt = tmp_path / "mnt"  # an empty folder on a read-only mount, in a writable parent
    mnt.mkdir()
    make_read_only(monkeypatch, ro)
    make_read_only(monkeypatch, mnt)
    before = listing(tmp_path)
    for out, kw, where in (
        (ro / "pred", {}, ro),
        (ro / "a" / "b" / "pred", {}, ro),  # parents to create: the nearest existing one is probed
        (ro / "cal.json", {"file": True}, ro),
        (mnt, {}, mnt),
        (mnt, {"reuse": True}, mnt),
    ):
        with pytest.raises(ConfigError) as e:
            check_out(out, kind="predictors", **kw)
        assert str(e.value) == f"--out {out}: cannot write in {where} (read-only file system); choose a writable --out"
    assert listing(tmp_path) == before
    assert check_out(tmp_path / "pred", kind="predictors") == tmp_path / "pred"  # a writable parent is fine
    assert listing(tmp_path) == before  # the probe is gone
    denied = tmp_path / "denied"
    denied.mkdir()
    make_read_only(monkeypatch, denied, errno.EACCES)
    with pytest.raises(ConfigError, match=r"cannot write in .*denied \(permission denied\)"):
        check_out(denied / "c.json", kind="calibration", file=True, flag="the calibration file")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores permission bits")
def test_check_out_refuses_a_folder_without_write_permission(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match=r"cannot write in .* \(permission denied\); choose a writable --out"):
            check_out(ro / "pred", kind="predictors")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def test_a_mount_point_is_refused_as_a_folder_to_replace(tmp_path, monkeypatch):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mnt or real(p))
    with pytest.raises(ConfigError, match=r"is a mount point, which cannot be replaced .* pass a path inside it"):
        check_out(mnt, kind="predictors")
    assert check_out(mnt, kind="trace", reuse=True) == mnt  # a trace is written into it: fine


@pytest.mark.parametrize("where", ["replace", "exchange"])
def test_atomic_dir_leaves_nothing_beside_the_target_when_publishing_fails(tmp_path, monkeypatch, where):
    """An empty read-only mount point as `final`: the swap fails (EBUSY / EROFS); no link, no versions left."""
    import moeflow.artifacts as art

    final = tmp_path / "sub" / "out"
    if where == "exchange":
        final.mkdir(parents=True)  # an empty real folder: swapped with the link by an atomic exchange

        def refuse(a, b):
            raise OSError(errno.EBUSY, "Device or resource busy", str(b))

        monkeypatch.setattr(art, "_exchange", refuse)
    else:
        real_replace = os.replace

        def refuse_link(src, dst, **kw):
            if ".link-" in str(src):
                raise OSError(errno.EROFS, "Read-only file system", str(dst))
            return real_replace(src, dst, **kw)

        monkeypatch.setattr(os, "replace", refuse_link)
    before = listing(tmp_path)
    with pytest.raises(OSError):
        with atomic_dir(final) as tmp:
            (tmp / "meta.json").write_text("{}")
    assert listing(tmp_path) == before  # no .out.link-*, no .out.versions/, no new sub/


def test_a_legacy_folder_is_put_back_when_the_link_cannot_replace_it(tmp_path, monkeypatch):
    import moeflow.artifacts as art

    final = tmp_path / "out"
    final.mkdir()
    (final / "meta.json").write_text('{"n": 1}')
    monkeypatch.setattr(art, "_exchange", lambda a, b: False)  # no renameat2: rename the old folder aside first
    real_replace = os.replace

    def refuse_link(src, dst, **kw):
        if ".link-" in str(src):
            raise OSError(errno.EROFS, "Read-only file system", str(dst))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "replace", refuse_link)
    with pytest.raises(OSError):
        with atomic_dir(final) as tmp:
            (tmp / "meta.json").write_text('{"n": 2}')
    assert final.is_dir() and not final.is_symlink() and (final / "meta.json").read_text() == '{"n": 1}'
    assert listing(tmp_path) == ["out", "out/meta.json"]


def _no_work(monkeypatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("work started before --out was checked")

    monkeypatch.setattr("moeflow.models.load_model", refuse)
    monkeypatch.setattr("moeflow.stages.train.fit_all", refuse)
    monkeypatch.setattr("moeflow.stages.calibrate.bandwidth_sweep", refuse)


def stage_args(command: str, root: Path, trace: Path, out: Path) -> list[str]:
    """Arguments of a writing command with --out `out` (the tiny model of `trained`; prompts in root/p.txt)."""
    (root / "p.txt").write_text("the king said\nto be or not\n")
    model = str(root / "model")
    return {
        "train": train_args(root, trace, out),
        "calibrate": ["calibrate", "--model", model, "--sizes", "16", "--repeats", "1", "--decode-steps", "1", "--out", str(out)],
        "run": ["run", "-m", model, "-p", str(root / "p.txt"), "--out", str(out)],
        "trace": ["trace", "--model", model, "--prompts", str(root / "p.txt"), "--out", str(out), "--no-progress"],
    }[command]


@pytest.mark.parametrize(
    "command,name",
    [("train", "pred"), ("train", ""), ("calibrate", "cal.json"), ("run", "gen.jsonl"), ("trace", "tr"), ("trace", "")],
)
def test_a_read_only_out_is_refused_before_any_work(trained, tmp_path, monkeypatch, capsys, command, name):
    """`name` "" is the read-only folder itself as --out (an empty read-only mount point)."""
    _, root, trace, _ = trained
    ro = tmp_path / "ro"
    ro.mkdir()
    make_read_only(monkeypatch, ro)
    _no_work(monkeypatch)
    out = ro / name if name else ro
    before = listing(tmp_path)
    code, err = cli(stage_args(command, root, trace, out), capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"--out {out}: cannot write in {ro} (read-only file system); choose a writable --out" in err
    assert listing(tmp_path) == before
