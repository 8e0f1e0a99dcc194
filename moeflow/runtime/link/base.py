"""Transfer links: how one expert row moves from the host store into a device cache slot.

- `DirectLink`: copy on the calling thread, now (no emulation; on CPU this is a memcpy).
- `EmulatedLink(gbps, latency_s)`: each transfer takes `latency + bytes / bandwidth` of wall time on a
  virtual schedule (one link, `PrioritySchedule`), while a worker thread does the real copy concurrently
  with compute on the main thread, so overlap, stalls and waiting are real wall time.
- `CudaLink`: side CUDA streams, pinned host rows, non-blocking copies, one event per copy (the transfers of
  adjacent rows handed over together share one copy: `adjacent_runs`); the compute stream waits on the slot's
  event, and a copy into a slot waits (on the GPU) for the event recorded after the last computation that read
  that slot.

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
`transfer_estimate_s(nbytes)` (one transfer: the link's bandwidth model, or on CUDA the fit of its completed copies as
latency + bytes x seconds per byte; None where copies are synchronous), `bulk_s(nbytes)` (the bytes alone, as moved in
long copies: the TTFT bound's), `backlog_s()` (link seconds still queued) and `clock_s()` are what the prefetch gate
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
import itertools
import time
from collections.abc import Iterable
from typing import Any

import torch


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


class Ticket:
    """One transfer: what the link knows of it (a plain class with slots: one is made per copy)."""

    __slots__ = (
        *("busy_s", "cancelled", "copied", "demand", "done", "due", "error", "event", "nbytes", "share", "start"),
        "start_event",
    )

    def __init__(
        self,
        nbytes: int,
        done: Flag | None = None,
        event: Any = None,  # CUDA event (CudaLink)
        start_event: Any = None,
        busy_s: float = 0.0,  # link time this transfer took, once known
        error: BaseException | None = None,
        due: float = 0.0,  # EmulatedLink: perf_counter time at which the transfer completes
        copied: Any = None,  # EmulatedLink: set when the worker's real copy is done (one event per handed-over batch)
        start: float = 0.0,  # scheduled links: when the transfer starts on the link
        demand: bool = True,  # a demand load (False: a prefetch, which demand loads overtake while queued)
        cancelled: bool = False,  # withdrawn before it started (`Link.cancel`)
    ):
        self.nbytes = nbytes
        self.done = Flag() if done is None else done
        self.event, self.start_event = event, start_event
        self.busy_s, self.error, self.due, self.copied = busy_s, error, due, copied
        self.start, self.demand, self.cancelled = start, demand, cancelled
        self.share = 1.0  # CudaLink: this transfer's part of the bytes of the one copy that moved it with others

    def __repr__(self) -> str:
        return f"Ticket(nbytes={self.nbytes}, start={self.start}, due={self.due}, demand={self.demand})"


def continues(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`b` starts where `a` ends, in the same storage (both contiguous, one dtype, one device): one copy can move
    both (expert rows of one layer of the host store into consecutive slot rows of the device buffer)."""
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.is_contiguous()
        and b.is_contiguous()
        and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def run_length(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], max_bytes: float) -> int:
    """How many of `pairs` (src, dst), from the first, one copy moves: each source continuing the previous source
    and each destination the previous destination (`continues`), at most `max_bytes` of source (the first pair
    always, however long). Stops reading `pairs` at the first that does not join."""
    n, size, prev = 0, 0, None
    for src, dst in pairs:
        nbytes = src.numel() * src.element_size()
        if prev is not None and (size + nbytes > max_bytes or not (continues(prev[0], src) and continues(prev[1], dst))):
            break
        n, size, prev = n + 1, size + nbytes, (src, dst)
    return n


def adjacent_runs(pairs: list[tuple[torch.Tensor, torch.Tensor]], max_bytes: int) -> list[list[int]]:
    """The indices of `pairs` (src, dst), in order, cut into the runs `run_length` takes: what one copy per run
    moves."""
    runs: list[list[int]] = []
    i = 0
    while i < len(pairs):
        n = run_length(itertools.islice(pairs, i, None), max_bytes)
        runs.append(list(range(i, i + n)))
        i += n
    return runs


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D view over tensors each of which `continues` the previous one (no copy)."""
    if len(parts) == 1:
        return parts[0]
    return parts[0].as_strided((sum(p.numel() for p in parts),), (1,))


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

    def bulk_s(self, nbytes: int) -> float | None:
        """Link seconds of `nbytes` moved as part of long copies: the bandwidth alone, without a copy's fixed cost
        (the TTFT bound's copies). A link that moves every transfer apart: `transfer_estimate_s`."""
        return self.transfer_estimate_s(nbytes)

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
