"""Transfer links: how one expert row moves from the host store into a device cache slot.

- `DirectLink`: copy on the calling thread, now (no emulation; on CPU this is a memcpy).
- `EmulatedLink(gbps, latency_s)`: each transfer takes `latency + bytes / bandwidth` of wall time on a
  virtual schedule (one link, `PrioritySchedule`), while a worker thread does the real copy concurrently
  with compute on the main thread, so overlap, stalls and waiting are real wall time.
- `CudaLink`: side CUDA streams, pinned host rows, non-blocking copies, one event per transfer;
  the compute stream waits on the slot's event, and a copy into a slot waits (on the GPU) for the
  event recorded after the last computation that read that slot.

Misses first (ExpertFlow 3.4: cache-miss resolution has the highest priority in the memory queue):
`submit(..., demand=True)` is a demand load, `demand=False` a prefetch. On the emulated link (and the
simulator's `ModelledLink`, the same `PrioritySchedule`) a demand transfer is scheduled after the transfer in
progress and after earlier queued demand transfers, ahead of every prefetch not yet started; those are
rescheduled after it (a started transfer is never preempted). `cancel(ticket)` removes a prefetch that has
not started (False once started), `promote(ticket)` turns a queued prefetch into a demand transfer (a
routed expert whose prefetch is still queued). On `CudaLink` demand copies go on their own high-priority
stream, so they never queue behind prefetch copies already enqueued on the prefetch stream (the copy
engines may still share bandwidth with a running prefetch copy); a copy enqueued on a CUDA stream cannot
be withdrawn, so `cancel` returns False there.
`transfer_estimate_s(nbytes)` (the link's bandwidth model, or the measured mean on CUDA; None where copies
are synchronous), `backlog_s()` (link seconds still queued) and `clock_s()` are what the prefetch gate
(`moeflow.policies.prefetch.PrefetchGate`) reads.

Every link returns a `Ticket` from `submit`; `wait(ticket)` blocks until the slot may be read and
returns the seconds the caller waited (stall). Accounting is the base class's, one code path for every
link: `_submitted(ticket)` at submit (`submitted_bytes`), `_account(ticket)` once per transfer when it is
known complete (`busy_s`, `bytes`, `transfers`); `_settle()` accounts whatever completed since (the
emulated schedule, CUDA events queried), so after `drain()` `bytes == submitted_bytes`, which is the
cache's `bytes_moved` (every copy the cache issues goes through `submit`).
"""

from __future__ import annotations

import contextlib
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError


class Flag:
    """`Ticket.done`: a completion mark set and read on the thread that accounts transfers (`threading.Event`'s
    `set` / `is_set` without its lock: one is made per copy)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


@dataclass
class Ticket:
    nbytes: int
    done: Flag = field(default_factory=Flag)
    event: Any = None  # CUDA event (CudaLink)
    start_event: Any = None
    busy_s: float = 0.0  # link time this transfer took, once known
    error: BaseException | None = None
    due: float = 0.0  # EmulatedLink: perf_counter time at which the transfer completes
    copied: Any = None  # EmulatedLink: set when the worker's real copy is done (one event per handed-over batch)
    start: float = 0.0  # scheduled links: when the transfer starts on the link
    demand: bool = True  # a demand load (False: a prefetch, which demand loads overtake while queued)
    cancelled: bool = False  # withdrawn before it started (`Link.cancel`)


class PrioritySchedule:
    """One link's virtual schedule with demand priority: `EmulatedLink` and the simulator's `ModelledLink`.

    `q` holds the transfers not yet accounted, in schedule order (start and due ascending). Invariant: the
    transfers not started at `now` (`start > now`) are all queued demand transfers, then all queued prefetches.
    A demand transfer goes after the started ones and the queued demand ones; the queued prefetches behind
    it are rescheduled back-to-back after it. A started transfer (`start <= now`) is never moved.
    """

    __slots__ = ("q",)

    def __init__(self) -> None:
        self.q: list[Ticket] = []

    def free_at(self, now: float) -> float:
        """When the link is free of everything scheduled (`now` when idle)."""
        return max(now, self.q[-1].due) if self.q else now

    def backlog_s(self, now: float) -> float:
        return max(0.0, self.free_at(now) - now)

    def _reflow(self, i: int, now: float) -> None:
        q = self.q
        prev = q[i - 1].due if i > 0 else now
        for j in range(i, len(q)):
            t = q[j]
            t.start = start = prev if prev > now else now  # max(now, prev)
            t.due = prev = start + t.busy_s

    def add(self, t: Ticket, now: float, *, demand: bool) -> None:
        q = self.q
        t.demand = demand
        i = len(q)
        if demand:  # ahead of every queued (not started) prefetch
            while i > 0 and not q[i - 1].demand and q[i - 1].start > now:
                i -= 1
        q.insert(i, t)
        self._reflow(i, now)

    def add_many(self, ts: list[Ticket], now: float, *, demand: bool) -> None:
        """`add` of each of `ts`, in order, at `now`: the same schedule with one reflow (a demand block goes
        where its first one would, the next ones right behind it; prefetches at the end, in order)."""
        q = self.q
        i = len(q)
        if demand:  # ahead of every queued (not started) prefetch
            while i > 0 and not q[i - 1].demand and q[i - 1].start > now:
                i -= 1
        for t in ts:
            t.demand = demand
        q[i:i] = ts
        self._reflow(i, now)

    def _index(self, t: Ticket) -> int:
        for i, x in enumerate(self.q):
            if x is t:
                return i
        return -1

    def cancel(self, t: Ticket, now: float) -> bool:
        """Withdraw `t` if it has not started; the transfers behind it move up."""
        i = self._index(t)
        if i < 0 or t.start <= now:
            return False
        del self.q[i]
        t.cancelled = True
        self._reflow(i, now)
        return True

    def promote(self, t: Ticket, now: float) -> bool:
        """A queued prefetch becomes a demand transfer (moves ahead of the other queued prefetches)."""
        if t.demand or t.start <= now:
            return False
        i = self._index(t)
        if i < 0:
            return False
        del self.q[i]
        self._reflow(i, now)
        self.add(t, now, demand=True)
        return True


class Link:
    """Base: counters shared by all links."""

    name = "link"
    instant = False  # True: every copy is complete at submit (the simulator's `InstantLink`)

    def __init__(self) -> None:
        self._busy_s = 0.0  # seconds the link spent on completed transfers
        self._bytes = 0  # bytes of completed transfers
        self._transfers = 0
        self._submitted_bytes = 0  # bytes of every transfer submitted (complete or not)

    def _submitted(self, t: Ticket) -> Ticket:
        self._submitted_bytes += t.nbytes
        return t

    def _account(self, t: Ticket) -> None:
        """Count a completed transfer exactly once (busy seconds, bytes) and mark it done."""
        if t.done.is_set():
            return
        self._busy_s += t.busy_s
        self._bytes += t.nbytes
        self._transfers += 1
        t.done.set()

    def _settle(self) -> None:
        """Account transfers that have completed by now (links that learn completion lazily)."""

    @property
    def busy_s(self) -> float:
        self._settle()
        return self._busy_s

    @property
    def bytes(self) -> int:
        self._settle()
        return self._bytes

    @property
    def transfers(self) -> int:
        self._settle()
        return self._transfers

    @property
    def submitted_bytes(self) -> int:
        """Bytes of every transfer submitted so far, complete or still in flight."""
        return self._submitted_bytes

    def submit(self, src: torch.Tensor, dst: torch.Tensor, *, after: Any = None, demand: bool = True) -> Ticket:
        """Start a copy; `demand=False` marks a prefetch (demand transfers go first where the link can)."""
        raise NotImplementedError

    def cancel(self, t: Ticket) -> bool:
        """Withdraw a transfer that has not started; True when withdrawn (its bytes are not counted)."""
        return False

    def promote(self, t: Ticket) -> None:
        """A prefetch that is now needed by the running layer: give it demand priority where possible."""

    def transfer_estimate_s(self, nbytes: int) -> float | None:
        """Link seconds one transfer of `nbytes` takes (None: unknown, or copies are synchronous)."""
        return None

    def backlog_s(self) -> float:
        """Link seconds of work submitted and not yet complete (estimated where not modelled)."""
        return 0.0

    def clock_s(self) -> float:
        """The link's clock (seconds): wall time, or the simulator's virtual clock."""
        return time.perf_counter()

    def ready(self, t: Ticket) -> bool:
        return t.done.is_set()

    def wait(self, t: Ticket) -> float:
        raise NotImplementedError

    def record_use(self) -> Any:
        """A marker placed after a computation that read slots; `submit(after=...)` orders a copy behind it."""
        return None

    def submit_many(self, items: list[tuple[torch.Tensor, torch.Tensor, Any]], *, demand: bool = True) -> list[Ticket]:
        """`submit(src, dst, after=after, demand=demand)` for each `(src, dst, after)` of `items`, in order."""
        return [self.submit(src, dst, after=after, demand=demand) for src, dst, after in items]

    def batch(self) -> contextlib.AbstractContextManager[Any]:
        """Copies submitted inside `with link.batch():` are handed to the copying thread together at its end (one
        wake-up for a staged batch, `runtime/prefill.py`); their schedule is the same as one by one."""
        return contextlib.nullcontext()

    def drain(self) -> None:
        """Block until every submitted transfer is complete."""

    def close(self) -> None:
        self.drain()

    def describe(self) -> str:
        return self.name


class DirectLink(Link):
    name = "direct"
    instant = True  # `copy_` returns when the copy is done: complete at submit

    def submit(self, src, dst, *, after=None, demand=True) -> Ticket:
        t0 = time.perf_counter()
        dst.copy_(src)
        t = self._submitted(Ticket(src.numel() * src.element_size()))
        t.busy_s = time.perf_counter() - t0
        self._account(t)
        return t

    def wait(self, t: Ticket) -> float:
        return 0.0

    def clock_s(self) -> float:
        return 0.0


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
        for src, _, _ in items:
            t = self._submitted(Ticket(src.numel() * src.element_size()))
            t.busy_s = self.transfer_s(t.nbytes)
            ts.append(t)
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
        for x in list(self._sched.q):  # the real copies of everything scheduled up to t (worker order differs)
            x.copied.wait()
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
            for t in list(q):
                t.copied.wait()
            self._settle()

    def close(self) -> None:
        if self._worker.is_alive():
            self.drain()
            self._q.put(None)
            self._worker.join(timeout=5)
        self._closed = True

    def describe(self) -> str:
        return f"emulated {self.gbps:g} GB/s, {self.latency_s * 1e6:g} us latency"


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


_EMU = re.compile(r"^emulated:(?P<gbps>[0-9.eE+-]+)(?:,(?P<lat>[0-9.eE+-]+))?$")


def parse_link(spec: str) -> tuple[str, float, float]:
    """`cuda` | `direct` | `emulated:GBPS[,LATENCY_US]` -> (kind, gbps, latency_s)."""
    s = spec.strip().lower()
    if s in ("cuda", "direct", "auto"):
        return s, 0.0, 0.0
    m = _EMU.match(s)
    if not m:
        raise ConfigError(f"--link {spec!r} not understood; use cuda, direct or emulated:GBPS[,LATENCY_US] (e.g. emulated:2,10)")
    try:
        gbps = float(m["gbps"])
        lat = float(m["lat"]) * 1e-6 if m["lat"] else 0.0
    except ValueError as e:
        raise ConfigError(f"--link {spec!r}: {e}") from e
    if gbps <= 0 or lat < 0:
        raise ConfigError(f"--link {spec!r}: bandwidth must be > 0 GB/s and latency >= 0 us")
    return "emulated", gbps, lat


def make_link(spec: str, device: torch.device) -> Link:
    kind, gbps, lat = parse_link(spec)
    if kind == "auto":
        kind = "cuda" if device.type == "cuda" else "direct"
    if kind == "cuda":
        if device.type != "cuda":
            raise ConfigError("--link cuda needs --device cuda; on CPU use --link emulated:GBPS[,LATENCY_US]")
        return CudaLink(device)
    if kind == "direct":
        return DirectLink()
    return EmulatedLink(gbps, lat)
