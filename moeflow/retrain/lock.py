"""The retrain lock: the predictor folder's artifact lock (`moeflow.locks.out_lock`), so a retrain, a
`moeflow train --out` of the same folder and a second retrain never write it at once.

Busy: `LockBusy` (exit 75, EX_TEMPFAIL) naming the holder; a cron run does nothing and tries again later.
A holder killed in any way (kill -9 included) releases it; the next run takes over and records the dead
holder (`took_over`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from ..locks import EX_TEMPFAIL, LockBusy, describe, lock_path, out_lock

__all__ = ["EX_TEMPFAIL", "LockBusy", "describe", "lock_path", "retrain_lock"]


@contextlib.contextmanager
def retrain_lock(predictors: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Hold the lock of `predictors`; raise LockBusy naming the holder when another process has it.

    Yields {"path", "took_over": the previous holder's record when its process is gone (a stale lock), or None}.
    """
    with out_lock(
        predictors, command="moeflow retrain", flag="predictors", hint="this run does nothing, try again later"
    ) as held:
        yield held
