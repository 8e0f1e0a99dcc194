"""Per-token records -> Arrow shards, appended atomically to a trace folder.

`TraceWriter` turns the records of `record.py` into shards: each shard is written to a temporary
folder and renamed into place, and `meta.json` is rewritten (atomically) only after that, so a
crash at any point leaves the previous valid trace.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..artifacts import META, atomic_dir, check_fingerprint, new_meta, now_iso, write_json_atomic
from ..errors import ArtifactError, MoeflowError
from .format import (
    DATA_FILE,
    FULL_HASH_MAX,
    KIND,
    PROMPTS_KEY,
    SCHEMA,
    TOKEN_FIELDS,
    ends_sha256,
    file_sha256,
    ids_dtype,
    shard_name,
)


def _flat_array(a: np.ndarray) -> pa.Array:
    """A 1-d numpy array as an Arrow array without nulls, sharing its memory (`pa.array` would first import
    pandas, about 2 CPU seconds, to check whether `a` is a pandas object)."""
    a = np.ascontiguousarray(a)
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), len(a), [None, pa.py_buffer(a)])


def _to_table(cols: dict[str, np.ndarray], prompt_ids: list[str]) -> pa.Table:
    arrays, names = [], []
    for name, a in cols.items():
        names.append(name)
        if a.ndim == 1:
            arrays.append(_flat_array(a))
        else:  # [N,w] -> fixed_size_list[w]
            arrays.append(pa.FixedSizeListArray.from_arrays(_flat_array(a.reshape(-1)), a.shape[1]))
    return pa.Table.from_arrays(arrays, names=names, metadata={PROMPTS_KEY: json.dumps(prompt_ids).encode()})


def write_shard(folder: Path, cols: dict[str, np.ndarray], prompt_ids: list[str]) -> dict[str, Any]:
    """Write one shard folder atomically; return its meta entry (name, file, records, bytes, sha256
    and, over FULL_HASH_MAX bytes, sha256_ends). A folder of that name left by a killed run (never
    listed in meta.json) is replaced."""
    table = _to_table(cols, prompt_ids)
    if folder.is_symlink():
        folder.unlink()
    elif folder.exists():
        shutil.rmtree(folder)
    with atomic_dir(folder, versioned=False) as tmp:  # a new shard: one rename, no symlink
        path = tmp / DATA_FILE
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
            w.write_table(table)
        info = {
            "name": folder.name,
            "file": f"{folder.name}/{DATA_FILE}",
            "records": table.num_rows,
            "bytes": path.stat().st_size,
            "sha256": file_sha256(path),
        }
        if info["bytes"] > FULL_HASH_MAX:
            info["sha256_ends"] = ends_sha256(path)
    return info


SHARD_BYTES = 256 << 20


def record_bytes(spec: dict[str, Any], record_hidden: bool) -> int:
    """Bytes of one token record (all MoE layers) in a shard."""
    k, E, H = spec["top_k"], spec["num_experts"], spec["hidden_size"]
    per_layer = k * (np.dtype(ids_dtype(E)).itemsize + 4) + 2 * E + (4 * H if record_hidden else 0)
    return 13 + len(spec["moe_layers"]) * per_layer


def auto_shard_size(spec: dict[str, Any], record_hidden: bool) -> int:
    """Records per shard for shards of about SHARD_BYTES (256 MiB)."""
    return max(1024, SHARD_BYTES // record_bytes(spec, record_hidden))


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """An exclusive lock on `<out>/.lock`, so two runs never append to one trace at once."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(out / ".lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise MoeflowError(f"another `moeflow trace` is writing to {out}; wait for it or choose another --out") from e
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver them to the handlers set before.

    Used around each meta.json update, so an interrupt can never fall between writing a shard and
    listing it (main thread only: elsewhere Python delivers no signals anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: h for s in (signal.SIGINT, signal.SIGTERM) if (h := signal.getsignal(s)) is not None}
    try:
        for s in old:
            signal.signal(s, lambda n, _frame: got.append(n))
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for n in got:
            signal.raise_signal(n)


def _sources_of(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """meta["sources"], or for a trace written before it existed, rebuilt from its `runs`."""
    if isinstance(meta.get("sources"), list):
        return [dict(s) for s in meta["sources"]]
    out: list[dict[str, Any]] = []
    for r in meta.get("runs") or []:
        if isinstance(r, dict) and r.get("prompt_source") is not None:
            _count(
                out,
                {"source": r["prompt_source"], "split": r.get("split"), "column": r.get("column")},
                int(r.get("prompts_added") or 0),
            )
    if not out and meta.get("prompt_source") is not None:
        out.append({"source": meta["prompt_source"], "split": None, "column": None, "prompts": len(meta.get("prompt_ids") or [])})
    return out


def _count(sources: list[dict[str, Any]], key: dict[str, Any], n: int) -> None:
    """Add `n` prompts to the entry of `sources` for `key` (source, split, column), creating it."""
    for s in sources:
        if all(s.get(k) == v for k, v in key.items()):
            s["prompts"] = int(s.get("prompts") or 0) + n
            return
    sources.append({**key, "prompts": n})


class TraceWriter:
    """Appends prompts' records to a trace folder, one atomic shard at a time.

    Use as a context manager; `add()` buffers one prompt, a shard is written whenever
    `shard_size` records are buffered, and on exit (also on Ctrl-C, SIGTERM turned into an
    exception, or any error) whatever is buffered, so every prompt finished so far stays in a
    valid, appendable trace. meta.json records every run (`runs`: source, split, limit, column,
    generation, batch size, shards, prompts added) and `sources`: each (source, split, column) with the number
    of prompts of the trace that came from it.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        *,
        fingerprint: str,
        spec: dict[str, Any],
        record_hidden: bool,
        generation: dict[str, Any],
        prompt_source: str,
        shard_size: int | None = None,
        split: str | None = None,
        limit: int | None = None,
        column: str | None = None,
        hidden_dtype: str = "float16",
        model: str | None = None,
        batch_size: int | None = None,
    ):
        self.out = Path(out)
        self.hidden_dtype = hidden_dtype
        self.model = model  # the --model path, recorded in a new trace's meta (named in wrong-model messages)
        self.shard_size = shard_size or auto_shard_size(spec, record_hidden)
        self._args = (fingerprint, spec, record_hidden, generation)
        self.meta: dict[str, Any] = {}
        self.known: set[str] = set()
        self._buf: list[tuple[str, dict[str, np.ndarray]]] = []
        self._buffered = 0
        self.added_prompts = 0
        self.added_tokens = 0
        self.new_shards: list[str] = []
        self._source = {"source": prompt_source, "split": split, "column": column}
        self._run: dict[str, Any] = {
            "started_at": now_iso(),
            "prompt_source": prompt_source,
            "split": split,
            "limit": limit,
            "column": column,
            "generation": generation,
            "shards": [],
            "prompts_added": 0,
            **({"batch_size": batch_size} if batch_size is not None else {}),
        }
        self._lock: contextlib.ExitStack | None = None
        self._created = False

    def _open(self, verify: bool = True) -> dict[str, Any]:
        """The existing trace's meta (checked against this run; with `verify`, its shards' checksums too),
        or a new one."""
        fingerprint, spec, record_hidden, generation = self._args
        out = self.out
        if out.exists() and not out.is_dir():
            raise ArtifactError(f"--out {out} is a file; pass a folder")
        if (out / META).exists():
            from .reader import Trace  # validates every shard before we add to it

            meta = Trace(out, verify=verify).meta
            check_fingerprint(meta, fingerprint, "the trace", out)
            if bool(meta["record_hidden"]) != record_hidden:
                have = "with" if meta["record_hidden"] else "without"
                raise ArtifactError(
                    f"trace at {out} was recorded {have} --record-hidden; use the same setting to append, or another --out"
                )
            if record_hidden and meta.get("hidden_dtype", "float16") != self.hidden_dtype:
                raise ArtifactError(
                    f"trace at {out} stores hidden states as {meta.get('hidden_dtype', 'float16')}; "
                    f"append with --hidden-dtype {meta.get('hidden_dtype', 'float16')}, or use another --out"
                )
            meta["sources"] = _sources_of(meta)
            meta.pop("prompt_source", None)  # one source per trace was never true after an append
            meta["runs"] = list(meta.get("runs") or [])
            return meta
        if out.is_dir():
            strays = [p.name for p in out.iterdir() if not (p.name.startswith(".") or p.name.startswith("shard-"))]
            if strays:
                raise ArtifactError(
                    f"--out {out} exists and is not a trace folder (holds {strays[0]}); choose an empty or new folder"
                )
        return new_meta(
            KIND,
            SCHEMA,
            fingerprint,
            spec=spec,
            generation=generation,
            record_hidden=record_hidden,
            hidden_dtype=self.hidden_dtype,
            **({"model": str(self.model)} if self.model else {}),
            num_tokens=0,
            prompt_ids=[],
            shards=[],
            sources=[],
            runs=[],
        )

    def __enter__(self) -> TraceWriter:
        self._open(verify=False)  # refuse before creating anything
        self._created = not self.out.exists()
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock = contextlib.ExitStack()
        self._lock.enter_context(_locked(self.out))
        try:
            self.meta = self._open()  # again under the lock: another run may have appended
        except BaseException:
            self._release()
            raise
        self.known = set(self.meta["prompt_ids"])
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.flush()  # keep every finished prompt, also on an interrupt
        finally:
            self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if self._created and not (self.out / META).exists():  # nothing written: leave no folder behind
            with contextlib.suppress(OSError):
                (self.out / ".lock").unlink()
                self.out.rmdir()

    def set_batch_size(self, n: int) -> None:
        """The prompts generated at once from now on (this run's `batch_size` in meta.json, once a shard is written)."""
        self._run["batch_size"] = n

    def has(self, prompt_id: str) -> bool:
        return prompt_id in self.known

    def add(self, prompt_id: str, rows: dict[str, np.ndarray]) -> None:
        """Buffer one prompt's records (without `prompt_id`; the index is assigned at flush)."""
        if prompt_id in self.known:
            return
        self.known.add(prompt_id)
        self._buf.append((prompt_id, rows))
        self._buffered += len(rows["position"])
        if self._buffered >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        """Write the buffered prompts as one shard, then meta.json; SIGINT/SIGTERM wait until both are done."""
        if not self._buf:
            return
        with signals_deferred():
            self._flush()

    def _flush(self) -> None:
        base = len(self.meta["prompt_ids"])
        ids = [pid for pid, _ in self._buf]
        first = self._buf[0][1]
        names = [*TOKEN_FIELDS[1:], *(n for n in first if n not in TOKEN_FIELDS)]  # fixed column order
        cols: dict[str, np.ndarray] = {
            "prompt_id": np.concatenate([np.full(len(r["position"]), base + i, np.int32) for i, (_, r) in enumerate(self._buf)])
        }
        for name in names:
            cols[name] = np.concatenate([r[name] for _, r in self._buf])
        index = max((int(s["name"].rsplit("-", 1)[1]) for s in self.meta["shards"]), default=-1) + 1
        info = write_shard(self.out / shard_name(index), cols, ids)
        info["prompts"] = len(ids)
        run = {
            **self._run,
            "shards": [*self._run["shards"], info["name"]],
            "finished_at": now_iso(),
            "prompts_added": self.added_prompts + len(ids),
        }
        sources = [dict(s) for s in self.meta["sources"]]
        _count(sources, self._source, len(ids))
        meta = dict(self.meta)
        meta["shards"] = [*self.meta["shards"], info]
        meta["prompt_ids"] = [*self.meta["prompt_ids"], *ids]
        meta["num_tokens"] = int(self.meta["num_tokens"]) + info["records"]
        meta["sources"] = sources
        meta["runs"] = [*(r for r in self.meta["runs"] if r is not self._run), run]
        write_json_atomic(self.out / META, meta)
        self.meta, self._run = meta, run
        self.new_shards.append(info["name"])
        self.added_prompts += len(ids)
        self.added_tokens += info["records"]
        self._buf.clear()
        self._buffered = 0
