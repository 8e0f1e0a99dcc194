"""`Trace(path)`: a validated, memory-mapped view of a trace folder.

Opening checks meta.json's fields and types, every shard's size, checksum (streamed; see
`format.FULL_HASH_MAX`) and record count, and that meta.json's prompt ids and the shards' prompts
agree. Shards are Arrow IPC streams opened through `pyarrow.memory_map`; `trace.layer(l)` copies
just the columns of layer `l` (rows in one fixed order for every layer: shard by shard, prompt by
prompt, position by position).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..artifacts import read_meta
from ..errors import ArtifactError, ConfigError
from ..moe import MoESpec
from .format import (
    FULL_HASH_MAX,
    HIDDEN_FIELDS,
    KIND,
    LAYER_FIELDS,
    PROMPTS_KEY,
    SCHEMA,
    TOKEN_FIELDS,
    column,
    ends_sha256,
    file_sha256,
)

# meta.json fields every trace must have, and their JSON types (checked before anything is read)
REQUIRED: dict[str, tuple[type, ...]] = {
    "model_fingerprint": (str,),
    "spec": (dict,),
    "prompt_ids": (list,),
    "shards": (list,),
    "num_tokens": (int,),
    "record_hidden": (bool,),
}
SHARD_REQUIRED: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "file": (str,),
    "records": (int,),
    "bytes": (int,),
    "sha256": (str,),
    "prompts": (int,),
}
_JSON_TYPE = {str: "a string", dict: "an object", list: "a list", int: "an integer", bool: "true/false"}


# Arrow's fixed-width number types and their numpy dtypes (`_numpy`)
_NUMPY: dict[str, np.dtype] = {
    t: np.dtype(t) for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
} | {
    "halffloat": np.dtype("float16"),
    "float": np.dtype("float32"),
    "double": np.dtype("float64"),
}


def _numpy(chunk: pa.Array) -> np.ndarray:
    """A chunk as numpy [n], zero-copy from its data buffer for a number type without nulls (`Array.to_numpy`
    imports pandas, about half a second, which nothing else here needs); a copy through `to_numpy` otherwise."""
    dt = _NUMPY.get(str(chunk.type))
    if dt is None or chunk.null_count:
        return chunk.to_numpy(zero_copy_only=False)
    data: Any = chunk.buffers()[1]  # a pyarrow Buffer (the buffer protocol)
    return np.frombuffer(data, dtype=dt, count=len(chunk), offset=chunk.offset * dt.itemsize)


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:  # JSON true is not an integer here
        return False
    return isinstance(value, types)


def check_meta(meta: dict[str, Any], path: Path) -> None:
    """Raise ArtifactError (one line naming the field) unless `meta` has every required field with its type."""
    where = f"{path}/meta.json"
    fix = f"delete {path} and re-run `moeflow trace`"

    def need(d: dict[str, Any], fields: dict[str, tuple[type, ...]], prefix: str) -> None:
        for name, types in fields.items():
            if name not in d:
                raise ArtifactError(f"{where} lacks the field '{prefix}{name}'; {fix}")
            if not _type_ok(d[name], types):
                raise ArtifactError(
                    f"{where} field '{prefix}{name}' must be {_JSON_TYPE[types[0]]}, not {type(d[name]).__name__}; {fix}"
                )

    need(meta, REQUIRED, "")
    by_name: dict[str, tuple[type, ...]] = {"int": (int,), "str": (str,)}
    spec_types = {f.name: by_name.get(str(f.type), (list,)) for f in dataclasses.fields(MoESpec)}
    need(meta["spec"], spec_types, "spec.")
    if not all(_type_ok(x, (int,)) for x in meta["spec"]["moe_layers"]):
        raise ArtifactError(f"{where} field 'spec.moe_layers' must be a list of integers; {fix}")
    for i, pid in enumerate(meta["prompt_ids"]):
        if not isinstance(pid, str):
            raise ArtifactError(f"{where} field 'prompt_ids[{i}]' must be a string, not {type(pid).__name__}; {fix}")
    for i, info in enumerate(meta["shards"]):
        if not isinstance(info, dict):
            raise ArtifactError(f"{where} field 'shards[{i}]' must be an object, not {type(info).__name__}; {fix}")
        need(info, SHARD_REQUIRED, f"shards[{i}].")
        f = Path(info["file"])
        if f.is_absolute() or ".." in f.parts:
            raise ArtifactError(f"{where} field 'shards[{i}].file' ({info['file']}) must name a file inside {path}; {fix}")


class Trace:
    """A trace folder written by `moeflow trace`, checked before use.

    Raises ArtifactError (one line naming the file and the fix) when meta.json is missing, corrupt,
    or lacks a field; when a shard is missing, truncated, unreadable or (with `verify`, the default)
    changed since it was written (sha256 in meta.json; shards over 64 MiB: `format.ends_sha256`);
    and when meta.json's `prompt_ids` and the shards' prompts disagree.
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True):
        self.path = Path(path)
        self.meta: dict[str, Any] = read_meta(self.path, KIND, SCHEMA)
        check_meta(self.meta, self.path)
        try:
            self.spec = MoESpec.from_dict(self.meta["spec"])
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(
                f"{self.path}/meta.json field 'spec' is invalid ({e}); delete {self.path} and re-run `moeflow trace`"
            ) from e
        self.prompt_ids: list[str] = list(self.meta["prompt_ids"])
        self.record_hidden = bool(self.meta["record_hidden"])
        self._tables = []
        base = 0
        for info in self.meta["shards"]:
            self._tables.append(self._open_shard(info, verify, base))
            base += info["prompts"]
        self._check_prompts()

    def _fix(self, what: str = "that shard and its entry") -> str:
        return f"delete {self.path} (or {what}) and re-run `moeflow trace`"

    def _open_shard(self, info: dict[str, Any], verify: bool, base: int) -> pa.Table:
        f = self.path / info["file"]
        fix = self._fix()
        if not f.is_file():
            raise ArtifactError(f"trace shard {f} is missing; {fix}")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise ArtifactError(f"trace shard {f} is truncated or changed ({size} bytes, expected {info['bytes']}); {fix}")
        if verify:
            if size > FULL_HASH_MAX and isinstance(info.get("sha256_ends"), str):
                ok = ends_sha256(f) == info["sha256_ends"]
            else:
                ok = file_sha256(f) == info["sha256"]
            if not ok:
                raise ArtifactError(f"trace shard {f} is corrupt (sha256 differs from meta.json); {fix}")
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(f), "r"))
            table = reader.read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise ArtifactError(f"trace shard {f} is unreadable ({str(e).splitlines()[0][:80]}); {fix}") from e
        if table.num_rows != info["records"]:
            raise ArtifactError(f"trace shard {f} has {table.num_rows} records, expected {info['records']}; {fix}")
        self._check_shard_prompts(f, table, info, base)
        return table

    def _check_shard_prompts(self, f: Path, table: pa.Table, info: dict[str, Any], base: int) -> None:
        """The shard holds exactly meta's prompts [base, base + info["prompts"]), in order, each with rows."""
        n = info["prompts"]
        fix = self._fix()
        if base + n > len(self.prompt_ids):
            raise ArtifactError(
                f"trace shard {f} holds prompts {base}..{base + n - 1} but meta.json lists only "
                f"{len(self.prompt_ids)} prompt_ids; {fix}"
            )
        md = table.schema.metadata or {}
        if PROMPTS_KEY in md:  # traces written before this check carry no list
            try:
                own = json.loads(md[PROMPTS_KEY])
            except (json.JSONDecodeError, UnicodeDecodeError):
                own = None
            if own != self.prompt_ids[base : base + n]:
                raise ArtifactError(f"trace shard {f} holds other prompts than meta.json's prompt_ids [{base}:{base + n}]; {fix}")
        if "prompt_id" not in table.column_names:
            raise ArtifactError(f"trace shard {f} has no prompt_id column; {fix}")
        chunks = table.column("prompt_id").chunks
        pid = np.concatenate([_numpy(c) for c in chunks]) if chunks else np.zeros(0, np.int64)  # [N]
        if pid.size and (pid.min() < base or pid.max() >= base + n or (np.diff(pid) < 0).any() or np.unique(pid).size != n):
            raise ArtifactError(
                f"trace shard {f}'s prompt_id column does not match its {n} prompts "
                f"(indices {base}..{base + n - 1} in order); {fix}"
            )
        if not pid.size and n:
            raise ArtifactError(f"trace shard {f} has no rows for its {n} prompts; {fix}")

    def _check_prompts(self) -> None:
        """meta.json's prompt_ids: no duplicates, all covered by the shards, record counts add up."""
        ids = self.prompt_ids
        where = f"{self.path}/meta.json"
        if len(set(ids)) != len(ids):
            dup = next(p for i, p in enumerate(ids) if p in ids[:i])
            raise ArtifactError(f"{where} lists prompt {dup} twice; {self._fix('the later shard and its entry')}")
        covered = sum(s["prompts"] for s in self.meta["shards"])
        if covered != len(ids):
            raise ArtifactError(
                f"{where} lists {len(ids)} prompt_ids but its shards hold {covered} prompts; {self._fix('meta.json')}"
            )
        rows = sum(t.num_rows for t in self._tables)
        if rows != self.meta["num_tokens"]:
            raise ArtifactError(
                f"{where} says num_tokens {self.meta['num_tokens']} but its shards hold {rows} records; {self._fix('meta.json')}"
            )

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
        return (
            f"Trace({str(self.path)!r}, {self.num_prompts} prompts, {self.num_tokens} tokens, "
            f"{self.spec.arch} {self.spec.num_moe_layers} MoE layers x {self.spec.num_experts} experts "
            f"top-{self.spec.top_k})"
        )

    # -- reading --
    def _column(self, name: str, rows: np.ndarray | None = None) -> np.ndarray:
        """One column over all shards: [N] or [N,w] (zero-copy when the trace has one shard); with `rows` (sorted
        row indices [n]) only those, a copy taken chunk by chunk from the memory-mapped shards, which reads the pages
        of those rows only."""
        if rows is not None:
            rows = np.asarray(rows)
            if rows.size and (
                rows.dtype.kind not in "iu" or rows[0] < 0 or rows[-1] >= self.num_tokens or (np.diff(rows) < 0).any()
            ):
                raise ValueError(f"rows must be sorted row indices in [0, {self.num_tokens})")
            rows = rows.astype(np.int64, copy=False)
        parts = []
        start = 0  # the chunk's first row
        for t in self._tables:
            if name not in t.column_names:
                raise KeyError(name)
            for chunk in t.column(name).chunks:
                if pa.types.is_fixed_size_list(chunk.type):
                    part = _numpy(chunk.flatten()).reshape(-1, chunk.type.list_size)
                else:
                    part = _numpy(chunk)
                if rows is not None:  # this chunk's rows of `rows`, then the next chunk's first row
                    lo, hi = np.searchsorted(rows, (start, start + len(part)))
                    part, start = part[rows[lo:hi] - start], start + len(part)
                parts.append(part)
        if not parts:
            raise KeyError(name)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)  # with `rows`, one part is a copy already

    def tokens(self) -> dict[str, np.ndarray]:
        """`prompt_id` (index into `trace.prompt_ids`), `position`, `phase` (0 prefill, 1 decode), `token_id`: [N]."""
        if not self._tables:
            return {f: np.zeros(0, np.int32) for f in TOKEN_FIELDS}
        return {f: self._column(f) for f in TOKEN_FIELDS}

    @property
    def fields(self) -> tuple[str, ...]:
        return LAYER_FIELDS + (HIDDEN_FIELDS if self.record_hidden else ())

    def layer(self, layer: int, fields: Iterable[str] | None = None, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Decoder layer `layer`'s records: `topk_ids` [N,k], `topk_weights` [N,k] f32, `probs` [N,E] f16,
        and with --record-hidden `hidden_in` [N,H] f16 (router input), `resid` [N,H] f16 (post-attention residual).
        `rows` (sorted row indices [n]): those records only, copies that read no other row's pages."""
        if layer not in self.spec.moe_layers:
            raise ArtifactError(f"layer {layer} is not an MoE layer of this trace; MoE layers: {list(self.spec.moe_layers)}")
        fields = tuple(fields) if fields is not None else self.fields
        bad = [f for f in fields if f not in self.fields]
        if bad:
            extra = " (trace recorded without --record-hidden)" if set(bad) & set(HIDDEN_FIELDS) else ""
            raise ArtifactError(f"trace field {bad[0]!r} not available{extra}; fields: {', '.join(self.fields)}")
        if not self._tables:
            k, E, H = self.spec.top_k, self.spec.num_experts, self.spec.hidden_size
            empty = {
                "topk_ids": (k, np.int16),
                "topk_weights": (k, np.float32),
                "probs": (E, np.float16),
                "hidden_in": (H, np.dtype(self.meta.get("hidden_dtype", "float16"))),
                "resid": (H, np.dtype(self.meta.get("hidden_dtype", "float16"))),
            }
            return {f: np.zeros((0, empty[f][0]), empty[f][1]) for f in fields}
        return {f: self._column(column(f, layer), rows) for f in fields}

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

    def model_folder(self) -> str | None:
        """The checkpoint folder this trace was recorded with, where it still exists (what a stage that was given
        no --model loads); None otherwise."""
        m = self.meta.get("model")
        return str(m) if m and Path(str(m)).is_dir() else None

    def check_model(self, model: Any) -> None:
        """Raise ArtifactError if `model` is not the model this trace was recorded with."""
        from ..artifacts import another_model
        from ..moe import model_fingerprint

        fp = model_fingerprint(model)
        if fp != self.fingerprint:
            raise another_model(f"trace at {self.path}", self.meta, fp, "re-run `moeflow trace` with this --model")
