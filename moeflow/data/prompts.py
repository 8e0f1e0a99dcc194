"""Prompt sets for tracing: local files of the common benchmark formats, short names resolved
against the data directory, and Hugging Face dataset names (when online).

`load_prompts(source)` returns deduplicated `Prompt`s in file order. `source` is

- a local file or folder: ShareGPT json (`conversations`, first human turn), Alpaca json/jsonl
  (`instruction` + `input`), GSM8K jsonl (`question`), MMLU csv (question + lettered choices; a folder
  of csv files is interleaved subject by subject), GLUE tsv (`sentence`, or `sentence1` + `sentence2`;
  header-less CoLA/RTE/WNLI files too), MRPC (`#1 String` + `#2 String`), MT-Bench jsonl (first of
  `turns`), WMT16 jsonl (`translation.en`) or `.source`, plain `.txt` (one prompt per non-empty line),
  generic json/jsonl with a `text` / `prompt` field;
- a short name (`sharegpt`, `alpaca`, `gsm8k`, `mmlu`, `sst2`, `cola`, `rte`, `wnli`, `mrpc`,
  `mt_bench`, `wmt16`) resolved against the data directory (see `data_dir`);
- `owner/name` that is not a local path: a Hugging Face dataset, via `datasets.load_dataset`.

Field and column names are matched case-insensitively (a TruthfulQA-style csv with a `Question`
column works); `column="NAME"` (`--column NAME`) picks the prompt field of csv, tsv, json, jsonl
and dataset records explicitly.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MoeflowError


@dataclass(frozen=True)
class Prompt:
    id: str  # content hash of `text`: sha1, first 16 hex digits
    text: str
    source: str  # the file (or dataset name) it came from


def prompt_id(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


# short name -> (path under the data dir per split, default split)
PROMPT_SETS: dict[str, tuple[dict[str, str], str]] = {
    "sharegpt": ({"train": "sharegpt/ShareGPT_V3_filtered_1000.json"}, "train"),
    "alpaca": ({"train": "alpaca/alpaca_en_demo.json", "seed": "alpaca/seed_tasks.jsonl"}, "train"),
    "gsm8k": ({"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"}, "test"),
    "mmlu": ({"dev": "mmlu/dev", "test": "mmlu/test"}, "test"),
    "sst2": ({"train": "glue/sst2/train.tsv", "dev": "glue/sst2/dev.tsv", "test": "glue/sst2/test-labeled.tsv"}, "dev"),
    "cola": ({"train": "glue/cola/train.tsv", "dev": "glue/cola/dev.tsv", "val": "glue/cola/val.tsv"}, "dev"),
    "rte": ({"train": "glue/rte/train.tsv", "dev": "glue/rte/dev.tsv", "val": "glue/rte/val.tsv"}, "dev"),
    "wnli": ({"train": "glue/wnli/train.tsv", "dev": "glue/wnli/dev.tsv", "val": "glue/wnli/val.tsv"}, "dev"),
    "mrpc": ({"train": "glue/mrpc/msr_paraphrase_train.txt", "test": "glue/mrpc/msr_paraphrase_test.txt"}, "test"),
    "mt_bench": ({"test": "mt_bench/question.jsonl"}, "test"),
    "wmt16": ({"train": "wmt16_en_ro/train.json", "val": "wmt16_en_ro/val.json", "test": "wmt16_en_ro/test.json"}, "test"),
}


# ---- the data directory --------------------------------------------------------------------------


def data_dir(explicit: str | os.PathLike | None = None) -> Path:
    """`explicit` > `$MOEFLOW_DATA` > `../shared/data` beside the checkout > `./shared/data`, `../shared/data`."""
    if explicit:
        p = Path(explicit)
        if not p.is_dir():
            raise MoeflowError(f"--data-dir {explicit} is not a folder; point it to the shared data directory")
        return p
    env = os.environ.get("MOEFLOW_DATA")
    if env:
        if not Path(env).is_dir():
            raise MoeflowError(f"$MOEFLOW_DATA={env} is not a folder; fix it or pass --data-dir")
        return Path(env)
    repo = Path(__file__).resolve().parent.parent.parent
    for cand in (repo.parent / "shared" / "data", Path.cwd() / "shared" / "data", Path.cwd().parent / "shared" / "data"):
        if cand.is_dir():
            return cand
    raise MoeflowError(
        "no data directory found; pass --data-dir DIR or set MOEFLOW_DATA (the folder holding sharegpt/, gsm8k/, ...)"
    )


# ---- record -> text ------------------------------------------------------------------------------

_TEXT_KEYS = ("prompt", "question", "text", "query", "content", "sentence", "input")  # after the formats above
PROMPT_COLUMNS = ("prompt", "question", "instruction", "text", "input")  # named in messages


def _lower_keys(rec: dict[Any, Any]) -> dict[Any, Any]:
    """`rec` with string keys lower-cased (a key already in lower case wins over another spelling)."""
    if all(not isinstance(k, str) or k == k.lower() for k in rec):
        return rec
    out = {k: v for k, v in rec.items() if not isinstance(k, str) or k == k.lower()}
    for k, v in rec.items():
        if isinstance(k, str):
            out.setdefault(k.lower(), v)
    return out


def column_text(rec: Any, column: str) -> str | None:
    """The value of field `column` (matched case-insensitively) of a record, if it is a string."""
    if not isinstance(rec, dict):
        return None
    v = rec[column] if column in rec else _lower_keys(rec).get(column.lower())
    return v if isinstance(v, str) else None


def record_text(rec: Any, column: str | None = None) -> str | None:
    """The prompt text of one record of any supported format (None if it has none); with `column`,
    that field's value. Field names are matched case-insensitively."""
    if column is not None:
        return column_text(rec, column)
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        return None
    rec = _lower_keys(rec)
    conv = rec.get("conversations") or rec.get("messages")
    if isinstance(conv, list):  # ShareGPT / chat: first user turn
        for turn in conv:
            if isinstance(turn, dict) and turn.get("from", turn.get("role")) in ("human", "user"):
                return turn.get("value", turn.get("content"))
        return None
    if isinstance(rec.get("turns"), list) and rec["turns"]:  # MT-Bench
        return rec["turns"][0]
    if isinstance(rec.get("instruction"), str):  # Alpaca (+ seed tasks' instances)
        inp = rec.get("input") or ""
        if not inp and isinstance(rec.get("instances"), list) and rec["instances"]:
            inp = rec["instances"][0].get("input") or ""
        return f"{rec['instruction']}\n\n{inp}" if inp else rec["instruction"]
    if isinstance(rec.get("translation"), dict):  # WMT16
        tr = rec["translation"]
        return tr.get("en") or next(iter(tr.values()), None)
    if "sentence1" in rec and "sentence2" in rec:  # GLUE pairs
        return f"{rec['sentence1']}\n{rec['sentence2']}"
    if "#1 string" in rec and "#2 string" in rec:  # MRPC
        return f"{rec['#1 string']}\n{rec['#2 string']}"
    if isinstance(rec.get("question"), str) and "choice0" in rec:  # MMLU
        return _mmlu_text(rec)
    if isinstance(rec.get("question"), str) and isinstance(rec.get("choices"), list):
        return rec["question"] + "".join(f"\n{'ABCDEFGH'[i]}. {c}" for i, c in enumerate(rec["choices"][:8]))
    for k in _TEXT_KEYS:
        if isinstance(rec.get(k), str):
            return rec[k]
    return None


def _mmlu_text(rec: dict[str, str]) -> str:
    choices = [rec[f"choice{i}"] for i in range(8) if rec.get(f"choice{i}") not in (None, "")]
    return rec["question"] + "".join(f"\n{'ABCDEFGH'[i]}. {c}" for i, c in enumerate(choices))


# ---- file formats --------------------------------------------------------------------------------


def _not_text(path: Path) -> MoeflowError:
    kind = "JSON" if path.suffix.lower() in (".json", ".jsonl") else path.suffix.lstrip(".").upper() or "text"
    return MoeflowError(
        f"{path} is not a UTF-8 text/{kind} prompt file (it looks binary); pass a json, jsonl, csv, tsv or txt prompt file"
    )


def _text(path: Path, strict: bool = True) -> str:
    """The file's text (BOM removed); a file with NUL bytes, or (strict) invalid UTF-8, is refused."""
    data = path.read_bytes()
    if b"\x00" in data[: 1 << 16]:
        raise _not_text(path)
    try:
        return data.decode("utf-8-sig", errors="strict" if strict else "replace")
    except UnicodeDecodeError:
        raise _not_text(path) from None


def _read_json(path: Path) -> Iterator[Any]:
    raw = _text(path)
    stripped = raw.lstrip()
    if not stripped:
        return
    if stripped[0] == "[":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise MoeflowError(f"{path} is not valid JSON ({e.msg}, line {e.lineno}); fix or replace the file") from e
        yield from data
        return
    if stripped[0] == "{":
        try:  # one JSON object holding a list (e.g. {"data": [...]})
            obj = json.loads(raw)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            lists = [v for v in obj.values() if isinstance(v, list)]
            yield from (lists[0] if lists and record_text(obj) is None else [obj])
            return
    yield from _read_jsonl(path, raw)


def _read_jsonl(path: Path, raw: str | None = None) -> Iterator[Any]:
    raw = _text(path) if raw is None else raw
    for n, line in enumerate(raw.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise MoeflowError(f"{path} line {n} is not valid JSON ({e.msg}); fix or remove that line") from e


def _read_csv(path: Path) -> Iterator[dict[str, str]]:
    yield from csv.DictReader(io.StringIO(_text(path), newline=""))


_TSV_HEADER_KEYS = {
    "sentence",
    "sentence1",
    "sentence2",
    "#1 string",
    "#2 string",
    "text",
    "question",
    "prompt",
    "instruction",
    "input",
    "query",
    "content",
}


def _read_tsv(path: Path, column: str | None = None) -> Iterator[Any]:
    """GLUE-style TSV: a header naming the text columns (records), or none (CoLA, RTE/WNLI val): then
    the columns whose first row contains a space are the text."""
    rows = list(csv.reader(io.StringIO(_text(path), newline=""), delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        return
    head = rows[0]
    if column is not None or _TSV_HEADER_KEYS & {h.lower() for h in head}:
        for r in rows[1:]:
            yield dict(zip(head, r, strict=False))  # short rows: the missing fields are absent
        return
    cols = [i for i, v in enumerate(head) if " " in v.strip()]
    for r in rows:
        parts = [r[i] for i in cols if i < len(r) and r[i].strip()]
        if parts:
            yield "\n".join(parts)


def _mmlu_folder(path: Path) -> Iterator[str]:
    """All csv files of a folder, interleaved one question per subject, so `--limit` gives a mix."""
    per_file = [[_mmlu_text(r) for r in _read_csv(p) if r.get("question")] for p in sorted(path.glob("*.csv"))]
    for i in range(max((len(x) for x in per_file), default=0)):
        for rows in per_file:
            if i < len(rows):
                yield rows[i]


def _texts_of(records: Iterable[Any], column: str | None, where: str) -> Iterator[str]:
    """The prompt texts of `records`; a `column` no record has, or records without any known prompt
    field, raise one line naming the fields there are."""
    fields: list[str] = []
    first: dict[str, Any] = {}  # the first record's values (what a field that holds no text holds)
    found = False
    for rec in records:
        if isinstance(rec, dict) and not fields:
            fields, first = [str(k) for k in rec], {str(k): v for k, v in rec.items()}
        t = record_text(rec, column)
        if t is not None:
            found = True
        if t:
            yield t
    if not found and fields:
        named = [column] if column is not None else [c for c in PROMPT_COLUMNS if c in fields]
        if named and named[0] in fields:  # the field is there, but not as text (a number, null, a list)
            raise ConfigError(
                f"no prompts found in {where}: its field {named[0]!r} holds no text (the first record's: "
                f"{repr(first.get(named[0]))[:40]}); a prompt is a string"
                + ("" if column is not None else "; or pass --column NAME")
            )
        if column is not None:
            raise ConfigError(f"--column {column!r} is not a field of {where}; its fields: {', '.join(fields)}")
        raise MoeflowError(
            f"no prompts found in {where}: none of its fields ({', '.join(fields)}) is a prompt "
            f"field ({', '.join(PROMPT_COLUMNS)}); pass --column NAME"
        )


def read_texts(path: Path, column: str | None = None) -> Iterator[str]:
    """Prompt texts of a local file (or an MMLU-style folder of csv files), in file order."""
    if path.is_dir():
        if not any(path.glob("*.csv")):
            raise MoeflowError(f"{path} is a folder without .csv files; pass a prompt file")
        if column is not None:
            raise ConfigError(f"--column applies to one csv, tsv, json or jsonl file, not the folder {path}")
        yield from _mmlu_folder(path)
        return
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        yield from _texts_of(_read_json(path), column, str(path))
    elif suffix == ".csv":
        yield from _texts_of(_read_csv(path), column, str(path))
    elif suffix == ".tsv" or (suffix == ".txt" and _looks_tsv(path)):
        yield from _texts_of(_read_tsv(path, column), column, str(path))
    elif column is not None:
        raise ConfigError(f"--column applies to csv, tsv, json and jsonl prompt files, not {path.name} (one prompt per line)")
    else:  # .txt, .source and anything else: one prompt per non-empty line
        for line in _text(path, strict=False).splitlines():
            if line.strip():
                yield line


def _looks_tsv(path: Path) -> bool:
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        first = f.readline()
    return "\t" in first and bool(_TSV_HEADER_KEYS & {h.lower() for h in first.rstrip("\n").split("\t")})


# ---- Hugging Face datasets -----------------------------------------------------------------------


def _hf_texts(name: str, split: str | None, column: str | None = None) -> Iterator[str]:
    if os.environ.get("HF_DATASETS_OFFLINE", "") not in ("", "0") or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise MoeflowError(
            f"{name!r} is not a local file and Hugging Face datasets are offline (HF_DATASETS_OFFLINE); "
            f"pass a local prompt file or a known set name"
        )
    try:
        import datasets

        ds = datasets.load_dataset(name, split=split or "train")
    except MoeflowError:
        raise
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MoeflowError(
            f"cannot load Hugging Face dataset {name!r} (split {split or 'train'}): {msg[:200]}; pass a local prompt file instead"
        ) from e
    yield from _texts_of(ds, column, f"Hugging Face dataset {name!r}")


# ---- the entry point -----------------------------------------------------------------------------


def resolve_source(source: str, data_dir_: str | os.PathLike | None = None, split: str | None = None) -> Path | None:
    """The local path `source` names (a path, or a short name under the data dir); None for an HF name."""
    p = Path(source).expanduser()
    if p.exists():
        return p
    if source in PROMPT_SETS:
        splits, default = PROMPT_SETS[source]
        sp = split or default
        if sp not in splits:
            raise ConfigError(f"prompt set {source!r} has no split {sp!r}; use one of {', '.join(splits)}")
        q = data_dir(data_dir_) / splits[sp]
        if not q.exists():
            raise MoeflowError(f"prompt set {source!r} expects {q}, which does not exist; pass --data-dir")
        return q
    if "/" in source and not source.startswith((".", "/", "~")) and not p.suffix:
        return None
    if "/" in source or p.suffix:
        raise MoeflowError(f"prompt file {source} does not exist")
    raise ConfigError(
        f"unknown prompt set {source!r}; known: {', '.join(PROMPT_SETS)} "
        f"(or pass a file path, or a Hugging Face dataset name owner/name)"
    )


def load_prompts(
    source: str | os.PathLike,
    data_dir: str | os.PathLike | None = None,
    limit: int | None = None,
    split: str | None = None,
    column: str | None = None,
) -> list[Prompt]:
    """Deduplicated prompts of `source` (a path, a short set name or an HF dataset name), at most `limit`;
    `column` names the prompt field of csv/tsv/json/jsonl/dataset records (default: detected)."""
    src = str(source)
    if column is not None and not column.strip():
        raise ConfigError("--column must name a field (got an empty name)")
    path = resolve_source(src, data_dir, split)
    if path is not None and path.is_file() and path.stat().st_size == 0:
        raise MoeflowError(f"no prompts found in {path}: the file is empty; pass a prompt file with at least one prompt")
    texts = read_texts(path, column) if path is not None else _hf_texts(src, split, column)
    origin = str(path) if path is not None else src
    out: list[Prompt] = []
    seen: set[str] = set()
    for t in texts:
        if not isinstance(t, str) or not t.strip():
            continue
        pid = prompt_id(t)
        if pid in seen:
            continue
        seen.add(pid)
        out.append(Prompt(pid, t, origin))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise MoeflowError(f"no prompts found in {origin}; check the file format (see `moeflow trace --help`)")
    return out
