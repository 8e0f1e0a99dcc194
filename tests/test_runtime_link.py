"""Transfer links: the emulated link's virtual FIFO schedule (latency + bytes / bandwidth per transfer,
one at a time, overlapping with work on the calling thread), checked exactly on a fake clock."""

from __future__ import annotations

import time

import pytest
import torch

from moeflow.errors import ConfigError
from moeflow.runtime.link import DirectLink, EmulatedLink, make_link, parse_link


def _bufs(n: int, numel: int):
    src = [torch.full((numel,), float(i)) for i in range(n)]
    dst = [torch.zeros(numel) for _ in range(n)]
    return src, dst


class FakeClock:
    """A virtual clock: `sleep(dt)` advances it by dt at once; `advance(dt)` stands for compute."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        assert dt > 0
        self.now += dt

    advance = sleep


def _link(clock: FakeClock, gbps: float, latency_s: float = 0.0) -> EmulatedLink:
    return EmulatedLink(gbps=gbps, latency_s=latency_s, clock=clock, sleep=clock.sleep)


def test_emulated_link_takes_bytes_over_bandwidth():
    clock = FakeClock()
    link = _link(clock, gbps=0.2)  # 0.2 GB/s
    src, dst = _bufs(4, 1_000_000)  # 4 MB each -> 20 ms each, 80 ms serialised
    tickets = [link.submit(s, d) for s, d in zip(src, dst)]
    assert [t.due for t in tickets] == pytest.approx([0.020, 0.040, 0.060, 0.080])
    stalls = [link.wait(t) for t in tickets]
    assert stalls == pytest.approx([0.020, 0.020, 0.020, 0.020])
    assert clock.now == pytest.approx(0.080)
    link.close()
    assert all(torch.equal(s, d) for s, d in zip(src, dst))
    assert link.bytes == 16_000_000 and link.transfers == 4
    assert link.busy_s == pytest.approx(0.080)


def test_emulated_link_latency_and_fifo():
    clock = FakeClock()
    link = _link(clock, gbps=100.0, latency_s=0.005)
    src, dst = _bufs(10, 16)  # 64 B each: 5 ms + 0.64 ns
    tickets = [link.submit(s, d) for s, d in zip(src, dst)]
    one = 0.005 + 64 / 100e9
    assert [t.due for t in tickets] == pytest.approx([one * (i + 1) for i in range(10)], rel=1e-12)
    done_at = []
    for t in tickets:
        link.wait(t)
        done_at.append(clock.now)
    link.close()
    assert done_at == pytest.approx([one * (i + 1) for i in range(10)], rel=1e-12)  # one at a time, in order


def test_emulated_link_overlaps_with_compute():
    clock = FakeClock()
    link = _link(clock, gbps=0.1)
    src, dst = _bufs(5, 2_500_000)  # 10 MB each -> 100 ms each, 0.5 s in all
    tickets = [link.submit(s, d) for s, d in zip(src, dst)]
    clock.advance(0.4)  # 0.4 s of "compute" on the calling thread
    stalls = [link.wait(t) for t in tickets]
    assert stalls == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.1])  # only the part the compute did not hide
    assert clock.now == pytest.approx(0.5)  # 0.5 s in all, not 0.4 + 0.5 one after the other
    # a transfer submitted while the link is idle starts at once; one submitted while it is busy queues
    clock.advance(1.0)  # t = 1.5, link idle since 0.5
    a = link.submit(src[0], dst[0])
    b = link.submit(src[1], dst[1])
    assert (a.due, b.due) == pytest.approx((1.6, 1.7))
    link.close()


def test_transfer_is_not_ready_before_it_is_due():
    clock = FakeClock()
    link = _link(clock, gbps=1.0, latency_s=0.001)
    src, dst = _bufs(1, 250_000)  # 1 MB -> 1 ms + 1 ms latency
    t = link.submit(src[0], dst[0])
    t.copied.wait()  # the real copy is done ...
    assert torch.equal(src[0], dst[0])
    assert not link.ready(t) and link.bytes == 0 and link.transfers == 0  # ... but the link is not
    clock.advance(0.0015)
    assert not link.ready(t)
    clock.advance(0.0005)
    assert link.ready(t) and link.wait(t) == 0.0
    assert link.bytes == 1_000_000 and link.busy_s == pytest.approx(0.002)
    link.close()


def test_real_clock_never_finishes_early():
    """The default clock is wall time: waiting on the last of 4 x 5 ms transfers takes at least 20 ms."""
    link = EmulatedLink(gbps=0.2)
    src, dst = _bufs(4, 250_000)  # 1 MB each -> 5 ms each
    t0 = time.perf_counter()
    tickets = [link.submit(s, d) for s, d in zip(src, dst)]
    link.wait(tickets[-1])
    assert time.perf_counter() - t0 >= 0.020  # a lower bound only: it cannot flake
    link.close()
    assert all(torch.equal(s, d) for s, d in zip(src, dst))


def test_wait_on_finished_transfer_is_free():
    link = EmulatedLink(gbps=10.0)
    src, dst = _bufs(1, 100)
    t = link.submit(src[0], dst[0])
    link.drain()
    assert link.ready(t) and link.wait(t) == 0.0
    link.close()


def test_direct_link_and_parse():
    link = DirectLink()
    src, dst = _bufs(1, 10)
    t = link.submit(src[0], dst[0])
    assert link.ready(t) and torch.equal(src[0], dst[0]) and link.bytes == 40
    assert parse_link("emulated:2,10") == ("emulated", 2.0, pytest.approx(10e-6))
    assert parse_link("emulated:16") == ("emulated", 16.0, 0.0)
    assert parse_link("cuda")[0] == "cuda"
    for bad in ("emulated:", "emulated:-1", "pcie", "emulated:2,x"):
        with pytest.raises(ConfigError):
            parse_link(bad)
    assert isinstance(make_link("auto", torch.device("cpu")), DirectLink)
    with pytest.raises(ConfigError, match="cuda"):
        make_link("cuda", torch.device("cpu"))


@pytest.mark.gpu
def test_cuda_link_copies_and_orders():
    from moeflow.runtime.link import CudaLink

    dev = torch.device("cuda")
    link = CudaLink(dev)
    src = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    dst = torch.zeros(1 << 20, device=dev)
    torch.cuda.synchronize(dev)  # the fill (compute stream) before the link's copy (a side stream)
    t = link.submit(src, dst)
    link.wait(t)
    assert link.ready(t) and torch.equal(dst.cpu(), src)
    # a copy ordered after a use marker does not overwrite data a queued computation still reads
    big = torch.randn(4096, 4096, device=dev)
    out = (big @ big).sum() + dst.sum()  # reads dst
    marker = link.record_use()
    t2 = link.submit(torch.zeros(1 << 20).pin_memory(), dst, after=marker)
    link.wait(t2)
    ref = (big @ big).sum() + src.to(dev).sum()
    assert torch.allclose(out, ref)
    assert link.bytes == 2 * (1 << 22) and link.busy_s > 0


def test_adjacent_runs_cut_where_rows_stop_continuing():
    """`adjacent_runs` groups (src, dst) pairs whose sources and destinations each continue the previous one in
    the same storage (one layer's expert rows into consecutive slot rows), in order, up to `max_bytes`; `joined`
    is one view over a run, no copy. What `CudaLink` moves as one copy per run."""
    from moeflow.runtime.link.base import adjacent_runs, continues, joined

    host = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)  # [E,R] one layer's rows
    dev = torch.zeros(10, 16)  # [C,R] slot rows
    rows, slots = list(host.unbind(0)), list(dev.unbind(0))
    row_bytes = 16 * 4
    pairs = [(rows[e], slots[s]) for e, s in [(0, 2), (1, 3), (2, 4), (4, 5), (5, 6), (6, 8), (7, 9)]]
    assert adjacent_runs(pairs, 1 << 20) == [[0, 1, 2], [3, 4], [5, 6]]  # expert 3 skipped; slot 7 skipped
    assert adjacent_runs(pairs, 2 * row_bytes) == [[0, 1], [2], [3, 4], [5, 6]]  # at most 2 rows per run
    assert adjacent_runs(pairs[:1], 0) == [[0]]  # a pair longer than the cap is a run of its own
    other = torch.zeros(4, 16)  # another storage right after in memory or not: never continued
    assert not continues(dev[9], other[0]) and not continues(rows[1], rows[0])
    assert not continues(rows[0], dev[1])  # another storage
    assert not continues(rows[0], rows[1].to(torch.float64))
    src = joined([rows[e] for e in (0, 1, 2)])
    assert src.shape == (48,) and src.data_ptr() == rows[0].data_ptr() and torch.equal(src, host[:3].reshape(-1))
    dst = joined([slots[s] for s in (2, 3, 4)])
    dst.copy_(src)  # the run's one copy
    assert torch.equal(dev[2:5], host[:3]) and float(dev[:2].abs().sum()) == 0.0 and float(dev[5:].abs().sum()) == 0.0
    assert joined([rows[5]]) is rows[5]


def test_a_handed_over_batch_is_waited_for_once():
    """`submit_many` hands a batch to the copying thread with ONE `copied` event: a wait on its last copy waits on
    that event once (not once per copy scheduled before it), and each copy is still due at its own time."""
    clock = FakeClock()
    link = _link(clock, gbps=0.2)
    src, dst = _bufs(6, 1_000_000)  # 4 MB each -> 20 ms each
    tickets = link.submit_many([(s, d, None) for s, d in zip(src, dst)])
    assert [t.due for t in tickets] == pytest.approx([0.020 * (i + 1) for i in range(6)])
    event = tickets[0].copied
    assert all(t.copied is event for t in tickets)
    waits = [0]
    wait = event.wait

    def counted(timeout=None):
        waits[0] += 1
        return wait(timeout)

    event.wait = counted  # type: ignore[method-assign]
    assert link.wait(tickets[-1]) == pytest.approx(0.120)
    assert waits[0] == 1
    link.close()
    assert all(torch.equal(s, d) for s, d in zip(src, dst))
    assert link.transfers == 6
