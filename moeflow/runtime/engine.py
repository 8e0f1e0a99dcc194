"""The offload engine: transformers' experts interface + router hooks, driving the expert cache.

`OffloadEngine(model, ...)` (a context manager) moves every routed expert to the host store, frees
the stacked parameters on the device, registers the `moeflow` experts implementation in
transformers' `ExpertsInterface` and switches the model to it, and tags each experts module with
its layer and this engine (attributes on the module instance; no globals hold engines).

Per MoE layer and forward pass:
  router forward hook -> routed ids to the host (ONE synchronization) -> `on_layer_start` -> unique
  needed experts -> stale queued prefetches of this layer cancelled -> miss policy -> demand loads (hits
  pinned first; misses go ahead of queued prefetches on the link) -> prefetch policy `propose(LayerContext)`
  -> the policy's gate admits each proposal or not (`PrefetchGate`, inside `ExpertCache.prefetch`) ->
  prefetch copies (overlap this layer's expert compute) -> experts call:
  wait only for this layer's slots -> exact grouped compute over the routed experts' slots, found in
  the cache's device table (in waves of <= capacity experts when a prefill needs more) -> release pins.
Fast path: when every expert of a layer is in a ready slot and no prefetch/routing policy needs the
routing on the host, no access can miss, so the router hook only queues the routing; the experts call
computes from the device table with no host synchronization, and the queued accesses are replayed into
the cache (same events, same order, same counters) at the next layer that needs the host or at the end
of the pass, with one synchronization for all of them.
A forward pre-hook on the model marks pass boundaries (`pass_id += 1`); a post-hook publishes a
`PassStats` to every callable in `engine.observers` (step-size controllers, learned prefetchers), with
the pass's compute time outside the engine's bookkeeping (gaps between experts calls up to each router
hook, i.e. attention + router, plus each experts call less its demand loads and waits) and the number of
proposed experts that were not resident (the step-size controller's N_e).
`engine.lookahead` (step size S) is read into every `LayerContext`, so it may change between passes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..errors import ConfigError
from ..moe import RouterEvent, get_adapter, residual_hooks, router_hooks, tx_compat
from ..policies.base import (
    CPU,
    DROP,
    SUBSTITUTE,
    EvictionPolicy,
    LayerContext,
    MissInfo,
    MissPolicy,
    PrefetchPolicy,
    PrefetchRequest,
    RoutingPolicy,
    miss_action,
)
from ..policies.routing import dual_select
from .cache import GATHER_BYTES, MAX_GROUPS, CacheCounters, ExpertCache, needed_experts, wave_capacity  # noqa: F401
from .link import Link
from .store import HostExpertStore

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IMPL_NAME = "moeflow"


def moeflow_experts_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The `moeflow` entry of transformers' ExpertsInterface: dispatch to the module's engine."""
    engine = getattr(module, "_moeflow_engine", None)
    if engine is None:
        raise RuntimeError("experts implementation 'moeflow' used on a module no OffloadEngine is attached to")
    return engine.experts_forward(module, module._moeflow_layer, hidden_states, top_k_index, top_k_weights)


def register_experts_implementation() -> None:
    """Idempotent: add `moeflow` to transformers' experts implementations."""
    tx_compat.register_experts(IMPL_NAME, moeflow_experts_forward)


@dataclass
class PassStats:
    """What one forward pass (prefill or one decode step) cost; given to every observer."""

    pass_id: int
    tokens: int  # tokens in this pass (prompt length for prefill, 1 per decode step)
    wall_s: float  # forward wall time
    stall_s: float  # compute waiting on transfers
    counters: CacheCounters  # this pass's cache counters (hits, misses, loads, overfetch, ...)
    transfer_s: float  # link busy time of transfers completed during the pass
    transfer_bytes: int  # bytes of transfers completed during the pass
    lookahead: int  # step size S used in this pass
    loads_by_layer: dict[int, int] = field(default_factory=dict)  # transfers issued, by the expert's layer
    # for the step-size controller (moeflow.runtime.adaptive_s):
    decode: bool = False  # one new token per row (input_ids [B,1]); False for a prefill
    compute_s: float = 0.0  # model compute without the engine's bookkeeping: attention/router gaps + expert compute
    moe_layers_run: int = 0  # experts calls in this pass
    predicted: int = 0  # distinct experts the prefetch policy proposed in this pass
    predicted_new: int = 0  # ... of which were not resident when first proposed (N_e's numerator)
    token_ids: torch.Tensor | None = None  # [B*T] input ids of this pass (Dist(t))

    @property
    def overfetch(self) -> int:
        return self.counters.prefetch_unused_evicted


Observer = Callable[[PassStats], None]


@dataclass
class _Routed:
    """A layer's routing, seen by the router hook, waiting for the layer's experts call."""

    indices: torch.Tensor  # [T,k] the routing the experts call is expected to receive
    experts: list[int] | None = None  # unique experts (None: deferred, everything resident)
    slots: list[int] | None = None  # their pinned slots (None: deferred or more than one wave)
    scores: dict[int, float] | None = None  # summed gate weight per expert (for waves demanded later)
    cpu: list[int] | None = None  # experts the miss policy runs on the host (no slot)


class OffloadEngine:
    """Runs `model` with its routed experts in host memory and a C-slot device cache."""

    def __init__(
        self,
        model: nn.Module,
        *,
        capacity: int,
        link: Link,
        eviction: EvictionPolicy | None,
        prefetch: PrefetchPolicy | None = None,
        miss: MissPolicy | None = None,
        routing: RoutingPolicy | None = None,
        per_layer: bool = False,
        retain: bool = True,
        lookahead: int = 1,
    ):
        impl = getattr(model.config, "_experts_implementation", None)
        if impl not in ("grouped_mm", IMPL_NAME):
            raise ConfigError(
                f"offloading replaces the 'grouped_mm' experts implementation, the model uses "
                f"{impl!r}; load it with experts_implementation='grouped_mm'"
            )
        tx_compat.check()
        self.model = cast("PreTrainedModel", model)  # a transformers model: `config`, `set_experts_implementation`
        self.adapter = get_adapter(model)
        for l in self.adapter.moe_layers:
            tx_compat.check_experts_module(self.adapter.experts(l))
        self.spec = self.adapter.spec
        self.link = link
        self.eviction, self.prefetcher, self.miss, self.routing = eviction, prefetch, miss, routing
        self._prefetching = prefetch is not None and getattr(prefetch, "name", None) != "none"  # proposes copies
        self._rerouting = routing is not None and bool(getattr(routing, "reroutes", routing.name != "standard"))
        self._hit_first = bool(getattr(routing, "hit_first", False))  # compute resident experts before waiting
        self._miss_hook = bool(getattr(miss, "needs_routing", False))  # drop / substitute / cpu in the router hook
        self.miss_counts = {DROP: 0, SUBSTITUTE: 0, CPU: 0}  # missing experts (per layer call) handled without a copy
        self.per_layer, self.retain = per_layer, retain
        self.capacity = capacity
        self.lookahead = int(lookahead)  # step size S; controllers may change it between passes
        self.observers: list[Observer] = []
        self.pass_start_hooks: list[Callable[[], None]] = []  # called at every pass start, after the cache's (plans)
        self.device = next(model.parameters()).device
        self.store = HostExpertStore(self.adapter, pin=self.device.type == "cuda")
        self._cache: ExpertCache | None = None  # created by `attach`
        self.pass_id = -1
        self._stack: contextlib.ExitStack | None = None
        self._pending: dict[int, _Routed] = {}
        self._deferred: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, indices, weights)
        self.host_syncs = 0  # device -> host reads the engine made (each one a sync on CUDA)
        self._aranges: dict[int, torch.Tensor] = {}
        self._predicting = False
        self._residual: dict[int, torch.Tensor] = {}
        self._token_ids: torch.Tensor | None = None
        self._pass_t0 = 0.0
        self._pass_c0 = CacheCounters()
        self._pass_link0 = (0.0, 0)
        self._loads_by_layer: dict[int, int] = {}
        self._prev_impl: str | None = None
        self._decode = False
        self._compute_s = 0.0  # this pass: compute outside the engine's bookkeeping (PassStats.compute_s)
        self._book_s = 0.0  # time inside experts calls spent on demand loads / waits (subtracted)
        self._t_mark = 0.0  # end of the last experts call (or pass start)
        self._moe_run = 0
        self._pred_keys: set[tuple[int, int]] = set()
        self._pred_new = 0
        self.host_s = 0.0  # seconds spent running experts on the host (miss policy `cpu`/`auto`)

    @property
    def cache(self) -> ExpertCache:
        """The expert cache; exists once the engine has been attached (`with engine:` or `attach()`)."""
        cache = self._cache
        if cache is None:
            raise RuntimeError("the OffloadEngine is not attached: use `with engine:` or call `engine.attach()` first")
        return cache

    # ---- lifecycle ------------------------------------------------------------------------------------
    def __enter__(self) -> OffloadEngine:
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def attach(self) -> None:
        if self._stack is not None:
            return
        stack = contextlib.ExitStack()
        try:
            self._cache = ExpertCache(
                self.store,
                self.capacity,
                device=self.device,
                link=self.link,
                eviction=self.eviction,
                per_layer=self.per_layer,
                retain=self.retain,
                gate=getattr(self.prefetcher, "gate", None) if self._prefetching else None,
            )
            stack.callback(self.link.close)
            bind = getattr(self.prefetcher, "bind", None)
            if bind is not None:  # learned prefetchers load their predictors and read experts: before offload
                stack.callback(bind(self.model, self))
            self.store.offload()
            stack.callback(self.store.restore)
            precisions = getattr(self.miss, "precisions", None)  # mixed-precision miss policies: compact copies
            if precisions:
                self.store.quantize(precisions, optimize=bool(getattr(self.miss, "optimize", True)))
            mbind = getattr(self.miss, "bind", None)
            if mbind is not None:  # substitute: router similarities; auto: host / copy timings
                mbind(self)
            for l in self.spec.moe_layers:
                ex = self.adapter.experts(l)
                # torch's stub types Module.__setattr__ values as Tensor | Module; any object is accepted
                ex._moeflow_engine, ex._moeflow_layer = self, l  # type: ignore[assignment]
                stack.callback(self._untag, ex)
            register_experts_implementation()
            self._prev_impl = self.model.config._experts_implementation
            self.model.set_experts_implementation(IMPL_NAME)
            stack.callback(self.model.set_experts_implementation, self._prev_impl)
            if self._prefetching:  # post-attention residual (None where a family has no norm)
                stack.enter_context(residual_hooks(self.adapter, self._residual.__setitem__, hint=None))
            stack.enter_context(router_hooks(self.adapter, self._on_route))
            h1 = self.model.register_forward_pre_hook(self._on_pass_start, with_kwargs=True)
            h2 = self.model.register_forward_hook(self._on_pass_end)
            stack.callback(h1.remove)
            stack.callback(h2.remove)
        except BaseException:
            stack.close()
            raise
        self._stack = stack

    def close(self) -> None:
        """Restore the model exactly as it was (experts back on the device, stock implementation)."""
        if self._stack is not None:
            if self._cache is not None:
                self._cache.close()
            stack, self._stack = self._stack, None
            stack.close()

    def warm(self, keys: list[tuple[int, int]] | None = None) -> int:
        """Load `keys` (default: every routed expert, up to capacity) through the cache's prefetch path and
        wait for the copies; returns the copies issued. For benchmarks of the all-resident decode path."""
        spec = self.spec
        keys = keys if keys is not None else [(l, e) for l in spec.moe_layers for e in range(spec.num_experts)]
        n = self.cache.prefetch([PrefetchRequest(k) for k in keys], spec.moe_layers[0])
        self.link.drain()
        return n

    @staticmethod
    def _untag(ex: nn.Module) -> None:
        for a in ("_moeflow_engine", "_moeflow_layer"):
            if hasattr(ex, a):
                delattr(ex, a)

    # ---- forward-pass boundaries -----------------------------------------------------------------------
    def _on_pass_start(self, module, args, kwargs) -> None:
        self.pass_id += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._token_ids = ids.reshape(-1) if isinstance(ids, torch.Tensor) else None
        self._decode = isinstance(ids, torch.Tensor) and ids.dim() >= 1 and ids.shape[-1] == 1
        self._compute_s, self._moe_run, self._pred_new = 0.0, 0, 0
        self._pred_keys = set()
        self._pending.clear()
        self._residual.clear()
        self._loads_by_layer = {}
        self._pass_c0 = self.cache.counters.copy()
        self._pass_link0 = (self.link.busy_s, self.link.bytes)
        self._pass_t0 = time.perf_counter()
        self._t_mark = self._pass_t0
        self.cache.begin_pass(self.pass_id)
        for hook in list(self.pass_start_hooks):
            hook()

    def _on_pass_end(self, module, args, output) -> None:
        self.flush()
        for r in self._pending.values():  # a layer routed but never computed
            if r.slots is not None:
                self.cache.release(r.slots)
        self._pending.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not self.observers:
            return
        c = self.cache.counters - self._pass_c0
        stats = PassStats(
            pass_id=self.pass_id,
            tokens=int(self._token_ids.numel()) if self._token_ids is not None else 0,
            wall_s=time.perf_counter() - self._pass_t0,
            stall_s=c.stall_s,
            counters=c,
            transfer_s=self.link.busy_s - self._pass_link0[0],
            transfer_bytes=self.link.bytes - self._pass_link0[1],
            lookahead=self.lookahead,
            loads_by_layer=dict(self._loads_by_layer),
            decode=self._decode,
            compute_s=self._compute_s,
            moe_layers_run=self._moe_run,
            predicted=len(self._pred_keys),
            predicted_new=self._pred_new,
            token_ids=self._token_ids,
        )
        for obs in list(self.observers):
            obs(stats)

    # ---- routing: demand loads and prefetch, as early as possible -------------------------------------
    def _on_route(self, ev: RouterEvent):
        if self._predicting:  # a prefetch policy applying another layer's router
            return None
        self._compute_s += max(0.0, time.perf_counter() - self._t_mark)  # attention + router since the last experts call
        cache, l = self.cache, ev.layer
        logits, weights, indices = ev.logits, ev.weights, ev.indices
        if self._can_defer(l, indices):
            self._deferred.append((l, indices, weights))
            self._pending[l] = _Routed(indices)
            return None
        self.flush()  # earlier layers' accesses first: events stay in order
        cache.begin_layer(l)
        replaced = None
        if self._rerouting and self.routing is not None:  # `_rerouting` implies a routing policy
            select_logits = getattr(self.routing, "select_logits", None)
            if select_logits is not None:  # dual-logit: z' selects, the original logits weight
                z2 = select_logits(l, logits, cache.resident, self.spec.top_k)
                if z2 is not None and getattr(self.routing, "renorm", False):  # z' selects and weights
                    weights, indices = self.adapter.select(l, z2)
                    replaced = (logits, weights, indices)
                elif z2 is not None:
                    weights, indices = dual_select(self.adapter.select, l, logits, z2)
                    replaced = (logits, weights, indices)
            else:
                bias = self.routing.bias(l, self.spec.num_experts, cache.is_ready)
                if bias is not None:
                    weights, indices = self.adapter.select(l, logits, bias)
                    replaced = (logits, weights, indices)
        ids_h, w_h = self._to_host([(indices, weights)])[0]
        cpu: list[int] = []
        if self._miss_hook:
            changed, ids_h, w_h, cpu = self._apply_miss(l, ids_h, w_h, indices.shape)
            if changed:
                indices = ids_h.view(indices.shape).to(indices.device)
                weights = w_h.view(weights.shape).to(device=weights.device, dtype=weights.dtype)
                replaced = (logits, weights, indices)
        experts, scores = self._needs_host(ids_h, w_h)
        if cpu:
            experts = [e for e in experts if e not in cpu]
            scores = {e: v for e, v in scores.items() if e not in cpu}
        routed = _Routed(indices, experts, scores=scores, cpu=cpu or None)
        loads0 = cache.counters.loads  # the access order of `moeflow.runtime.cache` (shared with the simulator)
        routed.slots = cache.route(l, experts, scores, self._wave_capacity(), None if self._miss_hook else self.miss)
        self._count_loads(l, cache.counters.loads - loads0)
        self._pending[l] = routed
        if self._prefetching:
            self._prefetch(l, ev.x, logits, indices, weights)
        return replaced

    def _can_defer(self, layer: int, indices: torch.Tensor) -> bool:
        """No access of this layer can miss and nothing needs its routing on the host before compute."""
        return (
            not self._prefetching
            and not self._rerouting
            and self.retain
            and min(indices.numel(), self.spec.num_experts) <= self._wave_capacity()
            and self.cache.layer_all_ready(layer)
        )

    def flush(self) -> None:
        """Replay the deferred accesses into the cache (one host synchronization for all of them)."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        cache = self.cache
        for (l, _, _), (ids, w) in zip(deferred, self._to_host([(i, w) for _, i, w in deferred])):
            experts, scores = self._needs_host(ids, w)
            cache.begin_layer(l)
            cache.release(cache.demand(l, experts, scores))  # all hits: pins nothing past this line

    def _to_host(self, routings: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Expert ids and gate weights of several routings, copied to the host in ONE transfer."""
        flat = [t.reshape(-1).to(torch.float64) for i, w in routings for t in (i, w)]  # f64: ids and weights exact
        packed = torch.cat(flat).cpu() if len(flat) > 1 else flat[0].cpu()
        self.host_syncs += 1
        out, o = [], 0
        for i, _ in routings:
            n = i.numel()
            out.append((packed[o : o + n].long(), packed[o + n : o + 2 * n].float()))  # [S] ids, [S] weights
            o += 2 * n
        return out

    @staticmethod
    def _needs_host(flat: torch.Tensor, weights: torch.Tensor) -> tuple[list[int], dict[int, float]]:
        """Unique experts of a call (host tensors `[S]`) and their summed gate weight over its tokens."""
        return needed_experts(flat, weights)

    def _apply_miss(
        self, layer: int, ids: torch.Tensor, w: torch.Tensor, shape: torch.Size
    ) -> tuple[bool, torch.Tensor, torch.Tensor, list[int]]:
        """Ask a `needs_routing` miss policy about every missing expert of the call (host tensors `[S]`).

        Returns (routing changed, ids, weights, cpu experts): a dropped expert's entries get weight 0 and
        the id of the token's best kept expert (computed, then weighted by 0), or with the policy's `renorm`
        the token's kept weights are rescaled to the original sum; a substituted one's entries get the
        substitute's id (weights kept); `cpu` experts keep their entries and are computed on the host.
        """
        cache, miss = self.cache, self.miss
        k = int(shape[-1])
        T = ids.numel() // k
        idx, wt = ids.view(T, k), w.view(T, k)
        missing = [e for e in idx.unique().tolist() if not cache.resident((layer, int(e)))]
        if not missing or miss is None:
            return False, ids, w, []
        order = torch.argsort(wt, dim=1, descending=True, stable=True)  # [T,k] columns by weight
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(1, k + 1).expand(T, k))  # [T,k] 1-based
        pos = cache.position(layer)
        dropped, subs, cpu = [], {}, []
        for e in missing:
            m = idx == e
            info = MissInfo(int(rank[m].min()), float(wt[m].max()), int(m.any(1).sum()), cache.resident)
            kind, arg = miss_action(miss.on_miss((layer, e), pos, info))  # type: ignore[call-arg]
            if kind == DROP:
                dropped.append(e)
            elif kind == SUBSTITUTE and arg is not None:
                if not cache.resident((layer, arg)):
                    raise ConfigError(f"miss policy {miss.name!r} substituted ({layer}, {arg}), which is not resident")
                subs[e] = arg
            elif kind == CPU:
                cpu.append(e)
        for key, n in ((DROP, len(dropped)), (SUBSTITUTE, len(subs)), (CPU, len(cpu))):
            self.miss_counts[key] += n
        if not dropped and not subs:
            return False, ids, w, cpu
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
            if getattr(miss, "renorm", False):
                new_w = new_w * (wt.sum(1, keepdim=True) / new_w.sum(1, keepdim=True))
        return True, new_idx.reshape(-1), new_w.reshape(-1), cpu

    def _wave_capacity(self) -> int:
        """Most experts one grouped call may cover: slots, the kernel's group limit, the gather budget."""
        return wave_capacity(self.cache.part_capacity, self.store.expert_bytes)

    def _count_loads(self, layer: int, n: int) -> None:
        if n:
            self._loads_by_layer[layer] = self._loads_by_layer.get(layer, 0) + n

    def _prefetch(self, layer: int, x: torch.Tensor, logits, indices, weights) -> None:
        def predict_logits(target: int, h: torch.Tensor) -> torch.Tensor:
            self._predicting = True
            try:
                with torch.no_grad():
                    return self.adapter.router_logits(target, h)
            finally:
                self._predicting = False

        ctx = LayerContext(
            pos=self.cache.position(layer),
            layer=layer,
            moe_layers=self.spec.moe_layers,
            num_experts=self.spec.num_experts,
            top_k=self.spec.top_k,
            router_input=x,
            logits=logits.reshape(-1, logits.shape[-1]),
            indices=indices.reshape(-1, indices.shape[-1]),
            weights=weights.reshape(-1, weights.shape[-1]),
            predict_logits=predict_logits,
            token_ids=self._token_ids,
            residual=self._residual.get(layer),
            lookahead=self.lookahead,
            resident=self.cache.resident,
        )
        if self.prefetcher is None:  # unreachable: `_prefetching` implies a prefetch policy
            raise RuntimeError("OffloadEngine._prefetch called without a prefetch policy")
        reqs = self.prefetcher.propose(ctx)
        for r in reqs:  # N_e for the step-size controller: proposed experts not yet resident
            key = (int(r.key[0]), int(r.key[1]))
            if key not in self._pred_keys:
                self._pred_keys.add(key)
                self._pred_new += not self.cache.resident(key)
        if reqs:
            cache = self.cache
            keys = {(int(r.key[0]), int(r.key[1])) for r in reqs}
            before = {k: cache.slots[s].ticket for k in keys if (s := cache.slot_of.get(k)) is not None}
            if cache.prefetch(reqs, layer):  # a load = a requested key with a new ticket (also evicted + reloaded)
                for k in keys:
                    s = cache.slot_of.get(k)
                    if s is not None and cache.slots[s].ticket is not before.get(k):
                        self._count_loads(k[0], 1)

    # ---- the experts call ------------------------------------------------------------------------------
    def experts_forward(
        self, module: nn.Module, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The layer's experts; its time minus demand loads and waits counts as compute (PassStats.compute_s)."""
        t0, b0 = time.perf_counter(), self._book_s
        out = self._experts_forward(module, layer, hidden_states, top_k_index, top_k_weights)
        self._t_mark = time.perf_counter()
        self._compute_s += max(0.0, self._t_mark - t0 - (self._book_s - b0))
        self._moe_run += 1
        return out

    def _experts_forward(
        self, module: nn.Module, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        routed = self._pending.pop(layer, None)
        if routed is not None and routed.experts is None:  # deferred: all resident, ready
            groups = min(top_k_index.numel(), self.spec.num_experts)
            return self._compute(module, layer, hidden_states, top_k_index, top_k_weights, [(None, None)], groups)
        if routed is None or not self._same_routing(routed, top_k_index):  # not the tensor the hook saw
            self.flush()
            experts, scores = self._needs_host(*self._to_host([(top_k_index, top_k_weights)])[0])
            if routed is not None and routed.experts != experts:
                if routed.slots is not None:
                    self.cache.release(routed.slots)
                routed = None
            routed = routed or _Routed(top_k_index, experts, scores=scores)
        needed, gate = routed.experts, routed.scores
        if needed is None or gate is None:  # unreachable: only deferred layers (returned above) lack them
            raise RuntimeError(f"layer {layer}: the router hook recorded no experts for this call")
        if routed.slots is not None:
            waves = [(needed, routed.slots)]
        else:  # prefill beyond capacity
            waves = self._plan_waves(layer, needed, gate)
        return self._compute(module, layer, hidden_states, top_k_index, top_k_weights, waves, len(needed), routed.cpu)

    @staticmethod
    def _same_routing(routed: _Routed, top_k_index: torch.Tensor) -> bool:
        """The experts call got the tensor the router hook saw (no host read: same storage and layout)."""
        a, b = routed.indices, top_k_index
        return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)

    def _plan_waves(self, layer: int, experts: list[int], scores: dict[int, float]):
        """Chunks of <= wave-capacity experts, resident ones first (they need no copy); slots issued later."""
        return [(wave, scores) for wave in self.cache.plan_waves(layer, experts, self._wave_capacity())]

    def _arange(self, n: int, device: torch.device) -> torch.Tensor:
        a = self._aranges.get(n)
        if a is None or a.device != device:
            a = self._aranges[n] = torch.arange(n, device=device)
        return a

    def _compute(self, module, layer, hidden_states, top_k_index, top_k_weights, waves, groups, cpu=None) -> torch.Tensor:
        """grouped_mm experts forward over the routed slots; bit-identical to transformers' `grouped_mm`.

        `waves`: `[(experts, slots)]` pinned by the router hook, `[(experts, scores)]` planned here
        (demanded one wave at a time), or `[(None, None)]` (deferred: every expert resident and ready).
        `cpu`: experts without a slot that the miss policy runs on the host (`_host_rows`). With `hit-first`
        the ready experts' rows are computed before waiting for the ones still loading.
        """
        cache = self.cache
        T, H = hidden_states.shape
        k = top_k_index.size(-1)
        if cache.table is None:  # unreachable: an engine's cache has a store, hence a device table
            raise RuntimeError("the expert cache has no device slot table")
        table = cache.table[cache.rank[layer]]  # [E] slot of each expert, -1
        sample_weights = top_k_weights.reshape(-1)  # [S]
        expert_ids = top_k_index.reshape(-1)  # [S]
        expert_ids_g, perm = torch.sort(expert_ids)  # same order as grouped_mm
        x_g = hidden_states[perm // k]  # [S,H]
        w_g = sample_weights[perm]  # [S]
        split = None
        if len(waves) == 1 and waves[0][0] is not None and (cpu or self._hit_first):
            split = self._split_wave(layer, waves[0][0], waves[0][1], cpu)
        if split is not None:  # parts of one pinned wave, ready ones first under hit-first
            out_g = None
            for i, (part_experts, part_slots) in enumerate(split):
                self._demand_wave(layer, part_experts, part_slots)  # waits for this part's slots only
                if part_experts:
                    rows, eg = self._rows(part_experts, expert_ids_g)
                    proj = self._grouped(module, x_g[rows], eg, table[eg], len(part_experts))  # [S_w,H]
                    out_g = self._put(out_g, rows, proj, expert_ids.numel())
                if i == 0 and cpu:  # host experts run while the misses' copies are in flight
                    out_g = self._host_rows(module, layer, cpu, x_g, expert_ids_g, out_g)
            cache.release(waves[0][1])
        elif len(waves) == 1:
            experts, slots = waves[0]
            if experts is not None:
                slots = self._demand_wave(layer, experts, slots)
            out_g = self._grouped(module, x_g, expert_ids_g, table[expert_ids_g], groups)  # [S,H]
            if experts is not None:
                cache.release(slots)
        else:
            out_g = None
            for experts, scores in waves:
                slots = self._demand_wave(layer, experts, scores)
                member = torch.zeros(self.spec.num_experts, dtype=torch.bool, device=x_g.device)
                member[torch.tensor(experts, device=x_g.device)] = True  # [E] experts of this wave
                rows = torch.nonzero(member[expert_ids_g]).squeeze(1)  # [S_w] rows of this wave
                eg = expert_ids_g[rows]  # [S_w] sorted
                proj = self._grouped(module, x_g[rows], eg, table[eg], len(experts))  # [S_w,H]
                if out_g is None:
                    out_g = torch.empty(expert_ids.numel(), proj.shape[-1], dtype=proj.dtype, device=x_g.device)
                out_g[rows] = proj
                cache.release(slots)
            if cpu:
                out_g = self._host_rows(module, layer, cpu, x_g, expert_ids_g, out_g)
        if out_g is None:  # unreachable: every routed row belongs to a wave or a host expert
            raise RuntimeError(f"layer {layer}: no expert computed")
        weighted = out_g * w_g.unsqueeze(-1)  # [S,H]
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = self._arange(perm.size(0), perm.device)
        weighted = weighted[inv_perm]  # [S,H] original order
        return weighted.view(T, k, H).sum(dim=1).to(hidden_states.dtype)  # [T,H]

    def _split_wave(
        self, layer: int, experts: list[int], slots: list[int], cpu: list[int] | None
    ) -> list[tuple[list[int], list[int]]] | None:
        """`[(experts, slots)]` parts of a pinned wave in compute order: under hit-first the ready experts,
        then the ones still loading; None when one grouped call over the whole wave will do."""
        ready = [self.cache.is_ready((layer, e)) for e in experts]
        if self._hit_first and any(ready) and not all(ready):
            first = [(e, s) for e, s, r in zip(experts, slots, ready) if r]
            rest = [(e, s) for e, s, r in zip(experts, slots, ready) if not r]
            return [([e for e, _ in first], [s for _, s in first]), ([e for e, _ in rest], [s for _, s in rest])]
        return [(experts, slots)] if cpu else None

    def _rows(self, experts: list[int], expert_ids_g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [S_w] of the sorted routing that go to `experts`, their expert ids [S_w], sorted)."""
        member = torch.zeros(self.spec.num_experts, dtype=torch.bool, device=expert_ids_g.device)
        member[torch.tensor(experts, device=expert_ids_g.device)] = True  # [E]
        rows = torch.nonzero(member[expert_ids_g]).squeeze(1)  # [S_w]
        return rows, expert_ids_g[rows]

    @staticmethod
    def _put(out_g: torch.Tensor | None, rows: torch.Tensor, proj: torch.Tensor, n: int) -> torch.Tensor:
        if out_g is None:
            out_g = torch.empty(n, proj.shape[-1], dtype=proj.dtype, device=proj.device)
        out_g[rows] = proj
        return out_g

    def _host_rows(self, module, layer: int, cpu: list[int], x_g, expert_ids_g, out_g: torch.Tensor | None) -> torch.Tensor:
        """Rows routed to the host experts `cpu`: activations to the host, the same grouped kernels over the
        host store's rows, results back into `out_g` (moves activations only, never weights)."""
        rows, eg = self._rows(cpu, expert_ids_g)
        t0 = time.perf_counter()
        x_h, eg_h = x_g[rows].cpu(), eg.cpu()
        views = self.store.layout.views(self.store.rows[layer])  # [E,...] host, no copy
        proj = self._grouped(module, x_h, eg_h, eg_h, len(cpu), views=views)  # [S_c,H] host
        out_g = self._put(out_g, rows, proj.to(x_g.device), x_g.shape[0])
        self.host_s += time.perf_counter() - t0
        return out_g

    def time_host_expert(self, tokens: int) -> float:
        """Fastest seconds to run one expert of the first MoE layer on `tokens` rows on the host."""
        from ..policies.miss import time_call

        l = self.spec.moe_layers[0]
        module = self.adapter.experts(l)
        x = torch.randn(tokens, self.spec.hidden_size, dtype=self.store.layout.dtype)  # [N,H]
        eg = torch.zeros(tokens, dtype=torch.long)
        views = self.store.layout.views(self.store.rows[l])
        with torch.no_grad():
            return time_call(lambda: self._grouped(module, x, eg, eg, 1, views=views))

    def time_row_copy(self) -> float:
        """Fastest seconds of one plain host -> device copy of one expert row (no link emulation)."""
        from ..policies.miss import time_call

        row = self.store.row(self.spec.moe_layers[0], 0)
        dst = torch.empty_like(row, device=self.device)

        def copy() -> None:
            dst.copy_(row)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        return time_call(copy)

    @property
    def lossy(self) -> bool:
        """True when outputs may differ from the model's: a lossy miss or routing policy, or host compute
        on a non-CPU device (host and device kernels differ)."""
        miss_exact = bool(getattr(self.miss, "exact", True))
        if self._miss_hook and self.device.type != "cpu" and getattr(self.miss, "name", "") in ("cpu", "auto"):
            miss_exact = False
        return not miss_exact or not bool(getattr(self.routing, "exact", True))

    def _demand_wave(self, layer: int, experts: list[int], slots_or_scores) -> list[int]:
        """Slots of a wave: already pinned by the router hook (a list), or demanded now (scores given)."""
        t0 = time.perf_counter()
        if isinstance(slots_or_scores, list):
            slots = slots_or_scores
            self.cache.wait(slots)
        else:
            loads0 = self.cache.counters.loads
            slots = self.cache.demand_wave(layer, experts, slots_or_scores, self.miss)
            self._count_loads(layer, self.cache.counters.loads - loads0)
        self._book_s += time.perf_counter() - t0
        return slots

    def _grouped(
        self, module, x: torch.Tensor, eg: torch.Tensor, slot_rows: torch.Tensor, groups: int, views=None
    ) -> torch.Tensor:
        """Up/gate, activation, down over the slots of the rows' experts; one group per routed expert.

        `x [N,H]` rows sorted by expert id `eg [N]`, `slot_rows [N]` their slots, `groups` >= the number
        of distinct experts in `eg` (extra groups are empty). No host synchronization, no Python lists.
        """
        views = self.cache.views if views is None else views  # the device slots, or the host store's rows
        N = eg.numel()
        gid = torch.zeros(N, dtype=torch.long, device=eg.device)  # [N] group of each row
        torch.cumsum(eg[1:] != eg[:-1], 0, out=gid[1:])
        offsets = torch.searchsorted(gid, self._arange(groups, eg.device), right=True, out_int32=True)  # [G]
        slot_g = torch.zeros(groups, dtype=torch.long, device=eg.device).scatter_(0, gid, slot_rows)  # [G]
        up_name = "gate_up_proj" if module.has_gate else "up_proj"
        bias = views[up_name + "_bias"][slot_rows] if module.has_bias else None  # [N, 2I] or [N, I]
        proj = tx_compat.grouped_linear(
            x, views[up_name].index_select(0, slot_g), offsets, bias=bias, is_transposed=module.is_transposed
        )  # [N, 2I] or [N, I]
        proj = module._apply_gate(proj) if module.has_gate else module.act_fn(proj)  # [N, I]
        bias = views["down_proj_bias"][slot_rows] if module.has_bias else None  # [N, H]
        proj = tx_compat.grouped_linear(
            proj, views["down_proj"].index_select(0, slot_g), offsets, bias=bias, is_transposed=module.is_transposed
        )  # [N, H]
        if module.has_post_expert_norm:
            proj = module.post_expert_norm(proj)
        return proj
