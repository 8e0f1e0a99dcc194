"""Prompt loaders: every format on small temp files, the short names on the real shared data."""

from __future__ import annotations

import hashlib
import json

import pytest

from moeflow.data import PROMPT_SETS, data_dir, load_prompts, prompt_id
from moeflow.errors import ConfigError, MoeflowError


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def texts(source, **kw):
    return [p.text for p in load_prompts(str(source), **kw)]


# ---- formats (temp files) ------------------------------------------------------------------------


def test_sharegpt_json(tmp_path):
    f = write(
        tmp_path / "sg.json",
        json.dumps(
            [
                {"id": "a", "conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello"}]},
                {"id": "b", "conversations": [{"from": "gpt", "value": "only a reply"}]},
                {"id": "c", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "Second"}]},
            ]
        ),
    )
    assert texts(f) == ["Hi there", "Second"]


def test_alpaca_json_and_jsonl(tmp_path):
    f = write(
        tmp_path / "a.json",
        json.dumps(
            [{"instruction": "Add", "input": "2 and 3", "output": "5"}, {"instruction": "Say hi", "input": "", "output": "hi"}]
        ),
    )
    assert texts(f) == ["Add\n\n2 and 3", "Say hi"]
    g = write(tmp_path / "a.jsonl", json.dumps({"instruction": "Translate", "instances": [{"input": "dog"}]}) + "\n")
    assert texts(g) == ["Translate\n\ndog"]


def test_gsm8k_mtbench_wmt_generic_jsonl(tmp_path):
    assert texts(write(tmp_path / "g.jsonl", '{"question": "1+1?", "answer": "2"}\n\n{"question": "2+2?"}\n')) == ["1+1?", "2+2?"]
    assert texts(write(tmp_path / "m.jsonl", '{"question_id": 1, "turns": ["first", "second"]}\n')) == ["first"]
    assert texts(write(tmp_path / "w.json", '{"translation": {"en": "Hello", "ro": "Salut"}}\n')) == ["Hello"]
    assert texts(write(tmp_path / "t.jsonl", '{"text": "a doc"}\n{"prompt": "a prompt"}\n{"other": 1}\n')) == [
        "a doc",
        "a prompt",
    ]


def test_mmlu_csv_and_folder(tmp_path):
    head = "question,choice0,choice1,choice2,choice3,answer\n"
    write(tmp_path / "a_test.csv", head + 'Q1?,x,"y, z",w,v,0\nQ2?,1,2,3,4,1\n')
    write(tmp_path / "b_test.csv", head + "R1?,p,q,r,s,2\n")
    assert texts(tmp_path / "a_test.csv") == ["Q1?\nA. x\nB. y, z\nC. w\nD. v", "Q2?\nA. 1\nB. 2\nC. 3\nD. 4"]
    # a folder is interleaved one question per subject
    assert [t.split("\n")[0] for t in texts(tmp_path)] == ["Q1?", "R1?", "Q2?"]


def test_glue_tsv_with_and_without_header(tmp_path):
    assert texts(write(tmp_path / "sst.tsv", 'sentence\tlabel\ngood film \t1\nbad "film\t0\n')) == ["good film ", 'bad "film']
    assert texts(write(tmp_path / "rte.tsv", "index\tsentence1\tsentence2\tlabel\n0\tA man runs.\tA man moves.\tent\n")) == [
        "A man runs.\nA man moves."
    ]
    # header-less CoLA (source, label, mark, sentence) and RTE val (index, s1, s2, label)
    assert texts(write(tmp_path / "cola.tsv", "gj04\t1\t\tThe cat sat.\ngj04\t0\t*\tCat the sat.\n")) == [
        "The cat sat.",
        "Cat the sat.",
    ]
    assert texts(write(tmp_path / "val.tsv", "2\tIt rained all day.\tIt was wet.\tentailment\n")) == [
        "It rained all day.\nIt was wet."
    ]
    mrpc = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tOne thing.\tThe same thing.\n"
    assert texts(write(tmp_path / "msr.txt", mrpc)) == ["One thing.\nThe same thing."]


def test_txt_dedup_limit_and_ids(tmp_path):
    f = write(tmp_path / "p.txt", "first line\n\n  \nsecond line\nfirst line\nthird\n")
    ps = load_prompts(str(f))
    assert [p.text for p in ps] == ["first line", "second line", "third"]
    assert ps[0].id == hashlib.sha1(b"first line").hexdigest()[:16] == prompt_id("first line")
    assert ps[0].source == str(f)
    assert texts(f, limit=2) == ["first line", "second line"]


def test_errors_are_one_line(tmp_path, monkeypatch):
    empty = write(tmp_path / "empty.jsonl", "")
    with pytest.raises(MoeflowError, match="no prompts found in .*empty.jsonl"):
        load_prompts(str(empty))
    with pytest.raises(MoeflowError, match="no prompts"):
        load_prompts(str(write(tmp_path / "x.json", '[{"nothing": 1}]')))
    with pytest.raises(MoeflowError, match="line 2 is not valid JSON"):
        load_prompts(str(write(tmp_path / "bad.jsonl", '{"text": "a"}\n{oops\n')))
    with pytest.raises(ConfigError, match="unknown prompt set 'nosuch'; known: sharegpt, alpaca"):
        load_prompts("nosuch")
    with pytest.raises(MoeflowError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.txt"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(MoeflowError, match="offline") as e:
        load_prompts("someone/some_dataset")
    assert "\n" not in str(e.value)


def test_data_dir_precedence(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "mt_bench").mkdir(parents=True)
        write(d / "mt_bench" / "question.jsonl", json.dumps({"turns": [f"from {d.name}"]}) + "\n")
    monkeypatch.setenv("MOEFLOW_DATA", str(b))
    assert data_dir() == b
    assert texts("mt_bench") == ["from b"]
    assert texts("mt_bench", data_dir=str(a)) == ["from a"]
    with pytest.raises(MoeflowError, match="data-dir"):
        data_dir(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no split 'dev'"):
        load_prompts("mt_bench", split="dev")


# ---- the real shared data ------------------------------------------------------------------------

EXPECTED = {  # name -> (number of distinct prompts in the default split, start of the first prompt)
    "sharegpt": (995, "a. A blog is a type of website"),
    "alpaca": (985, "Describe a process of making crepes."),
    "gsm8k": (660, "Janet’s ducks lay 16 eggs per day."),
    "mmlu": (2842, "Find the degree for the given field extension"),
    "sst2": (872, "it 's a charming and often affecting journey ."),
    "cola": (1039, "The sailors rode the breeze clear of the rocks."),
    "rte": (277, "Dana Reeve, the widow of the actor Christopher Reeve"),
    "wnli": (71, "The drain is clogged with hair. It has to be cleaned.\nThe hair has to be cleaned."),
    "mrpc": (1725, "PCCW's chief operating officer"),
    "mt_bench": (80, "Compose an engaging travel blog post about a recent trip to Hawaii"),
    "wmt16": (20, "UN Chief Says There Is No Military Solution in Syria"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_short_names_on_shared_data(shared_data, name):
    ps = load_prompts(name, data_dir=shared_data)
    n, start = EXPECTED[name]
    assert len(ps) == n
    assert ps[0].text.startswith(start)
    assert len({p.id for p in ps}) == len(ps)


def test_shared_data_details(shared_data):
    assert set(EXPECTED) == set(PROMPT_SETS)
    mmlu = load_prompts("mmlu", data_dir=shared_data, limit=57)
    assert all(p.text.count("\nA. ") == 1 and "\nD. " in p.text for p in mmlu)
    import csv

    firsts = [
        next(csv.DictReader(open(f, newline="", encoding="utf-8")))["question"]
        for f in sorted((shared_data / "mmlu" / "test").glob("*.csv"))
    ]
    assert len(firsts) == 57 and [p.text.split("\nA. ")[0] for p in mmlu] == firsts  # one per subject first
    assert len(load_prompts("gsm8k", data_dir=shared_data, split="train")) == 7473
    rte_val = load_prompts("rte", data_dir=shared_data, split="val")  # header-less file
    assert len(rte_val) == 363 and all(p.text.count("\n") >= 1 for p in rte_val)
    cola = load_prompts("cola", data_dir=shared_data, split="val", limit=3)
    assert [p.text for p in cola] == [
        "Bill broke the bathtub.",
        "The knee replacement candidate groaned up the stairs.",
        "The car honked down the road.",
    ]


def test_hf_dataset_name_autodetects_field(monkeypatch):
    import datasets

    seen = {}

    def fake_load(name, split=None):
        seen.update(name=name, split=split)
        return [
            {"id": 1, "question": "What is 2+2?", "answer": "4"},
            {"id": 2, "question": ""},
            {"id": 3, "question": "Name a colour."},
        ]

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    ps = load_prompts("someone/qa", split="test")
    assert [p.text for p in ps] == ["What is 2+2?", "Name a colour."] and ps[0].source == "someone/qa"
    assert seen == {"name": "someone/qa", "split": "test"}

    def failing(name, split=None):
        raise ConnectionError("Couldn't reach 'someone/qa' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setattr(datasets, "load_dataset", failing)
    with pytest.raises(MoeflowError, match="cannot load Hugging Face dataset 'someone/qa'") as e:
        load_prompts("someone/qa")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", [5, None, 2.5])
def test_a_prompt_field_that_holds_no_text_says_so(tmp_path, value):
    """`{"prompt": 5}`: the field is there, so "not a field" (with --column) and "none of its fields is a prompt
    field" (without) both contradicted the file; the message says what the field holds."""
    from moeflow.data.prompts import read_texts

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": value}) + "\n")
    for column in (None, "prompt"):
        with pytest.raises(ConfigError, match=r"its field 'prompt' holds no text .*a prompt is a string"):
            list(read_texts(f, column))
