"""`moeflow --help`, `--version` and a flag error answer without importing torch, transformers, scikit-learn or
numba: the policy names in the help come from the torch-free list `moeflow.registry.BUILTIN`, which must hold
exactly the classes the registries get once `moeflow.policies` is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "sklearn", "numba")
ARGVS = (["--help"], ["run", "--help"], ["simulate", "--help"], ["--version"], ["run", "--bogus"])

# In a fresh interpreter: run each command line through the CLI's entry point, then say which heavy packages
# it left in sys.modules (cumulative, so the first line that loads one is the culprit).
PROBE = """
import contextlib, io, json, sys
from moeflow.cli.app import main
out = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code
    out.append({"argv": argv, "code": code, "heavy": [m for m in json.loads(sys.argv[2]) if m in sys.modules]})
print(json.dumps(out))
"""


def test_help_version_and_flag_errors_import_no_heavy_library():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(ARGVS), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert [row["code"] for row in rows] == [0, 0, 0, 0, 2]  # the help, the version, then "no such option"
    assert [(row["argv"], row["heavy"]) for row in rows] == [(list(a), []) for a in ARGVS]


def test_the_light_name_list_is_the_registries():
    from moeflow.policies import EVICTION, MISS, PREFETCH, ROUTING
    from moeflow.registry import BUILTIN, LEARNED_PREFETCH

    regs = {"eviction": EVICTION, "prefetch": PREFETCH, "miss": MISS, "routing": ROUTING}
    assert set(BUILTIN) == set(regs)
    for kind, reg in regs.items():
        real = {n: f"{c.__module__}:{c.__qualname__}" for n, c in reg.items() if c.__module__.startswith("moeflow.")}
        assert BUILTIN[kind] == real, kind
    learned = {
        n
        for n, c in PREFETCH.items()
        if c.__module__.startswith("moeflow.")
        and (getattr(c, "needs_model", False) or getattr(c, "needs_residual", False) or getattr(c, "predictor", ""))
    }
    assert LEARNED_PREFETCH == learned


def test_a_builtin_policy_missing_from_the_list_is_refused_at_registration():
    from moeflow.registry import Registry

    class Unlisted:
        name = "unlisted"

    Unlisted.__module__ = "moeflow.policies.eviction"
    with pytest.raises(ValueError, match=r"not in moeflow\.registry\.BUILTIN\['eviction'\]"):
        Registry("eviction").register(Unlisted)

    class Plugin:  # a class from outside moeflow (a test, a plugin) needs no entry
        name = "plugin"

    assert Registry("eviction").register(Plugin) is Plugin


@pytest.mark.parametrize("module", ["moeflow", "moeflow.cli.app"])
def test_python_dash_m_finds_the_commands(module):
    """`python -m moeflow` and `python -m moeflow.cli.app` both know `run` (the second runs the file as `__main__`,
    a second copy of the module whose app has no commands unless it hands over to `moeflow.cli.app`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-m", module, "run", "--help"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "moeflow run" in r.stdout
