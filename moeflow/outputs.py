"""`--out` checks, run by every stage before any work: `check_out` (never replace an input, another kind of
artifact or other files; replace the same kind only with `--force`) and `check_writable` (a probe file created
and removed where the artifact will appear, so an unwritable target is refused before the work, not after).
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .artifacts import _versions, artifact_kind, noun
from .errors import ConfigError


def _within(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b)


_WHY = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
}


def unwritable(out: str | os.PathLike, folder: str | os.PathLike, err: OSError, flag: str = "--out") -> ConfigError:
    """The one-line error for an `out` that cannot be written because `folder` refuses new files."""
    why = _WHY.get(err.errno or 0) or (err.strerror or str(err)).lower()
    return ConfigError(f"{flag} {out}: cannot write in {folder} ({why}); choose a writable {flag}")


def _probe(folder: Path) -> OSError | None:
    """Create and remove a uniquely named file in `folder`: the error that stops writing there, or None."""
    try:
        fd, name = tempfile.mkstemp(prefix=".moeflow-probe-", dir=folder)
    except OSError as e:
        return e
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


def check_writable(out: str | os.PathLike, *, inside: bool = False, flag: str = "--out") -> None:
    """Refuse (ConfigError, one line) an `out` whose writes would fail, before any work.

    Probes the folder beside `out` where the writes go (its lock, atomic temp files, `.<name>.versions/`):
    the parent, or its nearest existing ancestor where the parent is still to be created. With `inside`
    (a stage that writes into an existing `out` folder, or an empty folder such as a mount point) also
    `out` itself.
    """
    out = Path(out).expanduser()
    lexical = Path(os.path.abspath(out))
    spots = [lexical.parent]
    while not spots[0].exists() and spots[0] != spots[0].parent:
        spots[0] = spots[0].parent
    if inside and out.is_dir():
        spots.append(out)
    for d in spots:
        err = _probe(d)
        if err is not None:
            raise unwritable(out, d, err, flag)


def check_out(
    out: str | os.PathLike,
    *,
    kind: str,
    inputs: Sequence[str | os.PathLike | None] = (),
    force: bool = False,
    file: bool = False,
    reuse: bool = False,
    flag: str = "--out",
) -> Path:
    """Check an output path before any work; raise ConfigError with one line if writing it could lose data.

    Refused: an `out` that is, contains or is inside one of `inputs` (symlinks resolved); with
    `file=True` an existing folder (without: an existing file); an existing file or folder that is
    not a moeflow `kind` artifact (never replaced, even with force); a folder holding other files.
    An existing `kind` artifact is replaced only with `force=True` (or kept with `reuse=True`, for
    stages that append to it). A new path or an empty folder is fine. Also refused: a folder where
    nothing can be written (`check_writable`: read-only file system, permission denied) and, for a
    folder artifact that is not appended to, a mount point (it cannot be replaced by the new folder).
    Returns `out` as a Path.
    """
    ext = {"plot": ".png", "run": ".jsonl", "quality": ".jsonl"}.get(kind, ".json")
    if file and str(out).endswith(("/", os.sep)):  # Path() drops the slash: the file would take the folder's name
        raise ConfigError(f"{flag} {out} names a folder (it ends with /); pass a file path (e.g. {out}{kind}{ext})")
    out = Path(out).expanduser()
    lexical = Path(os.path.abspath(out))
    if lexical == lexical.parent:
        raise ConfigError(f"{flag} {out} is a file-system root; pass a new path")
    at = lexical.parent.resolve() / lexical.name  # where the new artifact will appear
    spots = {at, _versions(at), out.resolve()}  # ... the folders it will replace or clean
    for inp in inputs:
        if inp is None or str(inp) == "":
            continue
        r = Path(inp).expanduser().resolve()
        for s in spots:
            if s == r:
                raise ConfigError(f"{flag} {out} is the input {inp}; choose another {flag}")
            if _within(s, r):
                raise ConfigError(f"{flag} {out} is inside the input {inp}; choose a path outside it")
            if _within(r, s):
                raise ConfigError(f"{flag} {out} contains the input {inp}; choose a path that does not")
    anc = at.parent
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise ConfigError(f"{flag} {out} is inside {anc}, which is a file; choose another {flag}")
    if not out.exists():
        check_writable(out, flag=flag)
        return out  # new (or a dangling link: nothing to lose)
    what = "file" if file else "folder"
    if file and out.is_dir():
        raise ConfigError(f"{flag} {out} is a folder; pass a file path (e.g. {out / (kind + ext)})")
    if not file and not out.is_dir():
        raise ConfigError(f"{flag} {out} is a file; pass a folder path")
    if not file and not reuse and os.path.ismount(out):
        raise ConfigError(
            f"{flag} {out} is a mount point, which cannot be replaced by the new folder; "
            f"pass a path inside it (e.g. {out / kind})"
        )
    real_dir = not file and not out.is_symlink()
    if not file and not any(out.iterdir()):
        check_writable(out, inside=real_dir, flag=flag)
        return out
    got = artifact_kind(out)
    if got != kind:
        holds = f"a moeflow {noun(got)}" if got else ("other files" if not file else "something else")
        raise ConfigError(
            f"{flag} {out} exists and holds {holds}, not a moeflow {noun(kind, what)}; "
            f"choose a new {'file' if file else 'or empty folder'}"
        )
    if not (force or reuse):
        raise ConfigError(f"{flag} {out} already holds a moeflow {noun(kind)}; pass --force to replace it")
    check_writable(out, inside=reuse and real_dir, flag=flag)
    return out
