"""Calibration files: `calibration/<device>.json`, one JSON object with its own meta fields.

Top-level fields the runtime reads: `bandwidth_bytes_per_s` (C_s, at the expert transfer size),
`latency_s`, `layer_time_s` (T_l), `expert_bytes` (E_s), `experts_per_layer` (N_e), `initial_s`, and
`best_threads` (the torch thread count every command uses by default, `moeflow.threads`; `thread_sweep` has
the decode time per token at each count timed). A file without `best_threads` (written before it was
recorded) stays valid: commands then use the default count. `engine_time` (the offload engine's decode pass
split per MoE layer: `engine_time.engine_timing`) and `link_timing` (the emulated link's `submit_s`, `wake_s`; the
engine's `demand_copy_s`, `prefetch_copy_s` per copy on it: `engine_time.copy_timing`; on a CPU device
`host_miss_s` and `host_split_s`, what miss policy cpu costs a pass: `engine_time.host_timing`) are
what `moeflow simulate --calibrated-time` and `moeflow tune` read; a file without them stays valid for everything
else (without the host terms, tune searches miss fetch only).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..artifacts import read_record, write_json_atomic
from ..errors import ArtifactError, ConfigError

KIND = "calibration"
SCHEMA = 1


def device_name(device: str, link_gbps: float | None = None) -> str:
    """`cpu`, `cpu-emulated-8gbps`, `cuda-NVIDIA_H100_80GB_HBM3` (file-name safe)."""
    if device.startswith("cuda"):
        import torch

        idx = torch.device(device).index or 0
        name = "cuda-" + re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(idx)).strip("_")
    else:
        name = re.sub(r"[^A-Za-z0-9]+", "_", device)
    if link_gbps is not None:
        name += f"-emulated-{link_gbps:g}gbps"
    return name


def missing_calibration(path: str | os.PathLike) -> str:
    """The one line for a --calibration that names no file: a folder is called one."""
    what = "is a folder, not a calibration file" if Path(path).is_dir() else "does not exist"
    return f"calibration file {path} {what}; run `moeflow calibrate` or drop --calibration"


def check_calibration(
    cal: dict[str, Any], path: str | os.PathLike, device: str, *, exact: str | None = None, required: tuple[str, ...] = ()
) -> None:
    """Refuse (one line) a calibration measured elsewhere or holding a non-positive time or bandwidth.

    Its device must be `exact` (`cpu-emulated-2gbps`: that device and link) when given, else `device`'s name or one
    of its emulated links. `bandwidth_bytes_per_s`, `layer_time_s` and the `required` keys must be positive numbers
    where present; the `required` ones must be present."""
    got, here = str(cal.get("device") or ""), device_name(device)
    same = got == exact if exact is not None else (not got or got == here or got.startswith(here + "-emulated-"))
    if not same:
        want = exact if exact is not None else here
        raise ConfigError(
            f"calibration {path} is of device {got!r}, not {want!r}; run `moeflow calibrate` on this device"
            + (" and link" if exact is not None and exact != here else "") + " or pass its file"
        )  # fmt: skip
    for k in dict.fromkeys(("bandwidth_bytes_per_s", "layer_time_s", *required)):
        v = cal.get(k)
        if (v is None and k in required) or (v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v <= 0)):
            raise ArtifactError(f"calibration {path} has no positive {k}; re-run `moeflow calibrate`")


def calibration_path(device: str, root: str | os.PathLike = "calibration") -> Path:
    """Where `moeflow calibrate` writes (and `moeflow run` looks for) the calibration of `device`.

    `device` is a `device_name(...)` (`cpu`, `cuda-NVIDIA_H100...`) or a torch device string."""
    if device.startswith("cuda") and not device.startswith("cuda-"):
        device = device_name(device)
    return Path(root) / f"{device}.json"


def write_calibration(path: str | os.PathLike, record: dict[str, Any]) -> Path:
    """Write atomically (temp file + rename); `record` must carry kind/schema/model_fingerprint."""
    for k in ("kind", "schema", "model_fingerprint"):
        if k not in record:
            raise ValueError(f"calibration record lacks {k!r}")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(p, record)
    return p


def load_calibration(
    path: str | os.PathLike, model: Any = None, *, fingerprint: str | None = None, against: str = "this --model"
) -> dict[str, Any]:
    """Read and check a calibration: kind, schema, and (given a model or fingerprint) the model it was made for;
    `against` names where that fingerprint comes from in the message (e.g. "the trace's model")."""
    p = Path(path)
    if not p.is_file():
        raise ArtifactError(f"no calibration at {p}; run `moeflow calibrate` (or pass --calibration FILE)")
    rec = read_record(p, KIND, SCHEMA)
    if model is not None and fingerprint is None:
        from ..moe import model_fingerprint

        fingerprint = model_fingerprint(model)
    if fingerprint is not None and rec.get("model_fingerprint") != fingerprint:
        from ..artifacts import another_model

        fix = f"re-run `moeflow calibrate` with {against}" + ("" if against == "this --model" else " or pass its calibration")
        raise another_model(f"calibration {p}", rec, fingerprint, fix, against=against)
    return rec
