"""The offload engine's experts call: the routed experts computed from the device slots (and the host store).

`ExpertsCall.forward(module, layer, hidden [T,H], top_k_index [T,k], top_k_weights [T,k])` is what
transformers' experts interface calls under the `moeflow` implementation (through `OffloadEngine`):
1. the routing the router hook left (`RouteStep.take`): the experts and their pinned slots (one wave), or
   the experts to demand in waves (a prefill needing more experts than a wave holds: `cache.plan_waves`,
   resident experts first), or nothing (deferred: every expert of the layer resident and ready);
2. the all-hit fast path (`_in_place`): when every routed expert has a slot, one wave holds them (deferred or
   pinned, no host expert, no hit-first split) and the slots' span is at most `MAX_GROUPS` slots (deferred: the
   span of the layer's slots, found on the host once per slot layout), `entry_sorted_forward`: the rows sorted by
   slot through the device table, ONE grouped call per projection over the span with the weights read in place
   (never gathered), the stock combine. A decode step off the CPU, where transformers' `generate` decodes the
   stock model with `batched_mm`, mirrors that instead (`entry_batched_forward`: each row's weights gathered from
   its slot, `bmm`; any span) while the gathered weights stay under `BATCHED_GATHER_MAX` (256 MiB: the
   OLMoE-1B-7B shape's top-8 gather 100 MB; a Mixtral expert alone is 336 MiB);
3. otherwise `moeflow.moe.compute.routed_experts_forward`: the stock sort; then per wave the wait for its own slots
   only (`cache.wait` / `demand_wave`, booked as non-compute time), `grouped_experts` over the rows of the
   wave with each expert's weights gathered from its slot through the cache's device table
   (`table[expert_ids]`: no tensor from a Python list), `release`; the stock weighted combine.
Host experts (`cpu` misses) run the same grouped kernels over the host store's rows (activations move,
weights never do): with a host worker (`runtime/host_worker.py`) their rows are submitted FIRST and computed
on the worker thread while this thread computes the experts with a slot (waits included), then joined just
before the combine; without one (`_host_rows`) serially, after the first part of the wave. On a CPU device a
call whose every expert is a host expert either splits them (the worker about half the rows, this thread the
rest) or computes them all here, whichever the worker's `SplitChoice` measured faster. Order inside one
pinned wave: with `hit-first` the ready experts' rows first, then the wait for the slots still loading.
Every path writes its rows into one `[S,H]` buffer before the single combine, so the result is bit-identical
to `grouped_mm` (rows are independent; each group holds the stock call's rows in the stock order).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from ..moe import tx_compat
from ..moe.compute import (
    MAX_GROUPS,
    Aranges,
    SpanViews,
    entry_batched_forward,
    entry_sorted_forward,
    grouped_experts,
    grouped_experts_in_place,
    routed_experts_forward,
)
from ..policies.base import MissPolicy
from .cache import ExpertCache
from .host_worker import HostJob, HostWorker
from .passstats import EngineCounts, PassAccount
from .step import Routed, RouteStep
from .store import HostExpertStore

BATCHED_GATHER_MAX = 256 << 20  # bytes of expert weights a mirrored batched_mm decode call may gather (T*k rows)

Wave = tuple[list[int] | None, Any]  # (experts, their pinned slots | their scores to demand | None: deferred)


class ExpertsCall:
    """The experts call of every MoE layer of one attached engine (see the module docstring)."""

    def __init__(
        self,
        *,
        step: RouteStep,
        cache: ExpertCache,
        store: HostExpertStore,
        miss: MissPolicy | None,
        hit_first: bool,
        account: PassAccount,
        counts: EngineCounts,
        host: HostWorker | None = None,
    ):
        self.step, self.cache, self.store, self.miss = step, cache, store, miss
        self.host = host  # computes host experts beside this thread (None: serially, on this thread)
        self.spec = store.spec
        self.hit_first = hit_first  # compute resident experts before waiting (`RoutingPolicy.hit_first`)
        self.account, self.counts = account, counts
        self._aranges = Aranges()
        self._host_aranges = Aranges()  # the worker thread's own (the cache is a dict)
        self._spans = SpanViews(cache.views)  # the slot spans read in place (entries, weight views)
        self._tables: dict[int, torch.Tensor] = {}  # layer -> its row of the device table (a view)
        # layer -> (loads then, its slot span, its slots' views when slot = lo + e): `_layer_layout`
        self._layouts: dict[int, tuple[int, tuple[int, int] | None, dict[str, torch.Tensor] | None]] = {}
        # off the CPU, transformers' generate decodes the stock model with `batched_mm`: the all-hit decode call
        # mirrors it (`entry_batched_forward`, bit-identical to that reference; fewer ops than a sorted grouped call)
        dev = next(iter(cache.views.values())).device if cache.views else None
        self._batched = tx_compat.decode_batched() if dev is not None and dev.type != "cpu" else None
        self._batched_rows = BATCHED_GATHER_MAX // max(1, store.expert_bytes)  # rows (T*k) it may gather
        self.decode_stage = False  # inside generate's decode stage (`tx_compat.decode_stage`, set by the engine)

    @property
    def mirrors_batched(self) -> bool:
        """Whether generate's decode stage is mirrored with `batched_mm` (off the CPU, where transformers has it)."""
        return self._batched is not None

    def forward(
        self, module: nn.Module, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The layer's routed experts: hidden [T,H] -> [T,H], bit-identical to transformers' `grouped_mm`."""
        routed = self.step.take(layer, top_k_index, top_k_weights)
        out = self._in_place(module, layer, hidden, top_k_index, top_k_weights, routed)
        if out is None:
            out = self._waves(module, layer, hidden, top_k_index, top_k_weights, routed)
        if self.miss is not None and self.miss.needs_routing and routed.scores is not None:
            self.miss.observe(layer, routed.scores)  # the call's experts with a slot (hits and fetched)
        return out

    def _waves(
        self,
        module: nn.Module,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        routed: Routed,
    ) -> torch.Tensor:
        """The call wave by wave (the general path): the stock sort, each wave's rows through its gathered weights
        once its slots are ready, host experts, the stock combine. hidden [T,H] -> [T,H]."""
        waves: list[Wave]
        if routed.experts is None:  # deferred: all resident, ready
            waves, groups = [(None, None)], min(top_k_index.numel(), self.spec.num_experts)
        elif routed.slots is not None:
            waves, groups = [(routed.experts, routed.slots)], len(routed.experts)
        elif routed.waves is not None:  # a staged prefill: its own waves (`sorted_rows`)
            waves, groups = [], len(routed.experts)
        else:  # prefill beyond one wave: demanded wave by wave
            scores = routed.scores
            plan = self.cache.plan_waves(layer, routed.experts, self.step.wave_cap)
            waves, groups = [(w, scores) for w in plan], len(routed.experts)
        table = self._table(layer)  # [E] slot of each expert, -1

        def sorted_rows(x_g: torch.Tensor, eg: torch.Tensor) -> torch.Tensor:
            if routed.waves is not None and self.step.prefill is not None:  # a staged prefill (`runtime/prefill.py`)
                return self.step.prefill.compute(self, module, layer, x_g, eg, table, routed)
            return self._compute(module, layer, x_g, eg, table, waves, groups, routed.cpu)

        return routed_experts_forward(hidden, top_k_index, top_k_weights, sorted_rows)

    def _in_place(
        self,
        module: nn.Module,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        routed: Routed,
    ) -> torch.Tensor | None:
        """The call with every routed expert's weights read in place from its slot (`entry_sorted_forward`):
        deferred (every expert of the layer in a ready slot) or one pinned wave without host experts nor a
        hit-first split, when the slots' span is at most `MAX_GROUPS` slots; in generate's decode stage off the
        CPU the same calls mirror `batched_mm` instead (`entry_batched_forward`, any span, at most
        `BATCHED_GATHER_MAX` gathered). None: not this case."""
        if routed.cpu or routed.waves is not None:
            return None
        slots = routed.slots
        own = None  # deferred, the layer's experts in slots lo..lo+E-1 in expert order: its own stacked weights
        if routed.experts is None:  # deferred
            span, own = self._layer_layout(layer)
        elif (
            slots
            and len(slots) == len(routed.experts)
            and (not self.hit_first or self._split_wave(layer, routed.experts, slots, None) is None)
        ):
            span = (min(slots), max(slots) + 1)
        else:
            return None
        batched = self._batched if self.decode_stage else None  # generate's decode stage off the CPU: as stock
        if batched is not None and top_k_index.numel() > self._batched_rows:
            batched = None  # its gathered weights would cost more device memory and copy time than the ops it saves
        if span is None or (batched is None and span[1] - span[0] > MAX_GROUPS):
            return None
        if routed.experts is not None and slots is not None:
            self._demand_wave(layer, routed.experts, slots)  # waits for the wave's slots
        table = self._table(layer)
        if batched is not None and own is not None:  # indexed by expert id, as the stock parameters
            out = entry_batched_forward(module, hidden, top_k_index, top_k_weights, None, own, batched)
        elif batched is not None:
            out = entry_batched_forward(module, hidden, top_k_index, top_k_weights, table, self.cache.views, batched)
        else:
            out = entry_sorted_forward(module, hidden, top_k_index, top_k_weights, table, self.cache.views, span, self._spans)
        # out: [T,H]
        if routed.experts is not None and slots is not None:
            self.cache.release(slots)
        return out

    def _table(self, layer: int) -> torch.Tensor:
        """The layer's row `[E]` of the cache's device table (slot of each expert, -1), a view made once."""
        t = self._tables.get(layer)
        if t is None:
            table = self.cache.table
            if table is None:  # unreachable: an engine's cache has a store, hence a device table
                raise RuntimeError("the expert cache has no device slot table")
            t = self._tables[layer] = table[self.cache.rank[layer]]  # [E]
        return t

    def _layer_layout(self, layer: int) -> tuple[tuple[int, int] | None, dict[str, torch.Tensor] | None]:
        """(span, own): (lowest slot, highest slot + 1) of the layer's experts, every one resident, None if one is
        not; and when each expert e sits in slot lo + e (as `warm` loads them), the slots' views `[E, ...]`, else
        None. Found on the host once per slot layout: a slot changes key only through a load (`counters.loads`)."""
        cache = self.cache
        loads = cache.counters.loads
        known = self._layouts.get(layer)
        if known is not None and known[0] == loads:
            return known[1], known[2]
        slot_of = cache.slot_of
        slots = [slot_of.get((layer, e)) for e in range(self.spec.num_experts)]
        span = None
        own = None
        if all(s is not None for s in slots):
            held = [s for s in slots if s is not None]
            span = (min(held), max(held) + 1)
            if held == list(range(span[0], span[0] + len(held))):  # slot = lo + e
                own = {name: w[span[0] : span[1]] for name, w in cache.views.items()}  # [E, ...] each, views
        self._layouts[layer] = (loads, span, own)
        return span, own

    def _compute(
        self,
        module: nn.Module,
        layer: int,
        x_g: torch.Tensor,
        eg: torch.Tensor,
        table: torch.Tensor,
        waves: list[Wave],
        groups: int,
        cpu: list[int] | None,
    ) -> torch.Tensor:
        """Every sorted row `x_g [S,H]` (experts `eg [S]`, ascending) through its expert -> [S,H].

        `waves`: `[(experts, slots)]` pinned by the router hook, `[(experts, scores)]` demanded one wave at a
        time, or `[(None, None)]` (deferred). `cpu`: experts without a slot the miss policy runs on the host."""
        cache = self.cache
        S = eg.numel()
        out_g: torch.Tensor | None = None
        t_host = time.perf_counter()
        job, mine, halves = self._host_job(module, layer, cpu, x_g, eg, waves)  # mine: host experts computed here
        split = None
        if len(waves) == 1 and waves[0][0] is not None and (cpu or self.hit_first):
            split = self._split_wave(layer, waves[0][0], waves[0][1], cpu)
        if split is not None:  # parts of one pinned wave, ready ones first under hit-first
            for i, (part_experts, part_slots) in enumerate(split):
                self._demand_wave(layer, part_experts, part_slots)  # waits for this part's slots only
                if part_experts:
                    rows, eg_w = self._rows(part_experts, eg)
                    proj = self._grouped(module, x_g[rows], eg_w, table[eg_w], len(part_experts))  # [S_w,H]
                    out_g = _put(out_g, rows, proj, S)
                if i == 0 and mine:  # this thread's host experts while the misses' copies are in flight
                    out_g = self._host_rows(module, layer, mine, x_g, eg, out_g)
            cache.release(waves[0][1])
        elif len(waves) == 1:
            experts, slots = waves[0]
            if experts is not None:
                slots = self._demand_wave(layer, experts, slots)
            out_g = self._grouped(module, x_g, eg, table[eg], groups)  # [S,H]
            if experts is not None:
                cache.release(slots)
        else:
            for experts, scores in waves:
                if experts is None:  # unreachable: only a single deferred wave has no experts
                    raise RuntimeError(f"layer {layer}: a planned wave without experts")
                slots = self._demand_wave(layer, experts, scores)
                rows, eg_w = self._rows(experts, eg)  # [S_w] rows of this wave, their experts sorted
                proj = self._grouped(module, x_g[rows], eg_w, table[eg_w], len(experts))  # [S_w,H]
                out_g = _put(out_g, rows, proj, S)
                cache.release(slots)
            if mine:
                out_g = self._host_rows(module, layer, mine, x_g, eg, out_g)
        if job is not None:  # the host rows, computed beside the work above
            host_rows, host_job = job
            out_g = _put(out_g, host_rows, host_job.join(), S)
        if halves is not None and self.host is not None:  # an all-host call on a CPU device: its mode's time
            self.host.split.record(S, halves, time.perf_counter() - t_host)
        if out_g is None:  # unreachable: every routed row belongs to a wave or a host expert
            raise RuntimeError(f"layer {layer}: no expert computed")
        return out_g

    def _host_job(
        self, module: nn.Module, layer: int, cpu: list[int] | None, x_g: torch.Tensor, eg: torch.Tensor, waves: list[Wave]
    ) -> tuple[tuple[torch.Tensor, HostJob] | None, list[int] | None, bool | None]:
        """(the host worker's job: its rows and the job, or None; the host experts this thread computes itself;
        for an all-host call on a CPU device whether it splits them, else None).

        Every host expert goes to the worker while this thread computes the experts with a slot. On a CPU
        device a call whose every expert is a host expert has no device work to hide the worker behind: split
        (`HostWorker.split` measures which is faster), the worker takes the first host experts (about half the
        rows) and this thread computes the rest meanwhile; else (or one expert, or no worker) all of them here."""
        if not cpu or self.host is None:
            return None, cpu, None
        if self.host.device.type != "cpu" or any(experts is None or experts for experts, _ in waves):
            return self._submit_host(module, layer, cpu, x_g, eg), None, None
        if len(cpu) < 2:
            return None, cpu, None
        if not self.host.split.pick(eg.numel()):
            return None, cpu, False
        k = _split_point(cpu, eg)
        return self._submit_host(module, layer, cpu[:k], x_g, eg), cpu[k:], True

    def _split_wave(
        self, layer: int, experts: list[int], slots: list[int], cpu: list[int] | None
    ) -> list[tuple[list[int], list[int]]] | None:
        """`[(experts, slots)]` parts of a pinned wave in compute order: under hit-first the ready experts,
        then the ones still loading; None when one grouped call over the whole wave will do."""
        ready = [self.cache.is_ready((layer, e)) for e in experts]
        if self.hit_first and any(ready) and not all(ready):
            first = [(e, s) for e, s, r in zip(experts, slots, ready) if r]
            rest = [(e, s) for e, s, r in zip(experts, slots, ready) if not r]
            return [([e for e, _ in first], [s for _, s in first]), ([e for e, _ in rest], [s for _, s in rest])]
        return [(experts, slots)] if cpu else None

    def _rows(self, experts: list[int], eg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [S_w] of the sorted routing that go to `experts`, their expert ids [S_w], sorted)."""
        member = torch.zeros(self.spec.num_experts, dtype=torch.bool, device=eg.device)
        member[torch.tensor(experts, device=eg.device)] = True  # [E]
        rows = torch.nonzero(member[eg]).squeeze(1)  # [S_w]
        return rows, eg[rows]

    def _demand_wave(self, layer: int, experts: list[int], slots_or_scores: Any) -> list[int]:
        """Slots of a wave: already pinned by the router hook (a list), or demanded now (scores given)."""
        t0 = time.perf_counter()
        if isinstance(slots_or_scores, list):
            slots = slots_or_scores
            self.cache.wait(slots)
        else:
            loads0 = self.cache.counters.loads
            miss = None if self.miss is not None and self.miss.needs_routing else self.miss  # decided in the hook
            slots = self.cache.demand_wave(layer, experts, slots_or_scores, miss)
            self.account.count_loads(layer, self.cache.counters.loads - loads0)
        self.account.book(time.perf_counter() - t0)
        return slots

    def _submit_host(
        self, module: nn.Module, layer: int, cpu: list[int], x_g: torch.Tensor, eg: torch.Tensor
    ) -> tuple[torch.Tensor, HostJob]:
        """Hand the rows routed to the host experts `cpu` to the host worker: (their rows [S_c], the job).
        The same rows, grouping and kernel as `_host_rows`, so the result is bit-identical to it."""
        if self.host is None:  # unreachable: only called with a host worker
            raise RuntimeError("no host worker")
        rows, eg_c = self._rows(cpu, eg)
        views = self.store.layout.views(self.store.rows[layer])  # [E,...] host, no copy
        groups, aranges = len(cpu), self._host_aranges

        def compute(x_h: torch.Tensor, eg_h: torch.Tensor) -> torch.Tensor:
            return grouped_experts(module, x_h, eg_h, views, eg_h, groups, aranges)  # [S_c,H] host

        return rows, self.host.submit(x_g[rows], eg_c, compute)

    def _host_rows(
        self, module: nn.Module, layer: int, cpu: list[int], x_g: torch.Tensor, eg: torch.Tensor, out_g: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows routed to the host experts `cpu`: activations to the host, the same grouped kernels over the
        host store's rows, results back into `out_g` (moves activations only, never weights)."""
        rows, eg_c = self._rows(cpu, eg)
        t0 = time.perf_counter()
        x_h, eg_h = x_g[rows].cpu(), eg_c.cpu()
        views = self.store.layout.views(self.store.rows[layer])  # [E,...] host, no copy
        proj = self._grouped(module, x_h, eg_h, eg_h, len(cpu), views=views)  # [S_c,H] host
        out_g = _put(out_g, rows, proj.to(x_g.device), x_g.shape[0])
        dt = time.perf_counter() - t0
        self.counts.host_s += dt
        self.counts.host_wait_s += dt  # serial: nothing hidden
        return out_g

    def _grouped(
        self,
        module: nn.Module,
        x: torch.Tensor,
        eg: torch.Tensor,
        rows: torch.Tensor,
        groups: int,
        views: dict[str, torch.Tensor] | None = None,
        span: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """`grouped_experts` over the device slots (`rows` = each row's slot) or, with `views`, the host store;
        `span`: the slots ascend with the experts within it (weights read in place, `grouped_experts_in_place`)."""
        w = self.cache.views if views is None else views
        if span is not None:
            return grouped_experts_in_place(module, x, w, rows, span, self._aranges)
        return grouped_experts(module, x, eg, w, rows, groups, self._aranges)


def _split_point(cpu: list[int], eg: torch.Tensor) -> int:
    """k in [1, len(cpu) - 1]: `cpu[:k]` holds about half the rows of `eg [S]` (host tensors; at least one
    expert each side), the first part the larger on a tie (it goes to the worker, which starts first)."""
    counts = torch.bincount(eg, minlength=max(cpu) + 1)[torch.tensor(cpu)].tolist()  # rows per host expert
    half, run = 0.5 * sum(counts), 0
    for k, n in enumerate(counts[:-1], start=1):
        run += n
        if run >= half:
            return k
    return len(cpu) - 1


def _put(out_g: torch.Tensor | None, rows: torch.Tensor, proj: torch.Tensor, n: int) -> torch.Tensor:
    """`proj [S_w,H]` into rows `rows` of the `[n,H]` output (allocated on first use)."""
    if out_g is None:
        out_g = torch.empty(n, proj.shape[-1], dtype=proj.dtype, device=proj.device)
    out_g[rows] = proj
    return out_g
