"""Device expert cache: C slots for the whole model, an (layer, expert) -> slot map, states and counters.

The cache is mechanism only. It asks the eviction policy for every victim (`victim(candidates, pos)`
over resident, unpinned, not-in-flight slots) and reports every event to it (`on_insert`,
`on_access(score=gate weight)`, `on_evict`, `on_pass_start`, `on_layer_start`). It never holds more
than C experts. With `per_layer=True` the C slots are split evenly between MoE layers and a layer only evicts
its own. With `retain=False` (the `on-demand` baseline) a layer's slots are freed as soon as its compute ends.

`ExpertCache` is one object in four modules of one job each (mixins sharing the cache's state, so every call site,
attribute and hot loop is as it was in one class, and tests hook `_evict`, `_core_apply`, `_write_table` on it):
- here: construction and the access order below (`demand`, `route`, `prefetch` / `_issue`, `stage`, `wait`,
  `release`, `cancel_stale`);
- `runtime/cache_slots.py` (`Slot`, `CacheState`: the state set below, declared once for the mixins; `SlotPool`):
  a slot's life, free -> loading (copy in flight) -> ready, plus
  pinned by the running layer (read by this layer's compute, not evictable): `_acquire` (the policy's victim),
  `_load`, `_evict`, `_upgrade`, `_refresh` / `_ready`; the queries over slots (`resident`, `is_ready`,
  `layer_all_ready`, `stage_room`, `free_room`, ...);
- `runtime/cache_device.py` (`CacheDevice`): the bytes that move: the slot buffer `[C, row_numel]` allocated once
  with per-parameter views `[C, *shape]` the engine gathers from, the device `table` `[L_moe, E]` (long, -1 = not
  resident) that follows the host's `slot_of` whenever a slot's key changes (so the expert compute finds slots
  without tensors built from Python lists), `_submit` (one copy) and `batch` (copies held and handed over together);
- `runtime/cache_compiled.py` (`CompiledBridge`): the compiled core (`runtime/corecache.py`). With an eviction
  policy that declares a `kernel` and an instant link, decisions, the policy's state and counters live in numba
  kernels, one call per cache call; the cache then follows each call's evictions and loads in `slot_of`,
  `slots[s].key/state/pinned/bits/ticket` and `table`, and `replay` runs the simulator's whole stream in one call.
  Every other policy or link (copies in flight, cancellation, a gate that reads the link) runs the Python mechanism.

Without a store (`store=None, spec=...`: the trace-driven simulator, `moeflow.sim`) the cache holds no
tensors: no buffer, no views, no device table; `_load` moves bookkeeping only and asks the link for a
transfer of `expert_bytes` (`link.submit_nbytes`). Every decision, event and counter is the same code.

One access order (the engine's router hook and experts call, and the simulator, call these in this order,
per forward pass `begin_pass`, then per MoE layer):
  `begin_layer` -> unique routed experts sorted by id with summed gate weights (`needed_experts`) ->
  `route` (stale prefetches of this layer still queued on the link are cancelled when the gate says so; the
  miss policy, then `demand`: hits pinned first, then misses in id order; a hit whose prefetch is still queued
  is promoted to demand priority) when they fit one wave (`wave_capacity`), else nothing yet ->
  `prefetch(proposals)` (priority order; each proposal that is not resident is admitted or refused by the
  prefetch policy's gate, `PrefetchGate`) -> per wave
  (`plan_waves`: resident experts first; one wave = the routed slots): `demand_wave` (only when `route`
  demanded nothing), `wait`, the layer's compute, `release`.

Mixed precision (`runtime/misses.py`): a `("fetch", bits)` miss loads a compact copy (`Slot.bits`), `_ready`
dequantizes it, `upgrade` (`cascade`) queues the full row over it on `release`; eviction policies with
`hears_precision` (`lhu`) are told every slot's precision (load and upgrade).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import Any, cast

import torch

from ..policies.base import EvictionPolicy, ExpertKey, MissPolicy, Position, PrefetchRequest
from ..quant import FULL
from .cache_compiled import CompiledBridge
from .cache_device import CacheDevice
from .cache_slots import LOADING, READY, Slot, SlotPool, make_position
from .counters import GATHER_BYTES, MAX_GROUPS, CacheCounters, check_capacity, needed_experts, wave_capacity  # noqa: F401
from .link import Link
from .misses import fetch_bits
from .store import HostExpertStore

_priority = attrgetter("priority")


RECORD_NOW: Any = object()  # `ExpertCache.release`: record the slot-use marker now (no caller-recorded one)


class ExpertCache(SlotPool, CompiledBridge, CacheDevice):
    def __init__(
        self,
        store: HostExpertStore | None,
        capacity: int,
        *,
        device: torch.device | None = None,
        link: Link,
        eviction: EvictionPolicy | None,
        per_layer: bool = False,
        retain: bool = True,
        spec: Any = None,
        expert_bytes: int | None = None,
        gate: Any = None,
        compiled: bool | None = None,
    ):
        """`store=None` (with `spec`, optionally `expert_bytes`): bookkeeping only, no tensors (the simulator).
        `compiled`: None keeps the bookkeeping in the compiled core when the policy and link allow it (see
        `runtime/cache_compiled.py`), False always runs the Python mechanism, True requires the core."""
        if store is None and spec is None:
            raise ValueError("ExpertCache needs a store, or spec= for a tensor-free (simulated) cache")
        spec = store.spec if store is not None else spec
        self.spec = spec
        self.store = store
        self.expert_bytes = int(store.expert_bytes if store is not None else (expert_bytes or spec.expert_bytes))
        self.link = link
        self.eviction = eviction
        self.gate = gate  # the prefetch policy's admission decision (`PrefetchGate`), None: admit every proposal
        self.retain = retain
        self.per_layer = per_layer
        self.capacity = int(capacity)
        self._check_capacity()
        L = spec.num_moe_layers
        self.rank = {l: r for r, l in enumerate(spec.moe_layers)}
        C = self.capacity
        self._init_device(store, C, L, spec.num_experts, device)
        self._instant = link.instant  # copies complete at submit (simulator links)
        self.slots = [Slot() for _ in range(C)]
        self.slot_of: dict[ExpertKey, int] = {}
        self._resident_in = [0] * L  # resident experts per MoE layer
        self._loading: set[int] = set()  # slots whose copy may be in flight
        self._pinned_n = 0  # slots pinned now (`_any_candidate`: a part with room needs no scan)
        per = C // L if per_layer else C
        parts = L if per_layer else 1
        self._part_slots = [list(range(p * per, (p + 1) * per)) for p in range(parts)]
        self._free = [list(reversed(s)) for s in self._part_slots]
        self.part_capacity = per
        self.counters = CacheCounters()
        self.time = 0
        self.pass_id = -1
        self._evicted_in_pass: dict[ExpertKey, int] = {}
        self._prefetch_seq = 0  # prefetches issued so far (never decreases: cancelled ones count)
        self._phase_seq = self._generation_seq = 0  # `_prefetch_seq` when the phase / generation began
        self.upgrade = False  # cascade: queue a full-precision copy over each low-precision slot on release
        self._on_precision = eviction.on_precision if eviction is not None and eviction.hears_precision else None
        self.core = self._make_core(compiled)

    # ---- capacity --------------------------------------------------------------------------------
    def _check_capacity(self) -> None:
        check_capacity(self.spec, self.capacity, per_layer=self.per_layer)

    # ---- positions and events -------------------------------------------------------------------
    def position(self, layer: int) -> Position:
        return make_position(self.pass_id, layer, self.rank[layer], self.time)

    def begin_pass(self, pass_id: int) -> None:
        self.pass_id = pass_id
        if self.core is not None:
            self.core.begin_pass(pass_id)
        elif self.eviction is not None:
            self.eviction.on_pass_start(Position(pass_id, self.spec.moe_layers[0], 0, self.time))

    def mark_phase(self, *, new_generation: bool = False) -> None:
        """A phase (a generation's prefill, or its decode passes) begins; `new_generation`: a generation too.
        A prefetch issued before it and first used after it counts in `prefetch_used_prior_phase` (and in
        `prefetch_used_prior_generation` when issued before the generation began), so a window's prefetch
        precision counts only the copies the window itself issued (`RunMetrics.prefetch_precision`)."""
        self._phase_seq = self._prefetch_seq
        if new_generation:
            self._generation_seq = self._prefetch_seq
        if self.core is not None:
            self.core.mark_phase(new_generation)

    def begin_layer(self, layer: int) -> None:
        if self.core is not None:
            self.core.begin_layer(self.rank[layer])
        elif self.eviction is not None:
            self.eviction.on_layer_start(self.position(layer))

    # ---- demand: the running layer's experts -------------------------------------------------------
    def demand(
        self, layer: int, experts: Sequence[int], scores: dict[int, float], bits: dict[int, int] | None = None
    ) -> list[int]:
        """Pin the experts `layer` needs now, issue loads for the missing ones; return their slots.

        Hits are pinned before any miss picks a victim, so a miss never evicts this layer's own hits.
        `bits`: misses to load as a low-precision copy (`check_misses`), the others load at full precision.
        """
        if len(experts) > self.part_capacity:
            raise RuntimeError(f"demand of {len(experts)} experts exceeds {self.part_capacity} slots; use waves")
        if self.core is not None:
            return self._core_demand(layer, experts, bits)
        slot_of, slots, c, ev = self.slot_of, self.slots, self.counters, self.eviction
        for e in experts:
            s = slot_of.get((layer, e))
            if s is not None and not slots[s].pinned:
                slots[s].pinned = True
                self._pinned_n += 1
        rank, pass_id = self.rank[layer], self.pass_id
        out = []
        t = self.time  # only this loop advances it
        for e in experts:
            key = (layer, e)
            s = slot_of.get(key)
            c.accesses += 1
            if s is not None:
                c.hits += 1
                if slots[s].bits != FULL:
                    c.lowbit_hits += 1
                if slots[s].state != READY and self._refresh(s) != READY:
                    c.late += 1
                    ticket = slots[s].ticket
                    if ticket is not None and not ticket.demand:  # a queued prefetch now needed: misses first
                        self._hand_over()  # a batch's earlier copies scheduled first, as one by one
                        self.link.promote(ticket)
            else:
                c.misses += 1
                if self._evicted_in_pass.get(key) == pass_id:
                    c.collision_misses += 1
                pos = make_position(pass_id, layer, rank, t)
                s = self._acquire(key, pos, demand=True, protected=())
                b = bits.get(e, FULL) if bits else FULL
                self._load(s, key, prefetched=False, pos=pos, bits=b)
                c.demand_loads += 1
                if b != FULL:
                    c.lowbit_loads += 1
                slots[s].pinned = True  # a fresh slot: not pinned before
                self._pinned_n += 1
            slot = slots[s]
            if slot.prefetched and not slot.used:
                c.prefetch_used += 1
                if slot.issued < self._phase_seq:
                    c.prefetch_used_prior_phase += 1
                    if slot.issued < self._generation_seq:
                        c.prefetch_used_prior_generation += 1
            slot.used = True
            self.time = t = t + 1
            if ev is not None:
                ev.on_access(key, make_position(pass_id, layer, rank, t), score=float(scores.get(e, 0.0)))
            out.append(s)
        return out

    def check_misses(
        self, miss: MissPolicy | None, layer: int, experts: Sequence[int], scores: dict[int, float] | None = None
    ) -> dict[int, int]:
        """{expert: bits} of the needed experts without a slot to load as a low-precision copy (`fetch_bits`)."""
        if miss is None:
            return {}
        self.upgrade = self.upgrade or miss.upgrade
        return fetch_bits(miss, layer, experts, scores, self.slot_of, self.position, self.resident, self.store)

    def route(
        self, layer: int, experts: Sequence[int], scores: dict[int, float], wave_cap: int, miss: Any = None
    ) -> list[int] | None:
        """At routing time: demand the layer's experts (pinned) when they fit one wave, else None (waves later)."""
        gate = self.gate
        if gate is not None and gate.cancel_stale and self._loading:
            self.cancel_stale(layer, experts)
        if len(experts) > wave_cap:
            return None
        bits = self.check_misses(miss, layer, experts, scores)
        return self.demand(layer, experts, scores, bits)

    def plan_waves(self, layer: int, experts: Sequence[int], wave_cap: int) -> list[list[int]]:
        """Chunks of <= wave_cap experts, resident ones first (they need no copy), each sorted by id."""
        ordered = sorted(experts, key=lambda e: ((layer, e) not in self.slot_of, e))
        return [sorted(ordered[i : i + wave_cap]) for i in range(0, len(ordered), wave_cap)]

    def demand_wave(self, layer: int, experts: Sequence[int], scores: dict[int, float], miss: Any = None) -> list[int]:
        """One wave planned by `plan_waves`: the miss policy, `demand`, `wait`; returns its slots."""
        wave_scores = {e: scores[e] for e in experts}
        bits = self.check_misses(miss, layer, experts, wave_scores)
        slots = self.demand(layer, experts, wave_scores, bits)
        self.wait(slots)
        return slots

    def wait(self, slots: Sequence[int]) -> float:
        """Block until every slot in `slots` may be read by compute; return the seconds waited."""
        if not self._loading:  # every LOADING slot is in `_loading`: nothing can be in flight
            return 0.0
        if self._held:  # a `batch`'s copies go to the link before anything waits on it
            self._hand_over()
        stall = 0.0
        for s in slots:
            slot = self.slots[s]
            if slot.state == LOADING and slot.ticket is not None:  # LOADING has a ticket
                stall += self.link.wait(slot.ticket)
                self._ready(s)
        self.counters.stall_s += stall
        return stall

    def release(self, slots: Sequence[int], marker: Any = RECORD_NOW) -> None:
        """The layer's compute that read `slots` has been issued: unpin them (free them if not retaining).
        `marker`: a `link.record_use()` placed after that compute already (several releases share one); by
        default one is recorded now."""
        if marker is RECORD_NOW:
            marker = self.link.record_use()
        if self.core is not None:
            for s in slots:
                slot = self.slots[s]
                self._pinned_n -= slot.pinned
                slot.pinned = False
                slot.last_use = marker
            if self.core.release(slots, self.retain, self.upgrade):  # else nothing but pins changed
                self._core_apply()
            return
        for s in slots:
            slot = self.slots[s]
            self._pinned_n -= slot.pinned
            slot.pinned = False
            slot.last_use = marker
            if not self.retain and slot.key is not None:
                self._evict(s)
            elif self.upgrade and slot.bits != FULL and slot.state == READY and slot.key is not None:
                self._upgrade(s)

    # ---- prefetch -----------------------------------------------------------------------------------
    def cancel_stale(self, layer: int, experts: Sequence[int]) -> int:
        """`layer` has routed to `experts`: withdraw its other prefetches whose copy has not started yet
        (the link's `cancel`), free their slots; returns how many (`prefetch_cancelled`)."""
        need, slot_of, loading = set(experts), self.slot_of, self._loading
        # the layer's slots in flight for experts it does not route, in slot order (E lookups, not every copy in flight)
        stale = sorted(
            s
            for e in range(self.spec.num_experts)
            if e not in need and (s := slot_of.get((layer, e))) is not None and s in loading
        )
        n = 0
        for s in stale:
            slot = self.slots[s]
            key, t = cast(ExpertKey, slot.key), slot.ticket  # (layer, e) with e not in `need`: `stale` holds no other
            if not slot.prefetched or slot.pinned or t is None:
                continue
            if not self.link.cancel(t):
                continue
            del self.slot_of[key]
            r = self.rank[layer]
            self._set_entry(r, key[1], -1)
            self._resident_in[r] -= 1
            self._loading.discard(s)
            self.slots[s] = Slot(last_use=slot.last_use)
            self._free[self._part(layer)].append(s)
            self.counters.prefetch_cancelled += 1
            self.counters.loads -= 1
            self.counters.bytes_moved -= self.expert_bytes  # prefetches are full-precision rows
            if self.eviction is not None:
                self.eviction.on_evict(key)
            n += 1
        return n

    def prefetch(self, requests: Sequence[PrefetchRequest], layer: int) -> int:
        """Issue copies for proposed experts, highest priority first, each one the gate admits; never waits.
        Returns copies issued."""
        pos = self.position(layer)
        gate = self.gate
        if gate is not None and self._held is not None:  # the gate reads the link's backlog copy by copy
            self._hand_over()
            held, self._held = self._held, None
            try:
                return self.prefetch(requests, layer)
            finally:
                self._held = held
        if gate is not None:
            gate.begin(self.link, self.expert_bytes, pos.pass_id, pos.layer_rank)
        if self.core is not None:
            return self._core_prefetch(requests, pos, gate)
        ordered = sorted(requests, key=_priority, reverse=True)  # stable: ties keep the proposal order
        return self._issue(((r.key, r) for r in ordered), pos, gate)

    def _issue(self, items: Iterable[tuple[ExpertKey, PrefetchRequest | None]], pos: Position, gate: Any) -> int:
        """The Python mechanism of `prefetch` and `stage`: a copy per (key, request) in the given order, each one
        `gate` admits (None: every one; then the request is not read and may be None). Returns copies issued."""
        issued: set[int] = set()
        rank, E, slot_of, slots, c = self.rank, self.spec.num_experts, self.slot_of, self.slots, self.counters
        predicted = self.eviction.on_predicted if self.eviction is not None else None
        victim_aware = gate is not None and getattr(gate, "victim", False)
        for k, req in items:
            key = (int(k[0]), int(k[1]))
            if key[0] not in rank or not 0 <= key[1] < E:
                continue
            if key in slot_of:  # already resident or in flight: tell the policy only
                if predicted is not None:
                    predicted(key, pos)
                continue
            if gate is not None and not gate.admit(req, rank[key[0]] - pos.layer_rank):
                c.prefetch_refused += 1
                continue
            keep = None  # a victim-aware gate may keep the victim (refusing the copy)
            if victim_aware:
                keep = lambda v, req=req: gate.keep_victim(self.eviction, req, v, pos)  # noqa: E731
                kept = gate.victim_refused
            s = self._acquire(key, pos, demand=False, protected=issued, keep=keep)
            if s is None:
                if keep is not None and gate.victim_refused != kept:
                    c.prefetch_refused += 1
                continue
            self._load(s, key, prefetched=True, pos=pos)
            slots[s].issued = self._prefetch_seq
            self._prefetch_seq += 1
            c.prefetch_issued += 1
            issued.add(s)
        return len(issued)

    def stage(self, keys: Sequence[ExpertKey], layer: int) -> int:
        """A staged batch (`runtime/prefill.py`): copies for `keys` in the given order at prefetch priority,
        without the prefetch policy's gate (counted as prefetches); never waits. Returns copies issued. With
        copies held for a hand-over, the slots the batch took are dealt to its keys in ascending order, layer by
        layer (`_ascend`): a wave of a layer's consecutive experts then reads its weights in place."""
        if self.core is not None:  # the compiled core's prefetch kernel, requests in the given order
            gate, self.gate = self.gate, None
            try:
                with self.batch():
                    n = len(keys)
                    return self.prefetch([PrefetchRequest(k, priority=float(n - i)) for i, k in enumerate(keys)], layer)
            finally:
                self.gate = gate
        with self.batch():
            i0 = len(self._held) if self._held is not None else -1
            issued = self._issue(((k, None) for k in keys), self.position(layer), None)  # no request objects, no sort
            if i0 >= 0 and self._held is not None and issued > 1:
                self._ascend(i0)
            return issued

    # ---- end ------------------------------------------------------------------------------------------
    def close(self) -> None:
        self.link.drain()
