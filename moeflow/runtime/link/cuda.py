"""`CudaLink`: copies from pinned host rows on side CUDA streams, prefetches held on the host within a window."""

from __future__ import annotations

import time
from typing import Any

import torch

from ...errors import ConfigError
from .base import Link, Ticket


class CudaLink(Link):
    """Copies from pinned host rows on side streams; per-transfer events order compute after copies.

    A GPU's copy engines run the copies queued on them in order whatever the streams' priorities, so a demand
    copy submitted behind many prefetches would wait for all of them. Prefetches are therefore held on the host
    and handed to the copy stream only while the copies already in flight are under `window_s` of link time
    (at least one); a demand copy goes to its own stream at once and waits behind at most that window. A held
    prefetch that becomes needed (`promote`, `wait`) is issued as a demand copy, and one withdrawn before it was
    issued (`cancel`) never moves.
    """

    name = "cuda"

    def __init__(self, device: torch.device, window_s: float = 2e-3):
        super().__init__()
        if not torch.cuda.is_available():
            raise ConfigError("--link cuda needs a CUDA device; use --link emulated:GBPS on CPU")
        self.device = device
        self.window_s = window_s
        self.stream = torch.cuda.Stream(device=device)  # prefetch copies
        self.demand_stream = torch.cuda.Stream(device=device, priority=-1)  # demand copies
        self._pending: list[Ticket] = []  # issued, not yet accounted
        self._held: list[tuple[Ticket, torch.Tensor, torch.Tensor, Any]] = []  # prefetches not issued yet
        self._inflight: list[Ticket] = []  # issued prefetches not seen complete

    def transfer_estimate_s(self, nbytes: int) -> float | None:
        """Mean measured seconds per byte of completed copies x nbytes (None before the first one)."""
        return nbytes * self._busy_s / self._bytes if self._bytes else None

    def backlog_s(self) -> float:
        per = self.transfer_estimate_s(1)
        if per is None:
            return 0.0
        issued = sum(t.nbytes for t in self._pending if not t.done.is_set() and not t.event.query())
        return per * (issued + sum(h[0].nbytes for h in self._held))

    def _issue(self, t: Ticket, src, dst, after, demand: bool) -> None:
        t.start_event = torch.cuda.Event(enable_timing=True)
        t.event = torch.cuda.Event(enable_timing=True)
        stream = self.demand_stream if demand else self.stream
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)  # the last computation reading this slot is done
            t.start_event.record(stream)
            dst.copy_(src, non_blocking=True)
            t.event.record(stream)
        if len(self._pending) > 1024:
            self._account_done()
        self._pending.append(t)
        if not demand:
            self._inflight.append(t)

    def _pump(self) -> None:
        """Hand held prefetches to the copy stream while the prefetches in flight are under the window."""
        if not self._held:
            return
        self._inflight = [t for t in self._inflight if not t.event.query()]
        per = self.transfer_estimate_s(1)
        while self._held:
            if per is None:
                if len(self._inflight) >= 2:
                    break
            elif self._inflight and per * sum(t.nbytes for t in self._inflight) >= self.window_s:
                break
            t, src, dst, after = self._held.pop(0)
            self._issue(t, src, dst, after, demand=False)

    def _take_held(self, t: Ticket) -> tuple[Ticket, torch.Tensor, torch.Tensor, Any] | None:
        for i, h in enumerate(self._held):
            if h[0] is t:
                return self._held.pop(i)
        return None

    def submit(self, src, dst, *, after=None, demand=True) -> Ticket:
        t = self._submitted(Ticket(src.numel() * src.element_size()))
        t.demand = demand
        if demand:
            self._issue(t, src, dst, after, demand=True)
        else:
            self._held.append((t, src, dst, after))
        self._pump()
        return t

    def cancel(self, t: Ticket) -> bool:
        if self._take_held(t) is None:
            return False
        t.cancelled = True
        self._submitted_bytes -= t.nbytes
        return True

    def promote(self, t: Ticket) -> None:
        """A held prefetch goes out now as a demand copy; an issued one cannot move (compute waits on its event)."""
        h = self._take_held(t)
        if h is not None:
            t.demand = True
            self._issue(t, h[1], h[2], h[3], demand=True)

    def ready(self, t: Ticket) -> bool:
        self._pump()
        if t.event is None:
            return False
        if not t.done.is_set() and t.event.query():
            self._complete(t)
        return t.done.is_set()

    def _complete(self, t: Ticket) -> None:
        if t.done.is_set():
            return
        t.busy_s = t.start_event.elapsed_time(t.event) / 1e3
        self._account(t)

    def _account_done(self) -> None:
        """Account every pending copy whose event has fired, waited for or not, and drop it from `_pending`."""
        if self._pending:
            for t in self._pending:
                if t.event.query():
                    self._complete(t)
            self._pending = [p for p in self._pending if not p.done.is_set()]

    def _settle(self) -> None:
        """`_account_done` (so `bytes` includes prefetches that completed unobserved), then issue the held
        prefetches the window has room for."""
        self._account_done()
        self._pump()

    def wait(self, t: Ticket) -> float:
        self.promote(t)  # still held: needed now
        stall = 0.0
        if not t.event.query():
            t0 = time.perf_counter()
            t.event.synchronize()
            stall = time.perf_counter() - t0
        torch.cuda.current_stream(self.device).wait_event(t.event)
        self._complete(t)  # stays in `_pending` (done) until `_settle` or `submit` prunes it: no list rebuilt per wait
        self._pump()
        return stall

    def record_use(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def drain(self) -> None:
        while self._held:
            t, src, dst, after = self._held.pop(0)
            self._issue(t, src, dst, after, demand=False)
        for t in self._pending:
            t.event.synchronize()
            self._complete(t)
        self._pending.clear()
        self._inflight.clear()

    def describe(self) -> str:
        return (
            f"cuda side streams on {self.device} (demand copies on their own stream; prefetches issued "
            f"{self.window_s * 1e3:g} ms of link time ahead)"
        )
