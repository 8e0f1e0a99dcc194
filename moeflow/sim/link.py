"""Link models for the simulator: the runtime's `Link` interface without threads, copies or sleeping.

The simulated `ExpertCache` (no store) asks `submit_nbytes(nbytes)` for each transfer of one expert row.

- `InstantLink`: every copy is complete when submitted (the runtime's `DirectLink` on the same accesses).
- `ModelledLink(gbps, latency_s)`: `EmulatedLink`'s schedule on a virtual clock: one FIFO link, a transfer
  submitted at `now` starts at `max(now, end of the previous transfer)` and is due `latency + bytes /
  bandwidth` later; it is ready when `now >= due`; `wait` advances the clock to `due` and returns the stall.
  The simulator advances `now` by the per-layer compute time (`advance`), as compute advances wall time.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..runtime.link import Link, Ticket, parse_link


class InstantLink(Link):
    """Copies complete at submission: no clock, no stall (the cache marks the slot ready at once)."""

    name = "instant"
    instant = True  # ExpertCache: a loaded slot is ready at once

    def __init__(self) -> None:
        super().__init__()
        self._ticket = Ticket(0)
        self._ticket.done.set()
        self.now = 0.0

    def submit_nbytes(self, nbytes: int, *, after: Any = None) -> Ticket:
        self._bytes += nbytes
        self._transfers += 1
        return self._ticket

    def submit(self, src, dst, *, after=None) -> Ticket:
        return self.submit_nbytes(src.numel() * src.element_size())

    def ready(self, t: Ticket) -> bool:
        return True

    def wait(self, t: Ticket) -> float:
        return 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def describe(self) -> str:
        return "instant"


class ModelledLink(Link):
    """`EmulatedLink`'s FIFO schedule (bandwidth + latency per transfer) on a virtual clock `now` (seconds)."""

    name = "modelled"

    def __init__(self, gbps: float, latency_s: float = 0.0):
        super().__init__()
        if gbps <= 0 or latency_s < 0:
            raise ConfigError(f"modelled link needs bandwidth > 0 GB/s and latency >= 0 (got {gbps}, {latency_s})")
        self.gbps, self.latency_s = gbps, latency_s
        self.now = 0.0
        self._free_at = 0.0
        self._inflight: list[Ticket] = []  # FIFO: due times ascending

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / (self.gbps * 1e9)

    def submit_nbytes(self, nbytes: int, *, after: Any = None) -> Ticket:
        t = Ticket(nbytes)
        t.busy_s = self.transfer_s(nbytes)
        t.due = max(self.now, self._free_at) + t.busy_s
        self._free_at = t.due
        self._inflight.append(t)
        return t

    def submit(self, src, dst, *, after=None) -> Ticket:
        return self.submit_nbytes(src.numel() * src.element_size(), after=after)

    def _settle(self) -> None:
        now, fl = self.now, self._inflight
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
        self.now += stall
        return stall

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def drain(self) -> None:
        if self._inflight:
            self.now = max(self.now, self._inflight[-1].due)
            self._settle()

    def describe(self) -> str:
        return f"modelled {self.gbps:g} GB/s, {self.latency_s * 1e6:g} us latency (virtual clock)"


def make_sim_link(spec: str | Link | None) -> Link:
    """`instant` (default) | `emulated:GBPS[,LATENCY_US]` (the `--link` syntax of `moeflow run`) | a Link object."""
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
    return ModelledLink(gbps, lat)
