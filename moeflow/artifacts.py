"""Artifact folders: meta.json, fingerprints, atomic writes, cross-stage checks (the `--out` checks: `moeflow.outputs`).

Every artifact folder (trace, predictors, calibration) holds a `meta.json` with
`schema`, `kind`, `moeflow_version`, `model_fingerprint`, `created_at` and stage-specific fields.

- `moeflow.outputs.check_out` validates every `--out` before any work: it never lets a stage replace an input or
  anything that is not a moeflow artifact of the same kind, replaces one of that kind only with --force,
  and refuses a folder it cannot write in (a probe file is created and removed where the writes will go).
  Each stage then holds `moeflow.locks.out_lock` on its target until the artifact is published.
- `atomic_dir` publishes a folder with one `os.replace` of a symlink (`<out>` -> `.<out>.versions/v-...`),
  `atomic_write` a file with one `os.replace` of an fsynced temp file: a kill -9 at any instant leaves
  the old artifact or the new one, complete.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from . import __version__
from .errors import ArtifactError

META = "meta.json"


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def config_fingerprint(config: Any, extra: bytes = b"") -> str:
    """A stable 16-hex-digit hash of a transformers config (minus run-time switches) and `extra`.

    `moeflow.moe.model_fingerprint` passes the router weights as `extra`, so two checkpoints
    with the same shapes but different training get different fingerprints.
    """
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    keep = {
        k: v
        for k, v in sorted(d.items())
        if not k.startswith("_")
        and k
        not in {
            "transformers_version",
            "torch_dtype",
            "dtype",
            "experts_implementation",
            "attn_implementation",
            "use_cache",
            "output_router_logits",
            "return_dict",
            "architectures_hint",
        }
    }
    blob = json.dumps(keep, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob + extra).hexdigest()[:16]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temp file beside `path`; on success it is fsynced and renamed to `path` (0644 less the umask).

    On an exception the temp file is removed and `path` is untouched; a kill leaves the old file or the new one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON to `path` via a temp file in the same folder and `os.replace`."""
    with atomic_write(path) as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


# -- atomic folders -------------------------------------------------------------------------------
#
#   <parent>/<name>                    -> .<name>.versions/v-<ns>-<pid>   (a relative symlink)
#   <parent>/.<name>.versions/v-...    complete versions: the current one and the previous one
#   <parent>/.<name>.versions/tmp-...  a writer's folder in progress
#   <parent>/.<name>.link-<pid>-<ns>   a new symlink about to be `os.replace`d onto <name>
#
# The only step that changes what <name> shows is one `os.replace` of a symlink, so a kill at any
# instant leaves the old artifact or the new one. Each write removes what dead writers left behind
# and every version but the current and the previous one (a reader that resolved the old link keeps
# working until the next write).


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_tree(root: Path) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(Path(d))


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _writer_pid(name: str) -> int | None:
    """The writer pid in `tmp-<ns>-<pid>`, `v-<ns>-<pid>[-legacy]`, `.<x>.link-<pid>-<ns>`."""
    m = re.search(r"(?:^(?:tmp|v)-\d+-(\d+))|(?:\.link-(\d+)-\d+$)", name)
    if not m:
        return None
    return int(m.group(1) or m.group(2))


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    else:
        shutil.rmtree(p, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _versions(final: Path) -> Path:
    return final.parent / f".{final.name}.versions"


def _clean(final: Path, keep: set[str]) -> None:
    """Remove dead writers' leftovers and every version of `final` not in `keep` (by name)."""
    vroot = _versions(final)
    me = os.getpid()
    for p in list(vroot.iterdir()) if vroot.is_dir() else []:
        pid = _writer_pid(p.name)
        if p.name in keep or pid is None:
            continue
        if p.name.startswith("tmp-") and (pid == me or _pid_alive(pid)):
            continue  # a live writer's folder in progress
        if p.name.startswith("v-") and pid != me and _pid_alive(pid):
            continue  # a live writer may be about to link it
        _remove(p)
    for p in final.parent.glob(f".{glob.escape(final.name)}.link-*"):
        pid = _writer_pid(p.name)
        if pid is not None and pid != me and not _pid_alive(pid):
            _remove(p)


@contextlib.contextmanager
def atomic_dir(
    final: str | os.PathLike, *, replace: bool = True, versioned: bool = True, keep_versions: int = 2
) -> Iterator[Path]:
    """Yield an empty folder to fill; on success it becomes `final` in one atomic step.

    `final` is a relative symlink to `.<name>.versions/v-<ns>-<pid>/` beside it, switched with one
    `os.replace`: a kill -9 at any instant leaves the old artifact or the new one, complete. On an
    exception the new folder is removed and `final` is untouched. The previous version is kept (a
    reader that resolved it keeps working), older ones and dead writers' leftovers are removed.

    A real folder at `final` (written by moeflow < 0.2) is swapped for the link with an atomic
    exchange (Linux `renameat2`); where that is unsupported it is first renamed into the versions
    folder, a one-time step during which a kill leaves `final` missing and the old copy in
    `.<name>.versions/`. `replace=False` refuses an existing `final`. `versioned=False` makes a plain
    folder with one rename; an existing `final` is then moved aside first (not atomic; for folders
    nothing points to yet, like trace shards). `keep_versions` (>= 2) keeps that many newest complete
    versions instead of two (`moeflow retrain`'s `keep`).
    """
    final = Path(os.path.abspath(final))
    present = final.exists() or final.is_symlink()
    if present and not replace:
        raise ArtifactError(f"{final} already exists; remove it or choose another --out")
    if final.exists() and not final.is_dir():
        raise ArtifactError(f"{final} is a file, not a folder; choose another --out")
    made = _mkdirs(final.parent)
    if not versioned:
        try:
            with _plain_dir(final) as plain:
                yield plain
        except BaseException:
            _rmdirs(made)
            raise
        return
    vroot = _versions(final)
    if not vroot.is_dir():
        vroot.mkdir()
        made.append(vroot)
    tmp: Path | None = None
    version: Path | None = None
    link: Path | None = None
    published = False
    try:
        _clean(final, keep=_keep_before(final) | _newest(final, keep_versions))  # free dead writers' space before writing
        stamp = f"{time.time_ns():020d}-{os.getpid()}"
        tmp = vroot / f"tmp-{stamp}"
        tmp.mkdir()
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        _fsync_tree(tmp)
        version = vroot / f"v-{stamp}"
        os.rename(tmp, version)
        _fsync_dir(vroot)
        old = _current(final)
        link = final.parent / f".{final.name}.link-{os.getpid()}-{time.time_ns()}"
        os.symlink(os.path.relpath(version, final.parent), link)
        keep = {version.name} | ({old} if old else set())
        if final.is_dir() and not final.is_symlink():  # legacy real folder
            legacy = vroot / f"v-{time.time_ns():020d}-{os.getpid()}-legacy"
            if _exchange(link, final):
                published = True
                os.rename(link, legacy)  # the old folder, now at `link`
            else:
                os.rename(final, legacy)  # one-time, not atomic (see docstring)
                try:
                    os.replace(link, final)
                except BaseException:
                    os.rename(legacy, final)  # put the old folder back
                    raise
                published = True
            keep.add(legacy.name)
        else:
            os.replace(link, final)
            published = True
        _fsync_dir(final.parent)
        if old is None:  # `final` was missing: keep the newest older copy
            keep |= _keep_before(final, exclude=version.name)
        _clean(final, keep | _newest(final, keep_versions))
    except BaseException:
        if not published:  # leave nothing of this write behind: its folder, version, link, new folders
            for p in (tmp, version, link):
                if p is not None and (p.exists() or p.is_symlink()):
                    _remove(p)
            _rmdirs(made)
        raise


def _mkdirs(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; the ones created, outermost first."""
    made: list[Path] = []
    for p in reversed([folder, *folder.parents]):
        if not p.exists():
            with contextlib.suppress(FileExistsError):
                p.mkdir()
                made.append(p)
    return made


def _rmdirs(made: list[Path]) -> None:
    """Remove the folders `_mkdirs` created, innermost first, where they are still empty."""
    for d in reversed(made):
        with contextlib.suppress(OSError):
            d.rmdir()


def _keep_before(final: Path, exclude: str = "") -> set[str]:
    """Versions to keep: the one `final` links to and the newest other complete one (not `exclude`)."""
    cur = _current(final)
    vroot = _versions(final)
    names = (
        sorted(p.name for p in vroot.iterdir() if p.name.startswith("v-") and p.name not in (exclude, cur))
        if vroot.is_dir()
        else []
    )
    return ({cur} if cur else set()) | set(names[-1:])


def _newest(final: Path, n: int) -> set[str]:
    """The `n` newest complete versions of `final` by name (none beyond the two always kept when n <= 2)."""
    vroot = _versions(final)
    if n <= 2 or not vroot.is_dir():
        return set()
    return set(sorted(p.name for p in vroot.iterdir() if p.name.startswith("v-"))[-n:])


def _current(final: Path) -> str | None:
    """The version name `final` links to (None for a missing path, a real folder or a foreign link)."""
    if not final.is_symlink():
        return None
    target = Path(os.readlink(final))
    if target.parent.name == _versions(final).name:
        return target.name
    return None


@contextlib.contextmanager
def _plain_dir(final: Path) -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        _fsync_tree(tmp)
        if final.exists() or final.is_symlink():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            _remove(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
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


COMMANDS = {"calibration": "calibrate", "predictors": "train"}  # artifact kind -> the command that writes it


def command_for(kind: str) -> str:
    """The `moeflow` command that writes artifacts of `kind` (`calibration` -> `calibrate`)."""
    return COMMANDS.get(kind, kind)


# artifact kind -> what messages call one, where the kind itself does not read as a noun ("a moeflow predictors")
NOUNS = {
    "predictors": "predictor folder",
    "run": "run results file (`moeflow run --out`)",
    "quality": "quality results file (`moeflow quality --out`)",
    "run-config": "run configuration (`moeflow tune --out`)",
    "plot": "plot (`tune`, `gps --plot`)",
}


def noun(kind: str, what: str = "") -> str:
    """`kind` as messages name it: "predictor folder", "trace" (+ " folder" with `what`)."""
    return NOUNS.get(kind) or f"{kind} {what}".strip()


def made_with(meta: dict[str, Any]) -> str | None:
    """The --model an artifact was made with, when its meta records it (`model`, or a stage's `config.model`)."""
    cfg = meta.get("config")
    m = meta.get("model") or (cfg.get("model") if isinstance(cfg, dict) else None)
    return str(m) if m else None


def another_model(what: str, meta: dict[str, Any], fingerprint: str, fix: str, against: str = "this --model") -> ArtifactError:
    """The one line for an artifact made with another model than this --model (or `against`, where the expected
    fingerprint comes from, e.g. "the trace's model"): names that model when recorded; `--model` is suggested only
    against this --model (the recorded one, else "the --model it was made with"), before `fix`."""
    by = made_with(meta)
    hint = (f"pass --model {by} or " if by else "pass the --model it was made with or ") if against == "this --model" else ""
    return ArtifactError(
        f"{what} was made for another model{f', {by}' if by else ''} (fingerprint {meta.get('model_fingerprint')}), "
        f"not {against} (fingerprint {fingerprint}); {hint}{fix}"
    )


def read_record(path: str | os.PathLike, kind: str, schema: int) -> dict[str, Any]:
    """Read a JSON record (a `meta.json`, a calibration file) and check its kind and schema.

    Raises ArtifactError with a fix-it line for a missing file, invalid JSON, another kind or schema.
    """
    p = Path(path)
    if not p.is_file():
        raise ArtifactError(f"no moeflow {noun(kind)} at {p}; run `moeflow {command_for(kind)}` first")
    try:
        rec = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        gone = f"the folder {p.parent}" if p.name == META else "it"  # a folder's data is useless without its meta.json
        raise ArtifactError(
            f"{p} is corrupt (not valid JSON: {e}); delete {gone} and re-run `moeflow {command_for(kind)}`"
        ) from e
    got = rec.get("kind") if isinstance(rec, dict) else None
    if got != kind:
        held = f"a moeflow {noun(got)}" if isinstance(got, str) else "no moeflow kind"
        where = p.parent if p.name == META else p
        raise ArtifactError(
            f"{where} is not a moeflow {noun(kind)} (it holds {held}); point to what `moeflow {command_for(kind)}` wrote"
        )
    if rec.get("schema") != schema:
        raise ArtifactError(
            f"{p} has {kind} schema {rec.get('schema')}, this moeflow reads schema {schema}; re-run `moeflow {command_for(kind)}`"
        )
    return rec


def read_meta(folder: str | os.PathLike, kind: str, schema: int) -> dict[str, Any]:
    """Read and check `folder/meta.json` (see `read_record`)."""
    folder = Path(folder)
    if not folder.exists():
        raise ArtifactError(f"{folder} does not exist; create it first (see `moeflow {command_for(kind)} --help`)")
    if not (folder / META).is_file():
        raise ArtifactError(
            f"{folder} is not a moeflow {noun(kind, 'folder')} (no {META}); "
            f"point to the folder `moeflow {command_for(kind)}` wrote"
        )
    return read_record(folder / META, kind, schema)


def check_fingerprint(meta: dict[str, Any], fingerprint: str, what: str, folder: str | os.PathLike) -> None:
    if meta.get("model_fingerprint") != fingerprint:
        raise another_model(f"{what} at {folder}", meta, fingerprint, "re-create it with this --model")


# -- --out checks -----------------------------------------------------------------------------------


PLOT_METADATA = {"Software": "moeflow"}  # the PNG text chunk every moeflow plot carries (`savefig(metadata=...)`)
_PNG = b"\x89PNG\r\n\x1a\n"


def artifact_kind(path: str | os.PathLike) -> str | None:
    """The moeflow kind held at `path`, or None if it is not a moeflow artifact.

    A folder: its `meta.json`'s "kind". A file: the "kind" of the JSON object it holds, or of the
    JSON object on its first line (a JSONL file such as `moeflow run --out`'s results); "plot" for a PNG
    whose header carries `PLOT_METADATA` (what `tune` and `gps --plot` write).
    """
    p = Path(path)
    if p.is_dir():
        p = p / META
    if not p.is_file():
        return None
    try:
        with open(p, "rb") as f:
            if f.read(len(_PNG)) == _PNG:
                mark = b"\x00".join(x.encode() for x in next(iter(PLOT_METADATA.items())))  # a tEXt chunk's key\0value
                return "plot" if mark in f.read(4096) else None
            f.seek(0)
            first = f.readline(1 << 20)
            rec: Any = None
            with contextlib.suppress(ValueError):
                rec = json.loads(first)
            if not isinstance(rec, dict) and p.stat().st_size <= 64 << 20:
                f.seek(0)
                rec = json.loads(f.read())
    except (OSError, ValueError):
        return None
    kind = rec.get("kind") if isinstance(rec, dict) else None
    return kind if isinstance(kind, str) else None
