"""requirements.lock: every dependency pinned, every pin inside pyproject.toml's ranges, installed as locked."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _lock() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for raw in (ROOT / "requirements.lock").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, ver = line.partition("==")
        assert sep, f"requirements.lock: {line!r} is not an exact pin (name==version)"
        key = canonicalize_name(name)
        assert key not in pins, f"requirements.lock pins {name} twice"
        pins[key] = Version(ver)
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def test_every_declared_dependency_is_pinned_inside_its_range():
    pins = _lock()
    for req in _declared():
        key = canonicalize_name(req.name)
        assert key in pins, f"{req.name} is declared in pyproject.toml but not pinned in requirements.lock (run make lock)"
        assert req.specifier.contains(pins[key], prereleases=True), (
            f"requirements.lock pins {req.name}=={pins[key]}, outside pyproject.toml's {req.specifier}"
        )


def test_build_requirement_accepts_the_license_string():
    # An SPDX string in project.license needs setuptools >= 77 (older setuptools reject it; the table form is deprecated).
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(data["project"]["license"], str)
    build = [Requirement(r) for r in data["build-system"]["requires"]]
    st = next(r for r in build if canonicalize_name(r.name) == "setuptools")
    assert not st.specifier.contains("76.9")


def test_installed_versions_match_the_lock():
    """The environment the tests run in is the locked one (torch aside: `make setup TORCH=...` may replace it)."""
    pins = _lock()
    wrong = []
    for req in _declared():
        key = canonicalize_name(req.name)
        if key == "torch":
            continue
        try:
            got = Version(metadata.version(req.name))
        except metadata.PackageNotFoundError:
            pytest.fail(f"{req.name} is not installed; run make setup")
        if got != pins[key]:
            wrong.append(f"{req.name} {got} (lock: {pins[key]})")
    assert not wrong, "installed versions differ from requirements.lock: " + ", ".join(wrong) + "; run make setup"
