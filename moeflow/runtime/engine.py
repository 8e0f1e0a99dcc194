"""The offload engine: lifecycle and hooks. Runs a transformers MoE model with its routed experts in host memory.

`OffloadEngine(model, ...)` (a context manager) moves every routed expert to the host store, frees the
stacked parameters on the device, makes the C-slot device cache, binds the policies that declare
`needs_model`, registers the `moeflow` experts implementation and switches the model to it
(`moeflow.moe.experts_impl`: each experts module tagged with its layer and this engine; no globals hold
engines), and installs its hooks. Each hook hands over to the module that does that job:
- model forward pre-hook -> `_on_pass_start`: `pass_id += 1`, `PassAccount.begin`, `RouteStep.begin_pass`,
  `StagedPrefill.begin` (a prefill pass: `runtime/prefill.py`, with `prefill="staged"` its layers' experts move
  as staged batches, double-buffered), `cache.begin_pass` (`on_pass_start`), then `pass_start_hooks` (plans),
  then a staged prefill's first staged batches (`StagedPrefill.start`: predicted from the embeddings);
- router forward hook (`moeflow.moe.router_hooks`) -> `_on_route` -> `RouteStep.route` (`runtime/step.py`:
  deferral, reroute, ONE host read, miss rewriting, `cache.route`, prefetch context and copies);
- post-attention residual hook (`needs_residual` prefetchers) -> `RouteStep.residual`;
- experts call (transformers' experts interface, `moeflow`) -> `experts_forward` -> `ExpertsCall.forward`
  (`runtime/experts_call.py`: waits for its own slots, waves, host experts) -> `moeflow.moe.compute`
  (sort, grouped GEMM over the routed experts' slots, weighted combine);
- model forward post-hook -> `_on_pass_end`: `RouteStep.end_pass` (deferred accesses replayed, unused
  pins released), then a `PassStats` (`runtime/passstats.py`) to every callable in `engine.observers`.
`engine.lookahead` (step size S) is read into every `LayerContext`, so it may change between passes.
What a policy can do is declared on its class (`moeflow.policies.base`), never probed; `lossy` is
`moeflow.policies.lossy.lossy` over the engine's policies and device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from torch import nn

from ..errors import ConfigError
from ..moe import RouterEvent, get_adapter, residual_hooks, router_hooks, tx_compat
from ..moe.experts_impl import check_replaceable, register_experts_impl, use_experts_impl
from ..policies.base import BindContext, EvictionPolicy, MissPolicy, PrefetchPolicy, PrefetchRequest, RoutingPolicy
from ..policies.lossy import lossy
from . import timing
from .cache import ExpertCache
from .counters import GATHER_BYTES, MAX_GROUPS, CacheCounters, needed_experts, wave_capacity  # noqa: F401
from .experts_call import ExpertsCall
from .host_worker import HostWorker, hidden_share, worker_is_exact
from .link import Link
from .passstats import EngineCounts, Observer, PassAccount, PassStats  # noqa: F401  (PassStats: importable here)
from .prefill import PREFILL_PATHS, StagedPrefill
from .step import RouteStep
from .store import HostExpertStore

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IMPL_NAME = "moeflow"
T = TypeVar("T")


def register_experts_implementation() -> None:
    """Idempotent: add `moeflow` to transformers' experts implementations."""
    register_experts_impl(IMPL_NAME)


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
        host_worker: bool = True,
        prefill: str = "staged",
    ):
        self.adapter = get_adapter(model)
        check_replaceable(model, self.adapter, IMPL_NAME, "offloading")
        self.model = cast("PreTrainedModel", model)  # a transformers model: `config`, `set_experts_implementation`
        self.spec = self.adapter.spec
        self.link = link
        self.eviction, self.prefetcher, self.miss, self.routing = eviction, prefetch, miss, routing
        self.per_layer, self.retain = per_layer, retain
        self.capacity = capacity
        self.lookahead = int(lookahead)  # step size S; controllers may change it between passes
        self.host_worker = bool(host_worker)  # host experts beside the device's (False: serially)
        if prefill not in PREFILL_PATHS:
            raise ConfigError(f"--prefill {prefill!r} unknown; use one of {', '.join(PREFILL_PATHS)}")
        self.prefill_path = prefill  # staged (`runtime/prefill.py`) or serial (the per-layer step alone)
        self.observers: list[Observer] = []
        self.pass_start_hooks: list[Callable[[], None]] = []  # called at every pass start, after the cache's (plans)
        self.device = next(model.parameters()).device
        self.store = HostExpertStore(self.adapter, pin=self.device.type == "cuda")
        self.counts = EngineCounts()  # host reads, host compute seconds, misses handled without a copy
        self.account = PassAccount()  # the running pass's ledger (PassStats)
        self.pass_id = -1
        self._cache: ExpertCache | None = None  # created by `attach`
        self._step: RouteStep | None = None
        self._prefill: StagedPrefill | None = None
        self._call: ExpertsCall | None = None
        self._stack: contextlib.ExitStack | None = None
        self._predicting = False  # a policy (or speculative routing) is applying a router: the hooks ignore it

    @property
    def cache(self) -> ExpertCache:
        """The expert cache; exists once the engine has been attached (`with engine:` or `attach()`)."""
        return _attached(self._cache)

    @property
    def step(self) -> RouteStep:
        """The per-layer step (router hook side); exists once attached."""
        return _attached(self._step)

    @property
    def host_syncs(self) -> int:
        """Device -> host reads the engine made (each one a synchronization on CUDA)."""
        return self.counts.host_syncs

    @property
    def host_s(self) -> float:
        """Seconds the host spent running experts (miss policy `cpu` / `auto`; copies to and from it included)."""
        return self.counts.host_s

    @property
    def host_wait_s(self) -> float:
        """Seconds experts calls waited for host experts (the part of `host_s` not hidden behind the device)."""
        return self.counts.host_wait_s

    @property
    def host_hidden_share(self) -> float | None:
        """Share of `host_s` hidden behind the device's work (0..1); None before any host expert ran."""
        return hidden_share(self.counts.host_s, self.counts.host_wait_s)

    @property
    def host(self) -> HostWorker | None:
        """The host worker running `cpu` / `auto` misses beside the device (its `split` choice on a CPU device);
        None before attach or without one."""
        return self._call.host if self._call is not None else None

    @property
    def miss_counts(self) -> dict[str, int]:
        """Missing experts (per layer call and expert) handled without a copy: drop / substitute / cpu."""
        return self.counts.miss_counts

    @property
    def lossy(self) -> bool:
        """True when outputs may differ from the model's (`moeflow.policies.lossy`, for this device)."""
        return lossy(
            device_type=self.device.type,
            eviction=[self.eviction] if self.eviction is not None else [],
            prefetch=[self.prefetcher] if self.prefetcher is not None else [],
            miss=self.miss,
            routing=self.routing,
        ).lossy

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
        pf, miss = self.prefetcher, self.miss
        prefetching = pf is not None and pf.proposes
        try:
            cache = self._cache = ExpertCache(
                self.store,
                self.capacity,
                device=self.device,
                link=self.link,
                eviction=self.eviction,
                per_layer=self.per_layer,
                retain=self.retain,
                gate=pf.gate if pf is not None and prefetching else None,
            )
            if cache.buffer is not None:  # the slot buffer's pages mapped now, not by the first prefill's copies
                cache.buffer.zero_()
            stack.callback(self.link.close)
            ctx = BindContext(
                self.model,
                self.adapter,
                self.link,
                self.store.expert_bytes,
                self.time_host_expert,
                self.time_row_copy,
                host_hidden=lambda: self.host_hidden_share,
            )
            if pf is not None and pf.needs_model:  # learned prefetchers load predictors, read experts: before offload
                stack.callback(pf.bind(ctx))
            self.store.offload()
            stack.callback(self.store.restore)
            if miss is not None and miss.precisions:  # mixed-precision miss policies: compact copies
                self.store.quantize(miss.precisions, optimize=miss.optimize)
            if miss is not None and miss.needs_model:  # substitute: router similarities; auto: host / copy timings
                miss.bind(ctx)
            wave_cap = wave_capacity(cache.part_capacity, self.store.expert_bytes)
            routing_miss = miss is not None and (miss.needs_routing or bool(miss.precisions))  # decided per call
            staged = self.prefill_path == "staged" and self.retain and not routing_miss
            self._prefill = StagedPrefill(
                cache=cache,
                spec=self.spec,
                wave_cap=wave_cap,
                account=self.account,
                predict_logits=self._predict_logits,
                enabled=staged,
                stage_next=prefetching,  # staging the next layer is speculative: only with a prefetch policy
            )
            step = self._step = RouteStep(
                adapter=self.adapter,
                cache=cache,
                wave_cap=wave_cap,
                miss=miss,
                routing=self.routing,
                prefetcher=pf,
                retain=self.retain,
                account=self.account,
                counts=self.counts,
                predict_logits=self._predict_logits,
                lookahead=lambda: self.lookahead,
                prefill=self._prefill,
            )
            host = None
            exact = worker_is_exact(self.device.type, torch.get_num_threads())  # a worker beside this device
            if self.host_worker and miss is not None and miss.needs_host and exact:
                host = HostWorker(self.device, self.counts)  # cpu / auto: host experts on a thread
                stack.callback(host.close)
            self._call = ExpertsCall(
                step=step,
                cache=cache,
                store=self.store,
                miss=miss,
                hit_first=self.routing is not None and self.routing.hit_first,
                account=self.account,
                counts=self.counts,
                host=host,
            )
            stack.enter_context(use_experts_impl(self.model, self.adapter, IMPL_NAME, self))
            call = self._call
            if call.mirrors_batched:  # the all-hit decode call mirrors generate's decode stage (`batched_mm`)
                stack.enter_context(tx_compat.decode_stage(self.model, lambda on: setattr(call, "decode_stage", on)))
            if prefetching and pf is not None and pf.needs_residual:  # post-attention residual (None without a norm)
                stack.enter_context(residual_hooks(self.adapter, step.residual.__setitem__, hint=None))
            stack.enter_context(router_hooks(self.adapter, self._on_route))
            h1 = self.model.register_forward_pre_hook(self._on_pass_start, with_kwargs=True)
            h2 = self.model.register_forward_hook(self._on_pass_end)
            stack.callback(h1.remove)
            stack.callback(h2.remove)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        timing.collect_setup()  # the policies' binding's garbage collected now, not in a timed decode step (settled heap)

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

    def flush(self) -> None:
        """Replay the deferred accesses into the cache now (`RouteStep.flush`)."""
        self.step.flush()

    # ---- hooks ----------------------------------------------------------------------------------------
    def _on_pass_start(self, module, args, kwargs) -> None:
        self.pass_id += 1
        self.account.begin(self.pass_id, kwargs.get("input_ids", args[0] if args else None), self.cache.counters, self.link)
        self.step.begin_pass()
        _attached(self._prefill).begin(self.account.decode)
        self.cache.begin_pass(self.pass_id)
        for hook in list(self.pass_start_hooks):
            hook()
        pf = self._prefill
        if pf is not None and pf.active and pf.stage_next:  # a staged prefill stages its first layers now
            embeds = kwargs.get("inputs_embeds")
            ids = kwargs.get("input_ids", args[0] if args else None)
            if embeds is None and ids is not None:
                with torch.no_grad():
                    embeds = self.model.get_input_embeddings()(ids)  # [B,P,H]
            pf.start(embeds)

    def _on_pass_end(self, module, args, output) -> None:
        self.step.end_pass()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not self.observers:
            return
        stats = self.account.stats(self.cache.counters, self.link, self.lookahead)
        if self._prefill is not None and self._prefill.prefill:
            stats.needed = self._prefill.needed
        for obs in list(self.observers):
            obs(stats)

    def _on_route(self, ev: RouterEvent):
        if self._predicting:  # a prefetch policy applying another layer's router
            return None
        self.account.router_called()  # attention + router since the last experts call
        return self.step.route(ev)

    def experts_forward(
        self, module: nn.Module, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The layer's experts; its time minus demand loads and waits counts as compute (PassStats.compute_s)."""
        t0, b0 = time.perf_counter(), self.account.book_s
        out = _attached(self._call).forward(module, layer, hidden_states, top_k_index, top_k_weights)
        self.account.experts_called(t0, b0)
        return out

    def _predict_logits(self, target: int, h: torch.Tensor) -> torch.Tensor:
        """Layer `target`'s router on h [T,H] -> [T,E] for a prefetch policy (the router hooks ignore it)."""
        self._predicting = True
        try:
            with torch.no_grad():
                return self.adapter.router_logits(target, h)
        finally:
            self._predicting = False

    # ---- measurements ---------------------------------------------------------------------------------
    def time_host_expert(self, tokens: int) -> float:
        """Fastest seconds to run one expert of the first MoE layer on `tokens` rows on the host (attached)."""
        return timing.time_host_expert(self.adapter, self.store, tokens)

    def time_row_copy(self) -> float:
        """Fastest seconds of one plain host -> device copy of one expert row (no link emulation; attached)."""
        return timing.time_row_copy(self.store, self.device)


def _attached(part: T | None) -> T:
    if part is None:
        raise RuntimeError("the OffloadEngine is not attached: use `with engine:` or call `engine.attach()` first")
    return part
