"""The run configuration file `moeflow tune --out FILE` writes and `moeflow run --config FILE` applies.

One JSON object: `kind` "run-config", `schema`, the model it was tuned for (`model`, `model_fingerprint`), the
`moeflow run` options (`options`: capacity, eviction, prefetch, lookahead, adaptive_s, miss, link, calibration;
a null lookahead leaves S to the calibration) and what tune predicted for them (`tuned`). Written atomically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..artifacts import new_meta, noun, write_json_atomic
from ..errors import ArtifactError

KIND = "run-config"
SCHEMA = 1
OPTIONS = ("capacity", "eviction", "prefetch", "lookahead", "adaptive_s", "miss", "link", "calibration")


def run_config(model: str, fingerprint: str, options: dict[str, Any], tuned: dict[str, Any]) -> dict[str, Any]:
    """The record: `options` must hold every key of OPTIONS."""
    missing = [k for k in OPTIONS if k not in options]
    if missing:
        raise ValueError(f"run configuration lacks {missing}")
    return new_meta(KIND, SCHEMA, fingerprint, model=model, options={k: options[k] for k in OPTIONS}, tuned=tuned)


def write_run_config(path: str | os.PathLike, record: dict[str, Any]) -> Path:
    p = Path(path)
    write_json_atomic(p, record)
    return p


def read_run_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a run configuration (kind, schema, the option keys); ArtifactError with one line otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ArtifactError(f"no run configuration at {p}; write one with `moeflow tune --out {p}` or drop --config")
    try:
        rec = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(
            f"{p} is not valid JSON ({e}); write a new one with `moeflow tune --out NEW.json` "
            "(tune never replaces a file that is not a run configuration)"
        ) from e
    if not isinstance(rec, dict) or rec.get("kind") != KIND:
        got = rec.get("kind") if isinstance(rec, dict) else None
        raise ArtifactError(
            f"{p} is not a run configuration (it holds {f'a moeflow {noun(got)}' if got else 'no moeflow kind'}); "
            f"pass the file `moeflow tune --out` wrote"
        )
    if rec.get("schema") != SCHEMA:
        raise ArtifactError(f"{p} has run-config schema {rec.get('schema')}, this moeflow reads {SCHEMA}; re-run `moeflow tune`")
    opts = rec.get("options")
    if not isinstance(opts, dict) or any(k not in opts for k in OPTIONS) or not rec.get("model_fingerprint"):
        raise ArtifactError(f"{p} lacks the options or model of a run configuration; re-run `moeflow tune --out {p} --force`")
    unknown = sorted(k for k in opts if k not in OPTIONS)
    if unknown:
        raise ArtifactError(
            f"{p}: unknown option {', '.join(map(repr, unknown))} (a run configuration holds {', '.join(OPTIONS)}); "
            f"fix the file or re-run `moeflow tune --out {p} --force`"
        )
    for key, v in opts.items():
        fits, want = _CHECKS[key]
        if not fits(v):
            raise ArtifactError(
                f"{p}: option {key!r} must be {want}, got {v!r}; fix the file or re-run `moeflow tune --out {p} --force`"
            )
    return rec


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _text(v: Any) -> bool:
    return v is None or isinstance(v, str)


# what each option may hold (null: the flag's default; for lookahead and calibration, the calibration's)
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "capacity": (lambda v: _text(v) or _int(v), 'a capacity (96, "25%", "1GiB") or null'),
    "eviction": (_text, "a policy string or null"),
    "prefetch": (_text, "a policy string or null"),
    "lookahead": (lambda v: v is None or (_int(v) and v >= 1), "an integer >= 1 or null"),
    "adaptive_s": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "miss": (_text, "a policy string or null"),
    "link": (_text, "a link string or null"),
    "calibration": (_text, "a file path or null"),
}
