"""`EmulatedLink`: one link of a given bandwidth and latency on a virtual schedule, copies on a worker thread."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...errors import ConfigError
from .base import Link, PrioritySchedule, Ticket


class EmulatedLink(Link):
    """One link of `gbps` GB/s (1e9 bytes/s) and `latency_s` per transfer; misses first.

    The schedule is virtual and exact (`PrioritySchedule`): a transfer submitted at time t starts when the
    link is free, `start = max(t, end of the previous transfer)`, and is due `latency + bytes / bandwidth`
    later; a demand transfer goes ahead of prefetches not yet started (which are pushed back). A
    worker thread does the real copy meanwhile (concurrently with compute on the calling thread). A
    transfer is complete when it is due and its copy is done, so `wait` blocks in real wall time until
    then, and the emulated timing does not depend on when the worker thread gets the GIL.

    `clock` / `sleep` (default `time.perf_counter` / `time.sleep`) can be replaced by a virtual clock
    (tests): the schedule (`Ticket.due`) and every stall are then exact, independent of machine load.
    """

    name = "emulated"

    def __init__(
        self,
        gbps: float,
        latency_s: float = 0.0,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ):
        super().__init__()
        self._clock, self._sleep = clock, sleep
        if gbps <= 0:
            raise ConfigError(f"emulated link bandwidth must be > 0 GB/s, got {gbps}")
        self.gbps = gbps
        self.latency_s = latency_s
        self._sched = PrioritySchedule()  # transfers not yet accounted, in schedule order
        self._q: queue.Queue = queue.Queue()
        self._batch: list[tuple[Any, Any, Ticket]] | None = None  # copies held back by `batch()`
        self._batch_copied = threading.Event()  # the held-back copies' `copied` (one event for the batch)
        self._closed = False
        self._worker = threading.Thread(target=self._copy_loop, name="moeflow-emulated-link", daemon=True)
        self._worker.start()

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / (self.gbps * 1e9)

    def transfer_estimate_s(self, nbytes: int) -> float | None:
        return self.transfer_s(nbytes)

    def backlog_s(self) -> float:
        return self._sched.backlog_s(self._clock())

    def clock_s(self) -> float:
        return self._clock()

    def _copy_loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            items = item if isinstance(item, list) else [item]
            # a withdrawn prefetch is not copied (its slot may be reused by a later copy)
            live = [(src, dst, t) for src, dst, t in items if not t.cancelled]
            try:  # a batch in one call (the GIL released once)
                torch._foreach_copy_([d for _, d, _ in live], [s for s, _, _ in live])
            except BaseException:  # one by one, each error surfaced to the thread that waits for its ticket
                for src, dst, t in live:
                    try:
                        dst.copy_(src)
                    except BaseException as e:
                        t.error = e
            for _, _, t in items:  # one event per batch: set once
                if not t.copied.is_set():
                    t.copied.set()

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        if self._batch is not None:  # nested: the outer batch hands everything over
            yield
            return
        self._batch = []
        try:
            yield
        finally:
            self._flush()

    def _flush(self) -> None:
        held, self._batch = self._batch, None
        if held:
            self._q.put(held)
            self._batch_copied = threading.Event()

    def submit(self, src, dst, *, after=None, demand=True) -> Ticket:
        if self._closed:
            raise RuntimeError("emulated link is closed; create a new one")
        t = self._submitted(Ticket(src.numel() * src.element_size()))
        t.busy_s = self.transfer_s(t.nbytes)
        self._sched.add(t, self._clock(), demand=demand)
        if self._batch is not None:
            t.copied = self._batch_copied
            self._batch.append((src, dst, t))
        else:
            t.copied = threading.Event()
            self._q.put((src, dst, t))  # the worker copies in submission order; the schedule decides `due`
        return t

    def submit_many(self, items, *, demand=True) -> list[Ticket]:
        """The copies of `items` scheduled at one clock reading with one reflow (`PrioritySchedule.add_many`: the
        schedule of `submit` one by one at that time) and handed to the copying thread together."""
        if self._closed:
            raise RuntimeError("emulated link is closed; create a new one")
        ts = []
        busy: dict[int, float] = {}  # link seconds per transfer size (a batch's rows are mostly one size)
        total = 0
        for src, _, _ in items:
            n = src.numel() * src.element_size()
            b = busy.get(n)
            if b is None:
                b = busy[n] = self.transfer_s(n)
            ts.append(Ticket(n, busy_s=b))
            total += n
        self._submitted_bytes += total  # `_submitted` of each
        self._sched.add_many(ts, self._clock(), demand=demand)
        held = self._batch
        copied = self._batch_copied if held is not None else threading.Event()
        batch = [(src, dst, t) for (src, dst, _), t in zip(items, ts)]
        for t in ts:
            t.copied = copied
        if held is not None:
            held.extend(batch)
        elif batch:
            self._q.put(batch)  # one hand-over, one `copied` event for them
        return ts

    def cancel(self, t: Ticket) -> bool:
        if t.done.is_set() or not self._sched.cancel(t, self._clock()):
            return False
        self._submitted_bytes -= t.nbytes
        return True

    def promote(self, t: Ticket) -> None:
        if not t.done.is_set():
            self._sched.promote(t, self._clock())

    def _settle(self) -> None:
        now, q = self._clock(), self._sched.q
        i = 0
        while i < len(q) and q[i].due <= now and q[i].copied.is_set():
            self._account(q[i])
            i += 1
        if i:
            del q[:i]

    def ready(self, t: Ticket) -> bool:
        if not t.done.is_set():
            self._settle()
        return t.done.is_set()

    def wait(self, t: Ticket) -> float:
        if self.ready(t):
            if t.error is not None:
                raise t.error
            return 0.0
        if self._batch is not None:  # a wait inside a batch: what it holds is handed over first
            self._flush()
            self._batch = []
        t0 = self._clock()
        while (rest := t.due - self._clock()) > 0:
            self._sleep(rest)
        seen = None
        for x in list(self._sched.q):  # the real copies of everything scheduled up to t (worker order differs)
            if x.copied is not seen:  # a handed-over batch's copies share one event: waited once
                seen = x.copied
                seen.wait()
            if x is t:
                break
        if t.error is not None:
            raise t.error
        self._settle()
        if not t.done.is_set():  # unreachable: every transfer scheduled before t is due and copied
            self.drain()
        return self._clock() - t0

    def drain(self) -> None:
        if self._batch:
            self._flush()
            self._batch = []
        q = self._sched.q
        while q:
            last = q[-1]
            while (rest := last.due - self._clock()) > 0:
                self._sleep(rest)
            for ev in {id(t.copied): t.copied for t in q}.values():  # one event per handed-over batch
                ev.wait()
            self._settle()

    def close(self) -> None:
        if self._worker.is_alive():
            self.drain()
            self._q.put(None)
            self._worker.join(timeout=5)
        self._closed = True

    def describe(self) -> str:
        return f"emulated {self.gbps:g} GB/s, {self.latency_s * 1e6:g} us latency"
