"""Every paper number a reproduction recipe quotes occurs in that paper's text.

A recipe (recipes/reproduce/<paper>.py) keeps the paper's published numbers in module constants named `PAPER_*`,
transcribed from `../shared/papers/<paper>.txt`; its tables and notes read them from there (moeflow/ quotes none).
This test walks every `PAPER_*` constant (numbers, and the numbers inside quoted strings such as "2.6-8.6x") and
looks each one up in the paper's text as the paper prints it: 30.84 as "30.84" or "30.840", 0.72 as "0.72" or
".72", a fraction also as a percent ("0.966" as "96.6%", "0.09" as "9-14%"), 6e-7 as "6 \\times 10^{-7}".
Thousands separators are ignored, and the few table cells the text extraction garbled are listed in OCR_ERRATA
(which is itself checked against the text).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recipes.reproduce import PAPERS

REPO = Path(__file__).resolve().parent.parent
PAPERS_DIR = REPO.parent / "shared" / "papers"

# (paper, value) -> the text the extraction made of that table cell (a digit run or a lost decimal point)
OCR_ERRATA: dict[tuple[str, float], str] = {
    ("speculating-experts", 0.942): "0.94210006",  # "0.942 ± 0.006" with the ± read as 1
    ("speculating-experts", 0.955): "095540006",  # "0.955 ± 0.006", decimal point lost
}


def _text(paper: str) -> str:
    path = PAPERS_DIR / f"{paper}.txt"
    if not PAPERS_DIR.is_dir():
        pytest.skip(f"the papers folder {PAPERS_DIR} is absent (it sits beside the checkout as ../shared/papers)")
    text = path.read_text()
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)  # 3,076.8 -> 3076.8
    return re.sub(r"(?<=\d)[~'‘’`](?=\d)", ".", text)  # OCR'd decimal points: 0~950 -> 0.950


def _decimals(v: float) -> list[str]:
    """v written with 0..4 decimals wherever that is exact, with and without a leading zero."""
    out = []
    for d in range(5):
        s = f"{v:.{d}f}"
        if abs(float(s) - v) < 1e-9 * max(1.0, abs(v)):
            out.append(s)
            if s.startswith("0."):
                out.append(s[1:])
    return out


def patterns(x: float) -> list[str]:
    """Regexes of the ways a paper prints x."""
    num = r"(?<![\d.]){}(?![\d])"
    pats = [num.format(re.escape(s)) for s in _decimals(x)]
    if 0 < abs(x) < 1:  # a fraction, printed as a percent (alone or as one end of a range)
        rng = r"(?:\s*[-–]\s*\d+(?:\.\d+)?)?\s*\\?%"
        pats += [num.format(re.escape(s)) + rng for s in _decimals(100 * x)]
        pats += [r"\d+(?:\.\d+)?\s*[-–]\s*" + re.escape(s) + r"\s*\\?%" for s in _decimals(100 * x)]
    if 0 < abs(x) < 1e-3:  # 6e-7 as 6 \times 10^{-7}
        mant, exp = f"{x:e}".split("e")
        m = mant.rstrip("0").rstrip(".")
        pats += [re.escape(m) + r"\s*\\times\s*10\^\{?" + str(int(exp)) + r"\}?", re.escape(f"{m}e{int(exp)}")]
    return pats


def numbers(value: Any) -> Iterator[float]:
    """Every number in a constant: values of dicts, items of sequences, the numbers written inside strings."""
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from numbers(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from numbers(v)
    elif isinstance(value, str):
        for m in re.findall(r"\d+(?:\.\d+)?", value):
            yield float(m) if "." in m else int(m)


def quoted(module: Any) -> dict[str, Any]:
    """The recipe's paper constants: module attributes named PAPER_*."""
    return {name: getattr(module, name) for name in dir(module) if name.startswith("PAPER_")}


def ranges(value: Any) -> Iterator[tuple[str, str]]:
    """The ranges written inside a constant's strings: "2.6-8.6x" -> ("2.6", "8.6")."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from ranges(v)
    elif isinstance(value, str):
        yield from re.findall(r"(?<![\d.])(\d+(?:\.\d+)?)\s*[-–]\s*(\d+(?:\.\d+)?)", value)


def missing(paper: str, constants: dict[str, Any]) -> list[str]:
    text = _text(paper)
    bad = []
    for name, value in constants.items():
        for x in numbers(value):
            erratum = OCR_ERRATA.get((paper, x))
            if erratum is not None and erratum in text:
                continue
            if not any(re.search(p, text) for p in patterns(x)):
                bad.append(f"{name}: {x!r}")
        for lo, hi in ranges(value):  # a quoted range must be a range in the text, not two numbers anywhere
            unit = r"\s*(?:\\?%|\\times|×|x)?\s*"
            if not re.search(r"(?<![\d.])" + re.escape(lo) + unit + "[-–]" + r"\s*" + re.escape(hi) + r"(?![\d])", text):
                bad.append(f"{name}: {lo}-{hi}")
    return bad


@pytest.mark.parametrize("paper", sorted(PAPERS))
def test_every_paper_number_occurs_in_the_paper(paper):
    constants = quoted(importlib.import_module(PAPERS[paper]))
    assert constants, f"recipes/reproduce for {paper} quotes no PAPER_* constants"
    bad = missing(paper, constants)
    assert not bad, f"not in ../shared/papers/{paper}.txt: " + ", ".join(bad)


def test_ocr_errata_occur_in_the_text():
    for (paper, _), garbled in OCR_ERRATA.items():
        assert garbled in _text(paper)


def test_an_altered_number_is_caught():
    assert not missing("expertflow", {"PAPER_TABLE2": {"DeepSeek": (63.44, 26.43, 37.01)}})
    assert missing("expertflow", {"PAPER_TABLE2": {"DeepSeek": (63.45, 26.43, 37.01)}})
    assert not missing("casmoe", {"PAPER_QUALITY_KEPT": 0.966, "PAPER_EAP_LR": 6e-7})
    assert missing("casmoe", {"PAPER_QUALITY_KEPT": 0.967})
    assert missing("casmoe", {"PAPER_EAP_LR": 7e-7})
    assert not missing("specmd", {"PAPER_FIG4_LS_FEWER": {"LRU": "2.6-8.6x"}})
    assert missing("specmd", {"PAPER_FIG4_LS_FEWER": {"LRU": "2.7-8.6x"}})
    assert missing("speculating-experts", {"PAPER_T1": {"Qwen3-30B-A3B": {"baseline": (0.951, 0.817)}}})


def test_numbers_and_formats():
    assert list(numbers({"a": (1.5, "2.6-8.6x"), "b": [True, None, 3]})) == [1.5, 2.6, 8.6, 3]
    text = "the predictor reaches 30.840 here, .72 there, 96.6% kept, a 9-14% drop and 27,720 tokens"
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)
    for x in (30.84, 0.72, 0.966, 0.09, 0.14, 27720):
        assert any(re.search(p, text) for p in patterns(x)), x
    for x in (30.8, 0.7, 0.97, 0.1, 2772):
        assert not any(re.search(p, text) for p in patterns(x)), x


def test_moeflow_quotes_no_paper_numbers():
    """moeflow/ holds no PAPER_* constants and none of the recipes' precise paper numbers (3+ significant digits)."""
    sources = {p: p.read_text() for p in (REPO / "moeflow").rglob("*.py")}
    assert not [p for p, src in sources.items() if re.search(r"^PAPER_\w*\s*[:=]", src, re.M)]
    precise = {
        f"{x}"
        for mod in PAPERS.values()
        for value in quoted(importlib.import_module(mod)).values()
        for x in numbers(value)
        if isinstance(x, float) and len(f"{x}".replace(".", "").lstrip("0")) >= 3
    }
    hits = [
        f"{p.relative_to(REPO)}: {x}"
        for p, src in sources.items()
        for x in precise
        if re.search(r"(?<![\d.])" + re.escape(x) + r"(?!\d)", src)
    ]
    assert not hits, "paper numbers belong in recipes/reproduce/: " + ", ".join(hits)
