"""`moeflow inspect` stage: what an artifact folder holds, summarised (today: trace folders)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import ArtifactError, ConfigError


def main(path: str | os.PathLike, phase: str | None = None) -> dict[str, Any]:
    """The routing statistics of the trace folder `path` (`moeflow.trace.summary.trace_summary`);
    another kind of moeflow artifact is refused with one line."""
    from ..artifacts import artifact_kind, noun
    from ..trace import Trace
    from ..trace.summary import trace_summary

    if phase not in (None, "prefill", "decode"):
        raise ConfigError(f"--phase must be prefill or decode (got {phase!r})")
    kind = artifact_kind(path)
    if kind not in ("trace", None):  # None: not an artifact, or a corrupt one: the reader says which
        raise ArtifactError(f"{path} holds a moeflow {noun(kind)}; `moeflow inspect` reads trace folders")
    return trace_summary(Trace(path), phase)
