"""Every adapter finds the MoE parts of its architecture and scores routing bit-identically."""

from __future__ import annotations

import math

import pytest
import torch

from moeflow.errors import UnsupportedModelError
from moeflow.models import tiny_config
from moeflow.moe import RouterTap, get_adapter, spec_from_config

from .conftest import ARCHS


def assert_select_is_the_routers(model, seed: int = 1) -> torch.Tensor:
    """Every MoE layer's `select` on the router's own logits gives its weights (same dtype) and indices, and
    `router_logits` its logits, on one forward of random ids [2,16] (returned)."""
    ad = get_adapter(model)
    tap = RouterTap(ad)
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad(), tap.attach():
        model(ids)
    assert set(tap.events) == set(ad.moe_layers)
    for layer, (ev,) in tap.events.items():
        w, i = ad.select(layer, ev.logits)
        assert torch.equal(i, ev.indices) and torch.equal(w, ev.weights)
        assert w.dtype == ev.weights.dtype
        assert torch.equal(ad.router_logits(layer, ev.x).reshape(ev.logits.shape), ev.logits)
    return ids


@pytest.mark.parametrize("arch", ARCHS)
def test_select_is_bit_identical_to_router(arch, tiny_models):
    assert_select_is_the_routers(tiny_models(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_spec_matches_model(arch, tiny_models):
    model = tiny_models(arch)
    spec = get_adapter(model).spec
    assert spec.arch == arch and spec.num_experts == 8
    assert spec.top_k == 2 and spec.hidden_size == 64 and spec.expert_intermediate_size == 32
    # one expert, float32, hidden H=64, intermediate I=32: gate+up [2I,H] and down [H,I] = 3*64*32 weights;
    # GPT-OSS adds the biases gate_up [2I] and down [H] = 128 more
    assert spec.expert_bytes == 4 * (3 * 64 * 32 + (2 * 32 + 64 if arch == "gpt_oss" else 0))
    assert spec_from_config(model.config) == spec


# ---- each family's scoring rule, worked out in plain Python on one row of 8 logits (k = 2) -----------

ROW = [1.0, 3.0, 2.0, 0.0, -1.0, 0.5, -0.5, 1.5]  # the two largest: expert 1 (3.0), then expert 2 (2.0)
# one outstanding expert in the first half, two good ones in the second: DeepSeek-V3's group score (sum of a
# group's 2 best) keeps the second half, a max-per-group score would keep the first
ROW2 = [4.0, -4.0, -4.0, -4.0, 1.6, 1.5, -4.0, -4.0]


def _softmax(xs: list[float]) -> list[float]:
    e = [math.exp(x - max(xs)) for x in xs]
    return [v / sum(e) for v in e]


def _top2(xs: list[float]) -> list[int]:
    return sorted(range(len(xs)), key=lambda i: -xs[i])[:2]


def _softmax_then_top2(row: list[float], norm: bool) -> dict[int, float]:
    p = _softmax(row)
    top = {i: p[i] for i in _top2(p)}
    return {i: v / sum(top.values()) for i, v in top.items()} if norm else top


def _top2_then_softmax(row: list[float]) -> dict[int, float]:
    idx = _top2(row)
    return dict(zip(idx, _softmax([row[i] for i in idx])))


def _deepseek_v3(row: list[float], correction: list[float]) -> dict[int, float]:
    """Sigmoid scores; the choice adds the correction bias; 2 groups of 4 experts scored by their 2 best choices,
    the best group kept; its top-2 choices; weights = their sigmoid scores normalised, times 2.5."""
    s = [1 / (1 + math.exp(-x)) for x in row]
    c = [a + b for a, b in zip(s, correction)]
    groups = [range(0, 4), range(4, 8)]
    best = max(groups, key=lambda g: sum(sorted((c[i] for i in g), reverse=True)[:2]))
    idx = sorted(best, key=lambda i: -c[i])[:2]
    return {i: 2.5 * s[i] / sum(s[j] for j in idx) for i in idx}


def _deepseek_v2(row: list[float]) -> dict[int, float]:
    """Softmax scores; 2 groups of 4 experts scored by their best score, the best group kept; its top-2 scores,
    not normalised, times 2.5 (`group_limited_greedy`)."""
    p = _softmax(row)
    best = max([range(0, 4), range(4, 8)], key=lambda g: max(p[i] for i in g))
    return {i: 2.5 * p[i] for i in sorted(best, key=lambda i: -p[i])[:2]}


def _ernie4_5(row: list[float], correction: list[float]) -> dict[int, float]:
    """Softmax probabilities; the top-2 of probability plus correction bias; their probabilities renormalised."""
    p = _softmax(row)
    idx = _top2([a + b for a, b in zip(p, correction)])
    return {i: p[i] / sum(p[j] for j in idx) for i in idx}


DEEPSEEK_V3_RULE = ("deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1", "exaone_moe", "solar_open")


def _as_dict(w: torch.Tensor, i: torch.Tensor) -> dict[int, float]:
    return dict(zip(i.reshape(-1).tolist(), w.reshape(-1).float().tolist()))


@pytest.mark.parametrize("arch", ARCHS)
def test_scoring_rule_matches_hand_computation(arch, tiny_models):
    ad = get_adapter(tiny_models(arch))
    l = ad.moe_layers[0]
    for row in (ROW, ROW2):
        if arch in ("olmoe", "qwen2_moe"):  # norm_topk_prob=False
            want = _softmax_then_top2(row, norm=False)
        elif arch in ("mixtral", "qwen3_moe"):  # renormalised top-k
            want = _softmax_then_top2(row, norm=True)
        elif arch in ("gpt_oss", "granitemoe"):
            want = _top2_then_softmax(row)
        elif arch in ("qwen3_next", "qwen3_5_moe_text", "hunyuan_v1_moe"):  # renormalised top-k
            want = _softmax_then_top2(row, norm=True)
        elif arch in DEEPSEEK_V3_RULE:
            want = _deepseek_v3(row, ad.router(l).e_score_correction_bias.tolist())
        elif arch == "ernie4_5_moe":
            want = _ernie4_5(row, ad.router(l).moe_statics.e_score_correction_bias.squeeze().tolist())
        elif arch == "deepseek_v2":
            if row is ROW2:  # experts 1-3 tie inside the kept group: checked below
                continue
            want = _deepseek_v2(row)
        else:  # phimoe's sparsemixer (eval): the argmax, weighted by a softmax over the logits within 2 * 0.01
            # (relative) of it; then the same for the runner-up with the winner removed. Far apart: weights 1.
            want = {1: 1.0, 2: 1.0} if row is ROW else {0: 1.0, 4: 1.0}
        got = _as_dict(*ad.select(l, torch.tensor([row])))  # logits [1,8]
        assert set(got) == set(want) and got == pytest.approx(want, rel=1e-6), (arch, row, got, want)
    if arch == "phimoe":
        near = torch.tensor([[3.0, 2.99, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]])  # (3 - 2.99) / 3 < 0.02
        assert _as_dict(*ad.select(l, near)) == pytest.approx({0: 1 / (1 + math.exp(-0.01)), 1: 1.0}, rel=1e-6)
    if arch in DEEPSEEK_V3_RULE:
        assert set(_as_dict(*ad.select(l, torch.tensor([ROW2])))) == {4, 5}
    if arch == "deepseek_v2":  # a group's score is its best single one: the first half, so not expert 4 (which a
        got = _as_dict(*ad.select(l, torch.tensor([ROW2])))  # greedy top-2 would take); its runner-up is a tie
        assert 0 in got and 4 not in got and got[0] == pytest.approx(2.5 * _softmax(ROW2)[0], rel=1e-6)


def test_selection_bias_steers_indices_not_weights(tiny_models):
    """OLMoE with +100 on expert 3: experts {3, 1} chosen, each weighted by its unbiased probability."""
    ad = get_adapter(tiny_models("olmoe"))
    bias = torch.zeros(8)
    bias[3] = 100.0
    p = _softmax(ROW)
    assert _as_dict(*ad.select(0, torch.tensor([ROW]), bias)) == pytest.approx({3: p[3], 1: p[1]}, rel=1e-6)


def test_dense_first_layers_and_shared_experts():
    assert spec_from_config(tiny_config("deepseek_v3")).moe_layers == (1, 2)
    assert spec_from_config(tiny_config("deepseek_v3")).num_shared_experts == 1
    assert spec_from_config(tiny_config("qwen2_moe")).moe_layers == (1, 2)
    assert spec_from_config(tiny_config("qwen3_moe")).num_shared_experts == 0
    for arch in ("glm4_moe", "glm4_moe_lite", "dots1", "exaone_moe", "deepseek_v2", "ernie4_5_moe"):  # 1st layer dense
        assert spec_from_config(tiny_config(arch)).moe_layers == (1, 2), arch
    assert spec_from_config(tiny_config("solar_open")).moe_layers == (0, 1, 2)  # no dense layer in this family
    # EXAONE-MoE names its shared experts num_shared_experts (DeepSeek's n_shared_experts elsewhere)
    assert spec_from_config(tiny_config("exaone_moe", num_shared_experts=2)).num_shared_experts == 2
    assert spec_from_config(tiny_config("glm4_moe", n_shared_experts=2)).num_shared_experts == 2
    assert spec_from_config(tiny_config("ernie4_5_moe", moe_num_shared_experts=2)).num_shared_experts == 2


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "phimoe"])  # phimoe's sparsemixer takes no bias
def test_a_selection_bias_chooses_its_expert_and_a_zero_bias_changes_nothing(arch, tiny_models):
    """Cache-aware routing adds a bias to the selection scores: +100 on expert 3 puts it in every row's choice
    (a group-limited rule keeps its group), and a zero bias gives exactly the unbiased result."""
    ad = get_adapter(tiny_models(arch))
    l = ad.moe_layers[0]
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    w0, i0 = ad.select(l, logits)
    wz, iz = ad.select(l, logits, torch.zeros(8))
    assert torch.equal(i0.sort(-1).values, iz.sort(-1).values) and torch.allclose(w0.sum(-1), wz.sum(-1))
    bias = torch.zeros(8)
    bias[3] = 100.0
    w, i = ad.select(l, logits, bias)
    assert (i == 3).any(dim=-1).all() and torch.isfinite(w).all() and (w > 0).all()


def test_an_unknown_deepseek_v2_topk_method_is_refused_when_the_model_loads():
    from moeflow.models import tiny_model

    with pytest.raises(UnsupportedModelError, match="topk_method 'noaux_tc' is not supported"):
        get_adapter(tiny_model("deepseek_v2", topk_method="noaux_tc"))


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

    cfg = AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(UnsupportedModelError, match="supported architectures: deepseek_v2, deepseek_v3, dots1"):
        get_adapter(model)


def test_adapter_of_an_offloaded_model_says_why(tiny_models):
    from moeflow.models import tiny_model
    from moeflow.runtime.generate import build_engine
    from moeflow.runtime.link import DirectLink

    model = tiny_model("olmoe")
    with build_engine(model, mode="offload", link=DirectLink(), capacity=4, eviction="lru", prefetch="none"):
        with pytest.raises(UnsupportedModelError, match="offloaded by a moeflow engine"):
            get_adapter(model)
    assert get_adapter(model).spec.num_experts == 8  # restored on close


def test_deepseek_v2_greedy_top_k_is_bit_identical_too():
    """DeepSeek-V2-Lite routes `greedy` (top-k of every expert), the larger V2 `group_limited_greedy` (the matrix's
    tiny config); both give the router's own weights and indices."""
    from moeflow.models import tiny_model

    model = tiny_model("deepseek_v2", topk_method="greedy")
    assert_select_is_the_routers(model, seed=2)
    ad = get_adapter(model)
    assert _as_dict(*ad.select(ad.moe_layers[0], torch.tensor([ROW2])))[4] > 0  # greedy: not limited to a group


def test_a_qwen3_5_moe_checkpoint_loads_as_its_text_model_and_offloads_exactly(tmp_path):
    """A Qwen3.5-MoE checkpoint is multimodal (`qwen3_5_moe`, a text and a vision config): `--model` loads its text
    model (`qwen3_5_moe_text`, what `AutoModelForCausalLM` builds from it, with the checkpoint's weights), which
    moeflow adapts; its spec reads from the config alone too (`moeflow ep`)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from moeflow.models import load_model
    from moeflow.runtime.generate import build_engine, generate_one
    from moeflow.runtime.link import DirectLink

    text = tiny_config("qwen3_5_moe_text", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    text = {k: v for k, v in text.to_dict().items() if k not in ("model_type", "transformers_version")}
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
    cfg = AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=vision)
    torch.manual_seed(0)
    full = AutoModelForImageTextToText.from_config(cfg).eval()
    full.save_pretrained(tmp_path / "q")
    model, _ = load_model(tmp_path / "q", dtype="float32", tokenizer=False)
    ad = get_adapter(model)
    assert ad.spec.arch == "qwen3_5_moe_text" and ad.spec.num_experts == 8 and ad.spec.num_shared_experts == 1
    assert spec_from_config(AutoConfig.from_pretrained(tmp_path / "q")) == ad.spec
    ids = torch.tensor([[5, 77, 120, 33, 201, 9]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, full(input_ids=ids).logits)  # the checkpoint's weights, text only
    ref, _ = generate_one(model, ids, None, max_new_tokens=6, min_new_tokens=6)
    with build_engine(model, mode="offload", link=DirectLink(), capacity=2, eviction="lru", prefetch="pregate") as eng:
        out, _ = generate_one(model, ids, eng, max_new_tokens=6, min_new_tokens=6)
    assert torch.equal(out, ref)


def test_a_router_that_casts_its_weights_to_its_input_dtype_is_matched_in_bf16():
    """ERNIE-4.5-MoE's router computes in fp32 and casts the weights to its input's dtype: in a bf16 model the
    adapter's weights are bf16 and equal to the router's (`ArchInfo.weights_in_input_dtype`), and offloaded greedy
    generation stays token-identical."""
    from moeflow.models import tiny_model
    from moeflow.runtime.generate import build_engine, generate_one
    from moeflow.runtime.link import DirectLink

    model = tiny_model("ernie4_5_moe", dtype=torch.bfloat16)
    ids = assert_select_is_the_routers(model)  # the weights' dtype included
    assert get_adapter(model).select(1, torch.zeros(1, 8))[0].dtype == torch.bfloat16
    prompt = ids[:1, :6]
    ref, _ = generate_one(model, prompt, None, max_new_tokens=6, min_new_tokens=6)
    with build_engine(model, mode="offload", link=DirectLink(), capacity=2, eviction="lru", prefetch="pregate") as eng:
        out, _ = generate_one(model, prompt, eng, max_new_tokens=6, min_new_tokens=6)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_learned_predictors_run_time_ops_read_every_familys_router(arch, tiny_models):
    """`moeflow.predict.fast.LayerOps` (the learned prefetchers' run-time path) reads each router's weight where the
    family keeps it (`Adapter.router_weight`: HunYuan's is `gate.wg.weight`) and gives its logits and selection."""
    from moeflow.predict.fast import LayerOps

    ad = get_adapter(tiny_models(arch))
    ops = LayerOps(ad, list(ad.moe_layers))
    x = torch.randn(5, ad.spec.hidden_size, generator=torch.Generator().manual_seed(4))
    for l in ad.moe_layers:
        with torch.no_grad():
            want = ad.router_logits(l, x.to(ad.router_weight(l).dtype)).float().numpy()
        got = ops.logits(l, x.numpy())
        assert got.shape == want.shape and abs(got - want).max() <= 1e-4 * max(1.0, abs(want).max()), arch
        _, ids = ops.select(l, got)
        assert ids.shape == (5, ad.spec.top_k)


def test_a_different_top_k_per_layer_is_refused():
    """HunYuan accepts a per-layer `moe_topk` list; MoESpec holds one top-k (capacity checks, prefetch sets, the
    trace's columns), so such a model is refused in one line instead of being read with its first layer's k."""
    from moeflow.models import tiny_model

    with pytest.raises(UnsupportedModelError, match=r"different top-k per layer \(2, 3\)"):
        get_adapter(tiny_model("hunyuan_v1_moe", moe_topk=[2, 3, 2]))


@pytest.mark.parametrize("arch", ARCHS)
def test_fingerprint_counts_every_tensor_that_routes(arch, tiny_models):
    """The fingerprint changes with any tensor of a router (weight, bias, DeepSeek-V3's correction bias, ...), and a
    router holding only its weight hashes as it did before the other tensors counted (artifacts stay valid)."""
    import copy
    import hashlib

    from moeflow.artifacts import config_fingerprint
    from moeflow.moe import model_fingerprint

    model = copy.deepcopy(tiny_models(arch))
    ad = get_adapter(model)
    before = model_fingerprint(model)
    router = ad.router(ad.moe_layers[-1])
    tensors = dict(router.named_parameters())
    tensors.update(router.named_buffers())
    weights_only = hashlib.sha256()
    for l in ad.moe_layers:
        weights_only.update(ad.router_weight(l).detach().float().contiguous().numpy().tobytes())
    assert (before == config_fingerprint(model.config, weights_only.digest())) == (len(tensors) == 1)
    for name, t in tensors.items():
        kept = t.detach().clone()
        with torch.no_grad():
            t.add_(0.5)
        assert model_fingerprint(model) != before, name
        with torch.no_grad():
            t.copy_(kept)
        assert model_fingerprint(model) == before


@pytest.mark.parametrize("arch", ARCHS)
def test_the_routing_load_of_a_bf16_checkpoint_routes_as_its_float32_load(arch, tiny_models, tmp_path):
    """`models.load_routing_model` (train, eval, simulate, tune: the experts kept in the checkpoint's dtype, the rest
    float32) gives the router logits, weights (values and dtype) and experts of the whole model loaded in float32."""
    import copy

    from moeflow.models import load_model, load_routing_model

    copy.deepcopy(tiny_models(arch)).to(torch.bfloat16).save_pretrained(tmp_path)
    full, _ = load_model(tmp_path, dtype="float32", tokenizer=False)
    narrow = load_routing_model(tmp_path)
    a, b = get_adapter(full), get_adapter(narrow)
    x = torch.randn(16, a.spec.hidden_size, generator=torch.Generator().manual_seed(0))  # [T,H]
    for layer in a.moe_layers:
        assert next(iter(b.per_expert_params(layer).values())).dtype == torch.bfloat16
        la, lb = a.router_logits(layer, x), b.router_logits(layer, x)
        assert torch.equal(la, lb)
        (wa, ia), (wb, ib) = a.select(layer, la), b.select(layer, lb)
        assert torch.equal(ia, ib) and torch.equal(wa, wb) and wa.dtype == wb.dtype
