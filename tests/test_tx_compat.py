"""The transformers shim (`moeflow.moe.tx_compat`) fails loudly when transformers changes what the offload
engine uses: `_grouped_linear`'s behaviour and signature, the experts registry, the experts module's attributes,
and the tested version range. Everything else in moeflow goes through the shim."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from moeflow.errors import MoeflowError
from moeflow.moe import get_adapter, tx_compat

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_check():
    """Re-run the cached checks in the test, and again afterwards (so a patched transformers never sticks)."""
    tx_compat._checked.cache_clear()
    yield
    tx_compat._checked.cache_clear()


def _loops(x: list[list[float]], w: list, offs: list[int], transposed: bool, bias=None) -> list[list[float]]:
    """out[i][o] = sum_j x[i][j] * W_g[o][j] (+ bias[i][o]) for row i in group g, by plain Python loops."""
    out, start = [], 0
    for g, end in enumerate(offs):
        for i in range(start, end):
            n_out = len(w[g][0]) if transposed else len(w[g])
            row = []
            for o in range(n_out):
                s = sum(x[i][j] * (w[g][j][o] if transposed else w[g][o][j]) for j in range(len(x[i])))
                row.append(s + (bias[i][o] if bias is not None else 0.0))
            out.append(row)
        start = end
    return out


def test_grouped_linear_is_a_grouped_matmul(fresh_check):
    # torch's grouped GEMM wants 16-byte strides: in = out = 4 float32
    x = [
        [1.0, 2.0, 0.0, 0.0],
        [0.0, 1.0, -1.0, 2.0],
        [2.0, 0.0, 1.0, 0.0],
        [1.0, 1.0, 1.0, 1.0],
        [-1.0, 0.0, 3.0, 0.5],
    ]  # [S=5, in=4]
    eye = [[1.0 if o == j else 0.0 for j in range(4)] for o in range(4)]
    w = [
        eye,  # expert 0: identity
        [[5.0] * 4] * 4,  # expert 1: no rows
        [[1.0, 1.0, 1.0, 1.0], [2.0, 0.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 4.0]],
    ]  # expert 2
    offs = [2, 2, 5]  # rows 0-1 -> expert 0, none -> 1, rows 2-4 -> expert 2
    got = tx_compat.grouped_linear(torch.tensor(x), torch.tensor(w), torch.tensor(offs, dtype=torch.int32))
    # by hand: row 0 through the identity; row 2 = [2+0+1+0, 4+0-1+0, 0, 0]; row 4 = [2.5, -5, 0, 2]
    assert got[0].tolist() == [1.0, 2.0, 0.0, 0.0]
    assert got[2].tolist() == [3.0, 3.0, 0.0, 0.0] and got[4].tolist() == [2.5, -5.0, 0.0, 2.0]
    assert got.tolist() == _loops(x, w, offs, transposed=False)
    # transposed weights [G, in, out] and a per-row bias [S, out]
    wt = [[list(col) for col in zip(*m, strict=True)] for m in w]
    bias = [[0.5, -0.5, 0.0, 1.0]] * 5
    got = tx_compat.grouped_linear(
        torch.tensor(x), torch.tensor(wt), torch.tensor(offs, dtype=torch.int32), bias=torch.tensor(bias), is_transposed=True
    )
    assert got[2].tolist() == [3.5, 2.5, 0.0, 1.0]
    assert got.tolist() == _loops(x, wt, offs, transposed=True, bias=bias)


def test_experts_registry_dispatches_to_a_registered_function(fresh_check):
    from moeflow.models import tiny_model

    model = tiny_model("olmoe", num_experts=8, top_k=2, num_hidden_layers=2)
    assert model.config._experts_implementation == "grouped_mm"
    stock = tx_compat.registered_experts("grouped_mm")
    assert callable(stock)
    calls = []

    def spy(module, hidden_states, top_k_index, top_k_weights):
        calls.append(tuple(top_k_index.shape))
        return stock(module, hidden_states, top_k_index, top_k_weights)

    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.no_grad():
        ref = model(ids).logits
    name = "moeflow-test-spy"
    tx_compat.register_experts(name, spy)
    tx_compat.register_experts(name, spy)  # idempotent
    try:
        assert tx_compat.registered_experts(name) is spy
        model.set_experts_implementation(name)
        with torch.no_grad():
            out = model(ids).logits
    finally:
        model.set_experts_implementation("grouped_mm")
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        ALL_EXPERTS_FUNCTIONS._global_mapping.pop(name, None)
    assert calls == [(4, 2), (4, 2)]  # one call per MoE layer, T=4 tokens, top-2
    assert torch.equal(out, ref)
    for l in get_adapter(model).moe_layers:
        tx_compat.check_experts_module(get_adapter(model).experts(l))


def test_check_names_the_version_when_transformers_is_outside_the_range(fresh_check, monkeypatch):
    import transformers

    tx_compat.check()  # the installed version is supported
    monkeypatch.setattr(transformers, "__version__", "6.1.0")
    tx_compat._checked.cache_clear()
    with pytest.raises(tx_compat.TransformersVersionError) as e:
        tx_compat.check()
    msg = str(e.value)
    assert isinstance(e.value, MoeflowError) and "\n" not in msg
    assert "transformers 6.1.0" in msg and f">={tx_compat.TESTED[0]},<{tx_compat.TESTED[1]}" in msg


def test_check_refuses_a_changed_grouped_linear_or_registry(fresh_check, monkeypatch):
    from transformers.integrations import moe

    def changed(input, weight, offsets, bias=None):  # renamed / dropped parameters
        raise AssertionError("must not be called")

    monkeypatch.setattr(moe, "_grouped_linear", changed)
    with pytest.raises(tx_compat.TransformersVersionError, match="_grouped_linear"):
        tx_compat.grouped_linear(torch.zeros(1, 1), torch.zeros(1, 1, 1), torch.ones(1, dtype=torch.int32))
    monkeypatch.undo()
    tx_compat._checked.cache_clear()
    monkeypatch.delattr(moe, "_grouped_linear")
    with pytest.raises(tx_compat.TransformersVersionError, match=r"has no transformers\.integrations\.moe\._grouped_linear"):
        tx_compat.check()
    monkeypatch.undo()
    tx_compat._checked.cache_clear()
    monkeypatch.setattr(moe.ALL_EXPERTS_FUNCTIONS, "_global_mapping", None, raising=False)
    with pytest.raises(tx_compat.TransformersVersionError, match="ALL_EXPERTS_FUNCTIONS"):
        tx_compat.check()


def test_check_experts_module_names_missing_attributes():
    with pytest.raises(tx_compat.TransformersVersionError, match="has_gate, has_bias"):
        tx_compat.check_experts_module(torch.nn.Linear(2, 2))


def test_the_signature_the_shim_expects_is_the_installed_one():
    from transformers.integrations import moe

    assert tuple(inspect.signature(moe._grouped_linear).parameters) == tx_compat.GROUPED_LINEAR_PARAMS


@pytest.fixture
def fresh_decode_batched():
    tx_compat.decode_batched.cache_clear()
    yield
    tx_compat.decode_batched.cache_clear()


def test_decode_batched_is_the_batched_kernel_where_generate_switches(fresh_check, fresh_decode_batched, monkeypatch):
    """`decode_batched`: transformers' `_batched_linear` where its generate has the decode-stage switch
    (`_optimize_model_for_decode`); None when either is missing or the kernel's signature changed."""
    from transformers.generation.utils import GenerationMixin
    from transformers.integrations import moe

    assert hasattr(GenerationMixin, "_optimize_model_for_decode")  # the installed transformers switches
    assert tx_compat.decode_batched() is moe._batched_linear
    assert tuple(inspect.signature(moe._batched_linear).parameters) == tx_compat.BATCHED_LINEAR_PARAMS
    x, w = torch.randn(3, 4), torch.randn(3, 5, 4)  # [S,in], [S,out,in]
    assert torch.allclose(tx_compat.decode_batched()(x, w, bias=None, is_transposed=False), torch.einsum("soi,si->so", w, x))
    for patch in (
        lambda: monkeypatch.delattr(GenerationMixin, "_optimize_model_for_decode"),
        lambda: monkeypatch.setattr(moe, "_batched_linear", lambda input, weight, bias=None: input),
    ):
        patch()
        tx_compat.decode_batched.cache_clear()
        assert tx_compat.decode_batched() is None
        monkeypatch.undo()


def test_only_the_shim_touches_transformers_private_moe_internals():
    offenders = []
    for p in (REPO / "moeflow").rglob("*.py"):
        if p.name == "tx_compat.py":
            continue
        text = p.read_text()
        for needle in ("_grouped_linear", "_batched_linear", "_global_mapping", "integrations.moe", "ALL_EXPERTS_FUNCTIONS"):
            if needle in text:
                offenders.append(f"{p.relative_to(REPO)}: {needle}")
    assert offenders == []


# ---- code health: one implementation of each shared piece, names that cannot be confused, no import cycle ----


def _code(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def test_predict_does_not_import_policies():
    """policies.learned imports predict (lazily); predict must not import policies back (no cycle)."""
    bad = []
    for p in (REPO / "moeflow" / "predict").rglob("*.py"):
        for node in ast.walk(_code(p)):
            if isinstance(node, ast.ImportFrom) and node.module and "policies" in node.module.split("."):
                bad.append(f"{p.name}: from {'.' * node.level}{node.module}")
    assert bad == []


def test_public_class_names_are_unique():
    seen: dict[str, list[str]] = {}
    for p in (REPO / "moeflow").rglob("*.py"):
        for node in _code(p).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                seen.setdefault(node.name, []).append(str(p.relative_to(REPO)))
    assert {n: ps for n, ps in seen.items() if len(ps) > 1} == {}
    # ExpertFlow's S formula has one implementation (runtime/stepsize.py, below runtime; calibrate re-exports it)
    defs = [
        str(p.relative_to(REPO))
        for p in (REPO / "moeflow").rglob("*.py")
        for node in _code(p).body
        if isinstance(node, ast.FunctionDef) and node.name in ("s_formula", "ceil_s", "initial_step_size")
    ]
    assert sorted(defs) == ["moeflow/runtime/stepsize.py"] * 3


def test_only_moe_hooks_reaches_the_residual_norm():
    """Every post-attention residual (trace, engine, speculative routing, learned prefetch) comes from moe.hooks."""
    users = set()
    for p in (REPO / "moeflow").rglob("*.py"):
        for node in ast.walk(_code(p)):
            if (isinstance(node, ast.Attribute) and node.attr == "post_attention_layernorm") or (
                isinstance(node, ast.Constant) and node.value == "post_attention_layernorm"
            ):
                users.add(str(p.relative_to(REPO)))
    assert users == {"moeflow/moe/hooks.py"}


def test_residual_hooks_give_the_router_input_before_its_norm():
    from moeflow.models import tiny_model
    from moeflow.moe import RouterTap, residual_hooks

    model = tiny_model("mixtral", num_experts=4, top_k=2, num_hidden_layers=2)
    ad = get_adapter(model)
    resid: dict[int, torch.Tensor] = {}
    tap = RouterTap(ad)
    with torch.no_grad(), residual_hooks(ad, resid.__setitem__), tap.attach():
        model(torch.tensor([[3, 1, 4, 1, 5]]))
    for l in ad.moe_layers:
        assert resid[l].shape == (5, model.config.hidden_size)
        assert torch.equal(ad.layers[l].post_attention_layernorm(resid[l]), tap.events[l][0].x)
    # hooks are gone after the block
    assert all(not ad.layers[l].post_attention_layernorm._forward_pre_hooks for l in ad.moe_layers)


def test_a_layer_without_the_norm_is_refused_or_skipped():
    from types import SimpleNamespace

    from moeflow.errors import UnsupportedModelError
    from moeflow.moe import residual_hooks

    fake = SimpleNamespace(moe_layers=(0,), layers=[torch.nn.Identity()], spec=SimpleNamespace(arch="toy"))
    with pytest.raises(UnsupportedModelError, match=r"toy layer 0 has no post_attention_layernorm .*; trace without"):
        with residual_hooks(fake, lambda l, r: None, hint="trace without --record-hidden"):
            pass
    with residual_hooks(fake, lambda l, r: None, hint=None):  # the engine: skip such layers
        pass


def test_recall_at_k_by_hand_for_arrays_and_tensors():
    import numpy as np

    from moeflow.moe.sets import recall_at_k, topk_hits

    pred, truth = [[1, 2], [3, 4], [5, 6]], [[2, 1], [4, 7], [8, 9]]  # hits 2, 1, 0 of k=2 -> 3/6
    assert recall_at_k(np.array(pred), np.array(truth)) == 0.5
    assert recall_at_k(torch.tensor(pred), torch.tensor(truth)) == 0.5
    assert topk_hits(torch.tensor(pred), torch.tensor(truth)).tolist() == [2, 1, 0]
    assert np.isnan(recall_at_k(np.zeros((0, 2)), np.zeros((0, 2))))
    # the evaluation's sums use the same count: scores put experts 2, 1 / 4, 0 / 0, 3 on top
    from moeflow.predict.evaluate import row_metrics

    scores = torch.tensor([[0, 0.3, 0.6, 0, 0.1], [0.2, 0, 0, 0, 0.8], [0.5, 0, 0, 0.4, 0.1]])
    m = row_metrics(scores, torch.tensor([[2, 1], [4, 3], [1, 2]]), mass=1.0)  # [T,3]: hits@k, in mass set, set size
    assert m[:, 0].tolist() == [2.0, 1.0, 0.0] and m.shape == (3, 3)


def test_one_option_and_capacity_parser_for_every_command():
    from moeflow.policies import parse
    from moeflow.stages import run_config as config
    from moeflow.stages.simulate import capacity_slots

    assert (config.parse_capacity, config.parse_opts, config.opts_dict) == (
        parse.parse_capacity,
        parse.parse_opts,
        parse.opts_dict,
    )
    typed = parse.opts_dict(parse.parse_opts(["overfetch=1.5", "lookahead=2", "right-x=none", "flag=True", "f=lru"]))
    assert typed == {"overfetch": 1.5, "lookahead": 2, "right_x": None, "flag": True, "f": "lru"}
    assert parse.parse_policy("pregate:overfetch=1.5,lookahead=2,right-x=none,flag=True,f=lru") == ("pregate", typed)
    # simulate takes the same capacity spellings as run: experts, percent, bytes (1 KiB / 512 B = 2 experts)
    assert capacity_slots("1KiB", 64, 512) == parse.parse_capacity("1KiB", total_experts=64, expert_bytes=512) == 2
    assert capacity_slots("25%", 64, 512) == 16
