"""Messages and --help in words a user can act on: one line per error, naming flags and models, never an
internal name; help that lists every policy and marks what it should."""

from __future__ import annotations

import json
import re

import pytest

from moeflow.cli.app import main
from moeflow.errors import ArtifactError, ConfigError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny OLMoE checkpoint (8 experts, top-2, 3 MoE layers) with a tokenizer, and a prompt file beside it."""
    from moeflow.lmtrain.tokenizer import train_tokenizer
    from moeflow.models import tiny_model

    d = tmp_path_factory.mktemp("messages") / "ckpt"
    text = ["the king said to the queen that the night was long", "to be or not to be, that is the question"] * 20
    tok = train_tokenizer(text, vocab_size=200)
    tiny_model("olmoe", num_experts=8, top_k=2).save_pretrained(d)
    tok.save_pretrained(d)
    (d.parent / "p.txt").write_text("the king said\nto be or not\n")
    return d


@pytest.fixture(scope="module")
def trace(ckpt):
    import contextlib
    import io

    out = ckpt.parent / "trace"
    argv = ["trace", "-m", ckpt, "-p", ckpt.parent / "p.txt", "-o", out, "--max-new-tokens", "2", "--record-hidden"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in [*argv, "--json"]])
    assert e.value.code == 0
    return out


def cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def one_line_error(argv, capsys, *needles, absent=()):
    code, _, err = cli(argv, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("note: ")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in err, (n, err)
    for n in absent:
        assert n not in err, (n, err)
    return lines[0]


def help_text(capsys, *cmd) -> str:
    """`moeflow CMD --help` as one line of words (the box drawing and the wrapping removed)."""
    code, out, _ = cli([*cmd, "--help"], capsys)
    assert code == 0
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", out).split())


def listed(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


# ---- simulate: learned prefetchers, the default model, one set of defaults ----------------------------------


def test_simulate_refuses_a_learned_prefetcher_in_words(ckpt, tmp_path, capsys):
    from moeflow.policies import PREFETCH
    from moeflow.stages.simulate import replayable_prefetchers

    learned = [n for n in PREFETCH if n not in replayable_prefetchers()]
    assert {"router-pf", "estimator", "hybrid", "token-id", "forest"} <= set(learned)
    for name in learned:  # before the trace or the predictor folder is even opened
        line = one_line_error(
            ["simulate", "-t", tmp_path / "none", "-f", f"{name}:predictors={tmp_path}"],
            capsys,
            f"cannot replay prefetch policy '{name}'",
            "need the running model",
            f"moeflow run -f {name}:predictors=DIR",
            absent=("bind", "engine"),
        )
        assert "none, pregate, all-next-layer" in line
    text = help_text(capsys, "simulate")
    assert "need the running model" in text and all(listed(n, text) for n in PREFETCH)


def test_simulate_has_run_defaults(capsys, monkeypatch):

    seen = {}
    monkeypatch.setattr("moeflow.stages.simulate.main", lambda cfg: seen.update(cfg=cfg) or {"rows": []})
    code, _, err = cli(["simulate", "-t", "T", "--json"], capsys)
    assert code == 0, err
    cfg = seen["cfg"]
    assert cfg.capacities == ("25%",) and cfg.evictions == ("next-use",) and cfg.model is None  # the trace's
    assert cfg.prefetches is None and cfg.lookahead is None  # pregate where the trace allows it; the calibration's S
    text = help_text(capsys, "simulate")
    assert "Default 25%, as `moeflow run`" in text and "Default pregate, as `moeflow run`" in text


def test_simulate_defaults_resolved_from_the_trace(ckpt, trace, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no calibration/ here
    code, out, err = cli(["simulate", "-t", trace, "-m", ckpt, "--no-belady", "--json"], capsys)
    assert code == 0, err
    res = json.loads(out)
    assert [r["prefetch"] for r in res["rows"]] == ["pregate"]  # the trace has router inputs
    assert res["lookahead"] == 1 and res["lookahead_source"].startswith("no calibration at calibration/cpu.json")
    assert res["rows"][0]["capacity"] == round(0.25 * res["total_experts"])


def test_simulate_pregate_uses_the_traces_model(ckpt, trace, capsys, monkeypatch, tmp_path):
    """No "needs --model": without --model the model the trace was made with is loaded (the default model refused
    every trace of another one); another --model is refused in a line that names the traced one."""
    monkeypatch.delenv("MOEFLOW_MODEL", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["simulate", "-t", str(trace), "-f", "pregate", "--no-progress"])
    assert e.value.code in (0, None), capsys.readouterr().err
    from moeflow.models import default_model_path

    one_line_error(
        ["simulate", "-t", trace, "-f", "pregate", "-m", default_model_path()],
        capsys,
        f"was made for another model, {ckpt}",
        f"pass --model {ckpt}",
        absent=("needs --model",),
    )
    # train names the traced model once, then the other fix (it said "pass --model X or pass the --model it was
    # traced with"); nothing is written
    one_line_error(
        ["train", "-t", trace, "-m", default_model_path(), "--out", tmp_path / "p"],
        capsys,
        f"pass --model {ckpt} or re-run `moeflow trace` with this --model",
        absent=("traced with",),
    )
    assert not (tmp_path / "p").exists()


# ---- run: lengths, option values, the model, typos -------------------------------------------------------


def test_max_new_tokens_beyond_the_model_names_the_flag_to_lower(ckpt, capsys):
    from moeflow.models import check_lengths

    with pytest.raises(ConfigError) as e:
        check_lengths({"max_position_embeddings": 256}, 14, 100_000)
    assert str(e.value).endswith("pass --max-new-tokens 242 or less") and "--max-prompt-tokens" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        check_lengths({"max_position_embeddings": 256}, 250, 10)
    assert str(e.value).endswith("lower --max-new-tokens to 6 or --max-prompt-tokens to 246")
    one_line_error(
        ["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--max-new-tokens", "100000", "--mode", "resident"],
        capsys,
        "pass --max-new-tokens",
        absent=("--max-prompt-tokens to 0",),
    )


def test_a_bad_option_value_is_named_without_python_words(tmp_path, capsys):
    for argv in (["-f", "pregate:overfetch=abc"], ["--prefetch-opt", "overfetch=abc"]):
        one_line_error(
            ["simulate", "-t", tmp_path, *argv],
            capsys,
            "prefetch policy 'pregate': overfetch='abc' is not a number",
            absent=("not supported between", "instances of"),
        )
    from moeflow.policies import EVICTION

    with pytest.raises(ConfigError, match=r"high_fraction='x' is not a number; give a number \(its default: lru2:"):
        EVICTION.create("lru2", high_fraction="x")


def test_a_missing_model_names_the_shipped_ones(capsys, tmp_path, monkeypatch):
    from pathlib import Path

    from moeflow.models import shipped_models

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # the checkout's root: relative names
    assert "models/olmoe-deep" in shipped_models()
    for argv in (["run", "-m", tmp_path / "nosuch", "--prompt", "x"], ["ep", "-m", tmp_path / "nosuch", "--prompt", "x"]):
        one_line_error(
            argv, capsys, "does not exist; check the path", "models/olmoe-deep", "MOEFLOW_MODEL", absent=("make models",)
        )


def test_a_typo_suggests_only_flags_help_shows(capsys):
    line = one_line_error(["run", "--capcity", "3"], capsys, "did you mean --capacity?")
    assert "--cache-capacity" not in line
    one_line_error(
        ["simulate", "-t", "T", "--max-prompt", "3"], capsys, "no such option: --max-prompt", absent=("--max-prompts",)
    )


# ---- artifacts: names in words, the model that made them ----------------------------------------------------


def test_artifact_kinds_read_as_nouns(trace, tmp_path, capsys):
    from moeflow.artifacts import read_meta
    from moeflow.outputs import check_out

    with pytest.raises(ArtifactError) as e:
        read_meta(trace, "predictors", 1)
    assert str(e.value).startswith(f"{trace} is not a moeflow predictor folder (it holds a moeflow trace)")
    pred = tmp_path / "p"
    pred.mkdir()
    (pred / "meta.json").write_text('{"kind": "predictors", "schema": 1}')
    with pytest.raises(ConfigError) as e2:
        check_out(pred, kind="predictors")
    assert "already holds a moeflow predictor folder; pass --force" in str(e2.value)
    assert "a moeflow predictors" not in str(e2.value)


def test_wrong_model_errors_name_the_model_that_made_it(ckpt, trace, tmp_path):
    from moeflow.artifacts import check_fingerprint
    from moeflow.models import tiny_model
    from moeflow.trace import Trace

    tr = Trace(trace)
    assert tr.meta["model"] == str(ckpt)  # recorded from now on
    with pytest.raises(ArtifactError) as e:
        tr.check_model(tiny_model("olmoe", num_experts=8, top_k=2, seed=1))
    assert f"made for another model, {ckpt} (fingerprint {tr.fingerprint})" in str(e.value)
    assert f"pass --model {ckpt} or re-run `moeflow trace`" in str(e.value)
    meta = {"model_fingerprint": "aaaa", "config": {"model": "models/olmoe-mini"}}  # a predictor folder's meta.json
    with pytest.raises(ArtifactError, match="made for another model, models/olmoe-mini .fingerprint aaaa."):
        check_fingerprint(meta, "bbbb", "predictor folder", tmp_path)
    with pytest.raises(ArtifactError, match=r"made for another model \(fingerprint aaaa\), not this --model") as e:
        check_fingerprint({"model_fingerprint": "aaaa"}, "bbbb", "predictor folder", tmp_path)  # none recorded
    assert "; pass the --model it was made with or re-create it with this --model" in str(e.value)


# ---- --help -------------------------------------------------------------------------------------------


def test_help_lists_every_registered_policy(capsys):
    from moeflow.policies import EVICTION, MISS, PREFETCH, ROUTING

    run, quality, sim = (help_text(capsys, c) for c in ("run", "quality", "simulate"))
    for reg, helps in (
        (EVICTION, (run, quality, sim)),
        (PREFETCH, (run, quality, sim)),
        (MISS, (run, quality)),
        (ROUTING, (run, quality)),
    ):
        builtin = [n for n, c in reg.items() if c.__module__.startswith("moeflow.")]
        assert len(builtin) >= 4
        for text in helps:
            missing = [n for n in builtin if not listed(n, text)]
            assert not missing, (reg.kind, missing)


def test_flags_show_no_value_placeholder_and_help_reads_at_80(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    for cmd in ("trace", "train", "eval", "retrain", "calibrate", "run", "simulate", "quality", "ep", "gps", "inspect"):
        code, out, _ = cli([cmd, "--help"], capsys)
        assert code == 0 and "<bool>" not in out, cmd
        assert "…" not in out, (cmd, [ln for ln in out.splitlines() if "…" in ln])  # no word cut at 80 columns
    assert "--json" in help_text(capsys, "run")
    one_line_error(["simulate", "-t", "T", "--json", "true"], capsys, "unexpected extra argument")


def test_help_texts_say_what_they_do(capsys):
    q = help_text(capsys, "quality")
    assert "Default: 8; with --prompt, every text given." in q and "Default: all" not in q.split("--split")[0]
    ev = help_text(capsys, "eval")
    assert re.search(r"\* --predictors .*\[required\]", ev) and "(required)" not in ev
    assert '{"*": {"3": [0, 1]}}' in help_text(capsys, "ep")  # the rank list is not taken for rich markup


def test_short_flags_mean_one_thing(ckpt, tmp_path, capsys):
    """-c is the capacity (run, simulate); retrain's config file is --config, -N is ep's hidden old --world-size."""
    retrain = help_text(capsys, "retrain")
    assert "--config" in retrain and not listed("-c", retrain)
    ep = help_text(capsys, "ep")
    assert "--world-size" in ep and not listed("-N", ep)
    code, _, err = cli(["retrain", "-c", tmp_path / "nosuch.toml"], capsys)
    assert code == 2 and "note: -c is now --config" in err and "nosuch.toml does not exist" in err
    code, _, err = cli(["retrain"], capsys)
    assert code == 2 and "Missing option '--config'" in err
    code, _, err = cli(["ep", "-N", "2", "-m", tmp_path / "nosuch", "--prompt", "x"], capsys)
    assert code == 2 and "note: -N is now --world-size" in err
    code, _, err = cli(["eval", "-p", tmp_path / "nosuch", "-t", tmp_path], capsys)  # the old spelling still works
    assert code == 2 and "note: -p is now --predictors" in err and "Missing option" not in err


def test_planner_tables_have_distinct_titles_in_words():
    from moeflow.plan.train import PLANNER_LABELS, planner_tables
    from moeflow.tables import render_text

    r = {
        "k": 2,
        "mass": 0.8,
        "prompts": 2,
        "recall_at_k": [0.5, 0.75],
        "mass_precision": [0.5, 0.5],
        "mass_recall": [0.5, 0.5],
        "mass_set_size": [2.0, 2.0],
        "chance_recall_at_k": 0.25,
        "split": {"eam": 1, "eap": 1},
        "ms_per_prompt": {"mean": 1.0},
    }
    text = render_text(planner_tables({"heldout": {n: r for n in ("eam", "eap", "cascade")}}))
    flat = " ".join(text.split())
    assert all(f"CasMoE planner, {label}" in flat for label in PLANNER_LABELS.values())


def test_recall_plot_title_is_math_not_raw_tex(tmp_path, monkeypatch):
    """recall.png's decay title reads as a formula: plain text (no TeX source such as `a e^{-bS}` or `$`, which
    would print as typed), or, if it uses mathtext, valid mathtext."""
    import matplotlib.axes
    from matplotlib.mathtext import MathTextParser

    from moeflow.predict.evaluate import plot

    titles: list[str] = []
    real = matplotlib.axes.Axes.set
    monkeypatch.setattr(matplotlib.axes.Axes, "set", lambda ax, **kw: titles.append(kw.get("title", "")) or real(ax, **kw))
    rep = {"results": {"pregate": {"0->1": {"S": 1, "target": 1, "recall_at_k": 0.5}}}, "by_s": {"pregate": {1: 0.5}}}
    plot({**rep, "fit": {"pregate": None}}, tmp_path / "recall.png")
    decay = next(t for t in titles if "recall vs S" in t)
    if "$" in decay:
        MathTextParser("agg").parse(decay[decay.index("$") : decay.rindex("$") + 1])  # valid mathtext
    else:  # plain text: no TeX markup left in it
        assert "\\" not in decay and "^{" not in decay and "exp(-b·S)" in decay


# ---- found by a new user's walk through the CLI ----------------------------------------------------------------


def test_step_size_beyond_the_model_is_refused_by_simulate_as_by_run(ckpt, trace, capsys):
    """The tiny model has 3 MoE layers, so S can be 1..2, in `simulate` as in `run` (simulate took S=99 silently)."""
    one_line_error(["simulate", "-t", trace, "-m", ckpt, "-S", "99", "-f", "pregate"], capsys, "-S 99:", "so S can be 1..2")
    one_line_error(["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "-S", "99"], capsys, "-S 99:", "so S can be 1..2")


def test_run_config_file_with_a_bad_value_or_key_names_the_file(ckpt, tmp_path, capsys):
    """A hand-edited run configuration: a value of the wrong type and an unknown key are one line naming the file
    and the option (the first was an internal ValueError, the second silently ignored)."""
    from moeflow.tune.config import OPTIONS, run_config, write_run_config

    opts = {**dict.fromkeys(OPTIONS), "capacity": "50%", "eviction": "lru", "prefetch": "pregate", "lookahead": 2}
    for bad, needle in (
        ({"lookahead": "two"}, "option 'lookahead' must be an integer >= 1 or null, got 'two'"),
        ({"frobnicate": 1}, "unknown option 'frobnicate'"),
    ):
        rec = run_config(str(ckpt), "0123", {**opts}, {})
        rec["options"].update(bad)
        path = write_run_config(tmp_path / "c.json", rec)
        one_line_error(["run", "--config", path, "-p", ckpt.parent / "p.txt"], capsys, f"{path}: ", needle)


def test_an_option_value_the_policy_refuses_gives_its_reason_alone(ckpt, capsys):
    """A value of the right type that the policy refuses: its own reason, not the tail about numbers."""
    one_line_error(
        ["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--miss", "fetch-priority:bits=3"],
        capsys,
        "bits must be among 8/4/2, got 3",
        absent=("give numbers",),
    )
    one_line_error(["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--miss", "fetch-priority:bits=four"], capsys, "give numbers")


def test_eval_refuses_an_unknown_predictor_before_the_model_loads(ckpt, trace, tmp_path, capsys, monkeypatch):
    """`eval --only bogus` names the choices (it suggested `train --only bogus`, which train refuses), and a
    missing predictor folder is said before the model loads."""
    import moeflow.stages.train as st

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the inputs were checked")

    monkeypatch.setattr(st, "load_cpu_model", no_load)
    one_line_error(
        ["eval", "--predictors", tmp_path, "-t", trace, "-m", ckpt, "--only", "bogus"], capsys, "unknown predictor bogus"
    )
    one_line_error(["eval", "--predictors", tmp_path / "none", "-t", trace, "-m", ckpt], capsys, str(tmp_path / "none"))


def test_a_size_capacity_is_echoed_with_its_experts(ckpt, capsys):
    """`-c 1KB` below top-k says what the user typed and the experts it makes, not only "0 experts"."""
    one_line_error(
        ["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "-c", "1KB"], capsys, "--capacity 1KB (0 experts of ", "is below top-k=2"
    )


def test_model_path_messages(tmp_path, monkeypatch):
    """A file given as --model is called a file; outside the checkout the shipped models are named by absolute path."""
    from moeflow.models import missing_model, shipped_models

    f = tmp_path / "f.txt"
    f.write_text("x")
    assert missing_model(f).startswith(f"--model {f} is a file, not a model folder")
    assert missing_model(tmp_path / "no").startswith(f"model folder {tmp_path / 'no'} does not exist")
    monkeypatch.setenv("MOEFLOW_MODEL", str(tmp_path / "no"))  # the path came from the variable, not from --model
    assert missing_model(str(tmp_path / "no")).startswith(f"$MOEFLOW_MODEL names {tmp_path / 'no'}, which does not exist")
    monkeypatch.delenv("MOEFLOW_MODEL")
    monkeypatch.chdir(tmp_path)
    assert shipped_models() and all(
        m.startswith("/") and m.endswith(("olmoe-deep", "olmoe-mini", "mixtral-mini")) for m in shipped_models()
    )


def test_a_long_load_error_is_cut_at_a_sentence():
    from moeflow.errors import brief

    long = "Weights only load failed. " + "This file can still be loaded, " * 10
    assert brief(long) == "Weights only load failed."
    assert brief("word " * 60).endswith(" ...") and len(brief("word " * 60)) <= 204
    assert brief("short\nsecond line") == "short"


def test_a_refused_value_from_a_config_file_says_it_came_from_the_file(ckpt, tmp_path, capsys):
    """A capacity below top-k written in a --config file: the line names the file (the user typed no --capacity);
    typed on the command line, the same value is the flag's."""
    from moeflow.models import load_model
    from moeflow.moe import model_fingerprint
    from moeflow.tune.config import OPTIONS, run_config, write_run_config

    fp = model_fingerprint(load_model(ckpt, tokenizer=False)[0])
    opts = {**dict.fromkeys(OPTIONS), "capacity": "1", "eviction": "lru", "prefetch": "pregate"}
    path = write_run_config(tmp_path / "c.json", run_config(str(ckpt), fp, opts, {}))
    one_line_error(
        ["run", "--config", path, "-p", ckpt.parent / "p.txt"], capsys, "is below top-k", f"(the 'capacity' of --config {path})"
    )
    one_line_error(
        ["run", "--config", path, "-p", ckpt.parent / "p.txt", "-c", "1"], capsys, "is below top-k", absent=("of --config",)
    )


def test_a_flag_given_with_nothing_in_it_is_refused(ckpt, capsys):
    """`-e ''` (an empty shell variable) was silently the default eviction; a flag given empty is refused."""
    from moeflow.policies.parse import split_list

    assert split_list(None, "--eviction") == () and split_list(["lru,", "lfu"], "--eviction") == ("lru", "lfu")
    one_line_error(["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "-e", ""], capsys, "--eviction '' names nothing")
    one_line_error(["simulate", "-t", ckpt, "-c", ","], capsys, "--capacity ',' names nothing")


def test_cache_flags_for_runs_without_a_cache_are_refused(ckpt, capsys):
    """`--mode resident -c 25%` ran the stock model and ignored the capacity; a cache or policy flag typed for
    modes that keep no cache is one line. With offload among the modes, or left at its default, it is not."""
    p = ckpt.parent / "p.txt"
    one_line_error(["run", "-m", ckpt, "-p", p, "--mode", "resident", "-c", "25%"], capsys, "--capacity applies to --mode")
    one_line_error(["run", "-m", ckpt, "-p", p, "--mode", "on-demand", "--miss", "drop"], capsys, "--miss applies to")
    one_line_error(["run", "-m", ckpt, "-p", p, "--mode", "ofload", "-c", "25%"], capsys, "--mode 'ofload' unknown")
    one_line_error(
        ["run", "-m", ckpt, "-p", p, "--mode", "resident,on-demand", "--sweep", "-e", "lru", "--adaptive-s"],
        capsys,
        "--adaptive-s, --eviction apply to --mode offload only",
        "drop them",
    )
    code, _, err = cli(["run", "-m", ckpt, "-p", p, "--mode", "resident", "--max-new-tokens", "1", "--json"], capsys)
    assert code == 0, err
    code, _, err = cli(
        ["run", "-m", ckpt, "-p", p, "--mode", "resident,offload", "--sweep", "-c", "4", "--max-new-tokens", "1", "--json"],
        capsys,
    )
    assert code == 0, err
    one_line_error(["quality", "-m", ckpt, "--prompt", "hi", "--mode", "on-demand", "-c", "4"], capsys, "--capacity applies")


def test_no_calibration_warning_only_where_s_is_used_and_with_the_command(ckpt, tmp_path, monkeypatch, capsys):
    """The missing-calibration warning names the exact `moeflow calibrate` command for this model and link, and
    is not printed for runs that read no step size (resident, on-demand, prefetch none, an -S given)."""
    monkeypatch.chdir(tmp_path)  # no calibration/ here
    base = ["run", "-m", ckpt, "-p", ckpt.parent / "p.txt", "--max-new-tokens", "1", "--no-warmup", "--threads", "1"]
    code, _, err = cli([*base, "--link", "emulated:2,10", "-c", "4"], capsys)
    assert code == 0, err
    assert "WARNING: no calibration at" in err
    assert f"moeflow calibrate --model {ckpt} --link-gbps 2 --link-latency-us 10" in " ".join(err.split())
    for quiet in (["--mode", "resident"], ["--mode", "on-demand"], ["-f", "none", "-c", "4"], ["-S", "1", "-c", "4"]):
        code, _, err = cli([*base, "--link", "emulated:2", *quiet], capsys)
        assert code == 0 and "WARNING" not in err, (quiet, err)


def test_help_gives_an_80_column_terminal_a_readable_help_column(ckpt, capsys):
    """A setting on by default has one name in --help (`--no-warmup`), not a `--warmup/--no-warmup` pair that
    widened the short-flag column and left 80 columns a help column of about 20 characters; `--warmup` still
    parses (a no-op: it is the default)."""
    from typer.testing import CliRunner

    from moeflow.cli.app import _register, app

    _register()
    for cmd in ("run", "quality", "ep", "tune"):
        text = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "80"}, terminal_width=80).output
        assert not re.search(r"--[a-z-]+ +--no-", text), cmd  # no on/off pair in the option column
        row = next(line for line in text.splitlines() if re.match(r"│ (\* +)?--", line))  # "*": a required option
        help_text = re.split(r"\s{2,}", row.strip("│ *").strip())[-1]
        assert row.index(help_text) <= 45, (cmd, row)  # the help column starts before column 45 (it was 54)
    p = ckpt.parent / "p.txt"
    for flags, want in ((["--warmup"], True), (["--no-warmup"], False), ([], True)):
        code, out, err = cli(
            ["run", "-m", ckpt, "-p", p, "--mode", "resident", "--max-new-tokens", "1", *flags, "--json"], capsys
        )
        assert code == 0 and json.loads(out)["runs"][0]["warmup"] is want, (flags, err)


def test_both_spellings_of_a_switch_are_one_line(ckpt, capsys):
    """`--no-warmup --warmup` went by the last flag when they were one option; as two they contradict: one line."""
    code, _, err = cli(["run", "-m", ckpt, "--prompt", "hi", "--no-warmup", "--warmup"], capsys)
    assert code == 2 and "--warmup and --no-warmup contradict each other" in " ".join(err.split()), err
