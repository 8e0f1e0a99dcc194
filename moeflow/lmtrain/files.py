"""The file names of a built embedded model's folder that `build` writes and `modelcard` reads."""

from __future__ import annotations

TRAINING_JSON = "training.json"  # the build's record: configs, corpus, timings
TRAIN_LOG = "train_log.jsonl"  # one JSON line per logged training step
