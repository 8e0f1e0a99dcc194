"""The cache's slots and their life: free -> loading (copy in flight) -> ready, evicted back to free.

`Slot` is one slot's record (its key, state, ticket, pin, precision); `SlotPool` is the part of `ExpertCache`
(`runtime/cache.py`) that moves a slot along that life, the Python mechanism shared by the runtime and the
simulator: `_acquire` (a free slot of the key's part, else the eviction policy's victim among the ready,
unpinned slots; `_InFlight` answers, slot by slot, which of them an eviction may not take), `_load` (the copy
and its bookkeeping: slot map, device table, counters, the policy's `on_insert`), `_evict`, `_upgrade` (cascade:
the full row over a low-precision slot), `_refresh` / `_ready` (a copy known complete; a compact copy is
dequantized then). It is a mixin of `ExpertCache`, not an object the cache owns: every method reads and writes
the cache's own slot map, free lists and counters, and tests hook `_evict` on the cache; the attributes it uses
are declared in `CacheState` and set by `ExpertCache.__init__`. The copies themselves (`_submit`, a `batch`'s held copies,
the device table) are `runtime/cache_device.py`'s. The queries over slots live here too (`resident`,
`is_ready`, `num_resident`, `layer_full`, `layer_all_ready`, `stage_room`, `free_room`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import torch

from ..policies.base import Candidates, EvictionPolicy, ExpertKey, Position
from ..quant import FULL
from .counters import CacheCounters
from .link import Link, Ticket
from .store import HostExpertStore

if TYPE_CHECKING:
    from .corecache import CacheCore

FREE, LOADING, READY = "free", "loading", "ready"
_new = object.__new__


def make_position(pass_id: int, layer: int, layer_rank: int, time: int) -> Position:
    """`Position(...)` without the frozen dataclass's per-field `object.__setattr__` (equal, same hash)."""
    p = _new(Position)
    d = p.__dict__
    d["pass_id"], d["layer"], d["layer_rank"], d["time"] = pass_id, layer, layer_rank, time
    return p


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
    issued: int = 0  # a prefetched slot's sequence number (`ExpertCache._prefetch_seq` at its issue)


class _InFlight:
    """The slots an eviction may not take, asked slot by slot: `protected` ones and copies still in flight (a
    slot's copy is checked, and a landed one marked ready, only when the policy asks about that slot)."""

    __slots__ = ("_cache", "_protected")

    def __init__(self, cache: SlotPool, protected: Any):
        self._cache, self._protected = cache, protected

    def __contains__(self, s: object) -> bool:
        if s in self._protected:
            return True
        cache = self._cache
        return s in cache._loading and cache._refresh(s) != READY


class CacheState:
    """What `ExpertCache.__init__` sets and its parts (`SlotPool` here, `cache_device.CacheDevice`,
    `cache_compiled.CompiledBridge`, mixins of the cache) read: declared once, for the type checker, with the
    methods one part calls on another. It holds nothing and defines nothing at run time."""

    spec: Any
    store: HostExpertStore | None
    buffer: torch.Tensor | None
    table: torch.Tensor | None
    link: Link
    eviction: EvictionPolicy | None
    gate: Any
    capacity: int
    per_layer: bool
    expert_bytes: int
    rank: dict[int, int]
    slots: list[Slot]
    slot_of: dict[ExpertKey, int]
    counters: CacheCounters
    core: CacheCore | None  # the compiled core (`cache_compiled`), None: the Python mechanism
    time: int
    pass_id: int
    upgrade: bool
    _instant: bool
    _resident_in: list[int]
    _loading: set[int]
    _pinned_n: int
    _part_slots: list[list[int]]
    _free: list[list[int]]
    _evicted_in_pass: dict[ExpertKey, int]
    _on_precision: Any
    _held: list[tuple[int, ExpertKey, int, bool]] | None

    if TYPE_CHECKING:  # defined by the parts (`CacheDevice`, `ExpertCache`)

        def _table_follows(self, r: int, e: int, slot: int) -> None: ...
        def _submit(self, s: int, key: ExpertKey, bits: int, *, demand: bool) -> Ticket: ...
        def bytes_at(self, bits: int) -> int: ...
        def wait(self, slots: Sequence[int]) -> float: ...


class SlotPool(CacheState):
    """The slots' life (mixin of `ExpertCache`): acquisition with eviction, loads, evictions, upgrades, readiness;
    and the queries over slots (`resident`, `is_ready`, `layer_full`, `layer_all_ready`, `stage_room`, `free_room`)."""

    # ---- queries ------------------------------------------------------------------------------------
    def resident(self, key: ExpertKey) -> bool:
        """True when `key` has a slot (ready or in flight)."""
        return key in self.slot_of

    def is_ready(self, key: ExpertKey) -> bool:
        s = self.slot_of.get(key)
        return s is not None and self._refresh(s) == READY

    def num_resident(self) -> int:
        return len(self.slot_of)

    def layer_full(self, layer: int) -> bool:
        """Every expert of `layer` has a slot (ready or in flight)."""
        return self._resident_in[self.rank[layer]] >= self.spec.num_experts

    def layer_all_ready(self, layer: int) -> bool:
        """True when every expert of `layer` is in a ready slot: no access of this layer can miss or wait."""
        if self._resident_in[self.rank[layer]] < self.spec.num_experts:
            return False
        for s in list(self._loading):
            if self._refresh(s) != READY and (key := self.slots[s].key) is not None and key[0] == layer:
                return False
        return True

    def stage_room(self, layer: int) -> int:
        """Slots of `layer`'s part that no running layer pins and that hold no expert of `layer` (room for a staged
        batch of `layer` that evicts none of its own)."""
        slots, n = self.slots, 0
        for s in self._part_slots[self._part(layer)]:
            sl = slots[s]
            if not sl.pinned and ((key := sl.key) is None or key[0] != layer):
                n += 1
        return n

    def free_room(self, layer: int) -> int:
        """Empty slots of `layer`'s part (a batch staged into them evicts nothing)."""
        if self.core is None:  # `_free` lists exactly the part's empty slots (the compiled core keeps its own)
            return len(self._free[self._part(layer)])
        slots = self.slots
        return sum(slots[s].key is None for s in self._part_slots[self._part(layer)])

    # ---- a slot's life -----------------------------------------------------------------------------
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

    @overload
    def _acquire(self, key: ExpertKey, pos: Position, *, demand: Literal[True], protected) -> int: ...
    @overload
    def _acquire(self, key: ExpertKey, pos: Position, *, demand: bool, protected, keep=None) -> int | None: ...
    def _acquire(self, key: ExpertKey, pos: Position, *, demand: bool, protected, keep=None) -> int | None:
        """A free slot of `key`'s part, evicting a victim if needed; None only when not `demand` and nothing is evictable,
        or `keep(victim)` (a prefetch's victim-aware gate) says to keep the victim."""
        part = self._part(key[0])
        free = self._free[part]
        if free:
            return free.pop()
        while True:
            slots, loading = self.slots, self._loading  # a slot of a full part not in `_loading` is ready
            # the candidates as a view (`key in cands` is O(1), so policies need not scan them)
            if not self.per_layer:  # one part, every slot holds a key: the unpinned slots' keys, listed only if iterated
                # a landed copy's slot is ready (a candidate), one still in flight is not: asked of the slots the
                # policy looks at only, not of every copy in flight at each acquisition
                exclude: Any = _InFlight(self, protected) if loading else protected
                cands = Candidates(self.slot_of, slots, exclude=exclude)
                found = self._any_candidate(protected)
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
                found = bool(cands)
            if found:
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
        if keep is not None and keep(victim):
            return None
        s = self.slot_of[victim]
        self._evict(s)
        return self._free[part].pop()

    def _any_candidate(self, protected: Any) -> bool:
        """The single part has an eviction candidate (what `bool` of its `Candidates` answers: an unpinned slot not
        `protected` whose copy is not in flight or has landed). Counted first: fewer slots pinned, in flight and
        `protected` than slots leaves one (a staged batch: its issued slots are `protected` and in flight, and
        `Candidates` asked ~11 copies per acquisition whether they had landed on olmoe-deep at 25%); else the
        slots asked, those not in flight first (sets only), then the copies in flight (one that has landed is
        marked ready). Which slot answers moves no choice: the policy's victim is asked of the candidates after."""
        slots, loading = self.slots, self._loading
        if self._pinned_n + len(loading) + len(protected) < len(slots):
            return True
        for s, sl in enumerate(slots):
            if not sl.pinned and s not in protected and s not in loading:
                return True
        return any(not slots[s].pinned and s not in protected and self._refresh(s) == READY for s in sorted(loading))

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
        self._table_follows(r, key[1], -1)
        self._resident_in[r] -= 1
        last_use = slot.last_use
        self.slots[s] = Slot(last_use=last_use)
        self._free[self._part(key[0])].append(s)
        if self.eviction is not None:
            self.eviction.on_evict(key)

    def _load(self, s: int, key: ExpertKey, *, prefetched: bool, pos: Position, bits: int = FULL) -> None:
        slot = self.slots[s]
        if self._held is not None:  # a `batch`: submitted at its end (a slot in flight without a ticket meanwhile)
            slot.ticket = None
            self._held.append((s, key, bits, not prefetched))
        else:
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
        self._table_follows(r, key[1], s)
        self._resident_in[r] += 1
        if not self._instant:
            self._loading.add(s)
        self.counters.loads += 1
        self.counters.bytes_moved += self.bytes_at(bits)  # this transfer's bytes (a compact copy is smaller)
        if self._on_precision is not None:
            self._on_precision(key, bits)
        if self.eviction is not None:
            self.eviction.on_insert(key, pos, prefetched=prefetched)

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
