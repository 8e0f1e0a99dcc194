"""Per-pass accounting of the offload engine: what one forward pass (prefill or one decode step) cost.

`PassAccount` is the running pass's ledger. The engine opens it at the model's forward pre-hook (`begin`),
feeds it from the router hook (`router_called`: the gap since the last experts call is attention + router
compute), from the experts call (`experts_called`: its time less the demand loads and waits booked with
`book`), from the cache's loads (`count_loads`, by the expert's layer) and from the prefetch step
(`proposed`: N_e, the proposed experts not resident when first proposed), and closes it at the forward
post-hook (`stats` -> `PassStats`, given to every observer: step-size controllers, learned prefetchers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..policies.base import CPU, DROP, SUBSTITUTE
from .counters import CacheCounters


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
    needed: int = 0  # a prefill: its routed experts not resident when it began (copies the TTFT bound counts)

    @property
    def overfetch(self) -> int:
        return self.counters.prefetch_unused_evicted


Observer = Callable[[PassStats], None]


@dataclass
class EngineCounts:
    """Counts over the engine's whole life (not per pass)."""

    host_syncs: int = 0  # device -> host reads the engine made (each one a sync on CUDA)
    host_s: float = 0.0  # seconds the host worker was busy running experts (miss policy `cpu` / `auto`)
    host_wait_s: float = 0.0  # seconds experts calls waited for the host worker (host_s not hidden)
    miss_counts: dict[str, int] = field(default_factory=lambda: {DROP: 0, SUBSTITUTE: 0, CPU: 0})  # missing
    #   experts (per layer call and expert) handled without a copy, by the miss policy's action


class PassAccount:
    """The running pass's ledger (see the module docstring); `begin` resets it."""

    def __init__(self) -> None:
        self.pass_id = -1
        self.token_ids: torch.Tensor | None = None  # [B*T] this pass's input ids
        self.decode = False
        self.compute_s = 0.0  # compute outside the engine's bookkeeping (PassStats.compute_s)
        self.book_s = 0.0  # time inside experts calls spent on demand loads / waits (subtracted)
        self.moe_run = 0
        self.loads_by_layer: dict[int, int] = {}
        self._pred_keys: set[tuple[int, int]] = set()
        self._pred_new = 0
        self._t0 = 0.0
        self._t_mark = 0.0  # end of the last experts call (or pass start)
        self._c0 = CacheCounters()
        self._link0 = (0.0, 0)

    def begin(self, pass_id: int, input_ids: Any, counters: CacheCounters, link: Any) -> None:
        """A forward pass starts (`input_ids [B,T]` or None): snapshot the counters and the link."""
        self.pass_id = pass_id
        ids = input_ids if isinstance(input_ids, torch.Tensor) else None
        self.token_ids = ids.reshape(-1) if ids is not None else None
        self.decode = ids is not None and ids.dim() >= 1 and ids.shape[-1] == 1
        self.compute_s, self.moe_run, self._pred_new = 0.0, 0, 0
        self._pred_keys = set()
        self.loads_by_layer = {}
        self._c0 = counters.copy()
        self._link0 = (link.busy_s, link.bytes)
        self._t0 = self._t_mark = time.perf_counter()

    def router_called(self) -> None:
        """A router hook runs: the time since the last experts call (attention + router) is compute."""
        self.compute_s += max(0.0, time.perf_counter() - self._t_mark)

    def experts_called(self, t0: float, book0: float) -> None:
        """An experts call that began at `t0` (with `book_s` = `book0`) ends: its time less what it booked."""
        self._t_mark = time.perf_counter()
        self.compute_s += max(0.0, self._t_mark - t0 - (self.book_s - book0))
        self.moe_run += 1

    def book(self, seconds: float) -> None:
        """Seconds an experts call spent on demand loads and waits (not compute)."""
        self.book_s += seconds

    def count_loads(self, layer: int, n: int) -> None:
        if n:
            self.loads_by_layer[layer] = self.loads_by_layer.get(layer, 0) + n

    def proposed(self, keys: Iterable[tuple[int, int]], resident: Callable[[tuple[int, int]], bool]) -> None:
        """Experts the prefetch policy proposed: count the distinct ones, and those not resident when first seen."""
        for key in keys:
            if key not in self._pred_keys:
                self._pred_keys.add(key)
                self._pred_new += not resident(key)

    def stats(self, counters: CacheCounters, link: Any, lookahead: int) -> PassStats:
        """The finished pass (`counters`: the cache's counters now)."""
        c = counters - self._c0
        return PassStats(
            pass_id=self.pass_id,
            tokens=int(self.token_ids.numel()) if self.token_ids is not None else 0,
            wall_s=time.perf_counter() - self._t0,
            stall_s=c.stall_s,
            counters=c,
            transfer_s=link.busy_s - self._link0[0],
            transfer_bytes=link.bytes - self._link0[1],
            lookahead=lookahead,
            loads_by_layer=dict(self.loads_by_layer),
            decode=self.decode,
            compute_s=self.compute_s,
            moe_layers_run=self.moe_run,
            predicted=len(self._pred_keys),
            predicted_new=self._pred_new,
            token_ids=self.token_ids,
        )
