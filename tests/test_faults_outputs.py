"""Issue 9, items 1, 2, 4 (corrupt predictor files, --out a folder), 6: outputs never lose data, are
replaced atomically, and loading a predictor folder never runs code from it."""

from __future__ import annotations

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

from moeflow.artifacts import artifact_kind, atomic_dir, check_out
from moeflow.errors import ArtifactError, ConfigError

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
    refused(pred, "already holds a moeflow predictors; pass --force to replace it")
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
    from moeflow.trace.writer import RoutingRecorder, TraceWriter, generation_kwargs, trace_one

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

    from moeflow.predict.forest import ArrayForest

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


# -- calibrate --out ------------------------------------------------------------------------------------------------


def test_calibrate_out_rules_before_any_measurement(trained, tmp_path, monkeypatch, capsys):
    _, root, trace, _ = trained
    import moeflow.calibrate.run as run

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
