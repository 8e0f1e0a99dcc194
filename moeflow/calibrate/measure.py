"""Measurements: host->device bandwidth over transfer sizes, per-layer decode compute, one expert's compute.

Copies and the single-expert timing take the minimum over repeats after a warm-up (robust to the
scheduler preempting a shared machine); per-layer decode times are medians over decode steps, timed at
each torch thread count of `thread_counts` (`thread_sweep`; the fewest threads within 5% of the
fastest are the calibration's `best_threads`). On CUDA:
pinned host -> device copies timed with CUDA events, module timings with synchronisation. Without CUDA:
host memcpy (`Tensor.copy_`, one thread), and, when asked, the runtime's `EmulatedLink` (submit + wait,
wall time) so the numbers include its worker-thread overhead.

`link_timing` measures the emulated link's host time per submit and its waiting thread's lateness, which the
simulator's clock needs (`moeflow.sim.timemodel.TimeModel`) beside the offload engine's own host time
(`engine_time.py`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def time_copy(nbytes: int, device: str, repeats: int, link: Any = None) -> float:
    """Fastest of `repeats` timed moves of `nbytes` host -> `device` (or through `link` on CPU), seconds."""
    if device.startswith("cuda"):
        src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        out = []
        for i in range(repeats + 1):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i:
                out.append(start.elapsed_time(end) / 1e3)
        return min(out)
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one copy stream; a multi-threaded copy_ measured ~8 ms of OpenMP wake-up per
    try:  # call on a shared 2-core machine, whatever the size
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            if link is None:
                dst.copy_(src)
            else:
                link.wait(link.submit(src, dst))
            if i:
                out.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return min(out)


def bandwidth_sweep(
    sizes: Sequence[int], device: str, repeats: int, link: Any = None, progress: Callable[[], None] | None = None
) -> list[dict[str, float]]:
    rows = []
    for n in sizes:
        s = time_copy(int(n), device, repeats, link)
        rows.append({"bytes": int(n), "seconds": s, "gbps": n / s / 1e9})
        if progress:
            progress()
    return rows


def fit_latency(rows: Sequence[dict[str, float]]) -> tuple[float, float]:
    """Least-squares t = latency + bytes / bandwidth over the sweep: (latency_s >= 0, bandwidth bytes/s)."""
    xs = [r["bytes"] for r in rows]
    ys = [r["seconds"] for r in rows]
    if len(xs) < 2:
        return 0.0, xs[0] / ys[0]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if slope <= 0:
        return 0.0, max(r["bytes"] / r["seconds"] for r in rows)
    return max(0.0, my - slope * mx), 1.0 / slope


class _Timer:
    """Forward pre-hook / hook pair recording the wall time of each call of one module."""

    def __init__(self, module: torch.nn.Module, device: str):
        self.device, self._t0 = device, 0.0
        self.times: list[float] = []
        self._h = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *a: Any) -> None:
        _sync(self.device)
        self._t0 = time.perf_counter()

    def _post(self, *a: Any) -> None:
        _sync(self.device)
        self.times.append(time.perf_counter() - self._t0)

    def remove(self) -> None:
        for h in self._h:
            h.remove()


def prompt_ids(model: Any, device: str, prompt_len: int) -> torch.Tensor:
    """[1,P] a fixed pseudo-random prompt of `prompt_len` token ids on `device` (the timed decodes' prompt)."""
    vocab = int(model.config.vocab_size)
    ids = torch.randint(3, max(4, min(vocab, 1000)), (1, prompt_len), generator=torch.Generator().manual_seed(0))
    return ids.to(device)  # [1,P]


def decode_timing(model: Any, adapter: Any, steps: int, device: str, prompt_len: int = 16) -> dict[str, Any]:
    """Median per-call seconds at decode (one token per call, all experts resident):
    whole forward, each decoder layer, each MoE block; attention+norms = layer - MoE block."""
    from ..runtime.generate import generate_exactly

    ids = prompt_ids(model, device, prompt_len)  # [1,P]
    timers = {"forward": _Timer(model, device)}
    for l in range(len(adapter.layers)):
        timers[f"layer{l}"] = _Timer(adapter.layers[l], device)
    for l in adapter.moe_layers:
        timers[f"moe{l}"] = _Timer(adapter.moe_block(l), device)
    try:
        with torch.no_grad():
            for _ in range(2):  # warm-up run, then the timed run (first call of each run is the prefill)
                for t in timers.values():
                    t.times.clear()
                generate_exactly(model, ids, steps + 1)
    finally:
        for t in timers.values():
            t.remove()
    med = {k: statistics.median(t.times[1:]) for k, t in timers.items() if len(t.times) > 1}
    layers = [med[f"layer{l}"] for l in range(len(adapter.layers))]
    moe = {l: med[f"moe{l}"] for l in adapter.moe_layers}
    attn = [med[f"layer{l}"] - moe[l] for l in adapter.moe_layers]
    return {
        "forward_s": med["forward"],
        "layer_s": layers,
        "moe_block_s": [moe[l] for l in adapter.moe_layers],
        "attention_s": attn,  # layer minus its MoE block (attention + norms)
        "layer_time_s": statistics.fmean(med[f"layer{l}"] for l in adapter.moe_layers),  # T_l
        "attention_time_s": statistics.fmean(attn),
    }


def thread_counts(cores: int) -> list[int]:
    """The thread counts a calibration times: 1, 2, 4, ... below `cores`, then `cores` itself."""
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return [*counts, max(1, cores)]


def best_thread_count(rows: Sequence[dict[str, Any]], tolerance: float = 0.05) -> int:
    """The fewest threads whose decode time per token is within `tolerance` of the fastest (fewer threads
    lose less when the machine gets busy). `rows`: {"threads", "compute_per_token_s"} per count timed."""
    fastest = min(float(r["compute_per_token_s"]) for r in rows)
    return min(int(r["threads"]) for r in rows if float(r["compute_per_token_s"]) <= fastest * (1 + tolerance))


def thread_sweep(
    model: Any,
    adapter: Any,
    counts: Sequence[int],
    steps: int,
    device: str,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    """`decode_timing` at each torch thread count of `counts`: (best count by `best_thread_count`, one row
    per count {"threads", "compute_per_token_s", "layer_time_s"}, the full timing at the best count).
    Leaves torch at the best count; `progress(n)` is called once n threads are timed."""
    rows, timings = [], {}
    for n in counts:
        torch.set_num_threads(n)
        comp = decode_timing(model, adapter, steps, device)
        timings[n] = comp
        rows.append({"threads": n, "compute_per_token_s": comp["forward_s"], "layer_time_s": comp["layer_time_s"]})
        if progress:
            progress(n)
    best = best_thread_count(rows)
    torch.set_num_threads(best)
    return best, rows, timings[best]


def expert_timing(adapter: Any, repeats: int, device: str) -> float:
    """Fastest seconds for one expert on one token (the experts module with top-1 routing to expert 0)."""
    l = adapter.moe_layers[0]
    ex = adapter.experts(l)
    p = next(ex.parameters())
    x = torch.randn(1, adapter.spec.hidden_size, dtype=p.dtype, device=p.device)  # [1,H]
    idx = torch.zeros(1, 1, dtype=torch.long, device=p.device)  # [1,1]
    w = torch.ones(1, 1, dtype=p.dtype, device=p.device)  # [1,1]
    out = []
    with torch.no_grad():
        for i in range(repeats + 2):
            _sync(device)
            t0 = time.perf_counter()
            ex(x, idx, w)
            _sync(device)
            if i >= 2:
                out.append(time.perf_counter() - t0)
    return min(out)


def link_timing(link: Any, nbytes: int, repeats: int, burst: int = 1) -> dict[str, float]:
    """The emulated link's host terms for transfers of `nbytes`, as a layer's demand loads use it: `burst`
    copies submitted back to back, then waited for in order, `repeats` times (after one warm-up). `submit_s`:
    mean seconds one `link.submit` takes on the calling thread; `wake_s`: mean of how long after a copy is due a
    wait that slept returns (the sleeping thread's lateness, the worker's real copy included); means, as a run's
    stall adds them up. `moeflow.sim.link.ModelledLink` adds both."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)  # [nbytes]
    dsts = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(max(1, burst))]  # burst x [nbytes]
    subs, wakes = [], []
    for i in range(repeats + 1):
        tickets = []
        for dst in dsts:
            c0 = link.clock_s()
            tickets.append(link.submit(src, dst))
            if i:  # the first round is a warm-up
                subs.append(link.clock_s() - c0)
        for t in tickets:
            slept = link.clock_s() < t.due
            link.wait(t)
            if i and slept:
                wakes.append(max(0.0, link.clock_s() - t.due))
    return {
        "submit_s": statistics.fmean(subs),
        "wake_s": statistics.fmean(wakes) if wakes else 0.0,
        "bytes": nbytes,
        "burst": max(1, burst),
        "repeats": repeats,
    }
