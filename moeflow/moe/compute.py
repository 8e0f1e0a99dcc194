"""Routed-expert compute: the one implementation the offload engine and expert-parallel execution share.

transformers' `grouped_mm` experts forward, in three steps so a caller
can put the routed rows wherever its experts' weights live (device slots, the host store, a rank's shard):

1. `sort_routing(top_k_index [T,k])` -> (expert ids [S], perm [S]): the S = T*k (token, expert) rows sorted
   by expert id with `torch.sort`, exactly as `grouped_mm` sorts them; row i is token `perm[i] // k`.
2. `grouped_experts(module, x [N,H], expert_ids [N], weights, rows [N], groups)` -> [N,H]: up/gate projection,
   gate or activation, down projection, biases per row, post-expert norm, with ONE group per distinct
   expert of `expert_ids` (the routed experts only: never all E, never all slots); each group's weights are
   gathered (`index_select`) from `weights` (per-parameter stacks `[R, ...]`) at the group's `rows` entry.
   The kernel is transformers' grouped linear, through the version-checked shim `moeflow.moe.tx_compat`.
   `grouped_experts_in_place(module, x, weights, rows, span=(lo, hi))`: the same when the caller knows each
   expert's entry lies above the previous one's within lo..hi-1 (a staged prefill wave whose slots ascend): the
   weights are read in place, `weights[name][lo:hi]`, one group per entry (unused entries are empty groups).
   `SpanViews` makes those reads once per span (the entries `lo..hi-1` and the `[lo:hi]` views).
3. `combine(out [n,H], positions [n], weights [S], tokens, k, dtype)` -> [tokens,H]: the rows put back in
   (token, slot) order, each times its gate weight and summed over the k slots of each token, as `grouped_mm` does.

`routed_experts_forward(hidden, top_k_index, top_k_weights, compute)` chains the three in one process.
`entry_sorted_forward(module, hidden, top_k_index, top_k_weights, table, weights, span)` is the same call when
every routed expert has an entry of `weights` (`table [E]`) within a span of at most `MAX_GROUPS` entries: the
rows are sorted by entry instead of by expert id (`sort_by_entry`) and the weights read in place, never gathered.
Each group holds exactly the rows, in exactly the order, it has in the stock call, so every caller is
bit-identical to `grouped_mm`. No host synchronization and no tensor built from a Python list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import tx_compat

MAX_GROUPS = 1024  # the most groups `torch._grouped_mm` accepts on CUDA: a wider span is gathered instead


class Aranges:
    """`torch.arange(n)` per size and device, made once (no allocation per call on the decode path)."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, n: int, device: torch.device) -> torch.Tensor:
        a = self._made.get((n, device))
        if a is None:
            a = self._made[(n, device)] = torch.arange(n, device=device)
        return a


class SpanViews:
    """The in-place reads of a span `(lo, hi)` of the stacked `weights`, made once per span: the entries
    `lo..hi-1` as a tensor `[hi-lo]` and each weight's `[lo:hi]` view (views: no copy, no op per call).
    Holds at most `keep` spans (then starts over)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], keep: int = 256) -> None:
        self.weights, self.keep = weights, keep
        self._made: dict[tuple[int, int], tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}

    def __call__(self, span: tuple[int, int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        made = self._made.get(span)
        if made is None:
            if len(self._made) >= self.keep:
                self._made.clear()
            lo, hi = span
            views = {name: w[lo:hi] for name, w in self.weights.items()}  # [hi-lo, ...] each
            dev = next(iter(self.weights.values())).device
            made = self._made[span] = (torch.arange(lo, hi, device=dev), views)
        return made


def sort_routing(top_k_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [S] ascending, perm [S]) of the routing [T,k] flattened to S = T*k rows, as `grouped_mm`."""
    return torch.sort(top_k_index.reshape(-1))


def sort_by_entry(top_k_index: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(entries [S] ascending, perm [S]): the routing [T,k]'s S = T*k rows sorted by their expert's entry
    `table [E]` (a slot), each expert's rows in the order `grouped_mm` gives them. One token (T = 1): one
    sort of the entries (rows of one expert are copies of the same token, so their order cannot matter);
    more: the stock sort, then a stable sort by entry (each expert's rows keep the stock order)."""
    if top_k_index.shape[0] == 1:
        return torch.sort(table[top_k_index.reshape(-1)])
    expert_ids, perm = sort_routing(top_k_index)  # [S], [S] the stock order
    entries, within = torch.sort(table[expert_ids], stable=True)  # [S], [S]
    return entries, perm[within]


def grouped_experts(
    module: Any,
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: Mapping[str, torch.Tensor],
    rows: torch.Tensor,
    groups: int,
    arange: Callable[[int, torch.device], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The experts of `module` over `x [N,H]`, rows sorted by expert id `expert_ids [N]`; -> [N,H].

    `weights`: name -> `[R, ...]` stacked per-expert parameters (the experts module's names: `gate_up_proj` or
    `up_proj`, `down_proj`, their `_bias`); `rows [N]`: the entry of `weights` holding each row's expert (a
    slot, a host row, a shard index); `groups` >= the number of distinct experts in `expert_ids` (extra
    groups are empty). `module` gives the flags and the activation (`has_gate`, `has_bias`,
    `is_transposed`, `_apply_gate` / `act_fn`, `has_post_expert_norm`, `post_expert_norm`).
    """
    N = expert_ids.numel()
    if N == 0 or groups == 0:
        return x.new_zeros(N, x.shape[-1])
    up = "gate_up_proj" if module.has_gate else "up_proj"
    w_up, w_down, offsets = _gathered(weights, up, expert_ids, rows, groups, arange)
    return _experts_mm(module, x, weights, up, w_up, w_down, offsets, rows)


def grouped_experts_in_place(
    module: Any,
    x: torch.Tensor,
    weights: Mapping[str, torch.Tensor],
    rows: torch.Tensor,
    span: tuple[int, int],
    arange: Callable[[int, torch.device], torch.Tensor] | None = None,
    spans: SpanViews | None = None,
) -> torch.Tensor:
    """`grouped_experts` when the caller knows that the entries `rows [N]` ascend with the rows (each expert's entry
    above the previous expert's) within `span = (lo, hi)`: the weights are read in place, `weights[name][lo:hi]`
    with one group per entry (an entry no row uses is an empty group, as the stock call's unrouted experts), not
    gathered per group. Each group holds the same rows in the same order, so the result is bit-identical.
    `spans`: `SpanViews` over the same `weights` (the span's entries and views made once; ignored over others). -> [N,H]."""
    N = rows.numel()
    if N == 0:
        return x.new_zeros(N, x.shape[-1])
    lo, hi = span
    up = "gate_up_proj" if module.has_gate else "up_proj"
    if spans is not None and spans.weights is weights:
        steps, views = spans(span)  # [hi-lo] entries, weights [hi-lo, ...]
        w_up, w_down = views[up], views["down_proj"]
    else:
        dev = rows.device
        steps = arange(hi, dev)[lo:] if arange is not None else torch.arange(lo, hi, device=dev)  # [hi-lo] entries
        w_up, w_down = weights[up][lo:hi], weights["down_proj"][lo:hi]
    offsets = torch.searchsorted(rows, steps, right=True, out_int32=True)  # [hi-lo] end row of each entry
    return _experts_mm(module, x, weights, up, w_up, w_down, offsets, rows)


def _experts_mm(
    module: Any,
    x: torch.Tensor,
    weights: Mapping[str, torch.Tensor],
    up: str,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """The grouped kernels over `x [N,H]` with the groups' weights `w_up`, `w_down` `[G, ...]` and end rows
    `offsets [G]`; biases per row from `weights` at `rows [N]`. -> [N,H]."""
    bias = weights[up + "_bias"][rows] if module.has_bias else None  # [N, 2I] or [N, I]
    proj = tx_compat.grouped_linear(x, w_up, offsets, bias=bias, is_transposed=module.is_transposed)  # [N, 2I] or [N, I]
    proj = module._apply_gate(proj) if module.has_gate else module.act_fn(proj)  # [N, I]
    bias = weights["down_proj_bias"][rows] if module.has_bias else None  # [N, H]
    proj = tx_compat.grouped_linear(proj, w_down, offsets, bias=bias, is_transposed=module.is_transposed)  # [N, H]
    if module.has_post_expert_norm:
        proj = module.post_expert_norm(proj)
    return proj


def _gathered(
    weights: Mapping[str, torch.Tensor],
    up: str,
    expert_ids: torch.Tensor,
    rows: torch.Tensor,
    groups: int,
    arange: Callable[[int, torch.device], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(up weights [G, ...], down weights [G, ...], offsets [G]): one group per distinct expert of `expert_ids [N]`
    (sorted), its weights gathered from the group's `rows` entry; extra groups are empty."""
    N, dev = expert_ids.numel(), expert_ids.device
    gid = torch.zeros(N, dtype=torch.long, device=dev)  # [N] group of each row
    torch.cumsum(expert_ids[1:] != expert_ids[:-1], 0, out=gid[1:])
    steps = arange(groups, dev) if arange is not None else torch.arange(groups, device=dev)  # [G]
    offsets = torch.searchsorted(gid, steps, right=True, out_int32=True)  # [G] end row of each group
    entry_g = torch.zeros(groups, dtype=torch.long, device=dev).scatter_(0, gid, rows)  # [G] weights entry per group
    return weights[up].index_select(0, entry_g), weights["down_proj"].index_select(0, entry_g), offsets


def combine(
    out: torch.Tensor,
    positions: torch.Tensor,
    weights: torch.Tensor,
    tokens: int,
    k: int,
    dtype: torch.dtype,
    first_token: int = 0,
) -> torch.Tensor:
    """Weighted sum over each token's k experts, as `grouped_mm`: `out [n,H]` rows at flat (token*k + slot)
    `positions [n]`, gate `weights [S]` (the whole call's, flat); every slot of tokens
    `first_token .. first_token + tokens - 1` must be among `positions`. -> [tokens,H] in `dtype`.
    The rows go back to (token, slot) order first, then each is weighted by its own gate weight: the same
    products as the stock weighting in sorted order, without gathering the weights."""
    n, H = tokens * k, out.shape[-1]
    flat = out.new_empty(n, H)  # [tokens*k, H] (token, slot) order
    flat[positions - first_token * k if first_token else positions] = out
    w = weights if first_token == 0 and weights.numel() == n else weights[first_token * k : first_token * k + n]  # [n]
    summed = (flat * w.unsqueeze(-1)).view(tokens, k, H).sum(dim=1)  # [tokens,H] (promoted dtype, as stock)
    return summed if summed.dtype == dtype else summed.to(dtype)


def routed_experts_forward(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """One experts call in one process: sort, `compute(x [S,H], expert_ids [S]) -> [S,H]` over the sorted rows
    (the caller's `grouped_experts` over wherever its experts live), combine. hidden [T,H] -> [T,H]."""
    T = hidden.shape[0]
    k = top_k_index.size(-1)
    expert_ids, perm = sort_routing(top_k_index)  # [S], [S]
    out = compute(hidden[perm // k], expert_ids)  # [S,H] sorted order
    return combine(out, perm, top_k_weights.reshape(-1), T, k, hidden.dtype)


def entry_batched_forward(
    module: Any,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    table: torch.Tensor | None,
    weights: Mapping[str, torch.Tensor],
    batched_linear: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """One experts call as transformers' `batched_mm` computes it, each row's expert weights gathered from its entry
    `table [E]` of `weights` (a slot; `table` None: `weights` are indexed by expert id, the layer's own stack)
    instead of the module's parameters: the same ops on the same values, so bit-identical to `batched_mm` (what
    transformers' `generate` decodes a `grouped_mm` model with off the CPU). No sort, no offsets, rows stay in
    (token, slot) order. `batched_linear`: transformers' batched kernel (`tx_compat.decode_batched`).
    hidden [T,H] -> [T,H]."""
    T, H = hidden.shape
    k = top_k_index.size(-1)
    x = hidden.repeat_interleave(k, dim=0)  # [S,H] each token k times
    w = top_k_weights.reshape(-1)  # [S]
    ids = top_k_index.reshape(-1)  # [S]
    entries = ids if table is None else table[ids]  # [S] each row's entry of `weights`
    up = "gate_up_proj" if module.has_gate else "up_proj"
    bias = weights[up + "_bias"][entries] if module.has_bias else None  # [S, 2I] or [S, I]
    proj = batched_linear(x, weights[up][entries], bias=bias, is_transposed=module.is_transposed)  # [S, 2I] or [S, I]
    proj = module._apply_gate(proj) if module.has_gate else module.act_fn(proj)  # [S, I]
    bias = weights["down_proj_bias"][entries] if module.has_bias else None  # [S, H]
    proj = batched_linear(proj, weights["down_proj"][entries], bias=bias, is_transposed=module.is_transposed)  # [S, H]
    if module.has_post_expert_norm:
        proj = module.post_expert_norm(proj)
    out = (proj * w.unsqueeze(-1)).view(T, k, H).sum(dim=1)  # [T,H] (promoted dtype, as stock)
    return out.to(hidden.dtype)


def entry_sorted_forward(
    module: Any,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    table: torch.Tensor,
    weights: Mapping[str, torch.Tensor],
    span: tuple[int, int],
    spans: SpanViews | None = None,
) -> torch.Tensor:
    """One experts call with every routed expert's weights read in place: `table [E]` gives each expert's entry
    of `weights` (a slot); every routed expert's entry lies in `span = (lo, hi)`, `hi - lo <= MAX_GROUPS`. The
    rows sorted by entry (`sort_by_entry`), one group per entry of the span (`grouped_experts_in_place`), the
    stock combine. Each group holds the stock call's rows in the stock order: bit-identical to `grouped_mm`.
    hidden [T,H] -> [T,H]."""
    T, k = hidden.shape[0], top_k_index.size(-1)
    entries, perm = sort_by_entry(top_k_index, table)  # [S], [S]
    x = hidden.repeat(k, 1) if T == 1 else hidden[perm // k]  # [S,H] (one token: every row is it)
    out = grouped_experts_in_place(module, x, weights, entries, span, spans=spans)  # [S,H] entry order
    return combine(out, perm, top_k_weights.reshape(-1), T, k, hidden.dtype)
