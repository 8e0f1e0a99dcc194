"""The training corpus of the embedded models: public text from the shared data folder.

Sources (`SOURCES`): war_and_peace, tinyshakespeare, botchan, wikitext2, wiki_demo, c4_demo (text
field), gsm8k train (question + answer) and mt_bench (questions + GPT-4 reference answers). Alpaca
and ShareGPT are deliberately excluded: they are the workloads the models are traced on.

Every source becomes a list of documents of about `chunk_chars` characters: paragraphs (split at
blank lines) are packed together; text without blank lines is packed line by line, and a line
longer than a chunk is cut at whitespace. About `val_fraction` of each source's documents (every
n-th, at a fixed offset) is held out for validation, so the split is deterministic.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

CHUNK_CHARS = 4096


@dataclass
class Corpus:
    train: dict[str, list[str]] = field(default_factory=dict)  # source -> documents
    val: dict[str, list[str]] = field(default_factory=dict)

    def train_docs(self) -> list[str]:
        return [d for docs in self.train.values() for d in docs]

    def val_docs(self) -> list[str]:
        return [d for docs in self.val.values() for d in docs]

    def chars(self) -> dict[str, tuple[int, int]]:
        """source -> (train characters, validation characters)."""
        return {s: (sum(map(len, self.train[s])), sum(map(len, self.val.get(s, [])))) for s in self.train}


def _units(text: str) -> list[str]:
    """Paragraphs if the text has blank lines, else lines; stripped, empty ones dropped."""
    if re.search(r"\n[ \t]*\n", text):
        parts = re.split(r"\n[ \t]*\n", text)
    else:
        parts = text.split("\n")
    return [p.strip() for p in parts if p.strip()]


def _cut(unit: str, size: int) -> list[str]:
    """Cut a unit longer than `size` at whitespace."""
    out = []
    while len(unit) > size:
        cut = unit.rfind(" ", size // 2, size)
        cut = size if cut < 0 else cut
        out.append(unit[:cut].strip())
        unit = unit[cut:].strip()
    if unit:
        out.append(unit)
    return out


def pack(units: Iterable[str], size: int = CHUNK_CHARS, sep: str = "\n\n") -> list[str]:
    """Pack text units into documents of at most ~`size` characters (longer units are cut)."""
    docs: list[str] = []
    cur: list[str] = []
    n = 0
    for u in units:
        for piece in _cut(u, size):
            if cur and n + len(piece) > size:
                docs.append(sep.join(cur))
                cur, n = [], 0
            cur.append(piece)
            n += len(piece) + len(sep)
    if cur:
        docs.append(sep.join(cur))
    return docs


def _text_file(*rel: str, sep: str = "\n\n") -> Callable[[Path], list[str]]:
    def load(root: Path) -> list[str]:
        docs = []
        for r in rel:
            text = (root / r).read_text(encoding="utf-8", errors="replace")
            has_par = bool(re.search(r"\n[ \t]*\n", text))
            docs += pack(_units(text), sep="\n\n" if has_par else "\n")
        return docs

    return load


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _c4(root: Path) -> list[str]:
    return pack((r["text"] for r in _jsonl(root / "c4_demo" / "c4_demo.jsonl")), sep="\n\n")


def _gsm8k(root: Path) -> list[str]:
    rows = _jsonl(root / "gsm8k" / "train.jsonl")
    return pack((f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows), sep="\n\n")


def _mt_bench(root: Path) -> list[str]:
    units = [t for r in _jsonl(root / "mt_bench" / "question.jsonl") for t in r["turns"]]
    ref = root / "mt_bench" / "reference_answer" / "gpt-4.jsonl"
    if ref.is_file():
        units += [t for r in _jsonl(ref) for c in r.get("choices", []) for t in c.get("turns", [])]
    return pack(units, sep="\n\n")


SOURCES: dict[str, Callable[[Path], list[str]]] = {
    "war_and_peace": _text_file("war_and_peace/war_and_peace.txt"),
    "tinyshakespeare": _text_file("tinyshakespeare/input.txt"),
    "botchan": _text_file("botchan/botchan.txt"),
    "wikitext2": _text_file("wikitext2/valid.txt", "wikitext2/test.txt"),
    "wiki_demo": _text_file("wiki_demo/wiki_demo.txt"),
    "c4_demo": _c4,
    "gsm8k": _gsm8k,
    "mt_bench": _mt_bench,
}


def split(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic hold-out: every n-th document (n = round(1/val_fraction)), at least one."""
    if val_fraction <= 0 or len(docs) < 2:
        return docs, []
    n = max(2, round(1 / val_fraction))
    offset = n // 2 if len(docs) > n // 2 else 0
    val_idx = set(range(offset, len(docs), n))
    return [d for i, d in enumerate(docs) if i not in val_idx], [d for i, d in enumerate(docs) if i in val_idx]


def load_corpus(data_dir: str | Path, *, sources: Iterable[str] | None = None, val_fraction: float = 0.02) -> Corpus:
    """Read the named sources (default: all of `SOURCES`) from `data_dir` and split them."""
    root = Path(data_dir)
    if not root.is_dir():
        raise ConfigError(f"data folder {root} does not exist; pass --data-dir the shared data folder (../shared/data)")
    names = list(sources) if sources is not None else list(SOURCES)
    corpus = Corpus()
    for name in names:
        if name not in SOURCES:
            raise ConfigError(f"unknown corpus source {name!r}; use some of {', '.join(SOURCES)}")
        try:
            docs = SOURCES[name](root)
        except FileNotFoundError as e:
            raise ConfigError(f"corpus source {name} is missing in {root}: {e.filename}") from e
        corpus.train[name], corpus.val[name] = split(docs, val_fraction)
    return corpus
