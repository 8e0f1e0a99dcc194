"""Every adapter finds the MoE parts of its architecture and scores routing bit-identically."""

from __future__ import annotations

import pytest
import torch

from moeflow.errors import UnsupportedModelError
from moeflow.moe import RouterTap, get_adapter, spec_from_config
from moeflow.models import tiny_config

from .conftest import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_select_is_bit_identical_to_router(arch, tiny_models):
    model = tiny_models(arch)
    ad = get_adapter(model)
    tap = RouterTap(ad)
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), tap.attach():
        model(ids)
    assert set(tap.events) == set(ad.moe_layers)
    for layer, (ev,) in tap.events.items():
        w, i = ad.select(layer, ev.logits)
        assert torch.equal(i, ev.indices) and torch.equal(w, ev.weights)
        assert w.dtype == ev.weights.dtype
        assert torch.equal(ad.router_logits(layer, ev.x).reshape(ev.logits.shape), ev.logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_spec_matches_model(arch, tiny_models):
    model = tiny_models(arch)
    spec = get_adapter(model).spec
    assert spec.arch == arch and spec.num_experts == 8
    assert spec.top_k == 2 and spec.hidden_size == 64
    # expert bytes = the per-expert slices of every stacked tensor
    ex = get_adapter(model).experts(spec.moe_layers[0])
    want = sum(p[0].numel() * p.element_size() for p in ex.parameters(recurse=False) if p.shape[0] == 8)
    assert spec.expert_bytes == want
    assert spec_from_config(model.config) == spec


def test_dense_first_layers_and_shared_experts():
    assert spec_from_config(tiny_config("deepseek_v3")).moe_layers == (1, 2)
    assert spec_from_config(tiny_config("deepseek_v3")).num_shared_experts == 1
    assert spec_from_config(tiny_config("qwen2_moe")).moe_layers == (1, 2)
    assert spec_from_config(tiny_config("qwen3_moe")).num_shared_experts == 0


def test_bias_steers_selection(tiny_models):
    model = tiny_models("olmoe")
    ad = get_adapter(model)
    logits = torch.randn(5, 8)
    bias = torch.zeros(8)
    bias[3] = 100.0
    _, idx = ad.select(0, logits, bias)
    assert (idx == 3).any(dim=-1).all()


def test_unsupported_architecture_is_refused():
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_size=32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(UnsupportedModelError, match="supported architectures: deepseek_v3, gpt_oss"):
        get_adapter(model)


def test_adapter_of_an_offloaded_model_says_why(tiny_models):
    from moeflow.runtime.generate import build_engine
    from moeflow.runtime.link import DirectLink
    from moeflow.models import tiny_model
    model = tiny_model("olmoe")
    with build_engine(model, mode="offload", link=DirectLink(), capacity=4, eviction="lru", prefetch="none"):
        with pytest.raises(UnsupportedModelError, match="offloaded by a moeflow engine"):
            get_adapter(model)
    assert get_adapter(model).spec.num_experts == 8          # restored on close
