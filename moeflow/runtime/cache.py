"""Device expert cache: C slots for the whole model, an (layer, expert) -> slot map, states and counters.

The cache is mechanism only. It asks the eviction policy for every victim (`victim(candidates, pos)`
over resident, unpinned, not-in-flight slots) and reports every event to it (`on_insert`,
`on_access(score=gate weight)`, `on_evict`, `on_pass_start`, `on_layer_start`). It never holds more
than C experts: the slot buffer `[C, row_numel]` is allocated once, with per-parameter views
`[C, *shape]` from which the engine gathers the slots a layer routes to.

The (layer, expert) -> slot map lives twice: `slot_of` on the host (the cache's decisions) and `table`
`[L_moe, E]` (long, -1 = not resident) on the device, updated whenever a slot's key changes, so the
engine's expert compute finds slots without building tensors from Python lists.

Slot states: free -> loading (copy in flight) -> ready; a ready or loading slot may additionally be
pinned by the running layer (it will be read by this layer's expert compute and cannot be evicted).
With `per_layer=True` the C slots are split evenly between MoE layers and a layer only evicts its own.
With `retain=False` (the `on-demand` baseline) a layer's slots are freed as soon as its compute ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from ..policies.base import EvictionPolicy, ExpertKey, Position, PrefetchRequest
from .link import Link, Ticket
from .store import HostExpertStore

FREE, LOADING, READY = "free", "loading", "ready"


@dataclass
class CacheCounters:
    """Monotone counters; subtract two snapshots for a window (one prompt, one forward pass)."""

    accesses: int = 0  # needed experts, one per (forward pass, layer, unique expert)
    hits: int = 0  # needed and already in a slot at routing time (ready or copy in flight)
    misses: int = 0  # needed and not in a slot: a demand load (misses == demand_loads)
    late: int = 0  # hits whose copy was still in flight (a prefetch not finished: stall)
    loads: int = 0  # transfers issued (demand + prefetch)
    demand_loads: int = 0
    prefetch_issued: int = 0  # prefetch transfers issued (requests for resident experts are skipped)
    prefetch_used: int = 0  # prefetched experts accessed before their eviction (counted once)
    prefetch_unused_evicted: int = 0  # overfetch: prefetched experts evicted without ever being used
    collision_misses: int = 0  # needed experts that were evicted earlier in the same forward pass
    evictions: int = 0
    bytes_moved: int = 0  # loads x expert row bytes
    stall_s: float = 0.0  # seconds the compute thread waited for copies

    @property
    def ready_hits(self) -> int:
        """Needed experts whose copy had completed: no wait at all."""
        return self.hits - self.late

    @property
    def waited(self) -> int:
        """Needed experts the layer had to wait for (demand loads + late prefetches): ExpertFlow's stalls."""
        return self.misses + self.late

    def __sub__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)})

    def __add__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)})

    def copy(self) -> CacheCounters:
        return dataclasses.replace(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Slot:
    state: str = FREE
    key: ExpertKey | None = None
    ticket: Ticket | None = None
    pinned: bool = False
    prefetched: bool = False  # inserted by a prefetch
    used: bool = False  # accessed since insertion
    last_use: Any = None  # link marker after the last compute that read this slot


class ExpertCache:
    def __init__(
        self,
        store: HostExpertStore,
        capacity: int,
        *,
        device: torch.device,
        link: Link,
        eviction: EvictionPolicy | None,
        per_layer: bool = False,
        retain: bool = True,
    ):
        spec = store.spec
        self.spec = spec
        self.store = store
        self.link = link
        self.eviction = eviction
        self.retain = retain
        self.per_layer = per_layer
        self.capacity = int(capacity)
        self._check_capacity()
        L = spec.num_moe_layers
        self.rank = {l: r for r, l in enumerate(spec.moe_layers)}
        C = self.capacity
        self.buffer = torch.empty(C, store.layout.row_numel, dtype=store.layout.dtype, device=device)  # [C,R]
        self.views = store.layout.views(self.buffer)  # name -> [C, *shape]
        self.slots = [Slot() for _ in range(C)]
        self.slot_of: dict[ExpertKey, int] = {}
        self.table = torch.full((L, spec.num_experts), -1, dtype=torch.long, device=device)  # [L,E] slot or -1
        self._resident_in = [0] * L  # resident experts per MoE layer
        self._loading: set[int] = set()  # slots whose copy may be in flight
        per = C // L if per_layer else C
        parts = L if per_layer else 1
        self._part_slots = [list(range(p * per, (p + 1) * per)) for p in range(parts)]
        self._free = [list(reversed(s)) for s in self._part_slots]
        self.part_capacity = per
        self.counters = CacheCounters()
        self.time = 0
        self.pass_id = -1
        self._evicted_in_pass: dict[ExpertKey, int] = {}

    # ---- capacity --------------------------------------------------------------------------------
    def _check_capacity(self) -> None:
        check_capacity(self.spec, self.capacity, per_layer=self.per_layer)

    # ---- positions and events -------------------------------------------------------------------
    def position(self, layer: int) -> Position:
        return Position(self.pass_id, layer, self.rank[layer], self.time)

    def begin_pass(self, pass_id: int) -> None:
        self.pass_id = pass_id
        if self.eviction is not None:
            self.eviction.on_pass_start(Position(pass_id, self.spec.moe_layers[0], 0, self.time))

    def begin_layer(self, layer: int) -> None:
        if self.eviction is not None:
            self.eviction.on_layer_start(self.position(layer))

    def resident(self, key: ExpertKey) -> bool:
        """True when `key` has a slot (ready or in flight)."""
        return key in self.slot_of

    def is_ready(self, key: ExpertKey) -> bool:
        s = self.slot_of.get(key)
        return s is not None and self._refresh(s) == READY

    def num_resident(self) -> int:
        return len(self.slot_of)

    def _part(self, layer: int) -> int:
        return self.rank[layer] if self.per_layer else 0

    def _refresh(self, s: int) -> str:
        slot = self.slots[s]
        if slot.state == LOADING and self.link.ready(slot.ticket):
            slot.state = READY
            self._loading.discard(s)
        return slot.state

    def layer_all_ready(self, layer: int) -> bool:
        """True when every expert of `layer` is in a ready slot: no access of this layer can miss or wait."""
        if self._resident_in[self.rank[layer]] < self.spec.num_experts:
            return False
        for s in list(self._loading):
            if self._refresh(s) != READY and self.slots[s].key[0] == layer:
                return False
        return True

    # ---- demand: the running layer's experts -------------------------------------------------------
    def demand(self, layer: int, experts: Sequence[int], scores: dict[int, float]) -> list[int]:
        """Pin the experts `layer` needs now, issue loads for the missing ones; return their slots.

        Hits are pinned before any miss picks a victim, so a miss never evicts this layer's own hits.
        """
        if len(experts) > self.part_capacity:
            raise RuntimeError(f"demand of {len(experts)} experts exceeds {self.part_capacity} slots; use waves")
        for e in experts:
            s = self.slot_of.get((layer, e))
            if s is not None:
                self.slots[s].pinned = True
        out = []
        for e in experts:
            key = (layer, e)
            s = self.slot_of.get(key)
            self.counters.accesses += 1
            if s is not None:
                self.counters.hits += 1
                if self._refresh(s) != READY:
                    self.counters.late += 1
            else:
                self.counters.misses += 1
                if self._evicted_in_pass.get(key) == self.pass_id:
                    self.counters.collision_misses += 1
                s = self._acquire(key, self.position(layer), demand=True, protected=())
                self._load(s, key, prefetched=False, pos=self.position(layer))
                self.counters.demand_loads += 1
                self.slots[s].pinned = True
            slot = self.slots[s]
            if slot.prefetched and not slot.used:
                self.counters.prefetch_used += 1
            slot.used = True
            self.time += 1
            if self.eviction is not None:
                self.eviction.on_access(key, self.position(layer), score=float(scores.get(e, 0.0)))
            out.append(s)
        return out

    def wait(self, slots: Sequence[int]) -> float:
        """Block until every slot in `slots` may be read by compute; return the seconds waited."""
        stall = 0.0
        for s in slots:
            slot = self.slots[s]
            if slot.state == LOADING:
                stall += self.link.wait(slot.ticket)
                slot.state = READY
                self._loading.discard(s)
        self.counters.stall_s += stall
        return stall

    def release(self, slots: Sequence[int]) -> None:
        """The layer's compute that read `slots` has been issued: unpin them (free them if not retaining)."""
        marker = self.link.record_use()
        for s in slots:
            slot = self.slots[s]
            slot.pinned = False
            slot.last_use = marker
            if not self.retain and slot.key is not None:
                self._evict(s)

    # ---- prefetch -----------------------------------------------------------------------------------
    def prefetch(self, requests: Sequence[PrefetchRequest], layer: int) -> int:
        """Issue copies for proposed experts, highest priority first; never waits. Returns copies issued."""
        issued: set[int] = set()
        pos = self.position(layer)
        for req in sorted(requests, key=lambda r: -r.priority):
            key = (int(req.key[0]), int(req.key[1]))
            if key[0] not in self.rank or not 0 <= key[1] < self.spec.num_experts:
                continue
            if key in self.slot_of:  # already resident or in flight: tell the policy only
                on_predicted = getattr(self.eviction, "on_predicted", None)
                if on_predicted is not None:
                    on_predicted(key, pos)
                continue
            s = self._acquire(key, pos, demand=False, protected=issued)
            if s is None:
                continue
            self._load(s, key, prefetched=True, pos=pos)
            self.counters.prefetch_issued += 1
            issued.add(s)
        return len(issued)

    # ---- slots ----------------------------------------------------------------------------------------
    def _acquire(self, key: ExpertKey, pos: Position, *, demand: bool, protected) -> int | None:
        part = self._part(key[0])
        free = self._free[part]
        if free:
            return free.pop()
        while True:
            cands = [
                self.slots[s].key
                for s in self._part_slots[part]
                if not self.slots[s].pinned and s not in protected and self._refresh(s) == READY
            ]
            if cands:
                break
            if not demand:
                return None
            loading = [
                s
                for s in self._part_slots[part]
                if self.slots[s].state == LOADING and not self.slots[s].pinned and s not in protected
            ]
            if not loading:
                raise RuntimeError(f"no evictable slot for {key}: all {len(self._part_slots[part])} are pinned")
            self.wait(loading[:1])  # an unfinished prefetch blocks a demand load: real stall
        if self.eviction is None:
            raise RuntimeError("cache is full and has no eviction policy")
        victim = tuple(self.eviction.victim(cands, pos))
        if victim not in cands:
            raise RuntimeError(f"eviction policy {self.eviction.name!r} chose {victim}, not one of the candidates")
        s = self.slot_of[victim]
        self._evict(s)
        return self._free[part].pop()

    def _evict(self, s: int) -> None:
        slot = self.slots[s]
        key = slot.key
        assert key is not None and slot.state != LOADING and not slot.pinned
        if slot.prefetched and not slot.used:
            self.counters.prefetch_unused_evicted += 1
        self.counters.evictions += 1
        self._evicted_in_pass[key] = self.pass_id
        del self.slot_of[key]
        r = self.rank[key[0]]
        self.table[r, key[1]] = -1  # device table follows the key
        self._resident_in[r] -= 1
        last_use = slot.last_use
        self.slots[s] = Slot(last_use=last_use)
        self._free[self._part(key[0])].append(s)
        if self.eviction is not None:
            self.eviction.on_evict(key)

    def _load(self, s: int, key: ExpertKey, *, prefetched: bool, pos: Position) -> None:
        slot = self.slots[s]
        src = self.store.row(*key)  # [R] host
        slot.ticket = self.link.submit(src, self.buffer[s], after=slot.last_use)
        slot.state = LOADING
        slot.key = key
        slot.prefetched = prefetched
        slot.used = False
        self.slot_of[key] = s
        r = self.rank[key[0]]
        self.table[r, key[1]] = s  # device table follows the key
        self._resident_in[r] += 1
        self._loading.add(s)
        self.counters.loads += 1
        self.counters.bytes_moved += self.store.expert_bytes
        if self.eviction is not None:
            self.eviction.on_insert(key, pos, prefetched=prefetched)

    def close(self) -> None:
        self.link.drain()


def check_capacity(spec: Any, capacity: int, *, per_layer: bool = False) -> None:
    """Refuse a cache of `capacity` experts below top-k (per layer with `per_layer`) or above all routed experts.

    `moeflow run` calls it for every capacity of a sweep before the first run; the cache calls it again."""
    C, need = capacity, spec.top_k
    if per_layer:
        per = C // spec.num_moe_layers
        if per < need:
            raise ConfigError(
                f"--capacity {C} with --per-layer-cache gives {per} slots per layer, below top-k={need}; "
                f"use at least {need * spec.num_moe_layers} experts"
            )
    elif C < need:
        raise ConfigError(
            f"--capacity {C} experts is below top-k={need}, the experts one decode token needs per layer; use at least {need}"
        )
    if C > spec.total_experts:
        raise ConfigError(
            f"--capacity {C} exceeds the model's {spec.total_experts} routed experts; use at most {spec.total_experts} (100%)"
        )
