"""Timings the runtime measures on this machine: one host expert, one plain row copy (`auto` miss policy,
`benchmarks/cpu_vs_fetch.py`), each the fastest of a few calls after a warm-up; and `settle_heap`, which keeps the
garbage collector's full collections out of timed generation."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from ..moe.compute import grouped_experts


def time_call(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Fastest of `repeats` timed calls (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def time_host_expert(adapter: Any, store: Any, tokens: int) -> float:
    """Fastest seconds to run one expert of the first MoE layer on `tokens` rows on the host, from the host
    store's rows (`store` must hold the experts: after `offload`), as the `cpu` miss policy runs it."""
    l = adapter.spec.moe_layers[0]
    module = adapter.experts(l)
    x = torch.randn(tokens, adapter.spec.hidden_size, dtype=store.layout.dtype)  # [N,H]
    eg = torch.zeros(tokens, dtype=torch.long)  # [N] expert 0
    views = store.layout.views(store.rows[l])  # [E,...] host, no copy
    with torch.no_grad():
        return time_call(lambda: grouped_experts(module, x, eg, views, eg, 1))


def time_row_copy(store: Any, device: torch.device) -> float:
    """Fastest seconds of one plain host -> device copy of one expert row (no link emulation)."""
    row = store.row(store.spec.moe_layers[0], 0)
    dst = torch.empty_like(row, device=device)

    def copy() -> None:
        dst.copy_(row)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return time_call(copy)


def settle_heap() -> int:
    """Collect, then move every object alive now to the garbage collector's permanent generation (`gc.freeze`);
    the number of objects frozen. Call it once the model is loaded, before timed generation: the loaded process
    holds the objects of torch, transformers and the model's modules, and Python's full collection, which a run's
    allocations trigger every so often, scanned them all in the middle of a decode step (on olmoe-deep in
    `benchmarks/predictors.py`, one adaptive-S row at 16-20% predictor share against 3-5% for the others). Frozen
    objects are never scanned again and never freed by a collection (reference counting still frees them), so
    call it once per process, after setup."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def collect_setup() -> bool:
    """In a process whose heap was settled (`settle_heap`: a timed one), one full collection now, at the end of a
    setup step (e.g. an engine binding its policies: predictors loaded, numba kernels compiled or loaded): the
    step's garbage and new long-lived objects otherwise bring the next full collection into a timed decode step (a
    router-pf decode call of 44-54 ms in a fresh checkout's first `benchmarks/predictors.py` run, against 0.3-1 ms).
    Cheap there (frozen objects are not scanned); skipped in a process that never settled its heap (a test suite
    attaching many engines), where it would scan every object each time. Whether it collected."""
    if not gc.get_freeze_count():
        return False
    gc.collect()
    return True
