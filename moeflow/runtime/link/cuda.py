"""`CudaLink`: copies from pinned host rows on side CUDA streams, prefetches held on the host within a window,
adjacent rows handed over together moved as one copy."""

from __future__ import annotations

import time
from typing import Any

import torch

from ...errors import ConfigError
from .base import Link, Ticket, adjacent_runs, joined, run_length

RUN_BYTES = 8 << 20  # at most this much in one copy of adjacent rows (an expert row alone may be longer)


class CopyFit:
    """Seconds of one copy of n bytes, fitted over the completed copies as latency + n x seconds per byte (least
    squares). A copy that moved several transfers counts once: each of its tickets adds it with its share of the
    bytes as the weight (the shares of one copy sum to 1)."""

    __slots__ = ("sx", "sxx", "sxy", "sy", "w")

    def __init__(self) -> None:
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, nbytes: float, seconds: float, weight: float = 1.0) -> None:
        """One copy of `nbytes` that took `seconds` (`weight`: the part of it one ticket stands for)."""
        self.w += weight
        self.sx += weight * nbytes
        self.sy += weight * seconds
        self.sxx += weight * nbytes * nbytes
        self.sxy += weight * nbytes * seconds

    def fit(self) -> tuple[float, float] | None:
        """(latency seconds, seconds per byte); None before the first copy. Copies of one size only, or sizes whose
        fit has no positive slope: no latency and the mean seconds per byte; a negative latency: the line through
        the origin."""
        if self.w <= 0.0 or self.sx <= 0.0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx  # spread of the copy sizes, bytes^2
        if var > 1e-6 * mx * mx:
            b = (self.sxy / self.w - mx * my) / var
            if b > 0.0:
                a = my - b * mx
                return (a, b) if a >= 0.0 else (0.0, self.sxy / self.sxx)
        return 0.0, self.sy / self.sx


class CudaLink(Link):
    """Copies from pinned host rows on side streams; per-copy events order compute after copies.

    A GPU's copy engines run the copies queued on them in order whatever the streams' priorities, so a demand
    copy submitted behind many prefetches would wait for all of them. Prefetches are therefore held on the host
    and handed to the copy stream only while the copies already in flight are under `window_s` of link time
    (at least one); a demand copy goes to its own stream at once and waits behind at most that window. A held
    prefetch that becomes needed (`promote`, `wait`) is issued as a demand copy, and one withdrawn before it was
    issued (`cancel`) never moves.

    Each copy costs the host several CUDA calls (events, stream switch, the copy itself): tens of microseconds
    on a busy host, which a prefill of many small experts pays per expert. Transfers handed over together
    (`submit_many`: a cache batch, e.g. a staged prefill's layer, whose keys ascend with their slots) and held
    prefetches issued one after another move as ONE copy per run of adjacent rows (`adjacent_runs`, at most
    `run_bytes`), its events shared, each transfer's link time its share of the run's bytes.

    The link's model is fitted over its completed copies (`CopyFit`): a copy of n bytes takes latency + n x seconds
    per byte. `transfer_estimate_s(n)` is one copy of n bytes (the prefetch gate's and `auto`'s cost of moving one
    expert), `bulk_s(n)` the bytes alone (copies in long runs: the staged prefill's TTFT bound); the prefetch window
    and `backlog_s` count the bytes and each copy's latency once (a held prefetch as a copy of its own). A mean over
    the bytes of runs and single copies alike read fast for one expert's copy, by the fixed cost the runs spread
    over their rows.
    """

    name = "cuda"

    def __init__(self, device: torch.device, window_s: float = 2e-3, run_bytes: int = RUN_BYTES):
        super().__init__()
        if not torch.cuda.is_available():
            raise ConfigError("--link cuda needs a CUDA device; use --link emulated:GBPS on CPU")
        self.device = device
        self.window_s = window_s
        self.run_bytes = run_bytes  # one copy moves adjacent rows up to this many bytes together
        self.stream = torch.cuda.Stream(device=device)  # prefetch copies
        self.demand_stream = torch.cuda.Stream(device=device, priority=-1)  # demand copies
        self._pending: list[Ticket] = []  # issued, not yet accounted
        self._held: list[tuple[Ticket, torch.Tensor, torch.Tensor, Any]] = []  # prefetches not issued yet
        self._inflight: list[Ticket] = []  # issued prefetches not seen complete
        self._fit = CopyFit()  # latency + bytes x seconds per byte of the completed copies

    def transfer_estimate_s(self, nbytes: int) -> float | None:
        """Seconds of one copy of `nbytes`: the fitted latency + nbytes x seconds per byte (None before the first
        copy completed)."""
        f = self._fit.fit()
        return None if f is None else f[0] + nbytes * f[1]

    def bulk_s(self, nbytes: int) -> float | None:
        """Seconds of `nbytes` moved in long copies: the fitted seconds per byte alone (None before the first copy)."""
        f = self._speed()
        return None if f is None else nbytes * f[1]

    def _speed(self) -> tuple[float, float] | None:
        """(latency s, seconds per byte) of the copies so far; None before the first one, or while every copy
        measured took no time (nothing to scale the window by)."""
        f = self._fit.fit()
        return f if f is not None and f[1] > 0.0 else None

    @staticmethod
    def _copies_s(speed: tuple[float, float], ts: Any) -> float:
        """Link seconds of the transfers `ts`: their bytes, and the latency once per copy (transfers sharing a copy's
        event count it once; one not issued yet, `event` None, counts it alone)."""
        a, per = speed
        seen: set[int] = set()
        copies = nbytes = 0
        for t in ts:
            nbytes += t.nbytes
            if t.event is None or id(t.event) not in seen:
                copies += 1
                if t.event is not None:
                    seen.add(id(t.event))
        return copies * a + nbytes * per

    def backlog_s(self) -> float:
        f = self._speed()
        if f is None:
            return 0.0
        issued = [t for t in self._pending if not t.done.is_set() and not t.event.query()]
        return self._copies_s(f, issued) + self._copies_s(f, [h[0] for h in self._held])

    def _issue(self, t: Ticket, src, dst, after, demand: bool) -> None:
        self._issue_run([t], src, dst, [after], demand)

    def _issue_run(self, ts: list[Ticket], src, dst, afters: list[Any], demand: bool) -> None:
        """ONE copy `src -> dst` moving the transfers `ts` (adjacent rows, `joined`), after every marker in
        `afters` (the last computation reading each slot); its two events shared by `ts`."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = self.demand_stream if demand else self.stream
        with torch.cuda.stream(stream):
            waited: list[Any] = []
            for after in afters:
                if after is not None and not any(after is w for w in waited):
                    stream.wait_event(after)  # the last computation reading this slot is done
                    waited.append(after)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        if len(self._pending) > 1024:
            self._account_done()
        total = sum(t.nbytes for t in ts) or 1
        for t in ts:
            t.start_event, t.event, t.share = start, end, t.nbytes / total
            self._pending.append(t)
            if not demand:
                self._inflight.append(t)

    def _pump(self) -> None:
        """Hand held prefetches to the copy stream while the prefetches in flight are under the window."""
        if not self._held:
            return
        self._inflight = [t for t in self._inflight if not t.event.query()]
        f = self._speed()
        while self._held:
            if f is None:
                if len(self._inflight) >= 2:
                    break
                self._issue_held_run()
                continue
            inflight = self._copies_s(f, self._inflight)  # link seconds in flight, each copy's latency once
            if self._inflight and inflight >= self.window_s:
                break
            self._issue_held_run((self.window_s - inflight - f[0]) / f[1])  # bytes of room after the next copy's latency

    def _issue_held_run(self, room: float | None = None) -> None:
        """Issue the first held prefetch with the held ones right after it that continue its rows (one copy), at
        most `run_bytes` and (`room`) what the prefetch window has room for: a run never carries the window past
        what one prefetch at a time would."""
        held = self._held
        n = run_length(((h[1], h[2]) for h in held), self.run_bytes if room is None else min(self.run_bytes, room))
        run, held[:n] = held[:n], []
        self._issue_run([h[0] for h in run], joined([h[1] for h in run]), joined([h[2] for h in run]), [h[3] for h in run], False)

    def _take_held(self, t: Ticket) -> tuple[Ticket, torch.Tensor, torch.Tensor, Any] | None:
        for i, h in enumerate(self._held):
            if h[0] is t:
                return self._held.pop(i)
        return None

    def submit_many(self, items: list[tuple[torch.Tensor, torch.Tensor, Any]], *, demand: bool = True) -> list[Ticket]:
        """`submit` of each `(src, dst, after)`, in order; demand copies of adjacent rows go out as one copy per run
        (`adjacent_runs`), prefetches are held (and issued in runs by `_pump`)."""
        ts = []
        for src, _, _ in items:
            t = self._submitted(Ticket(src.numel() * src.element_size()))
            t.demand = demand
            ts.append(t)
        if demand:
            for run in adjacent_runs([(src, dst) for src, dst, _ in items], self.run_bytes):
                srcs, dsts = joined([items[i][0] for i in run]), joined([items[i][1] for i in run])
                self._issue_run([ts[i] for i in run], srcs, dsts, [items[i][2] for i in run], demand=True)
        else:
            self._held.extend((t, src, dst, after) for t, (src, dst, after) in zip(ts, items))
        self._pump()
        return ts

    def submit(self, src, dst, *, after=None, demand=True) -> Ticket:
        return self.submit_many([(src, dst, after)], demand=demand)[0]

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
        copy_s = t.start_event.elapsed_time(t.event) / 1e3  # the whole copy's, shared by its tickets
        t.busy_s = copy_s * t.share  # its part of a shared copy
        if t.share > 0.0:
            self._fit.add(t.nbytes / t.share, copy_s, t.share)
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
            self._issue_held_run()
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
