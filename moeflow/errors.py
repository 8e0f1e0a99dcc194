"""User-facing errors.

Every error a user can cause (bad path, corrupt artifact, wrong model, unknown policy, ...) is raised
as a `MoeflowError` whose message is one line that says what to change. The CLI prints that line
and exits non-zero; `MOEFLOW_DEBUG=1` shows the traceback instead.
"""

from __future__ import annotations


class MoeflowError(Exception):
    """An error caused by input the user can fix. `str(err)` is the one-line message."""

    exit_code = 2


class ArtifactError(MoeflowError):
    """A missing, corrupt or mismatched artifact (trace, predictor, calibration)."""


class UnsupportedModelError(MoeflowError):
    """The model's architecture has no adapter."""


class ConfigError(MoeflowError):
    """Flags or a config value that cannot work (capacity below top-k, unknown policy, ...)."""


def brief(text: str, n: int = 200) -> str:
    """The first line of an error's text, at most `n` characters: cut after its last whole sentence within them,
    else at a word, marked with an ellipsis (a library's long explanation, not half a sentence)."""
    line = (text.strip().splitlines() or [""])[0]
    if len(line) <= n:
        return line
    head = line[:n]
    end = head.rfind(". ")
    if end > 0:
        return head[: end + 1]
    return head.rsplit(" ", 1)[0] + " ..."
