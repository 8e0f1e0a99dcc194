"""Every command's tables stay readable at 80 columns (an 80-column terminal, or output to a file or a pipe,
where rich uses 80): no cell cut to "…", no line wider than 80, nothing a title or a name holds lost to rich
markup. A tiny checkpoint with 8 MoE layers makes the per-layer tables as wide as a real model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.cells import cell_len

from moeflow.cli.app import main
from moeflow.tables import FitTable, render_text

WIDTH = 80


def cli(argv, capsys):
    """(exit code, stdout, stderr) of `moeflow argv` in this process."""
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_readable(text: str, *needles: str, width: int = WIDTH) -> None:
    wide = [line for line in text.splitlines() if cell_len(line) > width]
    assert not wide, f"{len(wide)} line(s) wider than {width}:\n" + "\n".join(wide)
    assert "…" not in text, text
    flat = " ".join(text.split())
    for n in needles:
        assert n in flat, (n, text)


@pytest.fixture(autouse=True)
def columns_80(monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))  # what rich uses for a console that is not a terminal


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint, trace with router inputs, predictor folder with router-pf and the CasMoE EAP)."""
    import contextlib
    import io

    from moeflow.lmtrain.tokenizer import train_tokenizer
    from moeflow.models import tiny_model

    root = tmp_path_factory.mktemp("tables80")
    ck = root / "ckpt"
    text = ["the king said to the queen that the night was long", "to be or not to be, that is the question"] * 20
    tok = train_tokenizer(text, vocab_size=200)
    tiny_model("olmoe", num_experts=8, top_k=2, num_hidden_layers=8).save_pretrained(ck)
    tok.save_pretrained(ck)
    prompts = ["the king said", "to be or not", "the queen that", "night was long", "that is the question"]
    prompts += ["to be the king", "the night", "or not to be", "said to the queen", "long night"]
    (root / "p.txt").write_text("\n".join(prompts) + "\n")
    trace, preds = root / "trace", root / "preds"
    quiet = io.StringIO()
    fit = ["--only", "router-pf", "--only", "eap", "--plan-opt", "eap_epochs=1", "--max-s", "3", "--threads", "1"]
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        for argv in (
            ["trace", "-m", ck, "-p", root / "p.txt", "-o", trace, "--max-new-tokens", "4", "--record-hidden", "--json"],
            ["train", "-t", trace, "-o", preds, "-m", ck, *fit, "--json"],
        ):
            try:
                main([str(a) for a in argv])
            except SystemExit as e:
                assert e.code == 0, (argv, quiet.getvalue()[-2000:])
    return ck, trace, preds


def test_fit_table_keeps_every_cell_at_any_width():
    t = FitTable("a [title] with a bracket", key=2, caption="a caption")
    for h in ("name", "S", *[f"L{i}" for i in range(20)], "mean recall"):
        t.add_column(h)
    rows = [[f"pol[{r}]", str(r)] + [f"{r}.{i:03d}" for i in range(21)] for r in range(3)]
    for row in rows:
        t.add_row(*row)
    for width in (80, 50):
        text = render_text([t], width)
        assert_readable(text, "a [title] with a bracket", "a caption", width=width)
        for row in rows:
            assert all(cell in text for cell in row)  # nothing dropped, nothing cut
        parts = text.count("┃ name")
        assert parts > 1 and text.count("(continued)") == parts - 1  # each continuation repeats the key columns
    assert render_text([t], 400).count("┃ name") == 1  # wide enough: one table


def _recorded(fn, *args) -> str:
    """What `fn(*args, console)` prints on an 80-column console."""
    import io

    from rich.console import Console

    con = Console(width=WIDTH, record=True, file=io.StringIO(), color_system=None)
    fn(*args, con)
    return con.export_text()


def test_train_and_eval_tables(setup, capsys):
    ck, trace, preds = setup
    from moeflow.cli.train import _print_planner, _print_report

    report = json.loads((preds / "meta.json").read_text())["eval"]  # what `moeflow train` printed
    assert len({m["target"] for r in report["results"].values() for m in r.values()}) == 7  # 7 target layers
    assert_readable(_recorded(_print_report, report), "router-pf", "pregate", "worst layer", "S=3")
    code, out, err = cli(["eval", "--predictors", preds, "-t", trace, "-m", ck, "--max-s", "3"], capsys)
    assert code == 0, err
    assert_readable(out, "router-pf", "recall@k", "worst layer", "CasMoE planner")
    # train's three planner variants: one title each, in words (a `[name]` was taken for rich markup)
    planner = {"heldout": {name: _plan_rep(8) for name in ("eam", "eap", "cascade")}}
    text = _recorded(_print_planner, {"planner": planner})
    assert_readable(text, "EAM alone", "EAP alone", "cascade (the EAM when")
    assert text.count("CasMoE planner,") == 3


def _plan_rep(L: int) -> dict:
    v = [0.5 + 0.01 * i for i in range(L)]
    return {
        "k": 2,
        "mass": 0.8,
        "recall_at_k": v,
        "recall_at_k_eam": v,
        "baseline_recall_at_k": v,
        "mass_precision": v,
        "mass_recall": v,
        "mass_set_size": [3.0] * L,
        "chance_recall_at_k": 0.25,
        "split": {"eam": 1, "eap": 1},
        "prompts": 2,
        "ms_per_prompt": {"mean": 1.0},
    }


def test_simulate_table(setup, capsys):
    ck, trace, _ = setup
    argv = ["simulate", "-t", trace, "-m", ck, "-c", "2,50%", "-e", "least-stale,belady-approx"]
    argv += ["-f", "pregate:overfetch=1.5,all-next-layer", "--link", "emulated:1,5"]
    code, out, err = cli(argv, capsys)
    assert code == 0, err
    assert_readable(out, "least-stale+pregate:overfetch=1.5", "belady-approx+all-next-layer", "hit rate", "stall s")


def test_gps_tables(setup, capsys):
    _, trace, _ = setup
    code, out, err = cli(["gps", "-t", trace, "--max-batches", "2"], capsys)
    assert code == 0, err
    assert_readable(out, "no prediction", "token-to-expert", "overhead", "recommended:")


def test_inspect_table(setup, capsys):
    _, trace, _ = setup
    code, out, err = cli(["inspect", trace], capsys)
    assert code == 0, err
    assert_readable(out, "H router", "busiest")


def test_run_sweep_table(setup, capsys, monkeypatch):
    """`moeflow run`'s table reads at 80 columns, and into a file or a pipe it is printed at 80 (it was 160)."""
    import importlib

    rm = importlib.import_module("moeflow.stages.run")
    ck, _, _ = setup
    made = []
    real = rm.metrics_table
    monkeypatch.setattr(rm, "metrics_table", lambda rows, title="": made.append(real(rows, title=title)) or made[-1])
    p = Path(ck).parent / "p.txt"
    argv = ["run", "-m", ck, "-p", p, "-n", "2", "--max-new-tokens", "2", "--sweep", "--mode", "resident,offload"]
    argv += ["-c", "2,50%", "-e", "least-stale", "-f", "none,pregate:overfetch=1.5", "--threads", "1", "--no-warmup"]
    monkeypatch.delenv("COLUMNS", raising=False)
    code, out, err = cli(argv, capsys)
    assert code == 0, err
    assert_readable(render_text(made, WIDTH), "resident", "least-stale+pregate:overfetch=1.5", "TPOT", "TTFT/bound", "eff GB/s")
    assert "TPOT" in out and max(len(line) for line in out.splitlines()) <= WIDTH


def test_quality_table(setup, capsys, monkeypatch):
    import importlib

    qm = importlib.import_module("moeflow.stages.quality")
    ck, _, _ = setup
    made = []
    real = qm.quality_table
    monkeypatch.setattr(qm, "quality_table", lambda results, title="": made.append(real(results, title=title)) or made[-1])
    root = Path(ck).parent
    (root / "text.txt").write_text("the king said to the queen that the night was long " * 4)
    argv = ["quality", "-m", ck, "--prompts", root / "p.txt", "-n", "2", "--max-new-tokens", "2", "--text"]
    argv += [root / "text.txt", "--ppl-tokens", "8", "--ppl-windows", "1", "--task", "none", "--threads", "1"]
    argv += ["--no-warmup", "-c", "2", "--miss", "drop", "--json"]
    monkeypatch.delenv("COLUMNS", raising=False)
    code, _, err = cli(argv, capsys)
    assert code == 0, err
    assert "LOSSY" in err and max(len(line) for line in err.splitlines()) <= WIDTH  # the table, on stderr (180 before)
    assert_readable(render_text(made, WIDTH), "resident", "LOSSY", "Δppl %", "bytes /tok")
