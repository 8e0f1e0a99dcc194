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

Without a store (`store=None, spec=...`: the trace-driven simulator, `moeflow.sim`) the cache holds no
tensors: no buffer, no views, no device table; `_load` moves bookkeeping only and asks the link for a
transfer of `expert_bytes` (`link.submit_nbytes`). Every decision, event and counter is the same code.

One access order (the engine's router hook and experts call, and the simulator, call these in this order,
per forward pass `begin_pass`, then per MoE layer):
  `begin_layer` -> unique routed experts sorted by id with summed gate weights (`needed_experts`) ->
  `route` (stale prefetches of this layer still queued on the link are cancelled when the gate says so; the
  miss policy, then `demand`: hits pinned first, then misses in id order; a hit whose prefetch is still
  queued is promoted to demand priority) when they fit one
  wave (`wave_capacity`), else nothing yet -> `prefetch(proposals)` (priority order; each proposal that is
  not resident is admitted or refused by the prefetch policy's gate, `PrefetchGate`) -> per wave
  (`plan_waves`: resident experts first; one wave = the routed slots): `demand_wave` (only when `route`
  demanded nothing), `wait`, the layer's compute, `release`.

Mixed precision: a miss action `("fetch", bits)` loads the store's compact copy at `bits` (int8/4/2, HQQ;
`moeflow.quant`) into the slot's first bytes; the slot records its precision (`Slot.bits`, 0 = full) and
the copy is dequantized into the model-dtype row on the device as soon as it is known complete (`_ready`),
before any compute reads it. Every load counts its own transfer's bytes (`bytes_at(bits)`) in `bytes_moved`;
without a store the compact size is estimated (`compact_bytes_estimate`). A hit on a low-precision slot
counts `lowbit_hits`. With a miss policy whose `upgrade` is True (`cascade`) each low-precision slot gets,
when the layer releases it, a full-precision copy queued as a prefetch-priority transfer into the same slot
(`upgrades`); until it lands the slot is in flight, so a later use waits for the exact expert. Eviction
policies with `on_precision(key, bits)` (`lhu`) are told every slot's precision (load and upgrade).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast, overload

import torch

from ..errors import ConfigError
from ..policies.base import FETCH, Candidates, EvictionPolicy, ExpertKey, MissInfo, Position, PrefetchRequest, miss_action
from ..quant import FULL, compact_bytes_estimate
from .link import Link, Ticket
from .store import HostExpertStore

FREE, LOADING, READY = "free", "loading", "ready"
MAX_GROUPS = 1024  # torch._grouped_mm on CUDA refuses more groups than this in one call
GATHER_BYTES = 1 << 30  # at most this many bytes of expert weights gathered per grouped call


_new = object.__new__


def _position(pass_id: int, layer: int, layer_rank: int, time: int) -> Position:
    """`Position(...)` without the frozen dataclass's per-field `object.__setattr__` (equal, same hash)."""
    p = _new(Position)
    d = p.__dict__
    d["pass_id"], d["layer"], d["layer_rank"], d["time"] = pass_id, layer, layer_rank, time
    return p


def wave_capacity(part_capacity: int, expert_bytes: int) -> int:
    """Most experts one grouped call (one wave) may cover: slots, the kernel's group limit, the gather budget."""
    return max(1, min(part_capacity, MAX_GROUPS, GATHER_BYTES // max(1, expert_bytes)))


def needed_experts(flat: torch.Tensor, weights: torch.Tensor) -> tuple[list[int], dict[int, float]]:
    """Unique experts of a call (host tensors `[S]` ids, `[S]` float32 gate weights), sorted by id, and their
    gate weight summed over the call's tokens (float32, in row order): the order of every cache access."""
    ids = flat.tolist()
    if len(set(ids)) == len(ids):  # every expert once (a decode step): nothing to sum
        ws = weights.tolist()
        order = sorted(range(len(ids)), key=ids.__getitem__)
        return [ids[i] for i in order], {ids[i]: ws[i] for i in order}
    uniq = torch.unique(flat)  # sorted [U]
    summed = torch.zeros(uniq.numel(), dtype=torch.float32)
    summed.index_add_(0, torch.searchsorted(uniq, flat), weights)
    experts = uniq.tolist()
    return experts, dict(zip(experts, summed.tolist()))


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
    prefetch_refused: int = 0  # proposals (not resident) the prefetch gate did not admit
    prefetch_cancelled: int = 0  # issued prefetches withdrawn before their copy started (stale: their layer
    #   routed to other experts); not in loads / bytes_moved (loads = demand_loads + issued - cancelled)
    collision_misses: int = 0  # needed experts that were evicted earlier in the same forward pass
    evictions: int = 0
    bytes_moved: int = 0  # bytes of every transfer issued: full rows, compact low-precision copies, upgrades
    lowbit_loads: int = 0  # demand loads of a low-precision copy (miss action ("fetch", bits); lossy)
    lowbit_hits: int = 0  # hits on a slot holding a low-precision copy (lossy)
    upgrades: int = 0  # full-precision copies queued over low-precision slots (`cascade`); not in `loads`
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
    bits: int = FULL  # precision of the copy in the slot (FULL = 0: the model dtype; 8/4/2: a compact copy)
    dequant: int = FULL  # bits of a compact copy in flight that `_ready` must dequantize (FULL: none)


class ExpertCache:
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
    ):
        """`store=None` (with `spec`, optionally `expert_bytes`): bookkeeping only, no tensors (the simulator)."""
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
        self.buffer: torch.Tensor | None = None  # [C,R] (None without a store)
        self.views: dict[str, torch.Tensor] = {}  # name -> [C, *shape]
        self.table: torch.Tensor | None = None  # [L,E] slot or -1, on the device
        if store is not None:
            self.buffer = torch.empty(C, store.layout.row_numel, dtype=store.layout.dtype, device=device)
            self.views = store.layout.views(self.buffer)
            self.table = torch.full((L, spec.num_experts), -1, dtype=torch.long, device=device)
        self._instant = bool(getattr(link, "instant", False))  # copies complete at submit (simulator links)
        self.slots = [Slot() for _ in range(C)]
        self.slot_of: dict[ExpertKey, int] = {}
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
        self.upgrade = False  # cascade: queue a full-precision copy over each low-precision slot on release
        self._on_precision = getattr(eviction, "on_precision", None)

    # ---- capacity --------------------------------------------------------------------------------
    def _check_capacity(self) -> None:
        check_capacity(self.spec, self.capacity, per_layer=self.per_layer)

    # ---- positions and events -------------------------------------------------------------------
    def position(self, layer: int) -> Position:
        return _position(self.pass_id, layer, self.rank[layer], self.time)

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
        if slot.state == LOADING and slot.ticket is not None and self.link.ready(slot.ticket):  # LOADING has a ticket
            self._ready(s)
        return slot.state

    def _ready(self, s: int) -> None:
        """The slot's copy is complete: mark it ready; a compact copy is dequantized in place now (device)."""
        slot = self.slots[s]
        slot.state = READY
        self._loading.discard(s)
        if slot.dequant != FULL:
            bits, slot.dequant = slot.dequant, FULL
            if self.store is not None and self.buffer is not None:
                self.store.dequantize(bits, self.buffer[s])

    def bytes_at(self, bits: int) -> int:
        """Bytes one transfer of an expert at `bits` moves (FULL: the full row)."""
        if bits == FULL:
            return self.expert_bytes
        if self.store is not None:
            return self.store.expert_bytes_at(bits)
        return compact_bytes_estimate(self.expert_bytes, bits)

    def layer_all_ready(self, layer: int) -> bool:
        """True when every expert of `layer` is in a ready slot: no access of this layer can miss or wait."""
        if self._resident_in[self.rank[layer]] < self.spec.num_experts:
            return False
        for s in list(self._loading):
            if self._refresh(s) != READY and (key := self.slots[s].key) is not None and key[0] == layer:
                return False
        return True

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
        slot_of, slots, c, ev = self.slot_of, self.slots, self.counters, self.eviction
        for e in experts:
            s = slot_of.get((layer, e))
            if s is not None:
                slots[s].pinned = True
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
                        self.link.promote(ticket)
            else:
                c.misses += 1
                if self._evicted_in_pass.get(key) == pass_id:
                    c.collision_misses += 1
                pos = _position(pass_id, layer, rank, t)
                s = self._acquire(key, pos, demand=True, protected=())
                b = bits.get(e, FULL) if bits else FULL
                self._load(s, key, prefetched=False, pos=pos, bits=b)
                c.demand_loads += 1
                if b != FULL:
                    c.lowbit_loads += 1
                slots[s].pinned = True
            slot = slots[s]
            if slot.prefetched and not slot.used:
                c.prefetch_used += 1
            slot.used = True
            self.time = t = t + 1
            if ev is not None:
                ev.on_access(key, _position(pass_id, layer, rank, t), score=float(scores.get(e, 0.0)))
            out.append(s)
        return out

    def check_misses(
        self, miss: Any, layer: int, experts: Sequence[int], scores: dict[int, float] | None = None
    ) -> dict[int, int]:
        """Ask the miss policy about every needed expert without a slot; returns {expert: bits} of the misses
        to load as a low-precision copy. The cache implements the fetch actions ("fetch", ("fetch", bits));
        drop / substitute / cpu are the engine's (policies with `needs_routing`, asked in its router hook).

        A policy with `precisions` (the mixed-precision ones) first sees every needed expert's summed gate
        weight (`observe(layer, scores)`) and is asked with `info=MissInfo(rank=0, score, tokens=0)`
        (rank and tokens unknown here)."""
        if miss is None:
            return {}
        mixed = getattr(miss, "precisions", None) is not None
        if mixed:
            scores = scores or {}
            miss.observe(layer, {e: scores.get(e, 0.0) for e in experts})
            self.upgrade = self.upgrade or bool(getattr(miss, "upgrade", False))
        out: dict[int, int] = {}
        for e in experts:
            if (layer, e) not in self.slot_of:
                key, pos = (layer, e), self.position(layer)
                if mixed:
                    action = miss.on_miss(key, pos, MissInfo(0, float(scores.get(e, 0.0)) if scores else 0.0, 0, self.resident))
                else:
                    action = miss.on_miss(key, pos)
                try:
                    kind, arg = miss_action(action)
                except ValueError as err:
                    raise ConfigError(f"miss policy {miss.name!r}: {err}") from None
                if kind != FETCH:
                    raise ConfigError(
                        f"miss policy {miss.name!r} asked for {action!r}; the cache implements only fetch actions "
                        "(drop / substitute / cpu are applied by the engine's router hook: set needs_routing)"
                    )
                if arg is not None and arg != FULL:
                    if self.store is not None and arg not in self.store.compact:
                        raise ConfigError(
                            f"miss policy {miss.name!r} asked for an int{arg} copy; the store holds "
                            f"{', '.join(f'int{b}' for b in self.store.precisions) or 'none'} (list it in its `precisions`)"
                        )
                    out[e] = int(arg)
        return out

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
        stall = 0.0
        for s in slots:
            slot = self.slots[s]
            if slot.state == LOADING and slot.ticket is not None:  # LOADING has a ticket
                stall += self.link.wait(slot.ticket)
                self._ready(s)
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
            elif self.upgrade and slot.bits != FULL and slot.state == READY and slot.key is not None:
                self._upgrade(s)

    def _upgrade(self, s: int) -> None:
        """Cascade: queue the full-precision row over a low-precision slot (prefetch priority, after the
        computation that just read it); the slot is in flight until the exact expert has landed."""
        slot = self.slots[s]
        key = cast(ExpertKey, slot.key)
        slot.ticket = self._submit(s, key, FULL, demand=False)
        slot.bits, slot.dequant = FULL, FULL
        if not self._instant:
            slot.state = LOADING
            self._loading.add(s)
        self.counters.upgrades += 1
        self.counters.bytes_moved += self.expert_bytes
        if self._on_precision is not None:
            self._on_precision(key, FULL)

    # ---- prefetch -----------------------------------------------------------------------------------
    def cancel_stale(self, layer: int, experts: Sequence[int]) -> int:
        """`layer` has routed to `experts`: withdraw its other prefetches whose copy has not started yet
        (the link's `cancel`), free their slots; returns how many (`prefetch_cancelled`)."""
        need = set(experts)
        n = 0
        for s in sorted(self._loading):
            slot = self.slots[s]
            key, t = slot.key, slot.ticket
            if key is None or key[0] != layer or key[1] in need or not slot.prefetched or slot.pinned or t is None:
                continue
            if not self.link.cancel(t):
                continue
            del self.slot_of[key]
            r = self.rank[layer]
            if self.table is not None:
                self.table[r, key[1]] = -1
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
        issued: set[int] = set()
        pos = self.position(layer)
        gate = self.gate
        if gate is not None:
            gate.begin(self.link, self.expert_bytes, pos.pass_id, pos.layer_rank)
        for req in sorted(requests, key=lambda r: -r.priority):
            key = (int(req.key[0]), int(req.key[1]))
            if key[0] not in self.rank or not 0 <= key[1] < self.spec.num_experts:
                continue
            if key in self.slot_of:  # already resident or in flight: tell the policy only
                on_predicted = getattr(self.eviction, "on_predicted", None)
                if on_predicted is not None:
                    on_predicted(key, pos)
                continue
            if gate is not None and not gate.admit(req, self.rank[key[0]] - pos.layer_rank):
                self.counters.prefetch_refused += 1
                continue
            s = self._acquire(key, pos, demand=False, protected=issued)
            if s is None:
                continue
            self._load(s, key, prefetched=True, pos=pos)
            self.counters.prefetch_issued += 1
            issued.add(s)
        return len(issued)

    # ---- slots ----------------------------------------------------------------------------------------
    @overload
    def _acquire(self, key: ExpertKey, pos: Position, *, demand: Literal[True], protected) -> int: ...
    @overload
    def _acquire(self, key: ExpertKey, pos: Position, *, demand: bool, protected) -> int | None: ...
    def _acquire(self, key: ExpertKey, pos: Position, *, demand: bool, protected) -> int | None:
        """A free slot of `key`'s part, evicting a victim if needed; None only when not `demand` and nothing is evictable."""
        part = self._part(key[0])
        free = self._free[part]
        if free:
            return free.pop()
        while True:
            slots, loading = self.slots, self._loading  # a slot of a full part not in `_loading` is ready
            # the candidates as a view (`key in cands` is O(1), so policies need not scan them)
            if not loading and not protected and not self.per_layer:  # common case: every slot is ready
                cands = Candidates(self.slot_of, slots)  # the unpinned slots' keys, listed only if iterated
            else:
                cands = Candidates(
                    self.slot_of,
                    slots,
                    [
                        cast(ExpertKey, slots[s].key)  # a full part's slots all hold a key
                        for s in self._part_slots[part]
                        if not slots[s].pinned and s not in protected and (s not in loading or self._refresh(s) == READY)
                    ],
                )
            if cands:
                break
            if not demand:
                return None
            in_flight = [
                s
                for s in self._part_slots[part]
                if self.slots[s].state == LOADING and not self.slots[s].pinned and s not in protected
            ]
            if not in_flight:
                raise RuntimeError(f"no evictable slot for {key}: all {len(self._part_slots[part])} are pinned")
            self.wait(in_flight[:1])  # an unfinished prefetch blocks a demand load: real stall
        if self.eviction is None:
            raise RuntimeError("cache is full and has no eviction policy")
        victim = cast(ExpertKey, tuple(self.eviction.victim(cands, pos)))
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
        if self.table is not None:
            self.table[r, key[1]] = -1  # device table follows the key
        self._resident_in[r] -= 1
        last_use = slot.last_use
        self.slots[s] = Slot(last_use=last_use)
        self._free[self._part(key[0])].append(s)
        if self.eviction is not None:
            self.eviction.on_evict(key)

    def _submit(self, s: int, key: ExpertKey, bits: int, *, demand: bool) -> Ticket:
        """Start the copy of `key` at `bits` into slot `s` (a compact copy lands in the row's first bytes)."""
        slot = self.slots[s]
        store, buffer = self.store, self.buffer
        if store is not None and buffer is not None:  # the buffer exists exactly when the store does
            src = store.compact_row(*key, bits)  # [R] model dtype or [compact bytes] uint8, host
            return self.link.submit(src, store.landing(buffer[s], bits), after=slot.last_use, demand=demand)
        # simulated: the link models the transfer of one expert (row or compact copy), nothing is copied
        return self.link.submit_nbytes(self.bytes_at(bits), after=slot.last_use, demand=demand)  # type: ignore[attr-defined]

    def _load(self, s: int, key: ExpertKey, *, prefetched: bool, pos: Position, bits: int = FULL) -> None:
        slot = self.slots[s]
        slot.ticket = self._submit(s, key, bits, demand=not prefetched)
        slot.bits, slot.dequant = bits, bits
        slot.state = READY if self._instant else LOADING
        slot.key = key
        slot.prefetched = prefetched
        slot.used = False
        if self._instant and bits != FULL and self.store is not None and self.buffer is not None:
            slot.dequant = FULL
            self.store.dequantize(bits, self.buffer[s])
        self.slot_of[key] = s
        r = self.rank[key[0]]
        if self.table is not None:
            self.table[r, key[1]] = s  # device table follows the key
        self._resident_in[r] += 1
        if not self._instant:
            self._loading.add(s)
        self.counters.loads += 1
        self.counters.bytes_moved += self.bytes_at(bits)  # this transfer's bytes (a compact copy is smaller)
        if self._on_precision is not None:
            self._on_precision(key, bits)
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
