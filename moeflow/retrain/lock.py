"""The retrain lock: `fcntl.flock` on `<parent>/.<predictors>.retrain.lock`, holder written inside.

The lock is held through an open file description, so the kernel releases it when the holder's process
ends in any way, kill -9 included: a lock file whose holder is gone is simply taken over by the next run
(the file stays; its old content only names the previous holder). `flock` is advisory and local: keep the
predictor folder on a local file system (not NFS) when several hosts share it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..artifacts import _pid_alive, now_iso
from ..errors import MoeflowError

EX_TEMPFAIL = 75  # sysexits.h: try again later


class LockBusy(MoeflowError):
    """Another retrain holds the lock (exit 75, EX_TEMPFAIL)."""

    exit_code = EX_TEMPFAIL


def lock_path(predictors: str | os.PathLike) -> Path:
    p = Path(os.path.abspath(predictors))
    return p.parent / f".{p.name}.retrain.lock"


def _holder(text: str) -> dict[str, Any]:
    with contextlib.suppress(ValueError):
        rec = json.loads(text)
        if isinstance(rec, dict):
            return rec
    return {}


def describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "an unknown process"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}"


@contextlib.contextmanager
def retrain_lock(predictors: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Hold the retrain lock for `predictors`; raise LockBusy naming the holder when another process has it.

    Yields {"path", "took_over": the previous holder's record when its process is gone (a stale lock), or None}.
    """
    path = lock_path(predictors)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            raise LockBusy(
                f"another moeflow retrain holds {path} ({describe(holder)}); this run does nothing, try again later"
            ) from None
        before = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
        pid = before.get("pid")
        stale = before if isinstance(pid, int) and before.get("host") == socket.gethostname() and not _pid_alive(pid) else None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": now_iso()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        try:
            yield {"path": str(path), "took_over": stale}
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # released: no holder named (the file stays, so its inode is stable)
    finally:
        os.close(fd)  # releases the flock
