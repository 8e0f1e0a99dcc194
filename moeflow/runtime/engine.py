"""The offload engine: transformers' experts interface + router hooks, driving the expert cache.

`OffloadEngine(model, ...)` (a context manager) moves every routed expert to the host store, frees
the stacked parameters on the device, registers the `moeflow` experts implementation in
transformers' `ExpertsInterface` and switches the model to it, and tags each experts module with
its layer and this engine (attributes on the module instance; no globals hold engines).

Per MoE layer and forward pass:
  router forward hook -> `on_layer_start` -> unique needed experts -> miss policy -> demand loads
  (hits pinned first) -> prefetch policy `propose(LayerContext)` -> prefetch copies (overlap this
  layer's expert compute) -> experts call: wait only for this layer's slots -> exact grouped compute
  on the slot buffer (in waves of <= capacity experts when a prefill needs more) -> release pins.
A forward pre-hook on the model marks pass boundaries (`pass_id += 1`); a post-hook publishes a
`PassStats` to every callable in `engine.observers` (step-size controllers, learned prefetchers).
`engine.lookahead` (step size S) is read into every `LayerContext`, so it may change between passes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ConfigError
from ..moe import RouterEvent, get_adapter, residual_hooks, router_hooks, tx_compat
from ..policies.base import EvictionPolicy, LayerContext, MissPolicy, PrefetchPolicy, RoutingPolicy
from .cache import CacheCounters, ExpertCache
from .link import Link
from .store import HostExpertStore

IMPL_NAME = "moeflow"


def moeflow_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
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
    tokens: int                   # tokens in this pass (prompt length for prefill, 1 per decode step)
    wall_s: float                 # forward wall time
    stall_s: float                # compute waiting on transfers
    counters: CacheCounters       # this pass's cache counters (hits, misses, loads, overfetch, ...)
    transfer_s: float             # link busy time of transfers completed during the pass
    transfer_bytes: int           # bytes of transfers completed during the pass
    lookahead: int                # step size S used in this pass
    loads_by_layer: dict[int, int] = field(default_factory=dict)  # transfers issued, by the expert's layer

    @property
    def overfetch(self) -> int:
        return self.counters.prefetch_unused_evicted


Observer = Callable[[PassStats], None]


class OffloadEngine:
    """Runs `model` with its routed experts in host memory and a C-slot device cache."""

    def __init__(self, model: nn.Module, *, capacity: int, link: Link, eviction: EvictionPolicy | None,
                 prefetch: PrefetchPolicy | None = None, miss: MissPolicy | None = None,
                 routing: RoutingPolicy | None = None, per_layer: bool = False, retain: bool = True,
                 lookahead: int = 1):
        if getattr(model.config, "_experts_implementation", None) not in ("grouped_mm", IMPL_NAME):
            raise ConfigError(f"offloading replaces the 'grouped_mm' experts implementation, the model uses "
                              f"{model.config._experts_implementation!r}; load it with experts_implementation='grouped_mm'")
        tx_compat.check()
        self.model = model
        self.adapter = get_adapter(model)
        for l in self.adapter.moe_layers:
            tx_compat.check_experts_module(self.adapter.experts(l))
        self.spec = self.adapter.spec
        self.link = link
        self.eviction, self.prefetcher, self.miss, self.routing = eviction, prefetch, miss, routing
        self.per_layer, self.retain = per_layer, retain
        self.capacity = capacity
        self.lookahead = int(lookahead)          # step size S; controllers may change it between passes
        self.observers: list[Observer] = []
        self.device = next(model.parameters()).device
        self.store = HostExpertStore(self.adapter, pin=self.device.type == "cuda")
        self.cache: ExpertCache | None = None
        self.pass_id = -1
        self._stack: contextlib.ExitStack | None = None
        self._pending: dict[int, tuple[list[int], list[int]]] = {}
        self._predicting = False
        self._residual: dict[int, torch.Tensor] = {}
        self._token_ids: torch.Tensor | None = None
        self._pass_t0 = 0.0
        self._pass_c0 = CacheCounters()
        self._pass_link0 = (0.0, 0)
        self._loads_by_layer: dict[int, int] = {}
        self._prev_impl: str | None = None

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
            self.cache = ExpertCache(self.store, self.capacity, device=self.device, link=self.link,
                                     eviction=self.eviction, per_layer=self.per_layer, retain=self.retain)
            stack.callback(self.link.close)
            bind = getattr(self.prefetcher, "bind", None)
            if bind is not None:   # learned prefetchers load their predictors and read experts: before offload
                stack.callback(bind(self.model, self))
            self.store.offload()
            stack.callback(self.store.restore)
            for l in self.spec.moe_layers:
                ex = self.adapter.experts(l)
                ex._moeflow_engine, ex._moeflow_layer = self, l
                stack.callback(self._untag, ex)
            register_experts_implementation()
            self._prev_impl = self.model.config._experts_implementation
            self.model.set_experts_implementation(IMPL_NAME)
            stack.callback(self.model.set_experts_implementation, self._prev_impl)
            if self.prefetcher is not None:           # post-attention residual (None where a family has no norm)
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
            if self.cache is not None:
                self.cache.close()
            stack, self._stack = self._stack, None
            stack.close()

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
        self._pending.clear()
        self._residual.clear()
        self._loads_by_layer = {}
        self._pass_c0 = self.cache.counters.copy()
        self._pass_link0 = (self.link.busy_s, self.link.bytes)
        self._pass_t0 = time.perf_counter()
        self.cache.begin_pass(self.pass_id)

    def _on_pass_end(self, module, args, output) -> None:
        for slots in [s for _, s in self._pending.values()]:   # a layer routed but never computed
            self.cache.release(slots)
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
        )
        for obs in list(self.observers):
            obs(stats)

    # ---- routing: demand loads and prefetch, as early as possible -------------------------------------
    def _on_route(self, ev: RouterEvent):
        if self._predicting:                     # a prefetch policy applying another layer's router
            return None
        cache, l = self.cache, ev.layer
        cache.begin_layer(l)
        logits, weights, indices = ev.logits, ev.weights, ev.indices
        replaced = None
        if self.routing is not None:
            bias = self.routing.bias(l, self.spec.num_experts, cache.is_ready)
            if bias is not None:
                weights, indices = self.adapter.select(l, logits, bias)
                replaced = (logits, weights, indices)
        experts, scores = self._needs(indices, weights)
        if len(experts) <= cache.part_capacity:
            self._check_misses(l, experts)
            loads0 = cache.counters.loads
            self._pending[l] = (experts, cache.demand(l, experts, scores))
            self._count_loads(l, cache.counters.loads - loads0)
        if self.prefetcher is not None:
            self._prefetch(l, ev.x, logits, indices, weights)
        return replaced

    @staticmethod
    def _needs(indices: torch.Tensor, weights: torch.Tensor) -> tuple[list[int], dict[int, float]]:
        """Unique experts of a call and their summed gate weight over the call's tokens."""
        flat = indices.reshape(-1)
        uniq = torch.unique(flat)                                               # sorted [U]
        summed = torch.zeros(uniq.numel(), dtype=torch.float32, device=flat.device)
        summed.index_add_(0, torch.searchsorted(uniq, flat), weights.reshape(-1).float())
        experts = uniq.tolist()
        return experts, dict(zip(experts, summed.tolist()))

    def _check_misses(self, layer: int, experts: list[int]) -> None:
        if self.miss is None:
            return
        for e in experts:
            if not self.cache.resident((layer, e)):
                action = self.miss.on_miss((layer, e), self.cache.position(layer))
                if action != "fetch":
                    raise ConfigError(f"miss policy {self.miss.name!r} asked for {action!r}; the runtime "
                                      f"implements only 'fetch' so far")

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
            pos=self.cache.position(layer), layer=layer, moe_layers=self.spec.moe_layers,
            num_experts=self.spec.num_experts, top_k=self.spec.top_k, router_input=x,
            logits=logits.reshape(-1, logits.shape[-1]), indices=indices.reshape(-1, indices.shape[-1]),
            weights=weights.reshape(-1, weights.shape[-1]), predict_logits=predict_logits,
            token_ids=self._token_ids, residual=self._residual.get(layer), lookahead=self.lookahead,
            resident=self.cache.resident)
        reqs = self.prefetcher.propose(ctx)
        if reqs:
            keys0 = set(self.cache.slot_of)
            if self.cache.prefetch(reqs, layer):
                for k in set(self.cache.slot_of) - keys0:
                    self._count_loads(k[0], 1)

    # ---- the experts call ------------------------------------------------------------------------------
    def experts_forward(self, module: nn.Module, layer: int, hidden_states: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        experts, scores = self._needs(top_k_index, top_k_weights)
        pending = self._pending.pop(layer, None)
        if pending is not None and pending[0] == experts:
            waves = [pending]
        else:                                        # prefill beyond capacity (or routing not seen)
            if pending is not None:
                cache.release(pending[1])
            waves = self._plan_waves(layer, experts)
        return self._compute(module, layer, hidden_states, top_k_index, top_k_weights, waves, scores)

    def _plan_waves(self, layer: int, experts: list[int]) -> list[tuple[list[int], None]]:
        """Chunks of <= per-layer capacity experts, resident ones first (they need no copy)."""
        cap = self.cache.part_capacity
        ordered = sorted(experts, key=lambda e: (not self.cache.resident((layer, e)), e))
        return [(sorted(ordered[i:i + cap]), None) for i in range(0, len(ordered), cap)]

    def _compute(self, module, layer, hidden_states, top_k_index, top_k_weights, waves, scores) -> torch.Tensor:
        """grouped_mm experts forward on the slot buffer; bit-identical to transformers' `grouped_mm`."""
        cache = self.cache
        device = hidden_states.device
        T, H = hidden_states.shape
        k = top_k_index.size(-1)
        C = cache.capacity
        views = cache.views
        sample_weights = top_k_weights.reshape(-1)                              # [S]
        expert_ids = top_k_index.reshape(-1)                                    # [S]
        expert_ids_g, perm = torch.sort(expert_ids)                             # same order as grouped_mm
        x_g = hidden_states[perm // k]                                          # [S,H]
        w_g = sample_weights[perm]                                              # [S]
        up_name = "gate_up_proj" if module.has_gate else "up_proj"
        out_g = None
        for experts, slots in waves:
            if slots is None:                                                   # a wave planned here
                self._check_misses(layer, experts)
                loads0 = cache.counters.loads
                slots = cache.demand(layer, experts, {e: scores[e] for e in experts})
                self._count_loads(layer, cache.counters.loads - loads0)
            cache.wait(slots)
            slot_map = torch.full((self.spec.num_experts,), -1, dtype=torch.long)
            slot_map[torch.tensor(experts, dtype=torch.long)] = torch.tensor(slots, dtype=torch.long)
            slot_ids = slot_map.to(device)[expert_ids_g]                        # [S] slot of each sorted row
            rows = torch.nonzero(slot_ids >= 0).squeeze(1) if len(waves) > 1 else \
                torch.arange(slot_ids.numel(), device=device)                   # [S_w] rows of this wave
            sid, order = torch.sort(slot_ids[rows], stable=True)                # group by slot, keep row order
            rows = rows[order]
            offsets = torch.cumsum(torch.bincount(sid, minlength=C), 0, dtype=torch.int32)  # [C]
            bias = views[up_name + "_bias"][sid] if module.has_bias else None
            proj = tx_compat.grouped_linear(x_g[rows], views[up_name], offsets, bias=bias,
                                            is_transposed=module.is_transposed)  # [S_w, 2I] or [S_w, I]
            proj = module._apply_gate(proj) if module.has_gate else module.act_fn(proj)   # [S_w, I]
            bias = views["down_proj_bias"][sid] if module.has_bias else None
            proj = tx_compat.grouped_linear(proj, views["down_proj"], offsets, bias=bias,
                                            is_transposed=module.is_transposed)  # [S_w, H]
            if module.has_post_expert_norm:
                proj = module.post_expert_norm(proj)
            if out_g is None:
                out_g = torch.empty(expert_ids.numel(), proj.shape[-1], dtype=proj.dtype, device=device)  # [S,H]
            out_g[rows] = proj
            cache.release(slots)
        weighted = out_g * w_g.unsqueeze(-1)                                    # [S,H]
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=device)
        weighted = weighted[inv_perm]                                           # [S,H] original order
        return weighted.view(T, k, H).sum(dim=1).to(hidden_states.dtype)        # [T,H]
