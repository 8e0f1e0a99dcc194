"""The bytes that move: the cache's slot buffer, its per-parameter views, the device table and the copies.

`CacheDevice` is the part of `ExpertCache` (`runtime/cache.py`) that holds the tensors: the slot buffer `[C, R]`
(allocated once) with per-parameter views `[C, *shape]` from which the engine gathers a layer's slots, and the
device table `[L_moe, E]` (long, -1 = not resident) that follows `slot_of` (`_table_follows`: now, through a
numpy view on the CPU (`_set_entry`), or once at a `batch`'s end (`_write_table`)). It starts every copy
(`_submit`: the host row, or a compact copy, into a slot row) and, inside a `batch`, holds them and hands them to
the link at its end in runs of equal priority (`_hand_over`; `_ascend` re-deals a staged batch's slots
so that a layer's keys ascend with them). Without a store (the simulator) there are no tensors: `_submit` asks the
link for a transfer of `bytes_at(bits)` bytes.

A mixin of `ExpertCache`, not an object the cache owns: the copies read and write the cache's slots (`last_use`,
`ticket`, `issued`) and slot map, `_held` is read per key by `_load`, and tests hook `_write_table` and
`_table_np` on the cache; the attributes it uses are declared in `cache_slots.CacheState` and set by
`ExpertCache.__init__`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..policies.base import ExpertKey
from ..quant import FULL, compact_bytes_estimate
from .cache_slots import CacheState
from .link import Ticket
from .store import HostExpertStore


class CacheDevice(CacheState):
    """The tensors and the copies of `ExpertCache` (mixin): buffer, views, device table, a `batch`'s held copies."""

    def _init_device(self, store: HostExpertStore | None, C: int, L: int, E: int, device: torch.device | None) -> None:
        """The buffer, views and table of `C` slots over `L` MoE layers of `E` experts (none without a store)."""
        self.buffer: torch.Tensor | None = None  # [C,R] (None without a store)
        self.views: dict[str, torch.Tensor] = {}  # name -> [C, *shape]
        self.table: torch.Tensor | None = None  # [L,E] slot or -1, on the device
        self._table_writes: tuple[list[int], list[int]] | None = None  # (ranks, experts) a `batch` loaded
        self._held: list[tuple[int, ExpertKey, int, bool]] | None = None  # (slot, key, bits, demand): a `batch`'s copies
        if store is not None:
            self.buffer = torch.empty(C, store.layout.row_numel, dtype=store.layout.dtype, device=device)
            self.views = store.layout.views(self.buffer)
            self.table = torch.full((L, E), -1, dtype=torch.long, device=device)
        # on the CPU the table is written through a numpy view of it (no tensor made per write)
        self._table_np = self.table.numpy() if self.table is not None and self.table.device.type == "cpu" else None
        # per-slot rows of `buffer` [R], made once, not per copy (the host rows' views are the store's: `row`)
        self._slot_rows: list[torch.Tensor] = list(self.buffer.unbind(0)) if self.buffer is not None else []

    def bytes_at(self, bits: int) -> int:
        """Bytes one transfer of an expert at `bits` moves (FULL: the full row)."""
        if bits == FULL:
            return self.expert_bytes
        if self.store is not None:
            return self.store.expert_bytes_at(bits)
        return compact_bytes_estimate(self.expert_bytes, bits)

    def _submit(self, s: int, key: ExpertKey, bits: int, *, demand: bool) -> Ticket:
        """Start the copy of `key` at `bits` into slot `s` (a compact copy lands in the row's first bytes)."""
        slot = self.slots[s]
        store, buffer = self.store, self.buffer
        if store is not None and buffer is not None:  # the buffer exists exactly when the store does
            src = store.compact_row(*key, bits)  # [R] model dtype or [compact bytes] uint8, host
            return self.link.submit(src, store.landing(buffer[s], bits), after=slot.last_use, demand=demand)
        # simulated: the link models the transfer of one expert (row or compact copy), nothing is copied
        return self.link.submit_nbytes(self.bytes_at(bits), after=slot.last_use, demand=demand)  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """The loads inside (`demand`, `stage`) as ONE batch: every decision and event as one by one, but the copies
        handed to the link at the end in runs of equal priority (`Link.submit_many`: the same schedule, one
        reflow; a promotion or a wait inside hands over what is held first) and the device table written once.
        Nested: the outer one hands over. Instant links and tensor-free caches load one by one."""
        if self._table_writes is not None:
            yield
            return
        with self.link.batch():  # the link hands what it got to its copying thread at the end, together
            self._table_writes = ([], [])
            if not self._instant and self.store is not None:
                self._held = []
            try:
                yield
            finally:
                try:
                    self._hand_over()
                finally:
                    self._held = None
                    rows, experts = self._table_writes
                    self._table_writes = None
                    if rows and self.table is not None:
                        self._write_table(rows, experts)

    def cut(self) -> None:
        """Within a `batch`: hand the copies held so far to the link now, so that no later copy of the batch joins
        them in one link copy (`CudaLink` moves adjacent rows handed over together as ONE copy, ready together: a
        staged prefill cuts after each wave, so a wave's experts are ready when that wave lands, not the next)."""
        if self._held:
            self._hand_over()

    def _table_follows(self, r: int, e: int, slot: int) -> None:
        """The table's entry (r, e) follows its key to `slot` (-1: none): within a `batch`, in the batch's one write
        at its end; else now."""
        if self._table_writes is not None:
            self._table_writes[0].append(r)
            self._table_writes[1].append(e)
        else:
            self._set_entry(r, e, slot)

    def _set_entry(self, r: int, e: int, slot: int) -> None:
        """Table entry (r, e) = `slot` now: on the CPU through its numpy view (no tensor made), else on the device."""
        if self._table_np is not None:
            self._table_np[r, e] = slot
        elif self.table is not None:
            self.table[r, e] = slot

    def _write_table(self, rows: list[int], experts: list[int]) -> None:
        """One write of the table: each `(rows[i], experts[i])` entry set to its key's slot now (-1: no slot)."""
        table, layers, slot_of = self.table, self.spec.moe_layers, self.slot_of
        assert table is not None  # written only with a store
        tn = self._table_np
        if tn is not None:  # the host table, entry by entry through its numpy view
            for r, e in zip(rows, experts):  # (a repeated entry gets the same value again)
                tn[r, e] = slot_of.get((layers[r], e), -1)
            return
        now = {(r, e): slot_of.get((layers[r], e), -1) for r, e in zip(rows, experts)}
        r_, e_ = zip(*now)
        # ONE host -> device copy, not waited for (a blocking copy would synchronize the device)
        w = torch.tensor([r_, e_, list(now.values())]).to(table.device, non_blocking=True)  # [3,n]
        table[w[0], w[1]] = w[2]

    def _hand_over(self) -> None:
        """The copies a `batch` holds, submitted now (in order, consecutive ones of equal priority together)."""
        held = self._held
        if not held:
            return
        self._held = []
        store, slots, rows = self.store, self.slots, self._slot_rows
        assert store is not None and rows  # held only with a store (`batch`)
        i, n = 0, len(held)
        while i < n:
            demand = held[i][3]
            j = i + 1
            while j < n and held[j][3] == demand:
                j += 1
            run = held[i:j]
            items = [
                (
                    store.row(*key) if bits == FULL else store.compact_row(*key, bits),  # [R] host
                    store.landing(rows[s], bits),
                    slots[s].last_use,
                )
                for s, key, bits, _ in run
            ]
            for (s, _, _, _), t in zip(run, self.link.submit_many(items, demand=demand)):
                slots[s].ticket = t
            i = j

    def _ascend(self, i0: int) -> None:
        """The held loads from `i0` on (one staged batch: prefetches, not handed over, not read by anyone yet) with
        their slots re-dealt so that each layer's keys ascend with their slots; their copies stay in key order.
        Only which of the batch's slots holds which of its keys changes (each slot keeps its own `last_use`):
        the keys, counters, eviction events and the device table (written from `slot_of` at the batch's end)
        are those of the batch as issued."""
        held = self._held
        assert held is not None
        run = held[i0:]
        by_layer: dict[int, list[tuple[int, ExpertKey, int, bool]]] = {}
        for h in run:
            by_layer.setdefault(h[1][0], []).append(h)
        slots, slot_of, out = self.slots, self.slot_of, []
        for group in by_layer.values():
            order = sorted(group, key=lambda h: h[1])  # by key
            dealt = sorted(h[0] for h in group)  # the group's slots, ascending
            if [h[0] for h in order] != dealt and all(h[2] == order[0][2] and not h[3] for h in order):
                issued = {h[1]: slots[h[0]].issued for h in group}
                for s, (_, key, _, _) in zip(dealt, order):
                    slot = slots[s]
                    slot.key, slot.issued = key, issued[key]
                    slot_of[key] = s
                order = [(s, h[1], h[2], h[3]) for s, h in zip(dealt, order)]
            out.extend(order)
        held[i0:] = out
