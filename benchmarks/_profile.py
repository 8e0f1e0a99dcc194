"""Shared by the benchmarks: per MoE layer per decode step, kernel launches (CUDA) or top-level aten ops
(CPU, the proxy) from torch.profiler, and host synchronizations.

`profile_counts(model, adapter, ids, engine, new, cuda)` runs one greedy generation of `new` tokens under
torch.profiler with a profiler range around every decode-step call of every MoE block (one token: the
block's input has one row), and returns
- `kernel_launches` (CUDA): cudaLaunchKernel & co. inside those ranges / decode-step MoE calls;
- `aten_ops`: top-level aten ops inside them (CPU proxy for launches);
- `host_syncs` (CUDA): stream/device/event synchronizations and blocking memcpys inside them, per call;
- `engine_host_syncs`: the engine's own device->host reads (`engine.host_syncs`) during decode passes
  (the prefill pass excluded) / (decode passes x MoE layers); 0 for the stock model. On CPU this is
  `host_syncs` too (no profiler event marks a CPU "sync").

`host_profile(label, run, top)` prints the `top` functions by own host time (cProfile) of `run()` to stderr
(`engine_overhead.py --host-profile`, `prefill.py --host-profile`).

Scripts in `benchmarks/` import it as `from _profile import profile_counts` (their folder is on sys.path).
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}
SYNCS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
DECODE_RANGE = "moeflow::moe_layer_decode"


class LayerRanges:
    """Forward hooks on every MoE block: a profiler range per decode-step call (one token)."""

    def __init__(self, adapter):
        self.handles, self.open = [], []
        for l in adapter.moe_layers:
            block = adapter.moe_block(l)
            self.handles.append(block.register_forward_pre_hook(self._enter))
            self.handles.append(block.register_forward_hook(self._exit))

    def _enter(self, module, args):
        x = args[0]
        rf = torch.autograd.profiler.record_function(DECODE_RANGE if x.numel() == x.shape[-1] else "moeflow::moe_layer")
        rf.__enter__()
        self.open.append(rf)

    def _exit(self, module, args, output):
        self.open.pop().__exit__(None, None, None)

    def remove(self):
        for h in self.handles:
            h.remove()


def engine_syncs_per_decode_layer(engine: Any, run) -> tuple[Any, float | None]:
    """Run `run()` and count `engine.host_syncs` over its decode passes only (per pass ends, via an
    observer): returns (run's result, syncs / (decode passes x MoE layers)), None without an engine."""
    if engine is None:
        return run(), None
    at_end: list[int] = []
    obs = lambda st: at_end.append(engine.host_syncs)  # noqa: E731
    engine.observers.append(obs)
    try:
        out = run()
    finally:
        engine.observers.remove(obs)
    passes = len(at_end) - 1  # decode passes (the first pass is the prefill)
    if passes < 1:
        return out, None
    return out, (at_end[-1] - at_end[0]) / (passes * engine.spec.num_moe_layers)


def profile_counts(model, adapter, ids, engine, new: int, cuda: bool) -> dict:
    """Per MoE layer per decode step: kernel launches or aten ops, host synchronizations."""
    from torch.profiler import ProfilerActivity, profile

    from moeflow.runtime.generate import generate_one

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    ranges = LayerRanges(adapter)
    try:
        with profile(activities=acts) as prof:
            _, eng_syncs = engine_syncs_per_decode_layer(
                engine, lambda: generate_one(model, ids, engine, max_new_tokens=new, min_new_tokens=new)
            )
    finally:
        ranges.remove()
    events = list(prof.events())
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == DECODE_RANGE)
    starts = [s for s, _ in spans]

    def inside(e) -> bool:
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        return i >= 0 and e.time_range.start <= spans[i][1]

    n = max(1, len(spans))
    aten = sum(
        1
        for e in events
        if e.name.startswith("aten::") and inside(e) and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
    )
    out: dict[str, Any] = {"decode_layer_calls": len(spans), "aten_ops": aten / n, "engine_host_syncs": eng_syncs or 0.0}
    if cuda:
        out["kernel_launches"] = sum(1 for e in events if e.name in LAUNCHES and inside(e)) / n
        out["host_syncs"] = sum(1 for e in events if e.name in SYNCS and inside(e)) / n
    else:  # CPU: the engine's own device->host reads
        out["host_syncs"] = eng_syncs or 0.0
    return out


def host_profile(label: str, run: Any, top: int) -> None:
    """cProfile of `run()`: the `top` functions by own time, to stderr under a `---- host profile: label` line."""
    import cProfile
    import io
    import pstats
    import sys

    prof = cProfile.Profile()
    prof.enable()
    try:
        run()
    finally:
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(f"---- host profile: {label} (cProfile, by own time)\n{out.getvalue()}", file=sys.stderr)


def h2d_gbps(nbytes: int, device: Any, reps: int = 20) -> float:  # offload.py and predictors.py
    """Pinned host -> device copies of `nbytes` (one expert row), timed with CUDA events: GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    b.record()
    b.synchronize()
    return nbytes * reps / (a.elapsed_time(b) / 1e3) / 1e9
