"""Routing data for predictors: the traced arrays of `moeflow.trace.Trace`, held in memory.

`RoutingData` is what every predictor fits on and what the evaluation scores against. It is
built from a trace folder (`from_trace`, via `moeflow.trace.Trace`):

    prompt_id, position, phase, token_id    [N]
    layers[l].topk_ids [N,k] int64, topk_weights [N,k] f32, probs [N,E] f16,
              hidden_in [N,H] f16 | None (router input), resid [N,H] f16 | None (post-attention residual)

Rows are token records in one fixed order for all layers. `SourceBatch` is what a predictor may
look at when it runs at a source layer; `batch_from_rows` builds one from traced rows, the
runtime policies build one from a `LayerContext`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ..errors import ArtifactError
from ..moe import MoESpec


@dataclass
class LayerArrays:
    topk_ids: np.ndarray  # [N,k] int64
    topk_weights: np.ndarray  # [N,k] float32
    probs: np.ndarray  # [N,E] float16
    hidden_in: np.ndarray | None = None  # [N,H] router input
    resid: np.ndarray | None = None  # [N,H] post-attention residual

    def take(self, rows: np.ndarray) -> LayerArrays:
        return LayerArrays(
            self.topk_ids[rows],
            self.topk_weights[rows],
            self.probs[rows],
            None if self.hidden_in is None else self.hidden_in[rows],
            None if self.resid is None else self.resid[rows],
        )


@dataclass
class RoutingData:
    spec: MoESpec
    prompt_id: np.ndarray  # [N]
    position: np.ndarray  # [N]
    phase: np.ndarray  # [N] 0 prefill, 1 decode
    token_id: np.ndarray  # [N]
    layers: dict[int, LayerArrays]
    fingerprint: str | None = None  # model fingerprint recorded by the trace
    source: str = ""  # where it came from (trace folder)
    trace_fingerprint: str | None = None
    trace_tokens: int = 0  # tokens of the whole trace it came from (more than `n` where `from_trace` drew prompts)

    @property
    def n(self) -> int:
        return int(self.token_id.shape[0])

    @property
    def has_hidden(self) -> bool:
        return all(a.hidden_in is not None and a.resid is not None for a in self.layers.values())

    def take(self, rows: np.ndarray) -> RoutingData:
        return replace(
            self,
            prompt_id=self.prompt_id[rows],
            position=self.position[rows],
            phase=self.phase[rows],
            token_id=self.token_id[rows],
            layers={l: a.take(rows) for l, a in self.layers.items()},
        )

    def split(self, holdout: float, seed: int) -> tuple[RoutingData, RoutingData]:
        """(train, held-out) by whole prompts: no prompt has tokens on both sides (`split_rows`); copies."""
        train, held = split_rows(self.prompt_id, holdout, seed)
        return self.take(train), self.take(held)

    def context(self, window: int, rows: np.ndarray | None = None) -> np.ndarray:
        """[n,window] token ids of the last `window` tokens of each record's prompt (this one last; -1 pad), for
        `rows` (default every record)."""
        pid, pos = (self.prompt_id, self.position) if rows is None else (self.prompt_id[rows], self.position[rows])
        ctx = np.full((len(pid), window), -1, dtype=np.int64)
        ctx[:, -1] = self.token_id if rows is None else self.token_id[rows]
        if window < 2:
            return ctx
        key = {(int(p), int(q)): int(t) for p, q, t in zip(self.prompt_id, self.position, self.token_id)}
        for j in range(1, window):
            ctx[:, window - 1 - j] = [key.get((int(p), int(q) - j), -1) for p, q in zip(pid, pos)]
        return ctx

    def rank_pairs(self, max_s: int) -> list[tuple[int, int]]:
        """(source layer, S) for every S in 1..max_s that stays inside the model."""
        ml = self.spec.moe_layers
        return [(ml[r], s) for s in range(1, max_s + 1) for r in range(len(ml) - s)]


def split_rows(prompt_id: np.ndarray, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, held-out rows), each sorted, of records with prompt ids `prompt_id` [N], split by whole prompts:
    `holdout` of the prompts (at least 1, and at least 1 left to train on) drawn with `seed`."""
    prompts = np.unique(prompt_id)
    if len(prompts) < 2:
        raise ArtifactError(f"the trace has {len(prompts)} prompt(s); a held-out split needs at least 2 (trace more prompts)")
    rng = np.random.default_rng(seed)
    n_out = min(len(prompts) - 1, max(1, round(holdout * len(prompts))))
    out = set(rng.choice(prompts, size=n_out, replace=False).tolist())
    mask = np.isin(prompt_id, list(out))
    return np.flatnonzero(~mask), np.flatnonzero(mask)


def target_of(spec: MoESpec, source: int, s: int) -> int:
    r = spec.moe_layers.index(source)
    return spec.moe_layers[r + s]


# ---- reading a trace folder ---------------------------------------------------------------------


def _copy(x: np.ndarray | None) -> np.ndarray | None:
    return None if x is None else np.array(x, copy=True)  # writable (the reader's arrays may be memory-mapped)


def prompt_rows(prompt_id: np.ndarray, max_tokens: int | None, seed: int) -> np.ndarray | None:
    """Rows [n] (in trace order) of whole prompts drawn at random (`seed`) until they hold at least `max_tokens`
    tokens, and at least 2 prompts (a held-out split needs them); None (all rows) where the trace holds no more, or
    `max_tokens` is None or 0."""
    if not max_tokens or len(prompt_id) <= max_tokens:  # None or 0: every row
        return None
    prompts, counts = np.unique(prompt_id, return_counts=True)
    order = np.random.default_rng(seed).permutation(len(prompts))
    n = max(2, int(np.searchsorted(np.cumsum(counts[order]), max_tokens)) + 1)
    return np.flatnonzero(np.isin(prompt_id, prompts[order[:n]]))


def from_trace(path: Any, *, need_hidden: bool = False, max_tokens: int | None = None, seed: int = 0) -> RoutingData:
    """Load a `moeflow trace` folder into memory (numpy arrays). `max_tokens` (None or 0: all): where the trace holds more tokens,
    only the rows of whole prompts drawn at random (`prompt_rows`), read from the memory-mapped shards without
    touching the other rows (`Trace.layer(rows=...)`), so a long trace's hidden states ([N,H] per MoE layer, twice)
    need not fit in memory. `path`: a trace folder, or a `Trace` already open."""
    tr, toks = _open(path, need_hidden)
    return _read(tr, toks, prompt_rows(np.asarray(toks["prompt_id"]), max_tokens, seed))


def split_from_trace(
    path: Any, holdout: float, seed: int, *, need_hidden: bool = False, max_tokens: int | None = None
) -> tuple[RoutingData, RoutingData]:
    """`from_trace(path, ...).split(holdout, seed)`, the same two parts, each read from the trace's shards on its
    own: the loaded rows are never held twice (the whole load and its two copies). `path`: as `from_trace`'s."""
    tr, toks = _open(path, need_hidden)
    pid = np.asarray(toks["prompt_id"])
    rows = prompt_rows(pid, max_tokens, seed)
    rows = np.arange(len(pid)) if rows is None else rows
    train, held = split_rows(pid[rows], holdout, seed)
    return _read(tr, toks, rows[train]), _read(tr, toks, rows[held])


def token_bytes(tr: Any) -> int:
    """Bytes one token of trace `tr` takes once loaded (`_read`'s arrays): per MoE layer its top-k ids (int64) and
    weights (float32), its router probabilities (float16) and, where recorded, its two hidden states ([H] each, in the
    trace's dtype); its prompt id, position and token id (int64) and phase (int8)."""
    spec = tr.spec
    per_layer = spec.top_k * (8 + 4) + spec.num_experts * 2
    if tr.record_hidden:
        per_layer += 2 * spec.hidden_size * np.dtype(tr.meta.get("hidden_dtype", "float16")).itemsize
    return spec.num_moe_layers * per_layer + 3 * 8 + 1


def _open(path: Any, need_hidden: bool) -> tuple[Any, dict[str, np.ndarray]]:
    """(the trace at `path`, or `path` itself where it is an open `Trace`, its token columns); refuses a trace without
    hidden states where they are needed."""
    try:
        from ..trace import Trace
    except ImportError as e:  # the trace stage is not in this checkout
        raise ArtifactError(f"cannot read traces: moeflow.trace.Trace is missing ({e})") from e
    tr = path if isinstance(path, Trace) else Trace(path)
    if need_hidden and not tr.record_hidden:
        raise ArtifactError(
            f"trace {tr.path} has no hidden states; re-run `moeflow trace --record-hidden` "
            "(needed by pregate, router-pf, estimator and hybrid) or pass --only forest"
        )
    return tr, tr.tokens()


def _read(tr: Any, toks: dict[str, np.ndarray], rows: np.ndarray | None) -> RoutingData:
    """The records `rows` (sorted; None: every one) of trace `tr` as numpy arrays of their own."""
    spec = tr.spec
    pick = slice(None) if rows is None else rows
    copy = _copy if rows is None else (lambda x: x)  # the reader's `rows` are copies already
    layers: dict[int, LayerArrays] = {}
    for l in spec.moe_layers:
        la = tr.layer(l, rows=rows)
        layers[l] = LayerArrays(
            np.asarray(la["topk_ids"]).astype(np.int64),
            np.asarray(la["topk_weights"]).astype(np.float32),
            np.asarray(la["probs"]),
            copy(la.get("hidden_in")),
            copy(la.get("resid")),
        )
    meta = tr.meta
    shards = "".join(str(s_.get("sha256", "")) for s_ in meta.get("shards", []))
    return RoutingData(
        spec,
        np.asarray(toks["prompt_id"])[pick].astype(np.int64),
        np.asarray(toks["position"])[pick].astype(np.int64),
        np.asarray(toks["phase"])[pick],
        np.asarray(toks["token_id"])[pick].astype(np.int64),
        layers,
        fingerprint=meta.get("model_fingerprint"),
        source=str(tr.path),
        trace_fingerprint=hashlib.sha256(shards.encode()).hexdigest()[:16],
        trace_tokens=len(toks["prompt_id"]),
    )


# ---- what a predictor sees at a source layer ------------------------------------------------------


@dataclass
class SourceBatch:
    """What is known when MoE layer `layer` has routed, for T tokens of one forward pass."""

    layer: int  # source decoder layer
    router_input: torch.Tensor  # [T,H] this layer's router input
    topk_ids: torch.Tensor  # [T,k] experts this layer chose
    topk_weights: torch.Tensor  # [T,k]
    residual: torch.Tensor | None = None  # [T,H] post-attention residual of this layer
    token_ctx: torch.Tensor | None = None  # [T,w] last w token ids (this one last, -1 pad)
    history: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer <= source -> topk ids [T,k]
    route: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    # ^ router logits of a layer for inputs [T,H]; the runtime passes `LayerContext.predict_logits`
    #   (which keeps the engine's router hooks out of it); None = call the model's router directly
    history_rows: np.ndarray | None = None  # [T,c] int64 rank x E + expert of every id in `history`, layer by layer
    #   (the policy's per-pass buffer, so a decode call converts no tensor); None = the runners derive it from `history`
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None  # (residual [T,H] float32, router
    #   input [T,H] float32, topk weights [T,k] float32, topk ids [T,k] int64) as C-contiguous host numpy, the same
    #   values as the tensors above (the policy's one conversion per layer, so the runners' compiled calls touch no
    #   tensor); None = the runners convert the tensors

    def router_logits(self, adapter, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Router logits [T,E] of `layer` for x [T,H], in the router's dtype."""
        x = x.to(adapter.router_weight(layer).dtype)
        return (self.route or adapter.router_logits)(layer, x)

    @property
    def t(self) -> int:
        a = self.arrays
        return int(self.topk_ids.shape[0]) if a is None else a[3].shape[0]


def batch_from_rows(data: RoutingData, layer: int, rows: np.ndarray | slice, *, ctx: np.ndarray | None = None) -> SourceBatch:
    """A SourceBatch for traced rows at source layer `layer` (history: all MoE layers up to it)."""
    a = data.layers[layer]

    def f(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x[rows])).float()

    hist = {l: torch.from_numpy(data.layers[l].topk_ids[rows]) for l in data.spec.moe_layers if l <= layer}
    return SourceBatch(
        layer,
        f(a.hidden_in) if a.hidden_in is not None else torch.zeros(0),
        torch.from_numpy(a.topk_ids[rows]),
        torch.from_numpy(a.topk_weights[rows]).float(),
        residual=None if a.resid is None else f(a.resid),
        token_ctx=None if ctx is None else torch.from_numpy(ctx[rows]),
        history=hist,
    )


def iter_chunks(n: int, size: int) -> Iterable[slice]:
    for i in range(0, n, size):
        yield slice(i, min(n, i + size))
