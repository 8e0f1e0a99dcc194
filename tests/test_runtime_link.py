"""Transfer links: the emulated link takes latency + bytes/bandwidth of wall time, serialised, and
overlaps with work on the calling thread. Bounds are generous: these are properties, not speeds."""

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


def test_emulated_link_takes_bytes_over_bandwidth():
    link = EmulatedLink(gbps=0.2, latency_s=0.0)               # 0.2 GB/s
    src, dst = _bufs(4, 1_000_000)                             # 4 MB each -> 20 ms each, 80 ms serialised
    t0 = time.perf_counter()
    tickets = [link.submit(s, d) for s, d in zip(src, dst)]
    for t in tickets:
        link.wait(t)
    wall = time.perf_counter() - t0
    link.close()
    assert wall >= 0.95 * 0.080, wall
    assert wall < 2.0                                          # generous: a loaded machine
    assert all(torch.equal(s, d) for s, d in zip(src, dst))
    assert link.bytes == 16_000_000 and link.transfers == 4
    assert link.busy_s >= 0.95 * 0.080
    assert link.bytes / link.busy_s <= 0.2e9 * 1.01          # effective bandwidth never beats the link


def test_emulated_link_latency_and_fifo():
    link = EmulatedLink(gbps=100.0, latency_s=0.005)
    src, dst = _bufs(10, 16)
    t0 = time.perf_counter()
    tickets = [link.submit(s, d) for s, d in zip(src, dst)]
    done_at = []
    for t in tickets:
        link.wait(t)
        done_at.append(time.perf_counter() - t0)
    link.close()
    assert done_at[-1] >= 0.95 * 0.050                        # 10 x 5 ms, one at a time
    assert done_at == sorted(done_at)


def test_emulated_link_overlaps_with_compute():
    link = EmulatedLink(gbps=0.1, latency_s=0.0)
    src, dst = _bufs(5, 2_500_000)                             # 10 MB each -> 100 ms each, 0.5 s in all
    t0 = time.perf_counter()
    tickets = [link.submit(s, d) for s, d in zip(src, dst)]
    time.sleep(0.4)                                            # "compute" on the main thread meanwhile
    stall = sum(link.wait(t) for t in tickets)
    wall = time.perf_counter() - t0
    link.close()
    serial = 0.5 + 0.4
    assert wall < 0.8 * serial, wall                           # ran concurrently, not one after the other
    assert 0.0 < stall < 0.5                                   # only the part the compute did not hide
    assert stall <= wall


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
    t = link.submit(src, dst)
    stall = link.wait(t)
    assert stall >= 0.0
    assert torch.equal(dst.cpu(), src)
    # a copy ordered after a use marker does not overwrite data a queued computation still reads
    big = torch.randn(4096, 4096, device=dev)
    out = (big @ big).sum() + dst.sum()                        # reads dst
    marker = link.record_use()
    t2 = link.submit(torch.zeros(1 << 20).pin_memory(), dst, after=marker)
    link.wait(t2)
    ref = (big @ big).sum() + src.to(dev).sum()
    assert torch.allclose(out, ref)
    assert link.bytes == 2 * (1 << 22) and link.busy_s > 0
