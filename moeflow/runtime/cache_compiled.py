"""The bridge from `ExpertCache` to its compiled core (`runtime/corecache.py` `CacheCore`).

With an eviction policy that declares a `kernel` (lru, lfu, least-stale, belady-approx; the simulator's Belady MIN)
and an instant link (the simulator's `InstantLink`, the runtime's `DirectLink`), the decisions, the policy's state
and the counters live in numba kernels, one call per cache call (`demand`, `prefetch`, `release`, `begin_pass`,
`begin_layer`). `CompiledBridge` is the part of `ExpertCache` (`runtime/cache.py`) that builds the core
(`_make_core`, or says why not), makes those calls (`_core_demand`, `_core_prefetch`) and follows each call's
evictions, loads and upgrades in the cache's own views (`_core_apply`: `slot_of`, `slots`, the device table, the
copies, the counters), and `replay`, the simulator's whole stream through the same kernels in one call.

A mixin of `ExpertCache`, not an object the cache owns: `_core_apply` writes the cache's slot map, slots, table
and counters and starts its copies, and tests hook `_core_apply` on the cache; the attributes it uses are
declared in `cache_slots.CacheState` and set by `ExpertCache.__init__`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from ..policies.base import Position, PrefetchRequest
from ..quant import FULL
from .cache_slots import READY, CacheState, Slot
from .cachecore import LOG_EVICT, LOG_LOAD
from .corecache import CacheCore, ReplayResult, kernel_kind


class CompiledBridge(CacheState):
    """`ExpertCache`'s calls into its compiled core and the following of their records (mixin)."""

    def _make_core(self, compiled: bool | None) -> CacheCore | None:
        """The compiled core for a policy with a `kernel`, an instant link without a transfer estimate (so a
        prefetch gate admits by its budget alone) and MoE layers in ascending order; else None (Python)."""
        kind = kernel_kind(self.eviction)
        why = None
        if kind is None:
            why = f"eviction policy {type(self.eviction).__name__} has no compiled kernel"
        elif getattr(self.gate, "victim", False):
            why = "the prefetch gate asks the eviction policy about each victim (victim=on)"
        elif not self.link.instant or self.link.transfer_estimate_s(self.expert_bytes) is not None:
            why = f"link {self.link.name!r} is not instant"
        elif list(self.spec.moe_layers) != sorted(self.spec.moe_layers):
            why = "the MoE layers are not in ascending order"
        if why is not None or compiled is False:
            if compiled:
                raise ValueError(f"compiled cache core unavailable: {why}")
            return None
        assert kind is not None  # `why` is None only with a kernel
        return CacheCore(
            capacity=self.capacity,
            num_layers=self.spec.num_moe_layers,
            num_experts=self.spec.num_experts,
            per_layer=self.per_layer,
            kind=kind,
            policy=self.eviction,
            bytes_of_bits=[self.expert_bytes] + [0] * 8,  # compact sizes: set when a load asks for them
            log=True,
        )

    def _core_demand(self, layer: int, experts: Sequence[int], bits: dict[int, int] | None) -> list[int]:
        core = cast(CacheCore, self.core)
        for b in set(bits.values()) if bits else ():
            core.st.byb[b] = self.bytes_at(b)
        out = core.demand(self.rank[layer], experts, bits)
        self._core_apply()
        slots = self.slots
        for s in out:
            self._pinned_n += not slots[s].pinned
            slots[s].pinned = True
        self.time = core.time
        return out

    def _core_prefetch(self, requests: Sequence[PrefetchRequest], pos: Position, gate: Any) -> int:
        core = cast(CacheCore, self.core)
        left = -1 if gate is None else gate.quota()
        if left is None:  # unreachable: the core is built only for links without a transfer estimate
            raise RuntimeError("the prefetch gate needs the link for this call; the compiled core cannot ask it")
        E, rank = self.spec.num_experts, self.rank
        keys = []
        for req in sorted(requests, key=lambda r: -r.priority):
            l, e = int(req.key[0]), int(req.key[1])
            r = rank.get(l)
            keys.append(r * E + e if r is not None and 0 <= e < E else -1)
        issued, admitted, refused = core.prefetch(pos.layer_rank, keys, left)
        if gate is not None:
            gate.count(admitted, refused)
        self._core_apply()
        return issued

    def _core_apply(self) -> None:
        """Follow the core's last call: its evictions, loads (the copies) and upgrades, and its counters."""
        core = cast(CacheCore, self.core)
        E, layers, slots, table = self.spec.num_experts, self.spec.moe_layers, self.slots, self.table
        for op, s, k, arg in core.records():
            r, e = divmod(k, E)
            key = (layers[r], e)
            if op == LOG_EVICT:
                del self.slot_of[key]
                if table is not None:
                    table[r, e] = -1
                self._resident_in[r] -= 1
                slots[s] = Slot(last_use=slots[s].last_use)
            elif op == LOG_LOAD:
                bits, prefetched = arg & 255, bool(arg >> 8)
                slot = slots[s]
                slot.ticket = self._submit(s, key, bits, demand=not prefetched)
                slot.state, slot.key, slot.bits, slot.prefetched = READY, key, bits, prefetched
                if bits != FULL and self.store is not None and self.buffer is not None:
                    self.store.dequantize(bits, self.buffer[s])  # the copy is complete (instant link)
                self.slot_of[key] = s
                if table is not None:
                    table[r, e] = s
                self._resident_in[r] += 1
            else:  # LOG_UPGRADE: the full row over a low-precision slot
                slots[s].ticket = self._submit(s, key, FULL, demand=False)
                slots[s].bits = FULL
        core.counters(self.counters)

    def replay(self, stream: Any, proposals: Any, *, wave_cap: int, count_phase: int | None, left: int) -> ReplayResult:
        """The simulator: a whole access stream through the compiled core in one call (`CacheCore.replay`); the
        slot map follows the final state."""
        if self.core is None:
            raise RuntimeError("ExpertCache.replay needs the compiled core")
        res = self.core.replay(stream, proposals, wave_cap=wave_cap, count_phase=count_phase, left=left)
        self.slot_of.clear()
        self._resident_in = [0] * self.spec.num_moe_layers
        E, layers = self.spec.num_experts, self.spec.moe_layers
        for s, k in self.core.resident():
            r, e = divmod(k, E)
            self.slots[s] = Slot(state=READY, key=(layers[r], e))
            self.slot_of[(layers[r], e)] = s
            self._resident_in[r] += 1
        self.core.counters(self.counters)
        self.time = self.core.time
        return res
