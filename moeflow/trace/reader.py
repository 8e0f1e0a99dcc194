"""`Trace(path)`: a validated, memory-mapped view of a trace folder.

Shards are Arrow IPC streams opened through `pyarrow.memory_map`, so opening a trace reads only
its schema; `trace.layer(l)` copies just the columns of layer `l` (rows in one fixed order for
every layer: shard by shard, prompt by prompt, position by position).
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa

from ..artifacts import read_meta
from ..errors import ArtifactError, ConfigError
from ..moe import MoESpec
from .format import HIDDEN_FIELDS, KIND, LAYER_FIELDS, SCHEMA, TOKEN_FIELDS, column


class Trace:
    """A trace folder written by `moeflow trace`.

    Raises ArtifactError (one line naming the file and the fix) when meta.json is missing or
    corrupt, or when a shard is missing, truncated or unreadable.
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = False):
        self.path = Path(path)
        self.meta: dict[str, Any] = read_meta(self.path, KIND, SCHEMA)
        try:
            self.spec = MoESpec.from_dict(self.meta["spec"])
            shards = list(self.meta["shards"])
            self.prompt_ids: list[str] = list(self.meta["prompt_ids"])
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"{self.path}/meta.json lacks {e}; delete {self.path} and re-run `moeflow trace`") from e
        self._tables = [self._open_shard(s, verify) for s in shards]
        self.record_hidden = bool(self.meta.get("record_hidden"))

    def _open_shard(self, info: dict[str, Any], verify: bool) -> pa.Table:
        f = self.path / info["file"]
        fix = f"delete {self.path} (or that shard and its entry) and re-run `moeflow trace`"
        if not f.is_file():
            raise ArtifactError(f"trace shard {f} is missing; {fix}")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise ArtifactError(f"trace shard {f} is truncated or changed ({size} bytes, expected {info['bytes']}); {fix}")
        if verify:
            from .writer import _sha256
            if _sha256(f) != info["sha256"]:
                raise ArtifactError(f"trace shard {f} is corrupt (sha256 mismatch); {fix}")
        try:
            table = pa.ipc.open_stream(pa.memory_map(str(f), "r")).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise ArtifactError(f"trace shard {f} is unreadable ({str(e).splitlines()[0][:80]}); {fix}") from e
        if table.num_rows != info["records"]:
            raise ArtifactError(f"trace shard {f} has {table.num_rows} records, expected {info['records']}; {fix}")
        return table

    # -- sizes --
    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_tokens(self) -> int:
        return sum(t.num_rows for t in self._tables)

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_ids)

    @property
    def fingerprint(self) -> str:
        return self.meta["model_fingerprint"]

    def __repr__(self) -> str:
        return (f"Trace({str(self.path)!r}, {self.num_prompts} prompts, {self.num_tokens} tokens, "
                f"{self.spec.arch} {self.spec.num_moe_layers} MoE layers x {self.spec.num_experts} experts top-{self.spec.top_k})")

    # -- reading --
    def _column(self, name: str) -> np.ndarray:
        """One column over all shards: [N] or [N,w] (zero-copy when the trace has one shard)."""
        parts = []
        for t in self._tables:
            if name not in t.column_names:
                raise KeyError(name)
            for chunk in t.column(name).chunks:
                if pa.types.is_fixed_size_list(chunk.type):
                    w = chunk.type.list_size
                    parts.append(chunk.flatten().to_numpy(zero_copy_only=False).reshape(-1, w))
                else:
                    parts.append(chunk.to_numpy(zero_copy_only=False))
        if not parts:
            raise KeyError(name)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def tokens(self) -> dict[str, np.ndarray]:
        """`prompt_id` (index into `trace.prompt_ids`), `position`, `phase` (0 prefill, 1 decode), `token_id`: [N]."""
        if not self._tables:
            return {f: np.zeros(0, np.int32) for f in TOKEN_FIELDS}
        return {f: self._column(f) for f in TOKEN_FIELDS}

    @property
    def fields(self) -> tuple[str, ...]:
        return LAYER_FIELDS + (HIDDEN_FIELDS if self.record_hidden else ())

    def layer(self, layer: int, fields: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Decoder layer `layer`'s records: `topk_ids` [N,k], `topk_weights` [N,k] f32, `probs` [N,E] f16,
        and with --record-hidden `hidden_in` [N,H] f16 (router input), `resid` [N,H] f16 (post-attention residual)."""
        if layer not in self.spec.moe_layers:
            raise ArtifactError(f"layer {layer} is not an MoE layer of this trace; MoE layers: {list(self.spec.moe_layers)}")
        fields = tuple(fields) if fields is not None else self.fields
        bad = [f for f in fields if f not in self.fields]
        if bad:
            extra = " (trace recorded without --record-hidden)" if set(bad) & set(HIDDEN_FIELDS) else ""
            raise ArtifactError(f"trace field {bad[0]!r} not available{extra}; fields: {', '.join(self.fields)}")
        if not self._tables:
            k, E, H = self.spec.top_k, self.spec.num_experts, self.spec.hidden_size
            empty = {"topk_ids": (k, np.int16), "topk_weights": (k, np.float32), "probs": (E, np.float16),
                     "hidden_in": (H, np.float16), "resid": (H, np.float16)}
            return {f: np.zeros((0, empty[f][0]), empty[f][1]) for f in fields}
        return {f: self._column(column(f, layer)) for f in fields}

    @cached_property
    def _phase(self) -> np.ndarray:
        return self._column("phase") if self._tables else np.zeros(0, np.int8)

    def mask(self, phase: str | None = None) -> np.ndarray:
        """Row mask [N] bool: `"prefill"`, `"decode"` or None (all rows)."""
        if phase is None:
            return np.ones(self.num_tokens, bool)
        if phase not in ("prefill", "decode"):
            raise ConfigError(f"phase must be 'prefill' or 'decode', not {phase!r}")
        return self._phase == (1 if phase == "decode" else 0)

    def check_model(self, model: Any) -> None:
        """Raise ArtifactError if `model` is not the model this trace was recorded with."""
        from ..moe import model_fingerprint
        fp = model_fingerprint(model)
        if fp != self.fingerprint:
            raise ArtifactError(f"trace at {self.path} is a trace of another model (fingerprint {self.fingerprint}, "
                                f"this model is {fp}); re-run `moeflow trace` with this --model")
