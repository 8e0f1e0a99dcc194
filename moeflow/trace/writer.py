"""Router hooks -> per-token records -> Arrow shards, appended atomically to a trace folder.

`RoutingRecorder` hooks every MoE router (and, with hidden states, the decoder layer's
`post_attention_layernorm`, whose input is the residual stream after the attention add; verified
for all 8 supported architectures in tests/test_trace.py) and keeps what one prompt's `generate`
routes. `TraceWriter` turns those records into shards: each shard is written to a temporary
folder and renamed into place, and `meta.json` is rewritten (atomically) only after that, so a
crash at any point leaves the previous valid trace.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import torch

from ..artifacts import META, atomic_dir, check_fingerprint, new_meta, now_iso, write_json_atomic
from ..errors import ArtifactError, MoeflowError
from ..moe import Adapter, RouterEvent, router_hooks
from .format import DATA_FILE, KIND, SCHEMA, TOKEN_FIELDS, column, ids_dtype, shard_name


class RoutingRecorder:
    """Keeps the routing of every forward pass since the last `take()`, per MoE layer."""

    def __init__(self, adapter: Adapter, record_hidden: bool = False):
        self.adapter = adapter
        self.record_hidden = record_hidden
        self._ids_dtype = np.dtype(ids_dtype(adapter.spec.num_experts))
        self._route: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._x: dict[int, list[torch.Tensor]] = {}
        self._resid: dict[int, list[torch.Tensor]] = {}

    def _on_route(self, ev: RouterEvent) -> None:
        self._route.setdefault(ev.layer, []).append((ev.logits, ev.weights, ev.indices))
        if self.record_hidden:
            self._x.setdefault(ev.layer, []).append(ev.x)                 # [T,H]
        return None

    @contextlib.contextmanager
    def attach(self) -> Iterator["RoutingRecorder"]:
        handles = []
        try:
            if self.record_hidden:
                for l in self.adapter.moe_layers:
                    norm = getattr(self.adapter.layers[l], "post_attention_layernorm", None)
                    if norm is None:
                        raise MoeflowError(f"{self.adapter.spec.arch} layer {l} has no post_attention_layernorm; "
                                           f"trace without --record-hidden")
                    handles.append(norm.register_forward_pre_hook(self._resid_hook(l)))
            with router_hooks(self.adapter, self._on_route):
                yield self
        finally:
            for h in handles:
                h.remove()

    def _resid_hook(self, layer: int):
        def hook(module, args):
            r = args[0].detach()
            self._resid.setdefault(layer, []).append(r.reshape(-1, r.shape[-1]))  # [T,H]
        return hook

    def clear(self) -> None:
        self._route.clear()
        self._x.clear()
        self._resid.clear()

    def take(self) -> dict[str, np.ndarray]:
        """Per-layer arrays of everything routed since the last call: `topk_ids_<l>` [T,k], ..."""
        out: dict[str, np.ndarray] = {}
        for l in self.adapter.moe_layers:
            parts = self._route.get(l, [])
            if not parts:
                raise RuntimeError(f"layer {l} routed no tokens during generate")
            logits = _cat([p[0] for p in parts], np.float32)                 # [T,E]
            logits = logits - logits.max(-1, keepdims=True)
            probs = np.exp(logits)
            probs /= probs.sum(-1, keepdims=True)
            out[column("topk_ids", l)] = _cat([p[2] for p in parts], self._ids_dtype)      # [T,k]
            out[column("topk_weights", l)] = _cat([p[1] for p in parts], np.float32)       # [T,k]
            out[column("probs", l)] = probs.astype(np.float16)                            # [T,E]
            if self.record_hidden:
                out[column("hidden_in", l)] = _cat(self._x[l], np.float16)                 # [T,H]
                out[column("resid", l)] = _cat(self._resid[l], np.float16)                 # [T,H]
        self.clear()
        return out


def _cat(parts: list[torch.Tensor], dtype: Any) -> np.ndarray:
    """Concatenate [.., w] tensors to one [T,w] numpy array of `dtype`.

    On CPU this stays in numpy (single-threaded: a handful of tiny torch ops per prompt would each
    wake the intra-op thread pool, which costs more than the work on a busy machine)."""
    parts = [p.reshape(-1, p.shape[-1]) for p in parts]
    if parts[0].device.type != "cpu":
        return torch.cat(parts).cpu().numpy().astype(dtype, copy=False)
    arrs = [(p.float() if p.dtype == torch.bfloat16 else p).numpy() for p in parts]
    return np.concatenate(arrs).astype(dtype, copy=False)


def generation_kwargs(gen: dict[str, Any], pad_token_id: int | None) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_new_tokens": gen["max_new_tokens"], "do_sample": gen["temperature"] > 0,
                          "disable_compile": True, "pad_token_id": pad_token_id}
    if gen["temperature"] > 0:
        kw.update(temperature=gen["temperature"], top_p=gen["top_p"], top_k=None)
    if gen["repetition_penalty"] != 1.0:
        kw["repetition_penalty"] = gen["repetition_penalty"]
    return kw


def trace_one(model: torch.nn.Module, recorder: RoutingRecorder, input_ids: torch.Tensor,
              gen_kwargs: dict[str, Any], seed: int | None = None) -> tuple[dict[str, np.ndarray], torch.Tensor]:
    """Generate from one prompt (`input_ids` [1,S], no padding) and return its records and the sequence."""
    if seed is not None:
        torch.manual_seed(seed)
    recorder.clear()
    with torch.no_grad(), recorder.attach():
        seq = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **gen_kwargs)[0]  # [S+G]
    rows = recorder.take()
    n = next(iter(rows.values())).shape[0]
    S = input_ids.shape[1]
    if n != seq.shape[0] - 1:
        raise RuntimeError(f"routed {n} tokens but generate returned {seq.shape[0]} (prompt {S}); "
                           f"expected every token but the last to be routed once")
    seq = seq.cpu()
    pos = np.arange(n, dtype=np.int32)
    rows["position"] = pos
    rows["phase"] = (pos >= S).astype(np.int8)
    rows["token_id"] = seq[:n].numpy().astype(np.int32)
    return rows, seq


# ---- the trace folder ----------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _to_table(cols: dict[str, np.ndarray]) -> pa.Table:
    arrays, names = [], []
    for name, a in cols.items():
        names.append(name)
        if a.ndim == 1:
            arrays.append(pa.array(a))
        else:                                                   # [N,w] -> fixed_size_list[w]
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(a).reshape(-1)), a.shape[1]))
    return pa.Table.from_arrays(arrays, names=names)


def write_shard(folder: Path, cols: dict[str, np.ndarray]) -> dict[str, Any]:
    """Write one shard folder atomically; return its meta entry (name, records, bytes, sha256)."""
    table = _to_table(cols)
    with atomic_dir(folder) as tmp:
        path = tmp / DATA_FILE
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
            w.write_table(table)
        info = {"name": folder.name, "file": f"{folder.name}/{DATA_FILE}", "records": table.num_rows,
                "bytes": path.stat().st_size, "sha256": _sha256(path)}
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


class TraceWriter:
    """Appends prompts' records to a trace folder, one atomic shard at a time.

    Use as a context manager; `add()` buffers one prompt, a shard is written whenever
    `shard_size` records are buffered, and on exit (also on Ctrl-C) whatever is buffered.
    """

    def __init__(self, out: str | os.PathLike, *, fingerprint: str, spec: dict[str, Any], record_hidden: bool,
                 generation: dict[str, Any], prompt_source: str, shard_size: int | None = None):
        self.out = Path(out)
        self.shard_size = shard_size or auto_shard_size(spec, record_hidden)
        self._args = (fingerprint, spec, record_hidden, generation, prompt_source)
        self.meta: dict[str, Any] = {}
        self.known: set[str] = set()
        self._buf: list[tuple[str, dict[str, np.ndarray]]] = []
        self._buffered = 0
        self.added_prompts = 0
        self.added_tokens = 0
        self.new_shards: list[str] = []
        self._run = {"started_at": now_iso(), "prompt_source": prompt_source, "generation": generation,
                     "shards": self.new_shards}
        self._lock: contextlib.ExitStack | None = None
        self._created = False

    def _open(self) -> dict[str, Any]:
        """The existing trace's meta (checked against this run), or a new one."""
        fingerprint, spec, record_hidden, generation, prompt_source = self._args
        out = self.out
        if out.exists() and not out.is_dir():
            raise ArtifactError(f"--out {out} is a file; pass a folder")
        if (out / META).exists():
            from .reader import Trace  # validates every shard before we add to it
            meta = Trace(out).meta
            check_fingerprint(meta, fingerprint, "the trace", out)
            if bool(meta["record_hidden"]) != record_hidden:
                have = "with" if meta["record_hidden"] else "without"
                raise ArtifactError(f"trace at {out} was recorded {have} --record-hidden; use the same setting "
                                    f"to append, or another --out")
            return meta
        if out.is_dir():
            strays = [p.name for p in out.iterdir() if not (p.name.startswith(".") or p.name.startswith("shard-"))]
            if strays:
                raise ArtifactError(f"--out {out} exists and is not a trace folder (holds {strays[0]}); "
                                    f"choose an empty or new folder")
        return new_meta(KIND, SCHEMA, fingerprint, spec=spec, prompt_source=prompt_source, generation=generation,
                        record_hidden=record_hidden, num_tokens=0, prompt_ids=[], shards=[], runs=[])

    def __enter__(self) -> "TraceWriter":
        self._open()                                   # refuse before creating anything
        self._created = not self.out.exists()
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock = contextlib.ExitStack()
        self._lock.enter_context(_locked(self.out))
        try:
            self.meta = self._open()                   # again under the lock: another run may have appended
        except BaseException:
            self._release()
            raise
        self.known = set(self.meta["prompt_ids"])
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.flush()
        finally:
            self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if self._created and not (self.out / META).exists():   # nothing written: leave no folder behind
            with contextlib.suppress(OSError):
                (self.out / ".lock").unlink()
                self.out.rmdir()

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
        if not self._buf:
            return
        base = len(self.meta["prompt_ids"])
        first = self._buf[0][1]
        names = [*TOKEN_FIELDS[1:], *(n for n in first if n not in TOKEN_FIELDS)]   # fixed column order
        cols: dict[str, np.ndarray] = {
            "prompt_id": np.concatenate([np.full(len(r["position"]), base + i, np.int32)
                                         for i, (_, r) in enumerate(self._buf)])}
        for name in names:
            cols[name] = np.concatenate([r[name] for _, r in self._buf])
        index = max((int(s["name"].rsplit("-", 1)[1]) for s in self.meta["shards"]), default=-1) + 1
        info = write_shard(self.out / shard_name(index), cols)
        info["prompts"] = len(self._buf)
        meta = dict(self.meta)
        meta["shards"] = [*self.meta["shards"], info]
        meta["prompt_ids"] = [*self.meta["prompt_ids"], *(pid for pid, _ in self._buf)]
        meta["num_tokens"] = int(self.meta["num_tokens"]) + info["records"]
        self.new_shards.append(info["name"])
        self._run.update(finished_at=now_iso(), prompts_added=self.added_prompts + len(self._buf))
        meta["runs"] = [r for r in self.meta["runs"] if r is not self._run] + [self._run]
        write_json_atomic(self.out / META, meta)
        self.meta = meta
        self.added_prompts += len(self._buf)
        self.added_tokens += info["records"]
        self._buf.clear()
        self._buffered = 0
