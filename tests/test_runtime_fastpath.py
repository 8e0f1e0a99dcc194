"""The decode fast path: grouping over routed experts (no slot-count limit), host reads, deferral.

- A model with more than 1024 routed experts (2 MoE layers x 640) at a capacity above 1024 slots runs
  token-identical to the resident `grouped_mm` model (grouping over every slot would exceed the 1024 groups
  `torch._grouped_mm` accepts on CUDA): no gathered grouped call has more groups than the pass routed
  (T*k) or than the layer has experts, and no call reading the weights in place spans more than 1024 slots.
- One host read per MoE layer per pass; none per layer once every expert is resident (the accesses
  are replayed at pass end), with the same counters as the non-deferred path, and one slot-use marker
  (`link.record_use`: a CUDA event on a GPU) per replay instead of one per layer.
"""

from __future__ import annotations

import pytest
import torch

from moeflow.models import tiny_model
from moeflow.moe import get_adapter
from moeflow.runtime import experts_call
from moeflow.runtime.generate import build_engine, generate_one
from moeflow.runtime.link import DirectLink
from moeflow.runtime.step import RouteStep, packed_to_host

NEW = 6


class MarkerCountingLink(DirectLink):
    """A direct link that counts the slot-use markers asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.markers = 0

    def record_use(self):
        self.markers += 1
        return super().record_use()


@pytest.fixture(scope="module")
def wide_model():
    """olmoe, 2 MoE layers x 640 experts (1280 routed experts), hidden 16, expert intermediate 16, top-k 2."""
    return tiny_model(
        "olmoe",
        num_experts=640,
        top_k=2,
        num_hidden_layers=2,
        hidden_size=16,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=2,
    )


def _record_groups(monkeypatch) -> tuple[list[tuple[int, int]], list[int]]:
    """Wrap the experts call's grouped compute: (groups, rows) of every gathered call, the span of every
    call that reads the weights in place."""
    seen: list[tuple[int, int]] = []
    spans: list[int] = []
    inner, inner_in_place = experts_call.grouped_experts, experts_call.entry_sorted_forward

    def spy(module, x, eg, weights, rows, groups, arange=None):
        seen.append((groups, x.shape[0]))
        return inner(module, x, eg, weights, rows, groups, arange)

    def spy_in_place(module, hidden, index, w, table, weights, span, spans_=None):
        spans.append(span[1] - span[0])
        return inner_in_place(module, hidden, index, w, table, weights, span, spans_)

    monkeypatch.setattr(experts_call, "grouped_experts", spy)
    monkeypatch.setattr(experts_call, "entry_sorted_forward", spy_in_place)
    return seen, spans


@pytest.mark.parametrize("capacity", [1100, 1280])
def test_more_than_1024_experts_token_identical(wide_model, capacity, monkeypatch):
    model = wide_model
    spec = get_adapter(model).spec
    assert spec.total_experts == 1280 and capacity > 1024
    prompt = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(3))  # [1,P]
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    with torch.no_grad():
        ref_logits = model(prompt).logits
    eng = build_engine(model, mode="offload", link=DirectLink(), capacity=capacity, eviction="lru", prefetch="none")
    with eng:
        assert eng.warm() == capacity  # fill every slot, so slots above 1024 are read
        assert eng.cache.num_resident() == capacity
        groups, spans = _record_groups(monkeypatch)
        with torch.no_grad():
            logits = model(prompt).logits
        out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(out, ref), f"C={capacity}: {out.tolist()} != {ref.tolist()}"
    assert groups or spans
    assert all(g <= min(rows, spec.num_experts) for g, rows in groups)
    assert max((g for g, _ in groups), default=0) <= spec.top_k * prompt.shape[1]
    assert max(spans, default=0) <= 1024
    assert m.counters.accesses == m.counters.hits + m.counters.misses


@pytest.mark.parametrize("arch", ["olmoe", "gpt_oss"])
def test_one_host_read_per_layer_and_deferred_counters(tiny_models, arch, monkeypatch):
    model = tiny_models(arch)
    spec = get_adapter(model).spec
    prompt = torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(7))
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)

    def run(capacity: int, warm: bool, ev: str):
        link = MarkerCountingLink()
        eng = build_engine(model, mode="offload", link=link, capacity=capacity, eviction=ev, prefetch="none")
        with eng:
            if warm:
                eng.warm()
            s0, k0 = eng.host_syncs, link.markers
            out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
            return out, m.counters, eng.host_syncs - s0, link.markers - k0

    passes, layers = NEW, spec.num_moe_layers  # prefill + NEW-1 decode steps are routed
    out, _, syncs, _ = run(spec.total_experts // 2, False, "lru")
    assert torch.equal(out, ref) and syncs == passes * layers
    for ev in ("lru", "least-stale"):
        out, fast, syncs, markers = run(spec.total_experts, True, ev)
        assert torch.equal(out, ref) and syncs == passes  # one replay per pass, none per layer
        assert markers == passes  # one slot-use marker per replay, not one per layer
        monkeypatch.setattr(RouteStep, "can_defer", lambda self, layer, indices: False)
        out, slow, syncs, markers = run(spec.total_experts, True, ev)
        monkeypatch.undo()
        assert torch.equal(out, ref) and syncs == passes * layers
        assert markers == passes * layers  # each layer's release marks its own slots
        fast.stall_s = slow.stall_s = 0.0
        assert fast == slow


@pytest.mark.gpu
def test_more_than_1024_slots_cuda():
    """On CUDA `torch._grouped_mm` refuses > 1024 groups: the old per-slot grouping crashed here."""
    from moeflow.runtime.link import CudaLink

    dev = torch.device("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(
            "olmoe",
            num_experts=640,
            top_k=2,
            num_hidden_layers=2,
            hidden_size=16,
            intermediate_size=16,
            num_attention_heads=2,
            num_key_value_heads=2,
            dtype=dtype,
        ).to(dev)
        prompt = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(3))
        ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
        for capacity in (1100, 1280):
            eng = build_engine(model, mode="offload", link=CudaLink(dev), capacity=capacity, eviction="lru", prefetch="none")
            with eng:
                eng.warm()
                out, _ = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
            assert torch.equal(out, ref), f"cuda {dtype} C={capacity}"


VIEWS = {"aten::reshape", "aten::view", "aten::_reshape_alias", "aten::unbind", "aten::select", "aten::slice", "aten::alias"}


def _aten_ops(fn) -> int:
    """Top-level aten ops `fn()` runs that are not views (on a GPU each one a kernel launch and its host cost)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(
        1
        for e in prof.events()
        if e.name.startswith("aten::")
        and e.name not in VIEWS
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )


def test_a_pass_replay_reads_its_routings_in_a_constant_number_of_ops():
    """`packed_to_host` (the device branch of `RouteStep.to_host`, run here on CPU tensors): a pass's deferred
    routings (one shape, one dtype pair) come back exact (ids long, weights float32, bit for bit) through two stacks
    and two copies, however many layers; mixed shapes fall back to the float64 pack, with the same values."""
    g = torch.Generator().manual_seed(0)
    same = [
        (torch.randint(0, 64, (1, 8), generator=g), torch.rand(1, 8, generator=g).to(torch.bfloat16)) for _ in range(16)
    ]  # 16 layers' [T,k] ids and weights
    mixed = [*same[:3], (torch.randint(0, 64, (2, 8), generator=g), torch.rand(2, 8, generator=g).to(torch.bfloat16))]
    for routings in (same, mixed, same[:1]):
        out = packed_to_host(routings)
        assert len(out) == len(routings)
        for (i, w), (i0, w0) in zip(out, routings):
            assert i.dtype == torch.long and w.dtype == torch.float32
            assert torch.equal(i, i0.reshape(-1)) and torch.equal(w, w0.reshape(-1).float())
    stacked, packed = _aten_ops(lambda: packed_to_host(same)), _aten_ops(lambda: packed_to_host(mixed))
    assert stacked <= 8 < 2 * len(same)  # stacks and copies (+ the host-side slices), not 2 conversions per layer
    assert packed >= 2 * len(mixed)  # the fallback converts each tensor
