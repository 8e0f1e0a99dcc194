"""`CudaLink`'s host-side logic on the CPU, with CUDA's events and streams replaced by recording fakes (the copies
are real CPU copies): runs of adjacent rows as one copy with shared events and shared link time, held prefetches
issued in runs, cancel / promote of held prefetches, each distinct use marker waited for once, a held run within
the prefetch window, and the whole engine over it exact with every byte counted. The adjacent-rows scenario runs on
a device too (`test_cuda_link_moves_adjacent_rows_as_one_copy`, gpu); the rest of the device behaviour is
`tests/test_gpu_paths.py` (gpu)."""

from __future__ import annotations

import contextlib

import pytest
import torch


class FakeEvent:
    """A CUDA event stand-in: each record advances a global clock by `step_ms` (so a copy's two events are `step_ms`
    apart); complete at once, or (`instant` False) only once synchronized."""

    now = 0.0
    step_ms = 1.0
    instant = True

    def __init__(self, enable_timing: bool = False) -> None:
        self.t: float | None = None
        self.done = False

    def record(self, stream=None) -> None:
        FakeEvent.now += FakeEvent.step_ms
        self.t = FakeEvent.now

    def query(self) -> bool:
        return self.t is not None and (FakeEvent.instant or self.done)

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:  # milliseconds, as CUDA's
        assert self.t is not None and end.t is not None
        return float(end.t - self.t)


class FakeStream:
    def __init__(self, device=None, priority: int = 0) -> None:
        self.waits: list[FakeEvent] = []

    def wait_event(self, ev: FakeEvent) -> None:
        self.waits.append(ev)


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(FakeEvent, "instant", True)
    monkeypatch.setattr(FakeEvent, "step_ms", 1.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    from moeflow.runtime.link import CudaLink

    return CudaLink


def _adjacent_rows(link, host: torch.Tensor, buf: torch.Tensor, settle) -> None:
    """On `link` (run_bytes 16 KiB): one layer's rows `host [8,1024]` into consecutive slot rows of `buf [10,1024]`
    go out as one copy per run (the tickets share its events), every byte counted once, each ticket's link time its
    share of the copy's; held prefetches of adjacent rows are issued as runs too, and rows that do not continue stay
    separate copies. `settle()` orders the buffer's fill before the link's copies (a device's streams)."""
    settle()
    rows, slots = list(host.unbind(0)), list(buf.unbind(0))
    items = [(rows[e], slots[e + 1], None) for e in range(8)]
    ts = link.submit_many(items, demand=True)
    for t in ts:
        link.wait(t)
    link.drain()
    assert torch.equal(buf[1:9].cpu(), host) and float(buf[0].abs().sum()) == float(buf[9].abs().sum()) == 0.0
    assert len({id(t.event) for t in ts}) == 2  # 8 rows of 4 KiB, at most 4 per copy
    assert link.bytes == link.submitted_bytes == host.numel() * 4 and link.transfers == 8
    run = ts[0].start_event.elapsed_time(ts[0].event) / 1e3
    assert sum(t.busy_s for t in ts[:4]) == pytest.approx(run) and ts[0].busy_s == pytest.approx(run / 4)
    buf.zero_()
    settle()
    scattered = [(rows[e], slots[9 - e], None) for e in range(8)]  # descending slots: nothing continues
    ts = link.submit_many(scattered, demand=False) + link.submit_many(items[:4], demand=False)
    link.drain()
    assert len({id(t.event) for t in ts}) == 8 + 1  # held prefetches: the adjacent four in one copy
    assert torch.equal(buf[1:5].cpu(), host[:4]) and torch.equal(buf[9].cpu(), host[0])
    assert link.bytes == link.submitted_bytes == 2 * host.numel() * 4 + 4 * 1024 * 4


def test_adjacent_rows_move_as_one_copy_per_run(fake_cuda):
    link = fake_cuda(torch.device("cpu"), run_bytes=4 * 1024 * 4)
    _adjacent_rows(link, torch.randn(8, 1024), torch.zeros(10, 1024), lambda: None)


@pytest.mark.gpu
def test_cuda_link_moves_adjacent_rows_as_one_copy():
    """The same scenario on a CUDA device: pinned host rows, a device buffer."""
    from moeflow.runtime.link import CudaLink

    dev = torch.device("cuda")
    link = CudaLink(dev, run_bytes=4 * 1024 * 4)
    _adjacent_rows(
        link, torch.randn(8, 1024).pin_memory(), torch.zeros(10, 1024, device=dev), lambda: torch.cuda.synchronize(dev)
    )


def test_copy_fit_recovers_latency_and_bandwidth():
    from moeflow.runtime.link.cuda import CopyFit

    f = CopyFit()
    assert f.fit() is None
    for n in (4096, 4096, 16384):  # two single rows, then a run of four moved as one copy (four tickets' shares)
        for _ in range(n // 4096):
            f.add(n, 2e-5 + n * 1e-9, weight=4096 / n)
    a, b = f.fit()  # type: ignore[misc]
    assert a == pytest.approx(2e-5) and b == pytest.approx(1e-9) and f.w == pytest.approx(3)  # three copies
    one = CopyFit()
    one.add(4096, 3e-5)
    one.add(4096, 5e-5)
    assert one.fit() == pytest.approx((0.0, 8e-5 / 8192))  # one size: the mean seconds per byte, no latency
    flat = CopyFit()  # a larger copy no slower: no positive slope, the mean seconds per byte
    flat.add(1e3, 1e-3)
    flat.add(1e8, 1e-4)
    assert flat.fit() == pytest.approx((0.0, 1.1e-3 / (1e3 + 1e8)))
    steep = CopyFit()  # a negative intercept: the line through the origin
    for n, t in ((1e6, 1e-4), (2e6, 3e-4), (3e6, 5e-4)):
        steep.add(n, t)
    assert steep.fit() == pytest.approx((0.0, (1e-4 * 1e6 + 3e-4 * 2e6 + 5e-4 * 3e6) / (1e12 + 4e12 + 9e12)))
    import numpy as np

    rng = np.random.default_rng(0)  # noisy copies of 1 to 8 rows: one weight per copy whatever its tickets
    noisy, xs, ys = CopyFit(), [], []
    for rows in rng.integers(1, 9, 40):
        x = float(rows * 4096)
        y = 1e-5 + x * 2e-9 + float(rng.normal(0, 2e-6))
        for _ in range(rows):
            noisy.add(x, y, weight=1.0 / rows)
        xs.append(x)
        ys.append(y)
    b_ref, a_ref = np.polyfit(xs, ys, 1)
    assert noisy.fit() == pytest.approx((a_ref, b_ref))


def test_copy_time_is_fitted_per_copy_not_averaged_over_runs(fake_cuda):
    """Single rows and runs of adjacent rows, each copy taking latency + bytes x seconds per byte: one expert's
    copy is estimated with its latency (a mean over the bytes of runs read it fast), the TTFT bound's bytes
    (`bulk_s`) without it, and the link's busy seconds are the copies' own."""
    link = fake_cuda(torch.device("cpu"), run_bytes=1 << 20)
    lat_ms, per_ms = 0.05, 1e-5  # per copy; per byte
    issue = link._issue_run

    def timed(ts, src, dst, afters, demand):  # the fake events of this copy lie lat + bytes x per apart
        FakeEvent.step_ms = lat_ms + src.numel() * src.element_size() * per_ms
        issue(ts, src, dst, afters, demand)

    link._issue_run = timed
    host, buf = torch.randn(16, 1024), torch.zeros(24, 1024)
    rows, slots = list(host.unbind(0)), list(buf.unbind(0))
    singles = [(rows[e], slots[2 * e], None) for e in range(4)]  # every other slot: nothing continues
    runs = [(rows[4 + e], slots[8 + e], None) for e in range(12)]  # one run of 12 adjacent rows
    link.submit_many(singles, demand=True)
    link.submit_many(runs, demand=True)
    link.drain()
    row = 1024 * 4
    copies = [lat_ms + row * per_ms] * 4 + [lat_ms + 12 * row * per_ms]
    assert link.busy_s == pytest.approx(sum(copies) / 1e3)
    assert link.transfer_estimate_s(row) == pytest.approx((lat_ms + row * per_ms) / 1e3)
    assert link.bulk_s(row) == pytest.approx(row * per_ms / 1e3)
    assert link._fit.w == pytest.approx(5)  # 4 single rows and one run of 12: five copies, each counted once
    mean = link.busy_s / link.bytes * row  # what a mean per byte over runs and single rows said
    assert mean < 0.8 * link.transfer_estimate_s(row)


def test_the_ttft_bound_counts_an_experts_bytes_alone(fake_cuda):
    """`generate`'s TTFT bound prices an expert at the link's seconds per byte (`bulk_s`: a staged prefill's copies
    move in runs), not at one copy's time with its latency (`transfer_estimate_s`)."""
    from moeflow.runtime.generate import expert_link_s

    link = fake_cuda(torch.device("cpu"))
    link._fit.add(4096, 1e-3)
    link._fit.add(8192, 1.5e-3)  # 0.5 ms per copy, 0.5 ms per 4 KiB
    assert link.transfer_estimate_s(4096) == pytest.approx(1e-3)
    assert expert_link_s(link, 4096) == pytest.approx(0.5e-3) == link.bulk_s(4096)


def test_the_prefetch_window_counts_each_copys_latency(fake_cuda, monkeypatch):
    """With copies whose fixed cost dominates (a 4 KiB row: 0.5 ms of latency, 4 us of bytes), the 2 ms window
    holds about four single-row prefetch copies, not the hundreds the bytes alone would let through; the backlog
    counts each held prefetch's latency too."""
    monkeypatch.setattr(FakeEvent, "instant", False)  # copies stay in flight until waited for
    link = fake_cuda(torch.device("cpu"), window_s=2e-3, run_bytes=1 << 20)
    link._fit.add(4096, 0.5e-3 + 4e-6)
    link._fit.add(8192, 0.5e-3 + 8e-6)
    host, buf = torch.randn(64, 1024), torch.zeros(128, 1024)
    ts = [link.submit(host[e], buf[2 * e], demand=False) for e in range(64)]  # every other slot: no runs
    assert 3 <= 64 - len(link._held) <= 4
    assert link.backlog_s() == pytest.approx(64 * (0.5e-3 + 4e-6), rel=1e-6)
    link.drain()
    assert all(t.done.is_set() for t in ts)


def test_held_prefetches_cancel_promote_and_markers(fake_cuda, monkeypatch):
    monkeypatch.setattr(FakeEvent, "instant", False)  # copies stay in flight until waited for
    link = fake_cuda(torch.device("cpu"), window_s=0.0)
    src = [torch.full((1024,), float(i)) for i in range(6)]
    dst = [torch.zeros(1024) for _ in range(6)]
    pf = [link.submit(s, d, demand=False) for s, d in zip(src, dst)]
    assert len(link._held) == 4  # two issued before anything was measured, the rest held
    assert link.cancel(pf[-1]) and not link.cancel(pf[0])  # held: withdrawn; issued: cannot
    link.promote(pf[-2])
    link.wait(pf[-2])
    link.drain()
    assert float(dst[-1].sum()) == 0.0 and all(float(d[0]) == i for i, d in enumerate(dst[:-1]))
    assert link.bytes == link.submitted_bytes == 5 * 4096
    link = fake_cuda(torch.device("cpu"))
    rows, slots = list(torch.randn(3, 16).unbind(0)), list(torch.zeros(4, 16).unbind(0))
    m1, m2 = FakeEvent(), FakeEvent()
    m1.record()
    m2.record()
    ts = link.submit_many([(rows[0], slots[1], m1), (rows[1], slots[2], m1), (rows[2], slots[3], m2)], demand=True)
    assert link.demand_stream.waits == [m1, m2] and len({id(t.event) for t in ts}) == 1  # each marker once
    link.drain()


def test_a_held_run_stays_within_the_prefetch_window(fake_cuda, monkeypatch):
    """Once the link's speed is measured, a run of held prefetches carries no more bytes than the window has room
    for (a demand copy waits behind at most the window, and what is not issued can still be cancelled)."""
    monkeypatch.setattr(FakeEvent, "instant", False)  # copies stay in flight until waited for
    link = fake_cuda(torch.device("cpu"), window_s=2e-3, run_bytes=1 << 20)
    link._fit.add(4096, 1e-3)  # measured: one copy of a 4 KiB row in 1 ms, the window holds 2 rows
    host, buf = torch.randn(8, 1024), torch.zeros(8, 1024)
    ts = link.submit_many([(host[e], buf[e], None) for e in range(8)], demand=False)
    assert len(link._held) == 6 and ts[0].event is ts[1].event  # one copy of the 2 rows the window has room for
    assert link.cancel(ts[-1])  # the rest still held
    link.drain()
    assert torch.equal(buf[:7], host[:7]) and float(buf[7].abs().sum()) == 0.0
    assert len({id(t.event) for t in ts[:7]}) == 2  # after the window's run, the other 5 rows in one copy


@pytest.mark.parametrize("instant,latency_ms", [(True, None), (False, None), (False, 0.5)])
def test_an_engine_on_the_fake_cuda_link_is_exact_and_counts_every_byte(fake_cuda, monkeypatch, instant, latency_ms):
    """The whole engine (staged prefill, decode, prefetch, evictions) over `CudaLink` with the fakes, copies complete
    at once or only once waited for (and, `latency_ms`, each copy taking that latency plus its bytes, so the prefetch
    window holds few copies): greedy tokens equal the resident model's at 25%, 50% and 100% capacity, the link counts
    exactly the cache's bytes, and a staged cold prefill of every expert moves them in a few copies."""
    from moeflow.models import tiny_model
    from moeflow.moe import get_adapter
    from moeflow.runtime.generate import build_engine, generate_one

    monkeypatch.setattr(FakeEvent, "instant", instant)
    model = tiny_model("olmoe", num_experts=16, top_k=4)
    spec = get_adapter(model).spec
    prompt = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(1))  # [1,P]
    ref, _ = generate_one(model, prompt, None, max_new_tokens=8, min_new_tokens=8)
    for capacity in (spec.total_experts // 4, spec.total_experts // 2, spec.total_experts):
        for prefetch in ("none", "pregate"):
            link = fake_cuda(torch.device("cpu"))
            copies = [0]
            issue = link._issue_run

            def counted(ts, src, *a, _issue=issue, _copies=copies, **k):
                _copies[0] += 1
                if latency_ms is not None:  # this copy's fake events lie latency + bytes x 1 ns/B apart
                    FakeEvent.step_ms = latency_ms + src.numel() * src.element_size() * 1e-6
                return _issue(ts, src, *a, **k)

            link._issue_run = counted  # type: ignore[method-assign]
            eng = build_engine(model, mode="offload", link=link, capacity=capacity, eviction="lru", prefetch=prefetch)
            assert eng is not None
            with eng:
                out, _ = generate_one(model, prompt, eng, max_new_tokens=8, min_new_tokens=8)
                link.drain()
                c = eng.cache.counters
            assert torch.equal(out, ref), f"C={capacity} {prefetch}"
            assert link.bytes == link.submitted_bytes == c.bytes_moved and link.transfers == c.loads
            if capacity == spec.total_experts and prefetch == "pregate":
                assert copies[0] * 4 <= c.loads  # a staged cold prefill: the layers' experts in runs
