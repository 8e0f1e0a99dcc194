"""The CUDA-only paths of the offload engine, one `gpu` test each (skipped without CUDA; `make gpu-check` runs them).

- the decode fast path: every expert resident, no host read per layer, no copy, token-identical to resident;
- `CudaLink`: bytes counted == expert bytes x loads (and == the cache's `bytes_moved`); a demand copy
  overtakes prefetch copies already queued (its own high-priority stream);
- HQQ dequantize in a device slot (`fetch-lowest-bit:bits=4`): the slot holds the dequantized compact
  copy; output close to resident, labelled lossy;
- cascade: the full row lands over the low-bit slot (`upgrades` > 0, every slot back to full precision);
- hit-first partial waits on a slow CUDA link: ready experts computed first, token-identical;
- `--miss cpu` / `auto` on CUDA: the host computes missing experts, output close to resident, lossy on cuda;
- speculative routing under the offload engine on CUDA: the same tokens as speculative resident;
- NCCL expert parallel: world size 1 in-process, 2 ranks when 2 GPUs are present; logits bit-identical.

The device and the link come from `_device()` / `_link()`, so the logic can be dry-run elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeflow.models import tiny_model
from moeflow.moe import get_adapter
from moeflow.quant import FULL, dequantize_row
from moeflow.runtime.experts_call import ExpertsCall
from moeflow.runtime.generate import build_engine, generate_one
from moeflow.runtime.link import Link

NEW = 8
SPIN_CYCLES = 2_000_000  # GPU clock cycles a slow link's copy waits before it starts (~1 ms)


def _device() -> torch.device:
    return torch.device("cuda")


def _link(slow: bool = False) -> Link:
    """`CudaLink` on the device; `slow`: every copy first spins `SPIN_CYCLES` on its stream, so copies are still
    in flight when the layer computes (the CUDA counterpart of a slow emulated link)."""
    from moeflow.runtime.link import CudaLink

    class SlowCudaLink(CudaLink):
        def _issue_run(self, ts, src, dst, afters, demand):
            stream = self.demand_stream if demand else self.stream
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SPIN_CYCLES)
            super()._issue_run(ts, src, dst, afters, demand)

    return SlowCudaLink(_device()) if slow else CudaLink(_device())


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(7))  # [1,P]


def _model(dtype: torch.dtype = torch.float32, **over):
    """A tiny random olmoe on the device, with the engine's exactness reference (stock `grouped_mm`)."""
    model = tiny_model("olmoe", dtype=dtype, **over).to(_device())
    model.set_experts_implementation("grouped_mm")
    return model


@pytest.fixture(scope="module")
def model():
    return _model()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.to(_device())).logits.float().cpu()  # [1,P,V]


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


@pytest.mark.gpu
def test_fast_path_all_resident_no_host_read_no_copy(model, prompt):
    """Every expert in a slot (warm): one host read per pass (the deferred replay), none per layer, no copy."""
    spec = get_adapter(model).spec
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    eng = build_engine(model, mode="offload", link=_link(), capacity=spec.total_experts, eviction="lru", prefetch="none")
    with eng:
        assert eng.warm() == spec.total_experts
        s0 = eng.host_syncs
        out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
        syncs = eng.host_syncs - s0
    assert torch.equal(out, ref), f"{out.tolist()} != {ref.tolist()}"
    assert syncs == NEW  # prefill + NEW-1 decode passes, one replay each
    assert m.counters.misses == 0 and m.link_bytes == 0 and m.counters.hits == m.counters.accesses > 0
    assert not eng.lossy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefetch", ["none", "pregate"])
def test_cuda_link_counts_every_byte(prompt, dtype, prefetch):
    """The link counts every byte the cache moved: full rows only here, so expert bytes x loads."""
    model = _model(dtype)
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    for cap in (2, 6):
        eng = build_engine(model, mode="offload", link=_link(), capacity=cap, eviction="lru", prefetch=prefetch)
        with eng:
            out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
            eb = eng.store.expert_bytes
            transfers = eng.link.transfers
        c = m.counters
        assert torch.equal(out, ref), f"{dtype} {prefetch} C={cap}"
        assert c.loads > 0 and c.lowbit_loads == 0 and c.upgrades == 0
        assert m.link_bytes == c.bytes_moved == eb * c.loads, (m.link_bytes, c.bytes_moved, eb, c.loads)
        assert transfers == c.loads


@pytest.mark.gpu
def test_cuda_link_demand_overtakes_queued_prefetches():
    """16 prefetches of 64 MB queued; a demand copy submitted after them completes while the last of them is still
    pending (prefetches are issued a window ahead, so the copy engine holds at most that window before it). The same
    copy as a prefetch (the control) completes only after all of them."""
    link = _link()
    dev = _device()
    n, numel = 16, 16 << 20  # 16 prefetches of 64 MB fp32 (~20 ms at 50 GB/s)
    src = torch.ones(numel).pin_memory()
    dst = [torch.empty(numel, device=dev) for _ in range(n)]
    small_src, small_dst = torch.full((1024,), 7.0).pin_memory(), torch.zeros(1024, device=dev)
    torch.cuda.synchronize(dev)
    pf = [link.submit(src, d, demand=False) for d in dst]
    demand = link.submit(small_src, small_dst, demand=True)
    link.wait(demand)
    overtaken = not link.ready(pf[-1])
    link.drain()
    assert overtaken, "the demand copy completed only after every queued prefetch"
    assert torch.equal(small_dst.cpu(), small_src)
    pf = [link.submit(src, d, demand=False) for d in dst]
    control = link.submit(small_src, small_dst, demand=False)
    while not link.ready(control):  # polling issues held prefetches in order
        pass
    assert all(link.ready(t) for t in pf)  # one stream: in order
    link.drain()


@pytest.mark.gpu
def test_cuda_link_cancel_and_promote_held_prefetches():
    """A prefetch still held on the host is withdrawn by `cancel` (its destination is never written, its bytes
    never counted) and goes out ahead of the other held ones when promoted."""
    link = _link()
    dev = _device()
    n, numel = 8, 16 << 20
    src = torch.ones(numel).pin_memory()
    dst = [torch.zeros(numel, device=dev) for _ in range(n)]
    torch.cuda.synchronize(dev)
    pf = [link.submit(src, d, demand=False) for d in dst]
    assert link.cancel(pf[-1]), "the last of 8 queued 64 MB prefetches was already issued"
    link.promote(pf[-2])
    link.wait(pf[-2])
    promoted_first = not link.ready(pf[-3])
    link.drain()
    assert promoted_first
    assert float(dst[-1].abs().sum()) == 0.0  # cancelled: never copied
    assert all(float(d[:8].sum()) == 8.0 for d in dst[:-1])
    assert link.bytes == (n - 1) * numel * 4 and link.submitted_bytes == (n - 1) * numel * 4


@pytest.mark.gpu
def test_hqq_dequantize_in_device_slot(model, prompt):
    """`fetch-lowest-bit:bits=4`: demand loads move the compact copy, the slot holds its dequantized row
    (computed on the device), the output stays close to resident and the run is labelled lossy."""
    spec = get_adapter(model).spec
    cap = max(spec.top_k, spec.total_experts // 4)
    ref = _logits(model, prompt)
    eng = build_engine(
        model, mode="offload", link=_link(), capacity=cap, eviction="lru", miss="fetch-lowest-bit", miss_opts={"bits": 4}
    )
    with eng:
        got = _logits(model, prompt)
        generate_one(model, prompt, eng, max_new_tokens=4, min_new_tokens=4)
        cache, store = eng.cache, eng.store
        c = cache.counters
        assert c.lowbit_loads == c.demand_loads > 0
        assert eng.link.bytes == c.bytes_moved < c.loads * store.expert_bytes  # compact copies are smaller
        cache.wait(list(range(cache.capacity)))
        low = [(k, s) for k, s in cache.slot_of.items() if cache.slots[s].bits == 4]
        assert low, "no slot holds a 4-bit copy"
        for key, s in low[:4]:
            want = torch.empty_like(store.row(*key))  # [row_numel] on the host
            dequantize_row(store.compact_layout[4], store.compact_row(*key, 4), store.layout, want)
            slot = cache.buffer[s].cpu()
            assert torch.allclose(slot, want, rtol=1e-5, atol=1e-6), key
            assert not torch.equal(slot, store.row(*key))  # the lossy copy, not the full row
        assert eng.lossy
    err = _rel_err(got, ref)
    assert 0 < err < 0.1, err  # int4 groups of 64 (~9% weight error, tests/test_quant.py): ~1% on these logits


@pytest.mark.gpu
def test_cascade_upgrades_land_over_low_bit_slots(model, prompt):
    spec = get_adapter(model).spec
    cap = max(spec.top_k, spec.total_experts // 4)
    eng = build_engine(model, mode="offload", link=_link(), capacity=cap, eviction="lhu", miss="cascade")
    with eng:
        _, m = generate_one(model, prompt, eng, max_new_tokens=4, min_new_tokens=4)
        cache, store = eng.cache, eng.store
        assert cache.counters.upgrades > 0 and cache.counters.lowbit_loads > 0
        cache.wait(list(range(cache.capacity)))
        for key, s in cache.slot_of.items():  # every slot: full precision again, bit for bit
            assert cache.slots[s].bits == FULL
            assert torch.equal(cache.buffer[s].cpu(), store.row(*key)), key
        assert m.link_bytes == m.counters.bytes_moved
        assert eng.lossy


@pytest.mark.gpu
def test_hit_first_partial_waits_token_identical(model, prompt, monkeypatch):
    """On a CUDA link whose copies are still in flight when a layer computes, hit-first computes the ready
    experts first and then waits for the rest: at least one wave split, output token-identical."""
    spec = get_adapter(model).spec
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    splits: list[int] = []
    inner = ExpertsCall._split_wave

    def spy(self, layer, experts, slots, cpu):
        parts = inner(self, layer, experts, slots, cpu)
        if parts is not None and len(parts) == 2 and self.hit_first:
            splits.append(layer)
        return parts

    monkeypatch.setattr(ExpertsCall, "_split_wave", spy)
    for cap in sorted({spec.top_k, max(spec.top_k, spec.total_experts // 4)}):
        for prefetch in ("none", "pregate"):
            eng = build_engine(
                model, mode="offload", link=_link(slow=True), capacity=cap, eviction="lru", prefetch=prefetch, routing="hit-first"
            )
            with eng:
                out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
            assert torch.equal(out, ref), f"C={cap} {prefetch}: {out.tolist()} != {ref.tolist()}"
            assert not eng.lossy and m.link_bytes == m.counters.bytes_moved
    assert splits, "no layer computed its ready experts before the loading ones"


@pytest.mark.gpu
@pytest.mark.parametrize("miss", ["cpu", "auto"])
def test_host_compute_on_cuda_close_and_lossy(model, prompt, miss):
    """`cpu` runs the missing experts on the host from the pinned store (`auto` may choose either): the
    output is close to resident but not promised bit-identical on CUDA, so the run is labelled lossy."""
    ref = _logits(model, prompt)
    eng = build_engine(model, mode="offload", link=_link(), capacity=2, eviction="lru", miss=miss)
    with eng:
        got = _logits(model, prompt)
        out, _ = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
        assert eng.lossy
        if miss == "cpu":
            assert eng.miss_counts["cpu"] > 0 and eng.host_s > 0
    assert out.numel() == NEW
    assert _rel_err(got, ref) < 1e-2, _rel_err(got, ref)


class _NextRouterPredictor:
    """Predicts layer l+1's routing by applying its router to layer l's router input (softmax over experts)."""

    max_lookahead = 1

    def predict(self, target: int, s: int, batch) -> torch.Tensor:
        logits = batch.route(target, batch.router_input)  # [T,E]
        return torch.softmax(logits.float(), -1)


@pytest.mark.gpu
def test_speculative_routing_under_offload_on_cuda(prompt):
    """Speculative routing with the offload engine on CUDA runs the predicted experts: the same tokens as
    speculative routing on the resident model (and the routing was actually replaced)."""
    from moeflow.policies.lossy import lossy
    from moeflow.predict.speculative import speculative_routing

    model = _model(num_hidden_layers=4)
    ad = get_adapter(model)
    spec = ad.spec
    with speculative_routing(model, _NextRouterPredictor()) as st:
        ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    assert st["replaced"] > 0
    for cap in (spec.top_k * 2, spec.total_experts):
        eng = build_engine(model, mode="offload", link=_link(), capacity=cap, eviction="lru", prefetch="pregate")
        with eng, speculative_routing(model, _NextRouterPredictor(), engine=eng, adapter=ad) as st2:
            got, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
        assert torch.equal(got, ref), f"C={cap}: {got.tolist()} != {ref.tolist()}"
        assert st2["replaced"] == st["replaced"] and m.counters.accesses > 0
    assert lossy(device_type="cuda", speculative=True).lossy


def _ep_logits(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(stock grouped_mm logits, expert-parallel logits, rows this rank computed) on this rank's GPU."""
    from moeflow.ep import ExpertParallel, default_placement

    model = tiny_model("olmoe", num_experts=8, top_k=2).to(torch.device("cuda", rank))
    model.set_experts_implementation("grouped_mm")
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    ids = ids.to(torch.device("cuda", rank))  # [B,P]
    with torch.no_grad():
        ref = model(ids).logits
    spec = get_adapter(model).spec
    with ExpertParallel(model, default_placement(spec.moe_layers, spec.num_experts, world)) as ep:
        with torch.no_grad():
            got = model(ids).logits
        rows = sum(s.rows for s in ep.stats.values())
    return ref.cpu(), got.cpu(), rows


@pytest.mark.gpu
def test_nccl_expert_parallel_world_size_1(tmp_path):
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    try:
        ref, got, rows = _ep_logits(0, 1)
    finally:
        dist.destroy_process_group()
    assert torch.equal(ref, got) and rows > 0


def _ep_rank(rank: int, world: int, store: str, out: str) -> None:
    """One spawned NCCL rank: write whether its expert-parallel logits equal the stock ones."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )
    try:
        ref, got, rows = _ep_logits(rank, world)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"equal": bool(torch.equal(ref, got)), "rows": rows}))


@pytest.mark.gpu
def test_nccl_expert_parallel_two_ranks(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices for 2 NCCL ranks ({torch.cuda.device_count()} present)")
    mp.start_processes(_ep_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["equal"] for r in res), res
    assert all(r["rows"] > 0 for r in res)  # both ranks computed rows
