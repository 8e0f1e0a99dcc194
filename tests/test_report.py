"""moeflow.report (the mechanism behind `make reproduce-<paper>`) and the Makefile's recipe targets."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moeflow.report import Recipe, Table, environment, fmt

REPO = Path(__file__).resolve().parent.parent


def _script(tmp: Path, name: str, body: str) -> str:
    p = tmp / name
    p.write_text("import json, sys, pathlib\n" + body)
    return str(p)


def _recipe(tmp: Path, **kw) -> Recipe:
    logs: list[str] = []
    r = Recipe(paper="demo", title="Demo paper", quick=True, root=tmp / "reports", repo=REPO, log=logs.append, **kw)
    r._test_logs = logs  # type: ignore[attr-defined]
    return r


def test_fmt_and_table_layout():
    assert fmt(None) == "—" and fmt(float("nan")) == "—"
    assert fmt(0.81234) == "0.812" and fmt(1234.6) == "1235" and fmt(123.45) == "123.5" and fmt(True) == "yes"
    t = Table("t2", "Table 2", ["ours: acc", "paper: acc"], label="S")
    t.row("1", 0.5, 0.76)
    t.row("2", None, 0.7)
    with pytest.raises(ValueError, match="2 columns"):
        t.row("3", 1.0)
    md = t.markdown().splitlines()
    assert md[0] == "| S | ours: acc | paper: acc |"
    assert md[2] == "| 1 | 0.5 | 0.76 |" and md[3] == "| 2 | — | 0.7 |"


def test_environment_records_versions_and_commit():
    env = environment(REPO)
    import torch
    import transformers

    assert env["torch"] == torch.__version__ and env["transformers"] == transformers.__version__
    assert env["git_commit"] and len(env["git_commit"]) == 40
    assert env["device"] == "cpu" and env["cpu_cores"] >= 1


def test_report_has_paper_beside_ours_commands_env_and_raw(tmp_path):
    ok = _script(tmp_path, "ok.py", "print('a table'); print(json.dumps({'acc': 0.625, 'argv': sys.argv[1:]}))\n")
    bad = _script(tmp_path, "bad.py", "print('error: trace is corrupt; re-run moeflow trace', file=sys.stderr); sys.exit(2)\n")

    def main(r: Recipe) -> None:
        good = r.python("measure", ok, "--n", 3)
        fail = r.python("broken", bad)
        t = r.table("table2", "Table 2: accuracy", ["ours: acc", "paper: acc"], label="S", source=["measure"])
        t.row("1", good["acc"] if good else None, 0.76)
        t.row("2", fail["acc"] if fail else None, 0.70)
        t.note(f"ours {good['acc']:.2f} vs the paper's 0.76: a 22M-parameter model")
        r.missing("Fig. 9 on an A6000", "needs a GPU")
        from matplotlib.figure import Figure

        fig = Figure()
        fig.add_subplot().plot([1, 2], [0.5, 0.4])
        r.figure(t, "fig2", fig, "accuracy vs S")

    r = _recipe(tmp_path)
    assert r.execute(main) == 1  # a failed step makes the exit non-zero
    out = tmp_path / "reports" / "demo"
    readme = (out / "README.md").read_text()
    assert "| 1 | 0.625 | 0.76 |" in readme  # ours beside the paper's
    assert "| 2 | — | 0.7 |" in readme  # the failed step's cell stays empty: nothing is made up
    assert "a 22M-parameter model" in readme and "![accuracy vs S](fig2.png)" in readme
    assert "Fig. 9 on an A6000" in readme and "needs a GPU" in readme
    assert "`broken` (exit 2): error: trace is corrupt" in readme
    assert (out / "fig2.png").stat().st_size > 1000
    assert json.loads((out / "raw" / "measure.json").read_text())["argv"] == ["--n", "3"]
    assert "exit 2" in (out / "raw" / "broken.log").read_text()
    cmds = (out / "commands.sh").read_text().splitlines()
    assert f"python {ok} --n 3" in cmds and any(c.startswith(f"python {bad}") and "FAILED" in c for c in cmds)
    env = json.loads((out / "environment.json").read_text())
    assert env["torch"] and env["git_commit"]
    res = json.loads((out / "results.json").read_text())
    assert res["tables"][0]["rows"][0]["cells"] == {"ours: acc": 0.625, "paper: acc": 0.76}
    assert [s["status"] for s in res["steps"]] == ["ran", "failed"]


def test_produces_stamp_reuses_until_command_or_input_changes(tmp_path):
    counter = tmp_path / "runs.txt"
    inp = tmp_path / "input.txt"
    inp.write_text("v1")
    make = _script(
        tmp_path,
        "make.py",
        f"p = pathlib.Path({str(counter)!r}); p.write_text(p.read_text() + 'x' if p.exists() else 'x')\n"
        "pathlib.Path(sys.argv[1]).write_text('artifact'); print(json.dumps({'made': sys.argv[1]}))\n",
    )
    art = tmp_path / "artifact.txt"

    def main(r: Recipe) -> None:
        assert r.python("make", make, art, produces=art, after=[inp]) == {"made": str(art)}

    for _ in range(2):
        assert _recipe(tmp_path).execute(main) == 0
    assert counter.read_text() == "x"  # the second run reused it
    res = json.loads((tmp_path / "reports" / "demo" / "results.json").read_text())
    assert res["steps"][0]["status"] == "reused"
    inp.write_text("v2")  # an input changed: made again
    assert _recipe(tmp_path).execute(main) == 0 and counter.read_text() == "xx"
    art.unlink()  # the artifact is gone: made again
    assert _recipe(tmp_path).execute(main) == 0 and counter.read_text() == "xxx"


def test_require_stops_the_rest_but_still_reports(tmp_path):
    bad = _script(tmp_path, "bad.py", "sys.exit(3)\n")
    reached = []

    def main(r: Recipe) -> None:
        r.require(r.python("trace", bad), "trace")
        reached.append(True)

    assert _recipe(tmp_path).execute(main) == 1
    assert not reached
    readme = (tmp_path / "reports" / "demo" / "README.md").read_text()
    assert "the rest of this report" in readme and "step trace failed" in readme


def test_a_recipe_bug_still_publishes_what_was_measured(tmp_path, capsys):
    ok = _script(tmp_path, "ok.py", "print(json.dumps({'v': 0.5}))\n")

    def main(r: Recipe) -> None:
        r.table("t", "T", ["ours: v"]).row("a", r.python("s", ok)["v"])
        r.raw["s"]["missing"]  # a KeyError in a table function

    assert _recipe(tmp_path).execute(main) == 1
    readme = (tmp_path / "reports" / "demo" / "README.md").read_text()
    assert "| a | 0.5 |" in readme and "KeyError" in readme and "a bug in the recipe" in readme
    assert "Traceback" in capsys.readouterr().err


def test_interrupted_recipe_keeps_the_previous_report(tmp_path):
    ok = _script(tmp_path, "ok.py", "print(json.dumps({'v': 1}))\n")

    def good(r: Recipe) -> None:
        r.table("t", "T", ["ours: v"]).row("a", r.python("s", ok)["v"])

    def interrupted(r: Recipe) -> None:
        r.python("s", ok)
        raise KeyboardInterrupt

    assert _recipe(tmp_path).execute(good) == 0
    before = (tmp_path / "reports" / "demo" / "README.md").read_text()
    with pytest.raises(KeyboardInterrupt):
        _recipe(tmp_path).execute(interrupted)
    assert (tmp_path / "reports" / "demo" / "README.md").read_text() == before
    leftovers = [p.name for p in (tmp_path / "reports" / ".demo.versions").iterdir() if p.name.startswith("tmp-")]
    assert leftovers == []


def test_duplicate_step_names_are_a_bug(tmp_path):
    ok = _script(tmp_path, "ok.py", "print('{}')\n")

    def main(r: Recipe) -> None:
        r.python("same", ok)
        r.python("same", ok)

    assert _recipe(tmp_path).execute(main) == 1  # a recipe bug: reported, not a silent overwrite of the first step
    assert "step name 'same' used twice" in (tmp_path / "reports" / "demo" / "README.md").read_text()


def test_make_reproduce_all_names_every_recipe():
    from recipes.reproduce import PAPERS

    out = subprocess.run(["make", "-n", "reproduce-all", "QUICK=1"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    lines = [ln for ln in out.splitlines() if "-m recipes.reproduce" in ln]
    assert [ln.split("-m recipes.reproduce ")[1].split()[0] for ln in lines] == list(PAPERS)
    assert all("--quick" in ln for ln in lines)
    assert set(PAPERS) == {"expertflow", "casmoe", "moe-gps", "speculating-experts", "specmd"}
    cuda = subprocess.run(["make", "-n", "reproduce-specmd", "DEVICE=cuda"], cwd=REPO, capture_output=True, text=True).stdout
    assert "--device cuda" in cuda and "--quick" not in cuda
    for paper, module in PAPERS.items():
        mod = importlib.import_module(module)
        assert callable(mod.main) and mod.TITLE, paper


def test_reproduce_refuses_bad_input_in_one_line(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "recipes.reproduce", *a], cwd=REPO, capture_output=True, text=True)  # noqa: E731
    p = run("specmd", "--model", str(tmp_path / "nope"), "--root", str(tmp_path))
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "does not exist" in p.stderr
    p = run("specmd", "--data-dir", str(tmp_path / "nodata"), "--root", str(tmp_path))
    assert p.returncode == 2 and "data folder" in p.stderr
    p = run("nosuchpaper")
    assert p.returncode == 2 and "invalid choice" in p.stderr
    assert not (tmp_path / "specmd").exists()


@pytest.mark.slow
def test_quick_recipe_writes_a_report(tmp_path):
    """`make reproduce-specmd QUICK=1` end to end into a fresh root (no reuse): ours beside the paper's."""
    p = subprocess.run(
        [sys.executable, "-m", "recipes.reproduce", "specmd", "--quick", "--root", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=20 * 60,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    out = tmp_path / "specmd"
    res = json.loads((out / "results.json").read_text())
    assert res["tier"] == "quick" and res["tables"]
    paired = 0
    for t in res["tables"]:
        ours = [c for c in t["columns"] if c.startswith("ours")]
        paper = [c for c in t["columns"] if c.startswith("paper")]
        if ours and paper and any(row["cells"][ours[0]] is not None for row in t["rows"]):
            paired += 1
    assert paired >= 2
    assert list(out.glob("*.png")) and (out / "commands.sh").read_text().count("moeflow ") >= 3
    assert json.loads((out / "environment.json").read_text())["git_commit"]


def test_train_and_eval_steps_pass_the_recipes_model(tmp_path, monkeypatch):
    """`make reproduce-<paper> MODEL=...`: a train or eval step without --model would load the default model and
    refuse the trace the recipe made with MODEL."""
    from recipes.reproduce import common

    r = _recipe(tmp_path, model="models/olmoe-mini")
    calls: list[list[str]] = []
    monkeypatch.setattr(r, "moeflow", lambda name, *args, **kw: calls.append([str(a) for a in args]) or {})
    monkeypatch.setattr(r, "require", lambda value, name: value)
    common.predictors(r, tmp_path / "trace")
    assert calls and calls[0][0] == "train"
    assert "--model" in calls[0] and calls[0][calls[0].index("--model") + 1] == "models/olmoe-mini"
    for path in sorted((REPO / "recipes" / "reproduce").glob("*.py")):  # every other train / eval step names it too
        for line in path.read_text().splitlines():
            if '"train", "--' in line or '"eval", "--' in line:
                assert '"--model", r.model' in line, f"{path.name}: {line.strip()}"
