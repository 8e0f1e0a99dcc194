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
import json
import math
import os
import shutil
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import torch

from ..artifacts import META, atomic_dir, check_fingerprint, new_meta, now_iso, write_json_atomic
from ..errors import ArtifactError, MoeflowError
from ..moe import Adapter, RouterEvent, residual_hooks, router_hooks
from .format import (
    DATA_FILE,
    FULL_HASH_MAX,
    KIND,
    PROMPTS_KEY,
    SCHEMA,
    TOKEN_FIELDS,
    column,
    ends_sha256,
    file_sha256,
    ids_dtype,
    shard_name,
)


class RoutingRecorder:
    """Keeps the routing of every forward pass since the last `take()`, per MoE layer."""

    def __init__(self, adapter: Adapter, record_hidden: bool = False, hidden_dtype: str = "float16"):
        self.adapter = adapter
        self.record_hidden = record_hidden
        self._hidden_dtype = np.dtype(hidden_dtype)  # float16 or float32 (exact router inputs of fp32/bf16 models)
        self._ids_dtype = np.dtype(ids_dtype(adapter.spec.num_experts))
        self._route: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._x: dict[int, list[torch.Tensor]] = {}
        self._resid: dict[int, list[torch.Tensor]] = {}

    def _on_route(self, ev: RouterEvent) -> None:
        self._route.setdefault(ev.layer, []).append((ev.logits, ev.weights, ev.indices))
        if self.record_hidden:
            self._x.setdefault(ev.layer, []).append(ev.x)  # [T,H]
        return None

    @contextlib.contextmanager
    def attach(self) -> Iterator[RoutingRecorder]:
        with contextlib.ExitStack() as stack:
            if self.record_hidden:
                stack.enter_context(residual_hooks(self.adapter, self._on_resid, hint="trace without --record-hidden"))
            stack.enter_context(router_hooks(self.adapter, self._on_route))
            yield self

    def _on_resid(self, layer: int, r: torch.Tensor) -> None:
        self._resid.setdefault(layer, []).append(r)  # [T,H]

    def clear(self) -> None:
        self._route.clear()
        self._x.clear()
        self._resid.clear()

    def take(self, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Per-layer arrays of everything routed since the last call: `topk_ids_<l>` [T,k], ...; with `rows`
        (indices into the T routed rows, in the order the passes ran) only those rows, in that order."""
        out: dict[str, np.ndarray] = {}
        for l in self.adapter.moe_layers:
            parts = self._route.get(l, [])
            if not parts:
                raise RuntimeError(f"layer {l} routed no tokens during generate")
            logits = _cat([p[0] for p in parts], np.float32, rows)  # [T,E]
            logits = logits - logits.max(-1, keepdims=True)
            probs = np.exp(logits)
            probs /= probs.sum(-1, keepdims=True)
            out[column("topk_ids", l)] = _cat([p[2] for p in parts], self._ids_dtype, rows)  # [T,k]
            out[column("topk_weights", l)] = _cat([p[1] for p in parts], np.float32, rows)  # [T,k]
            out[column("probs", l)] = probs.astype(np.float16)  # [T,E]
            if self.record_hidden:
                out[column("hidden_in", l)] = _cat(self._x[l], self._hidden_dtype, rows)  # [T,H]
                out[column("resid", l)] = _cat(self._resid[l], self._hidden_dtype, rows)  # [T,H]
        self.clear()
        return out

    def routed_rows(self) -> list[int]:
        """Rows of each forward pass since the last `take()` (of the first MoE layer): B x tokens per pass."""
        return [p[0].reshape(-1, p[0].shape[-1]).shape[0] for p in self._route.get(self.adapter.moe_layers[0], [])]


def _cat(parts: list[torch.Tensor], dtype: Any, rows: np.ndarray | None = None) -> np.ndarray:
    """Concatenate [.., w] tensors to one [T,w] numpy array of `dtype` (with `rows`: only those rows, [len(rows),w]).

    On CPU this stays in numpy (single-threaded: a handful of tiny torch ops per prompt would each
    wake the intra-op thread pool, which costs more than the work on a busy machine)."""
    parts = [p.reshape(-1, p.shape[-1]) for p in parts]
    if parts[0].device.type != "cpu":
        whole = torch.cat(parts)  # [T,w]
        if rows is not None:
            whole = whole[torch.from_numpy(rows).to(whole.device)]
        return whole.cpu().numpy().astype(dtype, copy=False)
    arrs = [(p.float() if p.dtype == torch.bfloat16 else p).numpy() for p in parts]
    cat = np.concatenate(arrs)  # [T,w]
    return (cat if rows is None else cat[rows]).astype(dtype, copy=False)


def generation_kwargs(gen: dict[str, Any], pad_token_id: int | None) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "max_new_tokens": gen["max_new_tokens"],
        "do_sample": gen["temperature"] > 0,
        "disable_compile": True,
        "pad_token_id": pad_token_id,
    }
    if gen["temperature"] > 0:
        kw.update(temperature=gen["temperature"], top_p=gen["top_p"], top_k=None)
    if gen["repetition_penalty"] != 1.0:
        kw["repetition_penalty"] = gen["repetition_penalty"]
    return kw


def trace_one(
    model: torch.nn.Module,
    recorder: RoutingRecorder,
    input_ids: torch.Tensor,
    gen_kwargs: dict[str, Any],
    seed: int | None = None,
) -> tuple[dict[str, np.ndarray], torch.Tensor]:
    """Generate from one prompt (`input_ids` [1,S], no padding) and return its records and the sequence."""
    if seed is not None:
        torch.manual_seed(seed)
    recorder.clear()
    with torch.no_grad(), recorder.attach():
        seq = cast(Any, model).generate(input_ids, attention_mask=torch.ones_like(input_ids), **gen_kwargs)[0]  # [S+G]
    rows = recorder.take()
    n = next(iter(rows.values())).shape[0]
    S = input_ids.shape[1]
    if n != seq.shape[0] - 1:
        raise RuntimeError(
            f"routed {n} tokens but generate returned {seq.shape[0]} (prompt {S}); "
            f"expected every token but the last to be routed once"
        )
    seq = seq.cpu()
    pos = np.arange(n, dtype=np.int32)
    rows["position"] = pos
    rows["phase"] = (pos >= S).astype(np.int8)
    rows["token_id"] = seq[:n].numpy().astype(np.int32)
    return rows, seq


class RowSampler:
    """A logits processor that samples every row with its own generator, seeded per prompt: generate runs
    greedy and picks the sampled token (the scores it returns are -inf except at the sample).

    Row b draws exactly what `torch.manual_seed(seeds[b])` + a batch-1 `generate(do_sample=True)` draws
    from the same scores (one `torch.multinomial` per step on that generator), so a prompt's sample does
    not depend on the prompts it is batched with."""

    def __init__(self, gen: dict[str, Any], seeds: Sequence[int], device: torch.device):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        self.warpers = LogitsProcessorList()  # the warpers generate(do_sample=True) adds, in its order
        if gen["temperature"] != 1.0:
            self.warpers.append(TemperatureLogitsWarper(gen["temperature"]))
        if gen["top_p"] < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=gen["top_p"]))
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids [B,L] (left-padded), scores [B,V] -> [B,V]: 0 at each row's sample, -inf elsewhere."""
        probs = torch.softmax(self.warpers(cast(Any, input_ids), scores), dim=-1)  # [B,V]
        picks = torch.cat([torch.multinomial(probs[b : b + 1], 1, generator=g) for b, g in enumerate(self.generators)])  # [B,1]
        return torch.full_like(scores, -math.inf).scatter_(1, picks, 0.0)  # [B,V]


def eos_ids(model: torch.nn.Module, gen_kwargs: dict[str, Any]) -> set[int]:
    """The token ids that end a sequence in `generate` (the generation config's eos_token_id)."""
    eos = gen_kwargs.get("eos_token_id", getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def trace_batch(
    model: torch.nn.Module,
    recorder: RoutingRecorder,
    prompts: Sequence[torch.Tensor],
    gen_kwargs: dict[str, Any],
    seeds: Sequence[int] | None = None,
) -> list[tuple[dict[str, np.ndarray], torch.Tensor]]:
    """Generate from several prompts (each [1,S_b], no padding) in one left-padded batch and return, per prompt,
    its records and its sequence [S_b+G_b], exactly as `trace_one` lays them out: the rows of its real tokens
    (pads, and the steps after its end-of-sequence token, excluded). With `seeds` (one per prompt) it samples
    each prompt with its own generator (`RowSampler`); without, `gen_kwargs` decide (greedy)."""
    B = len(prompts)
    lens = [int(p.shape[1]) for p in prompts]
    S = max(lens)
    device = prompts[0].device
    pad = gen_kwargs.get("pad_token_id")
    input_ids = torch.full((B, S), 0 if pad is None else int(pad), dtype=prompts[0].dtype, device=device)  # [B,S]
    mask = torch.zeros((B, S), dtype=torch.long, device=device)  # [B,S]
    for b, p in enumerate(prompts):
        input_ids[b, S - lens[b] :] = p[0]
        mask[b, S - lens[b] :] = 1
    kw = dict(gen_kwargs)
    if seeds is not None:
        from transformers import LogitsProcessorList

        gen = {"temperature": kw.pop("temperature", 1.0), "top_p": kw.pop("top_p", 1.0)}
        kw.pop("top_k", None)
        kw.update(do_sample=False, logits_processor=LogitsProcessorList([RowSampler(gen, seeds, device)]))
    recorder.clear()
    with torch.no_grad(), recorder.attach():
        seq = cast(Any, model).generate(input_ids, attention_mask=mask, **kw).cpu()  # [B,S+G]
    G = seq.shape[1] - S
    passes = recorder.routed_rows()
    if passes != [B * S] + [B] * (G - 1):
        recorder.clear()
        raise RuntimeError(
            f"routed {passes[:3]}... rows per forward pass but generate returned {G} new tokens for {B} prompts of "
            f"{S} (padded); expected {B * S}, then {B} per decode step"
        )
    eos = eos_ids(model, gen_kwargs)
    gens, index = [], []
    for b in range(B):
        new = seq[b, S:].tolist()
        g = next((i + 1 for i, t in enumerate(new) if t in eos), G)  # tokens generated, its end-of-sequence included
        gens.append(g)
        prefill = np.arange(b * S + S - lens[b], (b + 1) * S)  # its real prompt rows of the padded prefill
        decode = B * S + np.arange(g - 1) * B + b  # its row of decode passes 1 .. g-1 (the last new token is not routed)
        index.append(np.concatenate([prefill, decode]))
    rows = recorder.take(np.concatenate(index))
    out, start = [], 0
    for b in range(B):
        n = len(index[b])
        mine = {k: v[start : start + n] for k, v in rows.items()}
        start += n
        full = torch.cat([seq[b, S - lens[b] : S], seq[b, S : S + gens[b]]])  # [S_b+G_b]
        pos = np.arange(n, dtype=np.int32)
        mine["position"] = pos
        mine["phase"] = (pos >= lens[b]).astype(np.int8)
        mine["token_id"] = full[:n].numpy().astype(np.int32)
        out.append((mine, full))
    return out


# ---- the trace folder ----------------------------------------------------------------------------


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
