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


def test_resident_check_flags_a_resident_run_slower_than_its_probe():
    from moeflow.stages.run import RESIDENT_SLACK, resident_check

    assert resident_check(0.010, 0.010) is None
    assert resident_check(RESIDENT_SLACK * 0.010, 0.010) is None  # at the slack: agrees
    assert resident_check(None, 0.010) is None and resident_check(0.010, None) is None
    why = resident_check(0.127, 0.042)
    assert why is not None and "127.0 ms/token" in why and "3.0x" in why and "42.0 ms/pass" in why


def test_run_warns_when_the_resident_run_is_slower_than_its_probe(ckpt, monkeypatch, capsys):
    """A resident run far slower than the experts-implementation probe timed moments before (seen on an H100:
    127 ms/token against a 42 ms/pass probe) makes every TTFT bound and ratio to resident wrong: said, not hidden."""
    import moeflow.stages.run as run_stage

    real = run_stage.fastest_experts_impl

    def probe(model, ids, **kw):
        assert kw == {"new_tokens": 6}  # the run's --max-new-tokens: the generation the pick is for
        p = real(model, ids, **kw)
        return p._replace(decode_s={k: v / 1000 for k, v in p.decode_s.items()})  # a probe 1000x faster than the run

    args = ["run", "-m", str(ckpt), "--prompts", str(ckpt.parent / "p.txt"), "--max-new-tokens", "6"]
    args += ["--min-new-tokens", "6", "--mode", "resident", "--threads", "1", "--json"]
    assert _run(args) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"][0]
    assert res["experts_impl_probe_s"] > 0  # (whether a real probe agrees with its run depends on the load: not asserted)

    monkeypatch.setattr(run_stage, "fastest_experts_impl", probe)
    assert _run(args) == 0
    cap = capsys.readouterr()
    res = json.loads(cap.out.strip().splitlines()[-1])["runs"][0]
    assert "resident_warning" in res and "WARNING: the resident run decoded at" in cap.err


def test_run_warns_when_the_host_rows_could_not_be_page_locked(ckpt, monkeypatch, capsys):
    """A CUDA engine whose store could not page-lock the experts still runs (pageable copies, slower): the run says
    so on stderr, once, and its JSON has `host_memory: pageable` (a CPU engine made to ask for pinned rows here)."""
    import moeflow.runtime.engine as engine_mod
    from moeflow.runtime.store import HostExpertStore

    from .test_load_experts import refuse_page_locking

    refuse_page_locking(monkeypatch)
    monkeypatch.setattr(engine_mod, "HostExpertStore", lambda adapter, pin: HostExpertStore(adapter, pin=True))
    args = ["run", "-m", str(ckpt), "--prompts", str(ckpt.parent / "p.txt"), "--max-new-tokens", "4", "--threads", "1"]
    args += ["--sweep", "--mode", "resident,offload", "-c", "50%", "-e", "lru", "-f", "none", "--json"]
    assert _run(args) == 0
    cap = capsys.readouterr()
    runs = json.loads(cap.out.strip().splitlines()[-1])["runs"]
    assert [r["host_memory"] for r in runs] == [None, "pageable"]
    assert cap.err.count("could not be page-locked") == 1 and "WARNING:" in cap.err


def test_a_cpu_run_reports_no_host_memory_kind(ckpt, capsys):
    args = ["run", "-m", str(ckpt), "--prompts", str(ckpt.parent / "p.txt"), "--max-new-tokens", "3", "--threads", "1"]
    args += ["-c", "50%", "-e", "lru", "-f", "none", "--json"]
    assert _run(args) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out.strip().splitlines()[-1])["runs"][0]["host_memory"] is None
    assert "page-locked" not in cap.err
