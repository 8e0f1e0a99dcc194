"""The thread rule applied to a loaded model (`moeflow.threads` is the rule itself): `apply_threads` resolves
`--threads`, the environment, the calibration's fastest measured count (`find_thread_calibration`: the
calibration of this model on this device, as `moeflow calibrate` writes it) or the default (those two capped at
the CPUs idle now), and sets torch's intra-op thread count to it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..threads import CALIBRATION_ROOT, ThreadChoice, cap_to_idle, env_threads, idle_cpus, resolve_threads


def calibration_candidates(device: str, root: str | os.PathLike = CALIBRATION_ROOT) -> list[Path]:
    """What `moeflow calibrate` writes for `device`: `<root>/<device>.json`, then `<root>/<device>-emulated-*.json`."""
    from ..calibrate.io import calibration_path, device_name

    name = device_name(device)
    first = calibration_path(name, root)
    rest = sorted(Path(root).glob(f"{name}-emulated-*.json")) if Path(root).is_dir() else []
    return [first, *rest]


def find_thread_calibration(
    model: Any, device: str, *, records: Iterable[Mapping[str, Any] | None] = (), root: str | os.PathLike = CALIBRATION_ROOT
) -> Mapping[str, Any] | None:
    """The first calibration of `model` on `device` that records `best_threads`: among `records` (already
    read and checked, e.g. `moeflow run`'s), then the files `calibration_candidates` names. A file that is
    missing, unreadable or made for another model is skipped (`moeflow run` reports those itself)."""
    for rec in records:
        if rec and rec.get("best_threads") is not None:
            return rec
    from ..calibrate.io import load_calibration
    from ..errors import MoeflowError

    fingerprint = None
    for path in calibration_candidates(device, root):
        if not path.is_file():
            continue
        if fingerprint is None:
            from ..moe import model_fingerprint

            fingerprint = model_fingerprint(model)
        try:
            rec = load_calibration(path, fingerprint=fingerprint)
        except MoeflowError:
            continue
        if rec.get("best_threads") is not None:
            return {**rec, "path": str(path)}
    return None


def apply_threads(
    flag: int | None,
    model: Any,
    device: str = "cpu",
    *,
    calibration: Mapping[str, Any] | None = None,
    cores: int | None = None,
    look_up: bool = True,
    idle: float | None = None,
) -> ThreadChoice:
    """Resolve the rule for a loaded `model` on `device` (its spec; `calibration`, else one found by
    `find_thread_calibration` unless `look_up` is False), cap a calibrated or default count above 1 at the
    CPUs idle now (`idle`, default measured: `idle_cpus`), and set torch's intra-op thread count to it.
    The caller restores the previous count (`moeflow.models.torch_threads`)."""
    import torch

    from ..moe import get_adapter

    spec = get_adapter(model).spec
    cal = None
    if flag is None and env_threads() is None and look_up:
        cal = find_thread_calibration(model, device, records=(calibration,))
    choice = resolve_threads(flag, cal, spec, cores=cores)
    if choice.cappable:  # measured only then (0.1 s)
        choice = cap_to_idle(choice, idle_cpus() if idle is None else idle)
    torch.set_num_threads(choice.n)
    return choice
