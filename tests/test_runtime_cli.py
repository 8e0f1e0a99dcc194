"""`moeflow run` end to end on a tiny saved checkpoint with a tokenizer."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def ckpt(ckpt_with):
    return ckpt_with(p_txt="the king said\nto be or not\n")


def _run(args):
    from moeflow.cli.app import main

    try:
        main(args)
    except SystemExit as e:
        return e.code
    return 0


def test_run_sweep_json_and_jsonl(ckpt, tmp_path, capsys):
    out = tmp_path / "gen.jsonl"
    code = _run(
        [
            "run",
            "-m",
            str(ckpt),
            "--prompts",
            str(ckpt.parent / "p.txt"),
            "--max-new-tokens",
            "6",
            "--min-new-tokens",
            "6",
            "--sweep",
            "--mode",
            "resident,on-demand,offload",
            "-c",
            "2,50%",
            "-e",
            "lru,least-stale",
            "-f",
            "none,pregate",
            "--link",
            "emulated:1,5",
            "--threads",
            "1",
            "--json",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["mode"] for r in res["runs"]] == ["resident", "on-demand"] + ["offload"] * 8
    assert res["runs"][2]["capacity_experts"] == 2 and res["runs"][-1]["capacity_experts"] == 12
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(lines) == 10 * 2
    texts = {}
    for rec in lines:
        texts.setdefault(rec["prompt_id"], set()).add(rec["text"])
    assert all(len(v) == 1 for v in texts.values())  # every mode and policy generates the same text
    m = res["runs"][1]["metrics"]  # on-demand: every access is a miss
    assert m["hit_rate"] == 0 and m["transfers"] == m["counters"]["accesses"]
    assert res["runs"][0]["metrics"]["bytes_moved"] == 0


def test_run_refuses_bad_input(ckpt, capsys):
    p = str(ckpt.parent / "p.txt")
    assert _run(["run", "-m", str(ckpt), "--prompts", p, "-c", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err
    assert _run(["run", "-m", str(ckpt), "--prompts", p, "-e", "nope"]) == 2
    assert "unknown eviction policy" in capsys.readouterr().err
    assert _run(["run", "-m", str(ckpt), "--prompts", p, "--link", "emulated:x"]) == 2
    assert _run(["run", "-m", str(ckpt), "--prompts", p, "-e", "lru,lfu"]) == 2
    assert "--sweep" in capsys.readouterr().err


def test_warm_up_runs_on_a_fast_link_but_the_timed_run_on_the_requested_one(ckpt, monkeypatch, capsys):
    """The untimed warm-up of an emulated-link run copies at `WARM_UP_GBPS` (the same code paths, no seconds of
    slow copies); the timed run keeps the link the user asked for."""
    import moeflow.stages.run as run_stage
    import moeflow.stages.session as session
    from moeflow.runtime.link import make_link

    seen: dict[str, list[str]] = {"warm": [], "timed": []}

    def spy(where):
        def make(spec, device):
            seen[where].append(spec)
            return make_link(spec, device)

        return make

    monkeypatch.setattr(session, "make_link", spy("warm"))
    monkeypatch.setattr(run_stage, "make_link", spy("timed"))
    args = ["run", "-m", str(ckpt), "--prompts", str(ckpt.parent / "p.txt"), "--limit", "1", "--max-new-tokens", "2"]
    code = _run([*args, "--mode", "offload", "-c", "50%", "--link", "emulated:0.5", "--threads", "1", "--json"])
    assert code == 0, capsys.readouterr().err
    assert seen["warm"] == [f"emulated:{session.WARM_UP_GBPS:g}"]
    assert seen["timed"] == ["emulated:0.5"]
    assert session.warm_up_link("direct") == "direct"
