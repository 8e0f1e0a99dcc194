"""Checks that stage configs run before any work on what depends on this machine.

A config's `__post_init__` checks what the flags alone decide (ranges, names, syntax); its `preflight()`
checks what depends on the machine (`check_device`: is CUDA there?) and on the disk
(`moeflow.outputs.check_out`: may `--out` be written?). Each stage calls `cfg.preflight()` first,
before it loads a model, prompts or a trace.
"""

from __future__ import annotations

from .errors import ConfigError


def check_device(device: str, flag: str = "--device") -> None:
    """Refuse a device this machine cannot use: not `cpu`/`cuda[:N]`, CUDA absent, or N out of range."""
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{flag} {device!r} is not a device; use cpu or cuda[:N]") from None
    if d.type == "cpu":
        return
    if d.type != "cuda":
        raise ConfigError(f"{flag} {device!r}: moeflow runs on cpu or cuda[:N]")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"{flag} {device}: CUDA is not available on this machine (no GPU, or a CPU-only torch); use --device cpu"
        )
    n = torch.cuda.device_count()
    if d.index is not None and d.index >= n:
        raise ConfigError(f"{flag} {device}: this machine has {n} CUDA device(s); use cuda:0 .. cuda:{n - 1}")
