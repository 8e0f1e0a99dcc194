"""`--link` specifications: `cuda`, `direct`, `auto` or `emulated:GBPS[,LATENCY_US]`, parsed and built."""

from __future__ import annotations

import re

import torch

from ...errors import ConfigError
from .base import DirectLink, Link
from .cuda import CudaLink
from .emulated import EmulatedLink

_EMU = re.compile(r"^emulated:(?P<gbps>[0-9.eE+-]+)(?:,(?P<lat>[0-9.eE+-]+))?$")


def parse_link(spec: str) -> tuple[str, float, float]:
    """`cuda` | `direct` | `emulated:GBPS[,LATENCY_US]` -> (kind, gbps, latency_s)."""
    s = spec.strip().lower()
    if s in ("cuda", "direct", "auto"):
        return s, 0.0, 0.0
    m = _EMU.match(s)
    if not m:
        raise ConfigError(f"--link {spec!r} not understood; use cuda, direct or emulated:GBPS[,LATENCY_US] (e.g. emulated:2,10)")
    try:
        gbps = float(m["gbps"])
        lat = float(m["lat"]) * 1e-6 if m["lat"] else 0.0
    except ValueError as e:
        raise ConfigError(f"--link {spec!r}: {e}") from e
    if gbps <= 0 or lat < 0:
        raise ConfigError(f"--link {spec!r}: bandwidth must be > 0 GB/s and latency >= 0 us")
    return "emulated", gbps, lat


def make_link(spec: str, device: torch.device) -> Link:
    kind, gbps, lat = parse_link(spec)
    if kind == "auto":
        kind = "cuda" if device.type == "cuda" else "direct"
    if kind == "cuda":
        if device.type != "cuda":
            raise ConfigError("--link cuda needs --device cuda; on CPU use --link emulated:GBPS[,LATENCY_US]")
        return CudaLink(device)
    if kind == "direct":
        return DirectLink()
    return EmulatedLink(gbps, lat)
