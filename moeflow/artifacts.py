"""Artifact folders: meta.json, fingerprints, atomic writes, cross-stage checks.

Every artifact folder (trace, predictors, calibration) holds a `meta.json` with
`schema`, `kind`, `moeflow_version`, `model_fingerprint`, `created_at` and stage-specific fields.
Folders are written into a temporary sibling and renamed into place, so a crashed or concurrent
job never leaves a half-written artifact where a later stage will read it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator

from . import __version__
from .errors import ArtifactError

META = "meta.json"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def config_fingerprint(config: Any, extra: bytes = b"") -> str:
    """A stable 16-hex-digit hash of a transformers config (minus run-time switches) and `extra`.

    `moeflow.moe.model_fingerprint` passes the router weights as `extra`, so two checkpoints
    with the same shapes but different training get different fingerprints.
    """
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    keep = {k: v for k, v in sorted(d.items()) if not k.startswith("_") and k not in {
        "transformers_version", "torch_dtype", "dtype", "experts_implementation", "attn_implementation",
        "use_cache", "output_router_logits", "return_dict", "architectures_hint",
    }}
    blob = json.dumps(keep, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob + extra).hexdigest()[:16]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temp file beside `path`; on success it is renamed to `path` (0644 less the umask).

    On an exception the temp file is removed and `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON to `path` via a temp file in the same folder and `os.replace`."""
    with atomic_write(path) as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, *, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; on success rename it to `final`.

    On an exception the temporary folder is removed and `final` is untouched. With
    `replace=True` an existing `final` is swapped out (old copy removed after the rename).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        if final.exists():
            if not replace:
                raise ArtifactError(f"{final} already exists; remove it or choose another --out")
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def new_meta(kind: str, schema: int, fingerprint: str, **fields: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "schema": schema,
        "moeflow_version": __version__,
        "model_fingerprint": fingerprint,
        "created_at": now_iso(),
        **fields,
    }


def read_record(path: str | os.PathLike, kind: str, schema: int) -> dict[str, Any]:
    """Read a JSON record (a `meta.json`, a calibration file) and check its kind and schema.

    Raises ArtifactError with a fix-it line for a missing file, invalid JSON, another kind or schema.
    """
    p = Path(path)
    if not p.is_file():
        raise ArtifactError(f"no moeflow {kind} at {p}; run `moeflow {kind}` first")
    try:
        rec = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{p} is corrupt (not valid JSON: {e}); delete it and re-run `moeflow {kind}`") from e
    got = rec.get("kind") if isinstance(rec, dict) else None
    if got != kind:
        raise ArtifactError(f"{p} is not a moeflow {kind} (it holds kind {got!r})")
    if rec.get("schema") != schema:
        raise ArtifactError(
            f"{p} has {kind} schema {rec.get('schema')}, this moeflow reads schema {schema}; re-run `moeflow {kind}`")
    return rec


def read_meta(folder: str | os.PathLike, kind: str, schema: int) -> dict[str, Any]:
    """Read and check `folder/meta.json` (see `read_record`)."""
    folder = Path(folder)
    if not folder.exists():
        raise ArtifactError(f"{folder} does not exist; create it first (see `moeflow {kind} --help`)")
    if not (folder / META).is_file():
        raise ArtifactError(f"{folder} is not a moeflow {kind} artifact (no {META}); point to the folder `moeflow {kind}` wrote")
    return read_record(folder / META, kind, schema)


def check_fingerprint(meta: dict[str, Any], fingerprint: str, what: str, folder: str | os.PathLike) -> None:
    got = meta.get("model_fingerprint")
    if got != fingerprint:
        raise ArtifactError(
            f"{what} at {folder} was made for another model (fingerprint {got}, this model is {fingerprint}); "
            f"re-create it with this --model")
