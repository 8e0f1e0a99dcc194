"""Verified reads and bad inputs: trace checksums, meta.json fields,
prompt ids vs shards, sources after appends, SIGTERM during `moeflow trace`, prompt file columns,
binary prompt files, damaged checkpoints, prompt lengths beyond the model's positions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from moeflow.cli.app import _register, main
from moeflow.data import load_prompts, prompt_id
from moeflow.errors import ArtifactError, ConfigError, MoeflowError
from moeflow.stages.trace import run_trace
from moeflow.trace import Trace

from .conftest import REPO
from .test_trace import cfg, prompts, tiny_tokenizer

_register()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_models):
    """A tiny OLMoE checkpoint folder (max_position_embeddings 256) with a 256-id byte-level tokenizer."""
    d = tmp_path_factory.mktemp("ckpt") / "olmoe-tiny"
    tiny_models("olmoe").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def _cli(argv, capsys):
    """(exit code, stderr without progress lines) of `moeflow ARGV` run in-process."""
    code = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    return code, "\n".join(x for x in err.strip().splitlines() if "Loading weights" not in x)


def _meta(out):
    return json.loads((out / "meta.json").read_text())


def _write_meta(out, meta):
    (out / "meta.json").write_text(json.dumps(meta))


@pytest.fixture
def trace3(tiny_models, tok, tmp_path):
    out = tmp_path / "tr"
    run_trace(tiny_models("olmoe"), tok, prompts("the cat sat", "on the mat", "a dog"), cfg(out, shard_size=20))
    return out


# ---- item 3: checksums ---------------------------------------------------------------------------


def test_flipped_byte_is_caught_by_inspect_simulate_and_train(trace3, capsys):
    t = Trace(trace3)
    assert len(t.meta["shards"]) >= 2
    shard = trace3 / t.meta["shards"][0]["file"]
    w = np.ascontiguousarray(t.layer(0)["topk_weights"][:4])  # the first rows' routing weights, f32
    data = shard.read_bytes()
    at = data.find(w.tobytes())
    assert at > 0  # stored verbatim in the shard
    shard.write_bytes(data[: at + 2] + bytes([data[at + 2] ^ 0x40]) + data[at + 3 :])  # same size, one byte
    # without the checksum the shard reads fine and gives another weight: silently wrong results
    assert Trace(trace3, verify=False).layer(0)["topk_weights"][0, 0] != w[0, 0]
    with pytest.raises(ArtifactError, match=r"shard-00000/data.arrow is corrupt \(sha256"):
        Trace(trace3)
    code, err = _cli(["inspect", str(trace3)], capsys)
    assert code == 2 and "corrupt" in err and err.count("\n") == 0
    code, err = _cli(["simulate", "--trace", str(trace3), "--capacity", "4"], capsys)
    assert code == 2, err
    assert "corrupt" in err and err.count("\n") == 0
    from moeflow.predict.data import from_trace  # what `moeflow train` reads the trace with

    with pytest.raises(ArtifactError, match="corrupt"):
        from_trace(str(trace3))


def test_large_shards_use_the_documented_cheap_check(tiny_models, tok, tmp_path, monkeypatch):
    """Over FULL_HASH_MAX a shard is checked by sha256 of (size, first and last ENDS_BYTES): a changed
    byte there is caught, one in the middle is not (documented); small shards get the full sha256."""
    import hashlib

    import moeflow.trace.reader as rmod
    import moeflow.trace.writer as wmod
    from moeflow.trace import format as fmt

    f = tmp_path / "x"
    f.write_bytes(b"abcdefghijklmnop")
    monkeypatch.setattr(fmt, "ENDS_BYTES", 4)
    assert fmt.ends_sha256(f) == hashlib.sha256(b"16\nabcdmnop").hexdigest()
    assert fmt.file_sha256(f) == hashlib.sha256(b"abcdefghijklmnop").hexdigest()
    monkeypatch.setattr(fmt, "ENDS_BYTES", 256)
    monkeypatch.setattr(rmod, "FULL_HASH_MAX", 1024)
    monkeypatch.setattr(wmod, "FULL_HASH_MAX", 1024)
    out = tmp_path / "tr"
    run_trace(tiny_models("olmoe"), tok, prompts("a long enough prompt for a big shard"), cfg(out))
    info = _meta(out)["shards"][0]
    assert info["bytes"] > 4 * 1024 and "sha256_ends" in info
    shard = out / info["file"]
    data = shard.read_bytes()
    mid = len(data) // 2
    shard.write_bytes(data[:mid] + bytes([data[mid] ^ 1]) + data[mid + 1 :])
    Trace(out)  # the cheap check does not read the middle
    end = len(data) - 100  # inside the last ENDS_BYTES
    shard.write_bytes(data[:end] + bytes([data[end] ^ 1]) + data[end + 1 :])
    with pytest.raises(ArtifactError, match="corrupt"):
        Trace(out)
    monkeypatch.setattr(rmod, "FULL_HASH_MAX", 1 << 30)  # as a small shard: the full sha256
    shard.write_bytes(data[:mid] + bytes([data[mid] ^ 1]) + data[mid + 1 :])
    with pytest.raises(ArtifactError, match="corrupt"):
        Trace(out)


# ---- item 3 / 4: meta.json fields, prompt ids vs shards ------------------------------------------


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda m: m.pop("shards"), "'shards'"),
        (lambda m: m.update(num_tokens="12"), "'num_tokens' must be an integer"),
        (lambda m: m.update(record_hidden="no"), "'record_hidden' must be true/false"),
        (lambda m: m["shards"][0].pop("file"), "'shards[0].file'"),
        (lambda m: m["shards"][0].update(records=True), "'shards[0].records' must be an integer"),
        (lambda m: m["spec"].pop("num_experts"), "'spec.num_experts'"),
        (lambda m: m.update(prompt_ids={"a": 1}), "'prompt_ids' must be a list"),
        (lambda m: m["shards"][0].update(file="../../etc/passwd"), "inside"),
    ],
)
def test_meta_fields_and_types_give_one_line(trace3, capsys, edit, field):
    meta = _meta(trace3)
    edit(meta)
    _write_meta(trace3, meta)
    with pytest.raises(ArtifactError, match=r"meta\.json") as e:
        Trace(trace3)
    assert field in str(e.value) and "\n" not in str(e.value)
    code, err = _cli(["inspect", str(trace3)], capsys)
    assert code == 2 and field in err and err.count("\n") == 0


def test_prompt_ids_and_shards_must_agree(trace3):
    good = _meta(trace3)
    ids = good["prompt_ids"]
    bad = [
        (dict(good, prompt_ids=[ids[0], ids[0], ids[2]]), "twice|other prompts"),  # a duplicate
        (dict(good, prompt_ids=[ids[1], ids[0], ids[2]]), "other prompts"),  # swapped
        (dict(good, prompt_ids=[*ids, prompt_id("extra")]), "4 prompt_ids but its shards hold 3"),
        (dict(good, num_tokens=good["num_tokens"] + 1), "num_tokens"),
        (dict(good, shards=[dict(good["shards"][0], prompts=good["shards"][0]["prompts"] + 1), *good["shards"][1:]]), "prompt"),
    ]
    for meta, msg in bad:
        _write_meta(trace3, meta)
        with pytest.raises(ArtifactError, match=msg):
            Trace(trace3)
    _write_meta(trace3, good)
    assert Trace(trace3).prompt_ids == ids


def test_appended_trace_records_every_source(tiny_models, tok, tmp_path):
    model = tiny_models("olmoe")
    out = tmp_path / "tr"
    run_trace(model, tok, prompts("one", "two"), cfg(out, prompts="a.txt"))
    run_trace(model, tok, prompts("two", "three"), cfg(out, prompts="gsm8k", split="train", limit=2))
    meta = Trace(out).meta
    assert "prompt_source" not in meta  # the single top-level source was false after an append
    assert meta["sources"] == [
        {"source": "a.txt", "split": None, "column": None, "prompts": 2},
        {"source": "gsm8k", "split": "train", "column": None, "prompts": 1},
    ]
    assert [(r["prompt_source"], r["split"], r["limit"], r["prompts_added"]) for r in meta["runs"]] == [
        ("a.txt", None, None, 2),
        ("gsm8k", "train", 2, 1),
    ]
    # a trace written before `sources` existed gets them rebuilt from its runs on the next append
    old = dict(meta, prompt_source="a.txt")
    del old["sources"]
    _write_meta(out, old)
    run_trace(model, tok, prompts("four"), cfg(out, prompts="b.csv", column="Question"))
    meta = Trace(out).meta
    assert [(s["source"], s["prompts"]) for s in meta["sources"]] == [("a.txt", 2), ("gsm8k", 1), ("b.csv", 1)]
    assert meta["sources"][2]["column"] == "Question" and "prompt_source" not in meta


# ---- item 7: interrupts during `trace` -----------------------------------------------------------


def test_second_ctrl_c_while_flushing_keeps_the_finished_prompts(tiny_models, tok, tmp_path, monkeypatch):
    """Ctrl-C during the 3rd prompt, then Ctrl-C again while the buffered prompts are written: the second
    signal waits until the shard and meta.json are written, so prompts 1-2 stay in a valid trace."""
    import moeflow.stages.trace as run_mod
    import moeflow.trace.writer as wmod

    real_one, real_shard = run_mod.trace_one, wmod.write_shard
    calls = []

    def one(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_one(*a, **k)

    def shard_then_signal(*a, **k):
        info = real_shard(*a, **k)
        os.kill(os.getpid(), signal.SIGINT)
        return info

    monkeypatch.setattr(run_mod, "trace_one", one)
    monkeypatch.setattr(wmod, "write_shard", shard_then_signal)
    out = tmp_path / "tr"
    ps = prompts("alpha", "beta", "gamma", "delta")
    with pytest.raises(KeyboardInterrupt):
        run_trace(tiny_models("olmoe"), tok, ps, cfg(out, batch_size=1))  # one prompt per generate
    assert Trace(out).prompt_ids == [ps[0].id, ps[1].id]
    monkeypatch.setattr(run_mod, "trace_one", real_one)
    monkeypatch.setattr(wmod, "write_shard", real_shard)
    r = run_trace(tiny_models("olmoe"), tok, ps, cfg(out))
    assert r["prompts_skipped"] == 2 and Trace(out).prompt_ids == [p.id for p in ps]


def test_signals_deferred_delivers_after_the_block():
    from moeflow.trace.writer import signals_deferred

    got = []
    old = signal.signal(signal.SIGTERM, lambda n, f: got.append(n))
    try:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            inside = list(got)
        assert inside == [] and got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


_HOOKED_CLI = textwrap.dedent("""
    import sys
    from moeflow.trace.writer import TraceWriter
    add = TraceWriter.add
    def counted(self, pid, rows):
        add(self, pid, rows)
        print("added", self.added_prompts + len(self._buf), flush=True)
    TraceWriter.add = counted
    from moeflow.cli.app import main
    main(sys.argv[1:])
""")


def test_sigterm_during_trace_keeps_finished_prompts(checkpoint, tiny_models, tok, tmp_path):
    """`moeflow trace` in a subprocess, SIGTERM after 3 prompts were added (all still buffered: one big
    shard): the trace holds them, verifies, and a rerun appends the rest, equal to an uninterrupted run."""
    texts = [f"prompt number {i} about things" for i in range(40)]
    pfile = tmp_path / "p.txt"
    pfile.write_text("\n".join(texts) + "\n")
    out = tmp_path / "tr"
    argv = [
        "trace",
        "--model",
        str(checkpoint),
        "--prompts",
        str(pfile),
        "--out",
        str(out),
        "--max-new-tokens",
        "4",
        "--threads",
        "1",
        "--batch-size",
        "1",  # prompts added one at a time, as they finish
        "--no-progress",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("MOEFLOW_DEBUG", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOOKED_CLI, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        for line in proc.stdout:
            if line.strip() == "added 3":
                proc.send_signal(signal.SIGTERM)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (130, 143), err
    assert "Traceback" not in err and err.strip().splitlines()[-1].endswith(("terminated", "interrupted"))
    t = Trace(out)  # verifies every shard
    n = len(t.prompt_ids)
    assert 3 <= n < len(texts)
    assert t.prompt_ids == [prompt_id(x) for x in texts[:n]]
    res = subprocess.run(
        [sys.executable, "-c", "import sys; from moeflow.cli.app import main; main(sys.argv[1:])", *argv, "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["prompts_skipped"] == n
    whole = tmp_path / "whole"
    run_trace(tiny_models("olmoe"), tok, prompts(*texts), cfg(whole, max_new_tokens=4, max_prompt_tokens=256))
    a, b = Trace(out), Trace(whole)
    assert a.prompt_ids == b.prompt_ids
    for f in ("prompt_id", "position", "token_id"):
        assert a.tokens()[f].tolist() == b.tokens()[f].tolist()
    assert (a.layer(0)["topk_ids"] == b.layer(0)["topk_ids"]).all()


# ---- item 8 / 4: prompt files --------------------------------------------------------------------


def test_truthfulqa_csv_and_case_insensitive_columns(tmp_path):
    f = tmp_path / "TruthfulQA.csv"
    f.write_text(
        "Type,Category,Question,Best Answer,Source\n"
        'Adversarial,Misconceptions,What happens if you eat watermelon seeds?,Nothing,"https://x, y"\n'
        "Adversarial,Fiction,Where did fortune cookies originate?,San Francisco,https://z\n"
    )
    assert [p.text for p in load_prompts(str(f))] == [
        "What happens if you eat watermelon seeds?",
        "Where did fortune cookies originate?",
    ]
    assert [p.text for p in load_prompts(str(f), column="best answer")] == ["Nothing", "San Francisco"]
    g = tmp_path / "p.tsv"
    g.write_text("ID\tPrompt\n1\tWrite a poem.\n2\tName a river.\n")
    assert [p.text for p in load_prompts(str(g))] == ["Write a poem.", "Name a river."]
    assert [p.text for p in load_prompts(str(g), column="id")] == ["1", "2"]
    h = tmp_path / "p.jsonl"
    h.write_text('{"Instruction": "Sort these", "Input": "b a"}\n{"INPUT": "only input"}\n')
    assert [p.text for p in load_prompts(str(h))] == ["Sort these\n\nb a", "only input"]
    j = tmp_path / "p.json"
    j.write_text(json.dumps([{"Text": "a doc", "Question": "why?"}]))
    assert [p.text for p in load_prompts(str(j), column="QUESTION")] == ["why?"]
    with pytest.raises(ConfigError, match=r"--column 'answer' is not a field of .*its fields: Type, Category, Question"):
        load_prompts(str(f), column="answer")
    k = tmp_path / "odd.csv"
    k.write_text("Foo,Bar\n1,2\n")
    with pytest.raises(MoeflowError, match=r"none of its fields \(Foo, Bar\) is a prompt field.*--column"):
        load_prompts(str(k))


def test_column_flag_reaches_the_trace(checkpoint, tmp_path, capsys):
    f = tmp_path / "q.csv"
    f.write_text("Question,Answer\nWhat is up?,sky\nWho am I?,you\n")
    out = tmp_path / "tr"
    code, _ = _cli(
        [
            "trace",
            "--model",
            str(checkpoint),
            "--prompts",
            str(f),
            "--out",
            str(out),
            "--column",
            "ANSWER",
            "--max-new-tokens",
            "2",
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0
    t = Trace(out)
    assert t.prompt_ids == [prompt_id("sky"), prompt_id("you")]
    assert t.meta["sources"] == [{"source": str(f), "split": None, "column": "ANSWER", "prompts": 2}]


def test_binary_or_empty_prompt_file_gives_one_line(checkpoint, tmp_path, capsys):
    b = tmp_path / "prompts.json"
    b.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(MoeflowError, match="is not a UTF-8 text/JSON prompt file"):
        load_prompts(str(b))
    c = tmp_path / "bad.csv"
    c.write_bytes(b"Question\n\xff\xfe\xfa\n")
    with pytest.raises(MoeflowError, match="is not a UTF-8 text/CSV prompt file"):
        load_prompts(str(c))
    code, err = _cli(["trace", "--model", str(checkpoint), "--prompts", str(b), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "prompts.json is not a UTF-8 text/JSON prompt file" in err and err.count("\n") == 0
    e = tmp_path / "empty.csv"
    e.write_text("")
    code, err = _cli(["trace", "--model", str(checkpoint), "--prompts", str(e), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "empty.csv: the file is empty" in err and err.count("\n") == 0
    assert not (tmp_path / "o").exists()


# ---- item 4: damaged checkpoints -----------------------------------------------------------------


def test_damaged_checkpoint_gives_one_artifact_line(checkpoint, tmp_path, capsys):
    import shutil

    from moeflow.models import load_model

    d = tmp_path / "m"
    shutil.copytree(checkpoint, d)
    st = d / "model.safetensors"
    data = st.read_bytes()
    for damaged, msg in [
        (data[: len(data) // 2], "truncated"),
        (data[:5], "truncated"),
        (data[:8] + b"{oops" + data[13:], "corrupt"),
    ]:
        st.write_bytes(damaged)
        with pytest.raises(ArtifactError, match=f"model.safetensors is {msg}"):
            load_model(d)
    (tmp_path / "p.txt").write_text("hello\n")
    code, err = _cli(["trace", "--model", str(d), "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "model.safetensors is corrupt" in err and err.count("\n") == 0
    st.write_bytes(data)
    (d / "config.json").unlink()
    with pytest.raises(ArtifactError, match=r"config\.json is missing"):
        load_model(d)


def test_a_cpu_load_beyond_the_hosts_memory_gives_one_line_before_loading(checkpoint, tmp_path, capsys, monkeypatch):
    """A checkpoint whose weights alone exceed the host's memory and swap is refused before a byte loads (the kernel
    would kill the process part way, with no message); a bf16 checkpoint loaded in float32 is told its own dtype."""
    import copy

    import moeflow.models as mm

    bf16 = tmp_path / "bf16"
    copy.deepcopy(mm.load_model(checkpoint, dtype="float32")[0]).to(torch.bfloat16).save_pretrained(bf16)
    own = mm.weights_bytes(bf16)
    assert own is not None and mm.loaded_bytes(bf16, "float32", "cpu") == 2 * own
    assert mm.loaded_bytes(bf16, "checkpoint", "cpu") == own
    monkeypatch.setattr(mm, "host_available", lambda: own + own // 2)  # its own size fits, twice it does not
    with pytest.raises(ConfigError, match=r"GB once loaded in float32, and this host has .* own dtype"):
        mm.load_model(bf16, dtype="float32")
    mm.load_model(bf16, dtype="checkpoint", tokenizer=False)  # fits: loads
    mm.load_routing_model(bf16)  # train's and simulate's load: the experts stay bf16
    mm.check_host_memory(bf16, "auto", "cuda")  # a CUDA load reads its own dtype (bf16) on the host first: fits
    monkeypatch.setattr(mm, "host_available", lambda: own // 2)
    with pytest.raises(ConfigError, match=r"GB once loaded in its own dtype, .*larger host$"):
        mm.check_host_memory(bf16, "auto", "cuda")
    (tmp_path / "p.txt").write_text("hello\n")
    capsys.readouterr()  # save_pretrained's progress
    argv = ["trace", "--model", str(checkpoint), "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "o")]
    code, err = _cli(argv, capsys)
    assert code == 2 and "this host has" in err and err.count("\n") == 0
    assert not (tmp_path / "o").exists()
    monkeypatch.setattr(mm, "host_available", lambda: None)  # unknown (no /proc/meminfo): no refusal
    mm.load_model(checkpoint, dtype="float32", tokenizer=False)


# ---- item 5: lengths beyond the model's positions ------------------------------------------------


def test_check_lengths():
    from moeflow.models import check_lengths, tiny_config

    c = tiny_config("olmoe")  # max_position_embeddings 256
    check_lengths(c, 250, 6)
    check_lengths({"max_position_embeddings": 10}, 4, 6)
    with pytest.raises(
        ConfigError,
        match=r"250 tokens \+ 7 new tokens = 257 positions, beyond the model's maximum "
        r"of 256.*--max-prompt-tokens to 249",
    ):
        check_lengths(c, 250, 7)
    with pytest.raises(ConfigError, match="--max-prompt-tokens 300 is beyond the model's maximum position 256"):
        check_lengths(c, 300, 0)


def test_trace_refuses_prompts_beyond_max_positions(tiny_models, tok, tmp_path):
    model = tiny_models("olmoe")  # max_position_embeddings 256
    out = tmp_path / "tr"
    with pytest.raises(ConfigError, match="--max-prompt-tokens 300 is beyond the model's maximum position 256"):
        run_trace(model, tok, prompts("short"), cfg(out, max_prompt_tokens=300))
    long_text = "x" * 250  # 250 byte tokens (+ no special tokens)
    with pytest.raises(ConfigError, match="maximum of 256"):
        run_trace(model, tok, prompts("short", long_text), cfg(out, max_prompt_tokens=256, max_new_tokens=8))
    assert not out.exists()  # refused before any work
    r = run_trace(model, tok, prompts("short", long_text), cfg(out, max_prompt_tokens=248, max_new_tokens=8))
    assert r["prompts_added"] == 2


def test_trace_out_inside_an_input_is_refused_but_a_killed_first_run_is_resumed(checkpoint, tmp_path, capsys):
    p = tmp_path / "p.txt"
    p.write_text("hello there\ngeneral kenobi\n")
    code, err = _cli(["trace", "--model", str(checkpoint), "--prompts", str(p), "--out", str(checkpoint / "tr")], capsys)
    assert code == 2 and "inside the input" in err and not (checkpoint / "tr").exists()
    code, err = _cli(["trace", "--model", str(checkpoint), "--prompts", str(p), "--out", str(p)], capsys)
    assert code == 2 and err.count("\n") == 0 and p.read_text() == "hello there\ngeneral kenobi\n"
    # what a kill -9 between the first shard's rename and the first meta.json leaves: reused
    out = tmp_path / "tr"
    (out / "shard-00000").mkdir(parents=True)
    (out / "shard-00000" / "data.arrow").write_bytes(b"half")
    (out / ".lock").write_text("")
    code, err = _cli(
        ["trace", "--model", str(checkpoint), "--prompts", str(p), "--out", str(out), "--max-new-tokens", "2", "--no-progress"],
        capsys,
    )
    assert code == 0, err
    assert Trace(out).prompt_ids == [prompt_id("hello there"), prompt_id("general kenobi")]
