"""The keystone: offloaded generation is bit-exact to the stock resident model.

For every supported architecture, every eviction policy in the registry, capacities {top-k experts,
25%, 100%} and prefetch {none, pregate}, greedy output must be token-identical to the resident
model (which uses transformers' default `grouped_mm`), and logits of one forward pass `torch.equal`.
Capacity top-k forces prefill to run in waves (a prompt routes to more experts than fit).
"""

from __future__ import annotations

import pytest
import torch

from moeflow.moe import get_adapter
from moeflow.policies import EVICTION
from moeflow.runtime.generate import build_engine, generate_one
from moeflow.runtime.link import DirectLink

from .conftest import ARCHS

NEW = 8


def _capacities(spec) -> list[int]:
    return sorted({spec.top_k, max(spec.top_k, spec.total_experts // 4), spec.total_experts})


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, 250, (1, 6), generator=g)  # [1,P]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_bit_identical(tiny_models, arch, prompt):
    model = tiny_models(arch)
    spec = get_adapter(model).spec
    with torch.no_grad():
        ref = model(prompt).logits
    for cap in (spec.top_k, spec.total_experts):
        eng = build_engine(model, mode="offload", link=DirectLink(), capacity=cap, eviction="lru", prefetch="pregate")
        with eng:
            assert eng.store.device_numel() == 0  # stacked expert tensors freed on the device
            with torch.no_grad():
                out = model(prompt).logits
        assert torch.equal(out, ref), f"{arch} C={cap}: logits differ by {(out - ref).abs().max().item():.3g}"
    with torch.no_grad():  # restored model still exact
        assert torch.equal(model(prompt).logits, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_token_identical_every_policy(tiny_models, arch, prompt):
    model = tiny_models(arch)
    spec = get_adapter(model).spec
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    assert ref.numel() == NEW
    checked = 0
    for cap in _capacities(spec):
        for ev in sorted(EVICTION):
            for pf in ("none", "pregate"):
                eng = build_engine(model, mode="offload", link=DirectLink(), capacity=cap, eviction=ev, prefetch=pf)
                with eng:
                    out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
                    assert eng.cache.num_resident() <= cap
                assert torch.equal(out, ref), f"{arch} C={cap} {ev}+{pf}: {out.tolist()} != {ref.tolist()}"
                assert m.counters.accesses > 0
                checked += 1
    assert {"lru", "lfu", "fld", "score", "lru2", "least-stale"} <= set(EVICTION)  # every policy was checked
    assert checked == len(_capacities(spec)) * len(EVICTION) * 2


@pytest.mark.parametrize("arch", ["olmoe", "gpt_oss"])
def test_on_demand_and_per_layer_exact(tiny_models, arch, prompt):
    model = tiny_models(arch)
    spec = get_adapter(model).spec
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    eng = build_engine(model, mode="on-demand", link=DirectLink())
    with eng:
        out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
        assert eng.cache.num_resident() == 0  # on-demand keeps nothing past the layer
    assert torch.equal(out, ref)
    assert m.counters.hits == 0 and m.counters.loads == m.counters.accesses
    eng = build_engine(
        model,
        mode="offload",
        link=DirectLink(),
        capacity=spec.top_k * spec.num_moe_layers,
        eviction="lru",
        prefetch="pregate",
        per_layer=True,
    )
    with eng:
        out, _ = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
        per = {l: sum(1 for k in eng.cache.slot_of if k[0] == l) for l in spec.moe_layers}
    assert torch.equal(out, ref)
    assert max(per.values()) <= spec.top_k


def test_bf16_exact(prompt):
    from moeflow.models import tiny_model

    model = tiny_model("mixtral", dtype=torch.bfloat16)
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    eng = build_engine(model, mode="offload", link=DirectLink(), capacity=2, eviction="lfu", prefetch="pregate")
    with eng:
        out, _ = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
    assert torch.equal(out, ref)


@pytest.mark.gpu
def test_cuda_link_exact(prompt):
    from moeflow.models import tiny_model
    from moeflow.runtime.link import CudaLink

    dev = torch.device("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model("olmoe", dtype=dtype).to(dev)
        ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
        for cap in (2, 6, 24):
            eng = build_engine(model, mode="offload", link=CudaLink(dev), capacity=cap, eviction="lru", prefetch="pregate")
            with eng:
                out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
                assert eng.store.rows[0].is_pinned()
            assert torch.equal(out, ref), f"cuda {dtype} C={cap}"
            assert m.link_bytes == m.counters.bytes_moved
