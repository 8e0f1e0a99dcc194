"""The layering contract (`[tool.importlinter]` in pyproject.toml, run by `make lint` as `lint-imports`): the CLI
above the stages above the libraries, `runtime` importing none of plan / predict / calibrate, and no import cycle
between modules anywhere in moeflow."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

# import-linter (and its grimp) is a dev dependency: a machine without it (a GPU box running `make gpu-check`,
# whose collection covers every test module) skips this module instead of failing to collect it
grimp = pytest.importorskip("grimp", reason="import-linter is not installed (pip install -e '.[dev]')")

REPO = Path(__file__).resolve().parents[1]


def contracts() -> list[dict]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def layers() -> list[grimp.Layer]:
    (spec,) = [c for c in contracts() if c["type"] == "layers"]
    return [grimp.Layer(*(m.strip() for m in layer.split("|")), independent=True) for layer in spec["layers"]]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("moeflow", cache_dir=None)


@contextlib.contextmanager
def injected(graph: grimp.ImportGraph, *edges: tuple[str, str]) -> Iterator[grimp.ImportGraph]:
    """`graph` with the imports `edges` (importer, imported) added, removed again on exit."""
    new = [(a, b) for a, b in edges if b not in graph.find_modules_directly_imported_by(a)]
    for a, b in new:
        graph.add_import(importer=a, imported=b)
    try:
        yield graph
    finally:
        for a, b in new:
            graph.remove_import(importer=a, imported=b)


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on.add(m)
        for w in graph.find_modules_directly_imported_by(m):
            if w not in index:
                visit(w)
                low[m] = min(low[m], low[w])
            elif w in on:
                low[m] = min(low[m], index[w])
        if low[m] == index[m]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == m:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return out


def test_lint_imports_keeps_every_contract():
    """`lint-imports` (what `make lint` runs) on this checkout: every contract kept, exit 0."""
    exe = Path(sys.executable).parent / "lint-imports"
    if not exe.exists():
        pytest.skip("import-linter is not installed in this environment (make setup installs it)")
    res = subprocess.run([str(exe), "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"Contracts: {len(contracts())} kept, 0 broken." in res.stdout


def test_the_layers_hold_and_an_upward_import_breaks_them(graph):
    """The same layers through grimp: none broken now; one library module importing a stage, the CLI or a package
    above it, directly or through another module, is reported with its route."""
    assert graph.find_illegal_dependencies_for_layers(layers()) == set()
    for importer, imported in [
        ("moeflow.runtime.engine", "moeflow.stages.run"),  # a library importing a stage
        ("moeflow.predict.train", "moeflow.cli.app"),  # ... the CLI
        ("moeflow.policies.learned", "moeflow.runtime.engine"),  # ... a package above it
    ]:
        with injected(graph, (importer, imported)) as g:
            (dep,) = g.find_illegal_dependencies_for_layers(layers())
            assert importer.startswith(dep.importer) and imported.startswith(dep.imported)
    # indirectly: runtime -> threads (outside the layers) -> calibrate; every library that imports threads (predict's
    # training rule does too) is then reported, each with calibrate as what it reaches
    with injected(graph, ("moeflow.runtime.generate", "moeflow.threads"), ("moeflow.threads", "moeflow.calibrate.io")) as g:
        found = {(d.importer, d.imported) for d in g.find_illegal_dependencies_for_layers(layers())}
        assert ("moeflow.runtime", "moeflow.calibrate") in found
        assert {imported for _, imported in found} == {"moeflow.calibrate"}
    assert graph.find_illegal_dependencies_for_layers(layers()) == set()


def test_runtime_imports_none_of_plan_predict_calibrate(graph):
    (spec,) = [c for c in contracts() if c["type"] == "forbidden"]
    assert spec["source_modules"] == ["moeflow.runtime"]
    for forbidden in spec["forbidden_modules"]:
        chain = graph.find_shortest_chains(importer="moeflow.runtime", imported=forbidden, as_packages=True)
        assert chain == set(), f"runtime reaches {forbidden}: {chain}"


def test_no_import_cycle_between_any_modules(graph):
    """No cycle between any two modules of moeflow, at any depth (the acyclic_siblings contract only compares
    siblings); an injected back edge is found."""
    assert cycles(graph) == []
    with injected(graph, ("moeflow.moe.layout", "moeflow.runtime.store")) as g:  # store imports moe.layout
        (cycle,) = cycles(g)
        assert {"moeflow.moe.layout", "moeflow.runtime.store"} <= set(cycle)
    assert cycles(graph) == []
