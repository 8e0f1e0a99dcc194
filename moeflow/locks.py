"""One lock per artifact target: `fcntl.flock` on `<parent>/.<name>.lock`, its holder written inside.

Every stage that writes an `--out` (trace, train, calibrate, run; retrain for its predictor folder) holds
the lock of that target from its up-front checks until the artifact is published, so two writers of one
target never both write it: the second is refused (`LockBusy`, exit 75 = EX_TEMPFAIL) with one line
naming the holder, or with `wait=True` (`--wait`) blocks until the holder is done and then re-runs the
stage's `--out` check under the lock (the first writer may have published meanwhile). The lock file
sits beside the target, so it also works for a target that does not exist yet.

The kernel releases a flock when its holder's process ends in any way, kill -9 included: the next
writer simply takes over (`took_over` names the dead holder). A holder that ends normally, or with an
exception, removes the lock file and the parent folders it created (when still empty), so nothing is
left beside the target. `flock` is advisory and local: keep artifacts on a local file system (not NFS)
when several hosts write them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .artifacts import _mkdirs, _pid_alive, _rmdirs, now_iso
from .errors import MoeflowError
from .outputs import unwritable

EX_TEMPFAIL = 75  # sysexits.h: try again later

_HELD: set[Path] = set()  # lock files this process holds (waiting on one of them would never end)


class LockBusy(MoeflowError):
    """Another writer holds the lock of the target (exit 75, EX_TEMPFAIL)."""

    exit_code = EX_TEMPFAIL


def lock_path(target: str | os.PathLike) -> Path:
    """`<parent>/.<name>.lock` beside `target` (its parent's symlinks resolved, so every spelling of a
    target shares one lock)."""
    p = Path(os.path.abspath(os.path.expanduser(target)))
    return p.parent.resolve() / f".{p.name}.lock"


def _holder(text: str) -> dict[str, Any]:
    with contextlib.suppress(ValueError):
        rec = json.loads(text)
        if isinstance(rec, dict):
            return rec
    return {}


def describe(holder: dict[str, Any]) -> str:
    """`pid 123 on host since 2025-01-01T00:00:00+00:00` (or `an unknown process`)."""
    if not holder:
        return "an unknown process"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}"


def _read(fd: int) -> dict[str, Any]:
    return _holder(os.pread(fd, 4096, 0).decode(errors="replace"))


def _waiting(message: str) -> None:
    """Tell the user this run waits for another writer (stderr: stdout may carry --json)."""
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def out_lock(
    target: str | os.PathLike | None,
    *,
    wait: bool = False,
    command: str = "moeflow",
    flag: str = "--out",
    check: Callable[[], object] | None = None,
    hint: str | None = None,
) -> Iterator[dict[str, Any]]:
    """Hold the lock of `target` for the block; raise LockBusy naming the holder when another writer has it.

    `wait=True` blocks until the holder is done instead. `check` (the stage's `--out` check) runs again
    once the lock is held. `command` (e.g. "moeflow train") is recorded as the holder; `hint` ends the
    busy line (default: pass --wait, or choose another `flag`). A `target` of None or "" (no --out) locks
    nothing. A lock file that cannot be created is a ConfigError naming the folder (read-only file system,
    permission denied). Yields {"path", "waited", "took_over": the dead previous holder's record, or None}.
    """
    if target is None or str(target) == "":
        yield {"path": None, "waited": False, "took_over": None}
        return
    path = lock_path(target)
    hint = hint or f"pass --wait to wait for it, or choose another {flag}"
    waited = False
    vanished = 0
    while True:
        try:
            made = _mkdirs(path.parent)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            vanished += 1
            if vanished < 100:
                continue  # a parent just removed by a holder releasing: again
            raise
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
                raise unwritable(target, path.parent, e, flag) from None
            raise
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                who = holder.get("command") or "another moeflow process"
                if not wait or path in _HELD:
                    raise LockBusy(f"{flag} {target} is being written by {who} ({describe(holder)}); {hint}") from None
                _waiting(f"waiting for {who} ({describe(holder)}) to finish writing {target} ...")
                fcntl.flock(fd, fcntl.LOCK_EX)
                waited = True
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if not same:  # the holder released and removed this file while we waited on it: lock the new one
                os.close(fd)
                continue
        except BaseException:
            os.close(fd)
            raise
        break
    try:
        before = _read(fd)
        pid = before.get("pid")
        stale = before if isinstance(pid, int) and before.get("host") == socket.gethostname() and not _pid_alive(pid) else None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": now_iso(), "command": command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        _HELD.add(path)
        try:
            if check is not None:
                check()
            yield {"path": str(path), "waited": waited, "took_over": stale}
        finally:
            _HELD.discard(path)
            try:
                path.unlink()  # still ours: a waiter re-checks the path after it gets the lock
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)  # could not remove it: at least name no holder
            _rmdirs(made)  # the parents this lock created, when still empty
    finally:
        os.close(fd)  # releases the flock
