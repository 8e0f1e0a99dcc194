"""`moeflow trace` / `moeflow inspect`: flag -> config mapping, errors, a run on a saved tiny checkpoint."""

from __future__ import annotations

import collections
import json

import pytest
from typer.testing import CliRunner

from moeflow.cli.app import _register, app, main
from moeflow.stages.trace import TraceConfig
from moeflow.trace import Trace

from .test_trace import tiny_tokenizer

_register()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_models):
    """A tiny OLMoE checkpoint folder with a 256-id byte-level tokenizer, as save_pretrained writes it."""
    d = tmp_path_factory.mktemp("ckpt") / "olmoe-tiny"
    tiny_models("olmoe").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def test_flags_map_to_config(monkeypatch):
    seen = {}
    monkeypatch.setattr("moeflow.stages.trace.main", lambda cfg, json_out=False: seen.update(cfg=cfg, json=json_out))
    res = CliRunner().invoke(
        app,
        [
            "trace",
            "--model",
            "M",
            "--prompts",
            "gsm8k",
            "--out",
            "O",
            "--max-new-tokens",
            "7",
            "--batch-size",
            "4",
            "--limit",
            "5",
            "--record-hidden",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--repetition-penalty",
            "1.2",
            "--seed",
            "3",
            "--max-prompt-tokens",
            "64",
            "--data-dir",
            "D",
            "--split",
            "train",
            "--dtype",
            "bfloat16",
            "--device",
            "cuda:1",
            "--shard-size",
            "100",
            "--threads",
            "1",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    assert seen["cfg"] == TraceConfig(
        model="M",
        prompts="gsm8k",
        out="O",
        max_new_tokens=7,
        batch_size=4,
        limit=5,
        record_hidden=True,
        temperature=0.7,
        top_p=0.9,
        repetition_penalty=1.2,
        seed=3,
        max_prompt_tokens=64,
        data_dir="D",
        split="train",
        dtype="bfloat16",
        device="cuda:1",
        shard_size=100,
        threads=1,
        progress=False,
    )
    assert seen["json"] is True
    res = CliRunner().invoke(app, ["trace", "--model", "M", "--prompts", "p.txt", "--out", "O"])
    assert seen["cfg"] == TraceConfig(model="M", prompts="p.txt", out="O")
    assert (seen["cfg"].max_new_tokens, seen["cfg"].max_prompt_tokens, seen["cfg"].temperature) == (32, 256, 0.0)
    assert seen["cfg"].batch_size == 16  # the CLI's default is TraceConfig's


def test_help_gives_units_and_defaults():
    out = CliRunner().invoke(app, ["trace", "--help"], env={"COLUMNS": "200"}).output
    for s in (
        "--max-new-tokens",
        "default: 32",
        "--max-prompt-tokens",
        "default: 256",
        "--record-hidden",
        "--shard-size",
        "--batch-size",
        "default: 16",
        "greedy",
        "sharegpt",
    ):
        assert s in out, s


def _run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    return e.value.code, err


def test_bad_input_gives_one_line(capsys, tmp_path, checkpoint):
    code, err = _run(["trace", "--model", str(checkpoint), "--prompts", "nosuch", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "unknown prompt set 'nosuch'; known: sharegpt, alpaca, gsm8k, mmlu" in err
    assert err.strip().count("\n") == 0
    code, err = _run(["trace", "--model", str(checkpoint), "--prompts", "x.txt"], capsys)
    assert code == 2 and "--out" in err
    code, err = _run(["trace", "--model", str(checkpoint), "--prompts", "x.txt", "--out", str(tmp_path / "o"), "-b", "0"], capsys)
    assert code == 2 and "--batch-size must be >= 1 prompt (got 0)" in err and err.strip().count("\n") == 0
    code, err = _run(["inspect", str(tmp_path / "missing")], capsys)
    assert code == 2 and "does not exist" in err
    assert not (tmp_path / "o").exists()


def test_trace_then_inspect_end_to_end(capsys, tmp_path, checkpoint):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The quick brown fox\nHello world\nThe quick brown fox\n")
    out = tmp_path / "trace"
    argv = [
        "trace",
        "--model",
        str(checkpoint),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--max-new-tokens",
        "3",
        "--record-hidden",
        "--json",
    ]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["prompts_added"] == 2 and res["prompts_total"] == 2
    t = Trace(out)
    assert t.num_prompts == 2 and len(t) == res["tokens_added"]
    phase = t.tokens()["phase"]
    assert (phase == 0).sum() == 19 + 11 and 0 < (phase == 1).sum() <= 2 * 2  # the last new token is not routed
    assert t.record_hidden and t.meta["generation"]["max_new_tokens"] == 3
    # append with the same file: nothing new
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompts_added"] == 0
    # inspect (table and JSON) and trace --summary agree
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(out), "--json"])
    assert e.value.code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokens"] == len(t) and len(summary["layers"]) == 3
    for L in summary["layers"]:
        # per-expert load counted here in plain Python from the stored top-k ids; skewness = max / mean load
        ids = t.layer(L["layer"], ("topk_ids",))["topk_ids"].tolist()
        load = collections.Counter(e for row in ids for e in row)
        counts = [load.get(e, 0) for e in range(8)]
        assert L["counts"] == counts and sum(counts) == len(t) * 2
        assert L["skewness"] == pytest.approx(max(counts) / (sum(counts) / 8))
        assert L["dead"] == [e for e in range(8) if counts[e] < 0.01 * sum(counts) / 8]
    with pytest.raises(SystemExit) as e:
        main(["trace", "--summary", str(out), "--json"])
    assert e.value.code == 0
    assert json.loads(capsys.readouterr().out)["layers"] == summary["layers"]
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(out)])
    assert e.value.code == 0
    table = capsys.readouterr().out
    assert "skew" in table and "H router" in table
