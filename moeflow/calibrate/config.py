"""CalibrateConfig: everything `moeflow calibrate` needs, as one frozen dataclass (the CLI builds it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

DEFAULT_SIZES_KIB = (64, 256, 1024, 4096, 16384)


@dataclass(frozen=True)
class CalibrateConfig:
    model: str  # local checkpoint folder
    device: str = "cpu"
    dtype: str = "auto"
    link_gbps: float | None = None  # calibrate an EmulatedLink of this bandwidth (GB/s = 1e9 B/s)
    link_latency_s: float = 0.0  # its per-transfer latency
    sizes_kib: tuple[int, ...] = DEFAULT_SIZES_KIB  # transfer sizes for the bandwidth sweep (the expert size is added)
    repeats: int = 5  # timed repeats per size / per module (median)
    decode_steps: int = 8  # decode steps timed for per-layer compute
    regimes: tuple[str, ...] = ()  # e.g. ("copy-share=0.85", "specmd")
    out: str | None = None  # file; default calibration/<device>.json
    write: bool = True
    force: bool = False  # replace an existing calibration file at `out`
    wait: bool = False  # wait for another writer of `out` instead of refusing (moeflow.locks.out_lock)
    progress: bool = True
    threads: int | None = None  # time decode at this count only (None: at 1, 2, 4, ... up to the usable CPUs)

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1 (got {self.threads})")
        if self.link_gbps is not None and self.link_gbps <= 0:
            raise ConfigError(f"--link-gbps must be > 0 (got {self.link_gbps})")
        if self.link_latency_s < 0:
            raise ConfigError(f"--link-latency-us must be >= 0 (got {self.link_latency_s * 1e6})")
        if self.link_gbps is not None and not self.device.startswith("cpu"):
            raise ConfigError("--link-gbps emulates a link on CPU; drop it or use --device cpu")
        if self.repeats < 1 or self.decode_steps < 1:
            raise ConfigError("--repeats and --decode-steps must be >= 1")
        if not self.sizes_kib or min(self.sizes_kib) < 1:
            raise ConfigError("--sizes must be positive KiB values")
        from .stepsize import parse_regime

        for r in self.regimes:
            parse_regime(r)

    @staticmethod
    def parse_sizes(text: str) -> tuple[int, ...]:
        """`--sizes 64,256,1024` -> (64, 256, 1024) KiB."""
        try:
            return tuple(int(s) for s in text.split(",") if s.strip())
        except ValueError:
            raise ConfigError(f"--sizes must be comma-separated KiB integers, got {text!r}") from None

    def preflight(self) -> None:
        """What depends on this machine, checked before anything loads: the device (`--out` is checked by
        the stage with `moeflow.artifacts.check_out` before the model loads)."""
        from ..checks import check_device

        check_device(self.device)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sizes_kib"] = list(self.sizes_kib)
        d["regimes"] = list(self.regimes)
        return d
