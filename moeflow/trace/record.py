"""Router hooks -> per-token records: what one `generate` (one prompt, or a batch of prompts) routes.

`RoutingRecorder` hooks every MoE router (and, with hidden states, the decoder layer's
`post_attention_layernorm`, whose input is the residual stream after the attention add; verified
for every supported architecture in tests/test_trace.py) and keeps what one prompt's `generate`
routes; `trace_one` / `trace_batch` run the generation and return the rows that `TraceWriter`
(`writer.py`) appends to a trace folder.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np
import torch

from ..models import no_cudnn_attention
from ..moe import Adapter, RouterEvent, residual_hooks, router_hooks
from .format import (
    column,
    ids_dtype,
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
    with torch.no_grad(), recorder.attach(), no_cudnn_attention():  # the attention `moeflow run` decodes with
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
    with torch.no_grad(), recorder.attach(), no_cudnn_attention():
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
