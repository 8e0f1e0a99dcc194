"""The documentation is generated where it can be, and checked where it cannot.

- docs/cli.md, the generated tables of docs/policies.md and docs/models.md, docs/results/*.md and the README's
  results table equal what `make docs` writes now (a stale file fails, naming the command that fixes it);
- every registered policy has its section in docs/policies.md;
- every `moeflow ...` command printed in README.md and docs/*.md names a command and flags that exist, and every
  `benchmarks/*.py` / `recipes/*.py` command flags that script accepts (with `--model` where it takes one);
- every recorded study names the model it measured; the README stays a front door; no issue numbers or
  "was: ..." history notes in code or docs.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from moeflow.cli import docs as cli_docs

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *(p for p in DOCS if p.name != "cli.md")]


def _render_results():
    spec = importlib.util.spec_from_file_location("render_results", REPO / "benchmarks" / "render_results.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["render_results"] = mod
    spec.loader.exec_module(mod)
    return mod


# ---- generated files ---------------------------------------------------------------------------------------------


def test_cli_md_is_current():
    committed = (REPO / "docs" / "cli.md").read_text() if (REPO / "docs" / "cli.md").exists() else ""
    assert committed == cli_docs.render(), cli_docs.STALE


def test_cli_md_lists_every_command_and_visible_flag():
    text = cli_docs.render()
    for name, flags in cli_docs.option_names().items():
        if name:
            assert f"## moeflow {name}\n" in text
        for flag in flags:
            assert f"`{flag}`" in text, f"{flag} of moeflow {name} is missing from docs/cli.md"


def test_cli_md_does_not_depend_on_the_environment(monkeypatch):
    """The default model is written as models/olmoe-deep whatever $MOEFLOW_MODEL says, paths relative to the checkout."""
    text = cli_docs.render()
    assert str(REPO) not in text
    assert "`models/olmoe-deep`" in text


def test_generated_blocks_are_current():
    for path, text in cli_docs.pages().items():
        assert path.exists() and path.read_text() == text, f"{path.relative_to(REPO)} is stale; run `make docs`"


def test_a_stale_block_is_caught(tmp_path):
    begin, end = cli_docs.BLOCK_BEGIN.format(name="policies"), cli_docs.BLOCK_END.format(name="policies")
    stale = f"intro\n{begin}\n| kind | name |\n{end}\noutro\n"
    fresh = cli_docs.fill_blocks(stale)
    assert fresh != stale and fresh.startswith("intro\n") and fresh.endswith("outro\n")
    assert "`least-stale`" in fresh and cli_docs.fill_blocks(fresh) == fresh


def test_results_pages_are_current():
    rr = _render_results()
    assert list((REPO / "benchmarks" / "results").glob("*.json")), "no recorded study"
    stale = rr.render_all(check=True)
    assert not stale, f"stale: {', '.join(stale)}; run `make docs`"


def test_a_changed_result_changes_its_page():
    rr = _render_results()
    doc = json.loads((REPO / "benchmarks" / "results" / "least-stale.json").read_text())
    page = rr.render(doc)
    doc["result"]["rows"][0]["collisions"] += 1000
    assert rr.render(doc) != page


def test_a_hand_note_on_the_environment_shows_on_the_page():
    """A result whose recorded commit needs a word (e.g. a device copy without the large models) says it."""
    rr = _render_results()
    doc = json.loads((REPO / "benchmarks" / "results" / "least-stale.json").read_text())
    doc["environment"]["git_note"] = "the tree sent lacked models/olmoe-deep"
    assert "Note: the tree sent lacked models/olmoe-deep." in rr.render(doc)


def test_a_fidelity_result_recommends_only_with_intervals():
    """The recommendation shows only when the attached rows carry Δppl intervals (the recorded result does)."""
    rr = _render_results()
    doc = json.loads((REPO / "benchmarks" / "results" / "fidelity.json").read_text())
    assert doc["result"]["recommended"], "the recorded fidelity result recommends nothing; pick another check"
    assert "Recommended (" in rr.render(doc) and "(recommended `" in rr.HEADLINES["fidelity"][1](doc)
    for table in doc["attached"].values():
        for r in table["rows"]:
            r.pop("dppl_ci95", None)
    assert "Recommended: none" in rr.render(doc) and "no recommendation" in rr.HEADLINES["fidelity"][1](doc)


def test_every_study_names_its_model_and_has_a_page():
    rr = _render_results()
    for path in sorted((REPO / "benchmarks" / "results").glob("*.json")):
        doc = json.loads(path.read_text())
        argv = shlex.split(doc["command"])
        assert "--model" in argv or "-m" in argv, f"{path.name}: its command must name --model"
        assert doc["study"] in rr.STUDIES, f"{path.name}: no renderer"
        assert (REPO / "docs" / "results" / f"{doc['study']}.md").exists()
    with pytest.raises(SystemExit, match="--model"):
        rr.check_command([".venv/bin/python", "benchmarks/least_stale.py", "--prompts", "20"])


# ---- hand-written pages ------------------------------------------------------------------------------------------


def test_every_policy_has_a_section():
    from moeflow.policies import EVICTION, MISS, PREFETCH, ROUTING

    text = (REPO / "docs" / "policies.md").read_text()
    missing = [
        f"{reg.kind} {name}" for reg in (EVICTION, PREFETCH, MISS, ROUTING) for name in reg if f"### `{name}`\n" not in text
    ]
    assert not missing, f"docs/policies.md has no section for: {', '.join(missing)}"


def test_policy_table_labels_what_run_labels_lossy():
    """The generated table's output column says what `moeflow run` says of each policy with its default options
    (`moeflow.policies.lossy`), on a CPU device and on another one."""
    from moeflow.cli.docs import policy_table
    from moeflow.policies import EVICTION, MISS, PREFETCH, ROUTING
    from moeflow.policies.lossy import lossy

    rows = {}
    for line in policy_table().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[(cells[0], cells[1].split("`")[1])] = cells[-1]
    for reg in (EVICTION, PREFETCH):
        assert all(rows[(reg.kind, n)] == "exact (timing only)" for n in reg)
    for reg, kw in ((MISS, "miss"), (ROUTING, "routing")):
        for name in reg:
            p = reg.create(name)
            on_cpu, elsewhere = (lossy(device_type=d, **{kw: p}).lossy for d in ("cpu", "cuda"))
            want = "LOSSY" if on_cpu else "exact on CPU, LOSSY on other devices" if elsewhere else "exact"
            assert rows[(reg.kind, name)] == want, (reg.kind, name, rows[(reg.kind, name)])
    assert rows[("miss", "drop")] == "LOSSY" and rows[("miss", "fetch")] == "exact"
    assert rows[("miss", "cpu")].startswith("exact on CPU")


def test_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for needed in ("make setup", "make test", "<!-- install -->", "docs/cli.md", "docs/results/"):
        assert needed in text


def _commands(text: str) -> list[str]:
    """Command lines in fenced code blocks (backslash continuations joined, comments dropped) and inline code spans."""
    out: list[str] = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            out.append(re.split(r"\s#\s", line, maxsplit=1)[0])
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    out += re.findall(r"`([^`\n]+)`", prose)
    return out


MOEFLOW = re.compile(r"(?:^|[\s/])moeflow\s+([a-z][a-z-]*)(.*)")
SCRIPT = re.compile(r"(?:^|[\s/])((?:benchmarks|recipes)/[a-z_]+\.py)(.*)")
STOP = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}


def _tokens(rest: str) -> list[str]:
    out = []
    for tok in rest.split():
        if tok in STOP or tok == "--":
            break
        out.append(tok.strip("[]"))
    return out


def bad_moeflow_flags(text: str, known: dict[str, set[str]]) -> list[str]:
    bad = []
    for line in _commands(text):
        for m in MOEFLOW.finditer(line):
            sub, rest = m.group(1), m.group(2)
            if sub not in known:
                bad.append(f"unknown command `moeflow {sub}` in: {line.strip()}")
                continue
            for tok in _tokens(rest):
                flag = tok.split("=", 1)[0]
                if re.fullmatch(r"--[a-z][a-z0-9-]*|-[A-Za-z]", flag) and flag not in known[sub]:
                    bad.append(f"`moeflow {sub}` has no {flag}: {line.strip()}")
    return bad


def bad_script_flags(text: str) -> list[str]:
    bad = []
    for line in _commands(text):
        for m in SCRIPT.finditer(line):
            script, rest = REPO / m.group(1), m.group(2)
            if not script.exists():
                bad.append(f"no such script {m.group(1)}: {line.strip()}")
                continue
            source = script.read_text()
            flags = [t.split("=", 1)[0] for t in _tokens(rest) if t.startswith("--")]
            for flag in flags:
                if not re.search(r"add_argument\(\s*(\"-\w\",\s*)?\"" + re.escape(flag) + '"', source):
                    bad.append(f"{m.group(1)} has no {flag}: {line.strip()}")
            takes_model = re.search(r"add_argument\(\s*\"--model\"", source)
            if takes_model and rest.strip() and not {"--model", "--shape", "--help", "--make-model"} & set(flags):
                bad.append(f"{m.group(1)} without --model (say which model): {line.strip()}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_printed_commands_use_flags_that_exist(page):
    known = cli_docs.option_names()
    text = page.read_text()
    bad = bad_moeflow_flags(text, known) + bad_script_flags(text)
    assert not bad, "\n".join(bad)


def test_the_command_check_catches_mistakes():
    known = cli_docs.option_names()
    assert bad_moeflow_flags("```bash\nmoeflow run --prompts gsm8k --no-such-flag\n```", known)
    assert bad_moeflow_flags("`moeflow frobnicate --json`", known)
    assert bad_moeflow_flags("```\nmoeflow run -c 25% \\\n    --plan-update\n```", known)
    assert bad_moeflow_flags("`moeflow simulate --max-prompts 3`", known), "hidden old spellings are not documented"
    assert not bad_moeflow_flags("```\nmoeflow run -c 25% -e lru  # --not-checked in a comment\n```", known)
    assert bad_script_flags("```\n.venv/bin/python benchmarks/least_stale.py --prompts 20\n```")  # no --model
    assert bad_script_flags("`python benchmarks/least_stale.py --model M --no-such-flag`")
    assert not bad_script_flags("`python benchmarks/least_stale.py --model models/olmoe-mini --prompts 20`")


# ---- no history in code or docs ----------------------------------------------------------------------------------

HISTORY = re.compile(r"\bissue[- ]?#?\d|\bIssue \d|\bwas: |\(was ", re.I)


def test_no_issue_numbers_or_was_notes():
    roots = [REPO / d for d in ("moeflow", "tests", "benchmarks", "recipes", "docs")]
    files = [REPO / "README.md", *(p for r in roots for p in r.rglob("*") if p.suffix in (".py", ".md"))]
    hits = [
        f"{p.relative_to(REPO)}:{i}: {line.strip()}"
        for p in files
        if p.name != Path(__file__).name
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not hits, "history belongs in CHANGELOG.md:\n" + "\n".join(hits)
