"""The host worker: missed experts computed on the host while the device computes the layer's resident ones.

One long-lived thread per attached engine (`HostWorker`, started at attach, stopped at close). The experts
call hands it the rows routed to the host experts (`submit`) BEFORE it computes the experts with a slot, and
joins the result (`HostJob.join`) just before the single combine, so the host compute runs beside the device's
(on a CPU device a call whose every expert is a host expert has no device work to hide them behind: it either
hands about half of their rows to the worker and computes the rest itself meanwhile, or computes them all itself,
whichever `SplitChoice` measured faster; the hand-off costs two thread switches and the GIL serializes the Python
around small kernels, so splitting pays only with a free core and kernels large enough):
- CPU device: the job runs the same `grouped_experts` kernel over the host store's rows on the worker
  thread (torch releases the GIL inside its kernels). Only at one torch thread (`worker_is_exact`):
  the two threads each run single-threaded kernels, the count the resident model runs at; at several the host
  experts run serially on the calling thread (sharing the count between two threads would change, on some CPUs,
  the last bits of every other op). The rows, their grouping and the kernel are those of the serial path: the
  result is bit-identical.
- CUDA device: the rows go to pinned host memory on a side stream (after an event recorded on the compute
  stream), the worker waits for that copy, computes, and copies the result back to the device on the side
  stream (`non_blocking`); `join` makes the compute stream wait on the side stream's event before the
  result is read, so nothing synchronizes the whole device.

Overlap accounting (`EngineCounts`): `host_s` = seconds of the host path (from `submit` to the result: the
hand-off to the thread, copies and compute), `host_wait_s` = seconds of the host path still running when the
experts call reached `join` (from `join` to the worker's end: never more than `host_s`, since `join` comes after
`submit`); the share of host time hidden behind the
device's work is `1 - host_wait_s / host_s` (`hidden_share`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .passstats import EngineCounts

Compute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [N,H], expert ids [N]) on the host -> [N,H]


def worker_is_exact(device_type: str, threads: int) -> bool:
    """Whether host experts may run on a worker thread beside a device of type `device_type` at `threads` torch
    threads: always beside a CUDA device; on a CPU device only at one thread. Two compute threads on the same cores
    would need torch's count shared between them, and on some CPUs a kernel's result depends on that count (MKL's
    sgemm on AMD EPYC, where even a Linear differs in the last bit between one thread and two), so the model's other
    ops would no longer match the resident model's at the user's count; at several threads the host experts run
    serially on the calling thread at that count, bit for bit the resident computation on every CPU."""
    return device_type != "cpu" or threads == 1


def hidden_share(host_s: float, wait_s: float) -> float | None:
    """Share of host busy time hidden behind the device's work, in [0, 1]; None when no host time."""
    if host_s <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - wait_s / host_s))


class HostJob:
    """One submitted host computation; `join()` -> the result rows on the device, in the device's order."""

    def __init__(self, future: Future, counts: EngineCounts, t_submit: float, done: torch.cuda.Event | None = None):
        self._future, self._counts, self._t_submit, self._done = future, counts, t_submit, done

    def join(self) -> torch.Tensor:
        """The host result `[N,H]` on the device (blocks until the worker has finished; time booked as wait)."""
        t0 = time.perf_counter()
        out, t_end = self._future.result()
        # The wait is the part of the host path still running when the call asked for it (t0 -> the worker's
        # end); the thread wake-up after that is scheduling, not host work, so wait <= host_s always.
        self._counts.host_wait_s += max(0.0, t_end - t0)
        self._counts.host_s += t_end - self._t_submit
        if self._done is not None:  # CUDA: the compute stream waits for the copy back, the host does not
            main = torch.cuda.current_stream(out.device)
            main.wait_event(self._done)
            out.record_stream(main)  # allocated on the side stream, read on the compute stream
        return out


class SplitChoice:
    """On a CPU device, whether a call whose every expert is a host expert splits them between the host worker
    and the calling thread (`True`) or computes them all on the calling thread (`False`), by measurement.

    Two threads only help where a second core is free and the kernels, not the Python around them (which holds
    the GIL), dominate: on a loaded machine or a model of tiny experts the hand-off costs more than it hides.
    So each mode's seconds per call are kept as a recent-weighted mean (`decay`) per size class (the call's host
    rows, by powers of two); the faster one is used, each untried mode is tried first, and every `explore`-th
    call of a class tries the other one, so a change of load is noticed. `forced` (True / False) fixes the mode."""

    def __init__(self, explore: int = 16, decay: float = 0.8, forced: bool | None = None):
        self.explore, self.decay, self.forced = int(explore), float(decay), forced
        self._mean: dict[int, dict[bool, float]] = {}  # size class -> mode -> mean seconds per call
        self._calls: dict[int, int] = {}
        self.used = {False: 0, True: 0}  # calls per mode

    def pick(self, rows: int) -> bool:
        """The mode for a call of `rows` host rows."""
        if self.forced is not None:
            split = self.forced
        else:
            c = rows.bit_length()
            n = self._calls[c] = self._calls.get(c, 0) + 1
            mean = self._mean.get(c, {})
            if len(mean) < 2:
                split = True not in mean  # the untried mode
            else:
                split = mean[True] < mean[False]
                if n % self.explore == 0:
                    split = not split
        self.used[split] += 1
        return split

    def record(self, rows: int, split: bool, seconds: float) -> None:
        """A call of `rows` host rows in mode `split` took `seconds` (from the hand-off to the joined result)."""
        mean = self._mean.setdefault(rows.bit_length(), {})
        old = mean.get(split)
        mean[split] = seconds if old is None else self.decay * old + (1.0 - self.decay) * seconds


class HostWorker:
    """A single worker thread that runs host expert computations (see the module docstring)."""

    def __init__(self, device: torch.device, counts: EngineCounts):
        self.device, self.counts = device, counts
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeflow-host")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.split = SplitChoice()  # a CPU device's all-host calls: split with this thread or not (measured)

    def submit(self, x: torch.Tensor, eg: torch.Tensor, compute: Compute) -> HostJob:
        """Start `compute` over rows `x [N,H]` (on the device) with expert ids `eg [N]` on the host thread.

        The worker runs under the submitting thread's grad / inference mode (they are thread-local)."""
        pool = self._pool
        if pool is None:
            raise RuntimeError("the host worker is stopped")
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        t_submit = time.perf_counter()
        if self._stream is None:  # CPU device: the rows are host tensors already
            x_h, eg_h = x, eg

            def run_cpu() -> tuple[torch.Tensor, float]:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    out = compute(x_h, eg_h)  # [N,H]
                return out, time.perf_counter()

            return HostJob(pool.submit(run_cpu), self.counts, t_submit)
        run_cuda, done = self._cuda_job(x, eg, compute, grad, inference)
        return HostJob(pool.submit(run_cuda), self.counts, t_submit, done)

    def _cuda_job(
        self, x: torch.Tensor, eg: torch.Tensor, compute: Compute, grad: bool, inference: bool
    ) -> tuple[Callable[[], tuple[torch.Tensor, float]], torch.cuda.Event]:
        """CUDA: device -> pinned host on the side stream (enqueued now); the job for the thread (wait for that
        copy, host compute, pinned host -> device on the side stream) and the event its copy back records."""
        stream = self._stream
        if stream is None:  # unreachable: only called with a CUDA device
            raise RuntimeError("no side stream")
        main = torch.cuda.current_stream(x.device)
        ready = torch.cuda.Event()
        ready.record(main)  # x and eg are written by the compute stream
        x_h = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)  # [N,H] pinned
        eg_h = torch.empty(eg.shape, dtype=eg.dtype, pin_memory=True)  # [N] pinned
        down, done = torch.cuda.Event(), torch.cuda.Event()
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            x_h.copy_(x, non_blocking=True)
            eg_h.copy_(eg, non_blocking=True)
            down.record(stream)
        x.record_stream(stream)
        eg.record_stream(stream)
        dev = x.device

        def run_cuda() -> tuple[torch.Tensor, float]:
            down.synchronize()  # the rows are on the host
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                out_h = compute(x_h, eg_h)  # [N,H] host
            pinned = out_h.pin_memory()
            with torch.cuda.stream(stream):
                out = pinned.to(dev, non_blocking=True)  # [N,H] device, allocated on the side stream
                done.record(stream)
            return out, time.perf_counter()

        return run_cuda, done

    def close(self) -> None:
        """Stop the worker thread (waits for a running job)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
