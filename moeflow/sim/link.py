"""Link models for the simulator: the runtime's `Link` interface without threads, copies or sleeping.

The simulated `ExpertCache` (no store) asks `submit_nbytes(nbytes)` for each transfer of one expert row.

- `InstantLink`: every copy is complete when submitted (the runtime's `DirectLink` on the same accesses).
- `ModelledLink(gbps, latency_s)`: `EmulatedLink`'s schedule on a virtual clock, the same code
  (`moeflow.runtime.link.PrioritySchedule`): one link, a transfer submitted at `now` starts at `max(now, end
  of the previous transfer)` and is due `latency + bytes / bandwidth` later, demand transfers ahead of the
  prefetches not yet started (`cancel`, `promote` as on the emulated link); it is ready when `now >= due`;
  `wait` advances the clock to `due` and returns the stall.
  The simulator advances `now` by the host's time (`advance`: `moeflow.sim.timemodel.TimeModel`), as compute
  advances wall time; `submit_s` is the host's time per demand copy submitted and `prefetch_submit_s` per
  prefetch copy (the clock advances after the copy is scheduled), `wake_s` the lateness of a wait that stalls
  (the emulated link's sleeping thread runs again that long after the copy is due; all measured by
  `moeflow calibrate --link-gbps`, `link_timing`).
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..runtime.link import Link, PrioritySchedule, Ticket, parse_link

SETTLE_AT = 32  # ModelledLink: account the completed transfers once this many are scheduled


class InstantLink(Link):
    """Copies complete at submission: no clock, no stall (the cache marks the slot ready at once)."""

    name = "instant"
    instant = True  # ExpertCache: a loaded slot is ready at once

    def __init__(self) -> None:
        super().__init__()
        self._ticket = Ticket(0)
        self._ticket.done.set()
        self.now = 0.0

    def submit_nbytes(self, nbytes: int, *, after: Any = None, demand: bool = True) -> Ticket:
        self._bytes += nbytes
        self._transfers += 1
        return self._ticket

    def submit(self, src, dst, *, after=None, demand=True) -> Ticket:
        return self.submit_nbytes(src.numel() * src.element_size())

    def clock_s(self) -> float:
        return self.now

    def ready(self, t: Ticket) -> bool:
        return True

    def wait(self, t: Ticket) -> float:
        return 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def describe(self) -> str:
        return "instant"


class ModelledLink(Link):
    """`EmulatedLink`'s schedule (bandwidth + latency per transfer, misses first) on a virtual clock `now` (seconds)."""

    name = "modelled"

    def __init__(
        self,
        gbps: float,
        latency_s: float = 0.0,
        *,
        submit_s: float = 0.0,
        wake_s: float = 0.0,
        prefetch_submit_s: float | None = None,
    ):
        super().__init__()
        if gbps <= 0 or latency_s < 0:
            raise ConfigError(f"modelled link needs bandwidth > 0 GB/s and latency >= 0 (got {gbps}, {latency_s})")
        pf_submit = submit_s if prefetch_submit_s is None else prefetch_submit_s
        if min(submit_s, wake_s, pf_submit) < 0:
            raise ConfigError(f"modelled link needs submit and wake seconds >= 0 (got {submit_s}, {pf_submit}, {wake_s})")
        self.gbps, self.latency_s = gbps, latency_s
        self.submit_s, self.wake_s, self.prefetch_submit_s = submit_s, wake_s, pf_submit
        self.now = 0.0
        self._sched = PrioritySchedule()  # transfers not yet accounted, in schedule order

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / (self.gbps * 1e9)

    def transfer_estimate_s(self, nbytes: int) -> float | None:
        return self.transfer_s(nbytes)

    def backlog_s(self) -> float:
        return self._sched.backlog_s(self.now)

    def clock_s(self) -> float:
        return self.now

    def submit_nbytes(self, nbytes: int, *, after: Any = None, demand: bool = True) -> Ticket:
        t = self._submitted(Ticket(nbytes))
        t.busy_s = self.transfer_s(nbytes)
        q = self._sched.q
        if len(q) >= SETTLE_AT and q[0].due <= self.now:
            self._settle()  # keep the schedule short (the counters read settle anyway: nothing else changes)
        self._sched.add(t, self.now, demand=demand)
        self.now += self.submit_s if demand else self.prefetch_submit_s
        return t

    def submit(self, src, dst, *, after=None, demand=True) -> Ticket:
        return self.submit_nbytes(src.numel() * src.element_size(), after=after, demand=demand)

    def cancel(self, t: Ticket) -> bool:
        if t.done.is_set() or not self._sched.cancel(t, self.now):
            return False
        self._submitted_bytes -= t.nbytes
        return True

    def promote(self, t: Ticket) -> None:
        if not t.done.is_set():
            self._sched.promote(t, self.now)

    def _settle(self) -> None:
        now, fl = self.now, self._sched.q
        i = 0
        while i < len(fl) and fl[i].due <= now:
            t = fl[i]
            self._busy_s += t.busy_s
            self._bytes += t.nbytes
            self._transfers += 1
            t.done.set()
            i += 1
        if i:
            del fl[:i]

    def ready(self, t: Ticket) -> bool:
        return t.due <= self.now

    def wait(self, t: Ticket) -> float:
        stall = max(0.0, t.due - self.now)
        if stall > 0:
            stall += self.wake_s
        self.now += stall
        return stall

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def drain(self) -> None:
        if self._sched.q:
            self.now = max(self.now, self._sched.q[-1].due)
            self._settle()

    def describe(self) -> str:
        return f"modelled {self.gbps:g} GB/s, {self.latency_s * 1e6:g} us latency, misses first (virtual clock)"


def make_sim_link(
    spec: str | Link | None, *, submit_s: float = 0.0, wake_s: float = 0.0, prefetch_submit_s: float | None = None
) -> Link:
    """`instant` (default) | `emulated:GBPS[,LATENCY_US]` (the `--link` syntax of `moeflow run`; `submit_s`,
    `wake_s`, `prefetch_submit_s`: `ModelledLink`'s host terms) | a Link object (as it is)."""
    if spec is None:
        return InstantLink()
    if isinstance(spec, Link):
        return spec
    s = spec.strip().lower()
    if s in ("instant", "direct"):
        return InstantLink()
    kind, gbps, lat = parse_link(s)
    if kind != "emulated":
        raise ConfigError(f"simulator --link {spec!r}: use instant or emulated:GBPS[,LATENCY_US]")
    return ModelledLink(gbps, lat, submit_s=submit_s, wake_s=wake_s, prefetch_submit_s=prefetch_submit_s)
