"""`moeflow retrain`: cron-safe trace-append + train + evaluate + promote (see `moeflow.retrain.run`)."""

from __future__ import annotations

from .config import RetrainConfig, load_config
from .lock import EX_TEMPFAIL, LockBusy, retrain_lock
from .run import retrain

__all__ = ["EX_TEMPFAIL", "LockBusy", "RetrainConfig", "load_config", "retrain", "retrain_lock"]
