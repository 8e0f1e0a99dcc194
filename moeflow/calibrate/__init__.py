"""Calibration: bandwidth sweep, per-layer compute timing, ExpertFlow's initial step size S, named regimes."""

from .io import calibration_path, check_calibration, device_name, load_calibration, missing_calibration, write_calibration
from .stepsize import copy_share, copy_share_bandwidth, initial_step_size, parse_regime, regime_bandwidth, specmd_bandwidth

__all__ = [
    "calibration_path",
    "check_calibration",
    "copy_share",
    "copy_share_bandwidth",
    "device_name",
    "initial_step_size",
    "load_calibration",
    "missing_calibration",
    "parse_regime",
    "regime_bandwidth",
    "specmd_bandwidth",
    "write_calibration",
]
