"""The per-layer step: what the offload engine does in a MoE layer's router hook, before the experts call.

`RouteStep.route(event)` for MoE layer l of the running pass, in this order (the cache's "one access order"):
1. deferral: when no access of l can miss and nothing needs the routing on the host (`can_defer`: no
   prefetch and no rerouting policy, slots retained, every expert of l in a ready slot), only queue the
   routing; `flush` replays the queued accesses into the cache (the same events, the same order, the same
   counters) with ONE host read for all of them, before the next layer that takes this path and at pass end;
2. `on_layer_start` (`cache.begin_layer`), then the routing policy (`reroute`: a bias or dual logits
   through `adapter.select`) when it `reroutes`;
3. the routed ids and gate weights to the host in ONE packed transfer (`to_host`, `host_syncs`);
4. a `needs_routing` miss policy (`apply_miss`): drop / substitute rewrite the ids and weights the model
   gets back, cpu experts leave the needed list (the experts call computes them on the host); the policy
   first gets the engine's running host and stall totals (`measured`: `auto` calibrates on them);
5. the unique needed experts and their summed gate weights (`needed_experts`) -> `cache.route` (stale
   prefetches cancelled, the other miss policies, demand loads: hits pinned first);
6. with a proposing prefetch policy: `LayerContext` -> `propose` -> `cache.prefetch` (its gate admits each
   copy), so the copies overlap this layer's expert compute.
In a prefill pass the routed experts not resident at its start are counted (the TTFT bound); with the staged
prefill (`runtime/prefill.py`) step 3's host read also carries the next layer's pre-gate counts, and steps 5-6
are `StagedPrefill.route` (waves, the first demanded now; the policy's proposals once every wave is demanded).
What the experts call needs (`Routed`: the routing it should receive, the experts, their pinned slots, the
host experts) waits in `pending`; `take` hands it over and falls back to a host read when the experts
call received another tensor than the hook saw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..moe import RouterEvent
from ..policies.base import (
    CPU,
    DROP,
    FETCH,
    SUBSTITUTE,
    LayerContext,
    MissPolicy,
    PrefetchPolicy,
    RoutingPolicy,
    miss_action,
)
from ..policies.routing import dual_select
from .cache import ExpertCache
from .counters import needed_experts, routed_counts
from .passstats import EngineCounts, PassAccount
from .prefill import StagedPrefill


@dataclass
class Routed:
    """A layer's routing, seen by the router hook, waiting for the layer's experts call."""

    indices: torch.Tensor  # [T,k] the routing the experts call is expected to receive
    experts: list[int] | None = None  # unique experts (None: deferred, everything resident)
    slots: list[int] | None = None  # their pinned slots (None: deferred or more than one wave)
    scores: dict[int, float] | None = None  # summed gate weight per expert (for waves demanded later)
    cpu: list[int] | None = None  # experts the miss policy runs on the host (no slot)
    waves: list[list[int]] | None = None  # a staged prefill's waves (`runtime/prefill.py`; None: not staged)
    ends: list[int] | None = None  # ... the sorted routing's end row per expert [E] (host; None: one wave)
    first: list[int] | None = None  # ... the first wave's pinned slots
    ahead: tuple[int, list[int]] | None = None  # ... the next MoE layer and its predicted experts, to stage
    then: Callable[[], None] | None = None  # ... the prefetch policy's step, run when every wave is demanded


def same_routing(routed: Routed, top_k_index: torch.Tensor) -> bool:
    """The experts call got the tensor the router hook saw (no host read: same storage and layout)."""
    a, b = routed.indices, top_k_index
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


class RouteStep:
    """The router hook's work per MoE layer (see the module docstring) and the routings it leaves behind."""

    def __init__(
        self,
        *,
        adapter,
        cache: ExpertCache,
        wave_cap: int,
        miss: MissPolicy | None,
        routing: RoutingPolicy | None,
        prefetcher: PrefetchPolicy | None,
        retain: bool,
        account: PassAccount,
        counts: EngineCounts,
        predict_logits: Callable[[int, torch.Tensor], torch.Tensor],
        lookahead: Callable[[], int],
        prefill: StagedPrefill | None = None,
    ):
        self.adapter, self.spec, self.cache = adapter, adapter.spec, cache
        self.wave_cap = wave_cap  # most experts one grouped call may cover (`wave_capacity`)
        self.miss, self.routing, self.prefetcher = miss, routing, prefetcher
        self.retain = retain
        self.account, self.counts = account, counts
        self.predict_logits, self.lookahead = predict_logits, lookahead
        self.prefill = prefill  # prefill passes: the bound's count, and the staged path when it is active
        self.prefetching = prefetcher is not None and prefetcher.proposes
        self.rerouting = routing is not None and routing.reroutes
        self.miss_hook = miss is not None and miss.needs_routing  # drop / substitute / cpu in the router hook
        self.pending: dict[int, Routed] = {}
        self.deferred: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, indices, weights)
        self.residual: dict[int, torch.Tensor] = {}  # this pass's post-attention residuals (`needs_residual`)

    # ---- pass boundaries ---------------------------------------------------------------------------
    def begin_pass(self) -> None:
        self.pending.clear()
        self.residual.clear()

    def end_pass(self) -> None:
        self.flush()
        for r in self.pending.values():  # a layer routed but never computed
            if r.slots is not None:
                self.cache.release(r.slots)
            if r.first and self.prefill is not None:
                self.prefill.release(r)
        self.pending.clear()

    # ---- the router hook ---------------------------------------------------------------------------
    def route(self, ev: RouterEvent) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Layer `ev.layer` has routed: demand loads and prefetches, as early as possible. Returns the
        replacement routing (logits, weights [T,k], indices [T,k]) when a policy changed it, else None."""
        cache, l = self.cache, ev.layer
        logits, weights, indices = ev.logits, ev.weights, ev.indices
        pf = self.prefill if self.prefill is not None and self.prefill.prefill else None
        staged = pf is not None and pf.active
        if self.can_defer(l, indices) and (pf is None or not staged or pf.next_ready(l)):
            self.deferred.append((l, indices, weights))
            self.pending[l] = Routed(indices)
            return None
        self.flush()  # earlier layers' accesses first: events stay in order
        cache.begin_layer(l)
        replaced = None
        if self.rerouting:
            chosen = self.reroute(l, logits)
            if chosen is not None:
                weights, indices = chosen
                replaced = (logits, weights, indices)
        pred = pf.predict(l, ev.x) if pf is not None and staged else None  # [E] next layer's pre-gate counts
        hosted = self.to_host([(indices, weights)] if pred is None else [(indices, weights), (pred, pred)])
        ids_h, w_h = hosted[0]
        cpu: list[int] = []
        if self.miss_hook and self.miss is not None:
            c = cache.counters  # the engine's own timings so far (`auto` calibrates on them)
            self.miss.measured(self.counts.host_s, self.counts.host_wait_s, c.stall_s, c.misses + c.late)
            changed, ids_h, w_h, cpu = apply_miss(self.miss, cache, l, ids_h, w_h, indices.shape, self.counts.miss_counts)
            if changed:
                indices = ids_h.view(indices.shape).to(indices.device)
                weights = w_h.view(weights.shape).to(device=weights.device, dtype=weights.dtype)
                replaced = (logits, weights, indices)
        per: list[int] | None = None  # rows routed to each expert [E] (a staged prefill's waves)
        if staged and not cpu and ids_h.numel() > self.spec.num_experts:
            experts, scores, per = routed_counts(ids_h, w_h, self.spec.num_experts)
        else:
            experts, scores = needed_experts(ids_h, w_h, self.spec.num_experts)
        if cpu:
            experts = [e for e in experts if e not in cpu]
            scores = {e: v for e, v in scores.items() if e not in cpu}
        routed = Routed(indices, experts, scores=scores, cpu=cpu or None)
        if pf is not None:
            pf.count(l, experts)
            if staged:  # the staged prefill: first wave demanded now, the next layer's experts predicted
                if self.prefetching and pf.step_needed(l):  # the policy's proposals once l's waves are demanded
                    x = ev.x
                    routed.then = lambda: self.prefetch(l, x, logits, indices, weights)
                self.pending[l] = routed
                pf.route(l, routed, hosted[1][0] if pred is not None else None, per)
                return replaced
        loads0 = cache.counters.loads  # the access order of `moeflow.runtime.cache` (shared with the simulator)
        routed.slots = cache.route(l, experts, scores, self.wave_cap, None if self.miss_hook else self.miss)
        self.account.count_loads(l, cache.counters.loads - loads0)
        self.pending[l] = routed
        if self.prefetching:
            self.prefetch(l, ev.x, logits, indices, weights)
        return replaced

    def can_defer(self, layer: int, indices: torch.Tensor) -> bool:
        """No access of this layer can miss and nothing needs its routing on the host before compute."""
        return (
            not self.prefetching
            and not self.rerouting
            and self.retain
            and min(indices.numel(), self.spec.num_experts) <= self.wave_cap
            and self.cache.layer_all_ready(layer)
        )

    def flush(self) -> None:
        """Replay the deferred accesses into the cache (one host synchronization for all of them)."""
        if not self.deferred:
            return
        deferred, self.deferred = self.deferred, []
        cache = self.cache
        routings = self.to_host([(i, w) for _, i, w in deferred])
        marker = cache.link.record_use()  # after every deferred layer's compute: one marker for all their slots
        for (l, _, _), (ids, w) in zip(deferred, routings):
            experts, scores = needed_experts(ids, w, self.spec.num_experts)
            if self.prefill is not None and self.prefill.prefill:
                self.prefill.count(l, experts)
            cache.begin_layer(l)
            cache.release(cache.demand(l, experts, scores), marker)  # all hits: pins nothing past this line

    def to_host(self, routings: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Expert ids and gate weights of several routings, copied to the host with one wait for the device
        (`packed_to_host`; on the CPU, where they already are: converted, not packed), counted as one host read."""
        self.counts.host_syncs += 1
        if all(i.device.type == "cpu" and w.device.type == "cpu" for i, w in routings):  # the packed path's values
            return [(i.reshape(-1).to(torch.long, copy=True), w.reshape(-1).to(torch.float32, copy=True)) for i, w in routings]
        return packed_to_host(routings)

    def reroute(self, layer: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The routing policy's choice (weights [T,k], indices [T,k]) from the router's logits [T,E], or None
        (the router's own). `dual_logits`: z' selects, the original logits weight (z' too with `renorm`)."""
        routing, ad = self.routing, self.adapter
        if routing is None:
            return None
        if routing.dual_logits:
            z2 = routing.select_logits(layer, logits, self.cache.resident, self.spec.top_k)
            if z2 is None:
                return None
            return ad.select(layer, z2) if routing.renorm else dual_select(ad.select, layer, logits, z2)
        bias = routing.bias(layer, self.spec.num_experts, self.cache.is_ready)
        return ad.select(layer, logits, bias) if bias is not None else None

    def prefetch(self, layer: int, x: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> None:
        """The prefetch policy's proposals for later layers (`LayerContext`) -> the cache's gated copies."""
        cache, spec = self.cache, self.spec
        ctx = LayerContext(
            pos=cache.position(layer),
            layer=layer,
            moe_layers=spec.moe_layers,
            num_experts=spec.num_experts,
            top_k=spec.top_k,
            router_input=x,
            logits=logits.reshape(-1, logits.shape[-1]),
            indices=indices.reshape(-1, indices.shape[-1]),
            weights=weights.reshape(-1, weights.shape[-1]),
            predict_logits=pf.logits if (pf := self.prefill) is not None and pf.active else self.predict_logits,  # memo
            token_ids=self.account.token_ids,
            residual=self.residual.get(layer),
            lookahead=self.lookahead(),
            resident=cache.resident,
        )
        if self.prefetcher is None:  # unreachable: `prefetching` implies a prefetch policy
            raise RuntimeError("RouteStep.prefetch called without a prefetch policy")
        reqs = self.prefetcher.propose(ctx)
        keys = [(int(r.key[0]), int(r.key[1])) for r in reqs]
        self.account.proposed(keys, cache.resident)  # N_e for the step-size controller
        if reqs:
            uniq = set(keys)
            before = {k: cache.slots[s].ticket for k in uniq if (s := cache.slot_of.get(k)) is not None}
            if cache.prefetch(reqs, layer):  # a load = a requested key with a new ticket (also evicted + reloaded)
                for k in uniq:
                    s = cache.slot_of.get(k)
                    if s is not None and cache.slots[s].ticket is not before.get(k):
                        self.account.count_loads(k[0], 1)

    # ---- for the experts call ----------------------------------------------------------------------
    def take(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Routed:
        """The routing the router hook left for this experts call (deferred: `experts` None); when the call
        received another tensor (a caller outside the hooks), its experts from one host read."""
        routed = self.pending.pop(layer, None)
        if routed is not None and routed.experts is None:  # deferred: all resident, ready
            return routed
        if routed is None or not same_routing(routed, top_k_index):  # not the tensor the hook saw
            self.flush()
            experts, scores = needed_experts(*self.to_host([(top_k_index, top_k_weights)])[0])
            if routed is not None and routed.experts != experts:
                if routed.slots is not None:
                    self.cache.release(routed.slots)
                if routed.first and self.prefill is not None:
                    self.prefill.release(routed)
                routed = None
            routed = routed or Routed(top_k_index, experts, scores=scores)
        if routed.experts is None or routed.scores is None:  # unreachable: only deferred layers lack them
            raise RuntimeError(f"layer {layer}: the router hook recorded no experts for this call")
        return routed


def packed_to_host(routings: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Device -> host of several routings (ids [T,k], weights [T,k] each): [(ids [S] long, weights [S] float32)],
    the values exact. Several routings of one shape and dtypes (a pass's deferred layers) are stacked: ONE stack of
    the ids and ONE of the weights, each one copy (the second finds the device idle), 4 device ops for any number of
    layers; otherwise (one routing, or mixed shapes) every tensor goes to float64 (ids and weights exact) and ONE
    packed copy (2n + 2 ops). Each device op costs the host tens of microseconds on a GPU, where decode is host-bound."""
    i0, w0 = routings[0]
    if len(routings) > 1 and all(
        i.shape == i0.shape and i.dtype == i0.dtype and w.shape == w0.shape and w.dtype == w0.dtype for i, w in routings
    ):
        ids_d = torch.stack([i.reshape(-1) for i, _ in routings])  # [n,S] on the device
        ws_d = torch.stack([w.reshape(-1) for _, w in routings])  # [n,S]
        ids, ws = ids_d.cpu().long(), ws_d.cpu().float()  # both stacks queued before the first copy waits
        return list(zip(ids.unbind(0), ws.unbind(0)))  # [S] ids, [S] weights per routing
    flat = [t.reshape(-1).to(torch.float64) for i, w in routings for t in (i, w)]  # f64: ids and weights exact
    packed = torch.cat(flat).cpu() if len(flat) > 1 else flat[0].cpu()
    out, o = [], 0
    for i, _ in routings:
        n = i.numel()
        out.append((packed[o : o + n].long(), packed[o + n : o + 2 * n].float()))  # [S] ids, [S] weights
        o += 2 * n
    return out


def miss_infos(ids: list[int], weights: list[float], k: int, experts: set[int]) -> dict[int, tuple[int, float, int]]:
    """Per expert of `experts`: (its best 1-based rank among a token's k choices by gate weight, descending,
    ties in routing order; its largest gate weight; the tokens routed to it) over a routing of `len(ids) / k`
    tokens given flat, token by token."""
    out: dict[int, tuple[int, float, int]] = {}
    last: dict[int, int] = {}  # expert -> the last token counted
    for t in range(len(ids) // k):
        row_w = weights[t * k : (t + 1) * k]
        for r, j in enumerate(sorted(range(k), key=lambda j: -row_w[j]), start=1):  # stable: ties keep order
            e = ids[t * k + j]
            if e not in experts:
                continue
            x = row_w[j]
            if e not in out:
                out[e] = (r, x, 1)
            else:
                r0, x0, n0 = out[e]
                out[e] = (min(r0, r), max(x0, x), n0 + (last[e] != t))
            last[e] = t
    return out


def apply_miss(
    miss: MissPolicy,
    cache: ExpertCache,
    layer: int,
    ids: torch.Tensor,
    w: torch.Tensor,
    shape: torch.Size,
    counts: dict[str, int],
) -> tuple[bool, torch.Tensor, torch.Tensor, list[int]]:
    """Ask a `needs_routing` miss policy about every missing expert of the call (host tensors `[S]`).

    Returns (routing changed, ids, weights, cpu experts): a dropped expert's entries get weight 0 and
    the id of the token's best kept expert (computed, then weighted by 0), or with the policy's `renorm`
    the token's kept weights are rescaled to the original sum; a substituted one's entries get the
    substitute's id (weights kept); `cpu` experts keep their entries and are computed on the host.
    `counts[action]` (drop / substitute / cpu) counts the missing experts handled without a copy.
    """
    k = int(shape[-1])
    flat = ids.tolist()  # [S] python ints: a few list passes cost less than tensor ops per missing expert
    resident = cache.resident
    missing = [e for e in sorted(set(flat)) if not resident((layer, e))]
    if not missing:
        return False, ids, w, []
    info = miss_infos(flat, w.tolist(), k, set(missing))  # expert -> (best rank, largest weight, tokens)
    pos = cache.position(layer)
    dropped, subs, cpu = [], {}, []
    actions = miss.on_misses(layer, missing, [info[e] for e in missing], pos, resident)  # `auto`: all at once
    for e, action in zip(missing, actions):
        if action == CPU or action == FETCH:  # the common actions, without parsing
            if action == CPU:
                cpu.append(e)
            continue
        kind, arg = miss_action(action)
        if kind == DROP:
            dropped.append(e)
        elif kind == SUBSTITUTE and arg is not None:
            if not resident((layer, arg)):
                raise ConfigError(f"miss policy {miss.name!r} substituted ({layer}, {arg}), which is not resident")
            subs[e] = arg
    if cpu:
        counts[CPU] += len(cpu)
    if not dropped and not subs:
        return False, ids, w, cpu
    counts[DROP] += len(dropped)
    counts[SUBSTITUTE] += len(subs)
    T = ids.numel() // k
    idx, wt = ids.view(T, k), w.view(T, k)
    new_idx, new_w = idx.clone(), wt.clone()
    for e, r in subs.items():
        new_idx[idx == e] = r
    if dropped:
        drop = torch.isin(idx, torch.tensor(dropped))  # [T,k]
        usable = ~drop & ~torch.isin(new_idx, torch.tensor(cpu, dtype=torch.long))  # kept, with a slot
        if not bool(usable.any(1).all()):  # unreachable for `drop` (a token's top expert is never dropped)
            raise ConfigError(f"miss policy {miss.name!r} dropped every expert of a token in layer {layer}")
        best = torch.where(usable, wt, torch.full_like(wt, -1.0)).argmax(1, keepdim=True)  # [T,1]
        new_idx = torch.where(drop, new_idx.gather(1, best).expand(T, k), new_idx)
        new_w = torch.where(drop, torch.zeros_like(wt), new_w)
        if miss.renorm:
            new_w = new_w * (wt.sum(1, keepdim=True) / new_w.sum(1, keepdim=True))
    return True, new_idx.reshape(-1), new_w.reshape(-1), cpu
