"""The all-hit decode MoE layer: weights read in place from the slots, no more aten ops than the stock layer.

With every expert in a ready slot (capacity = all routed experts, warmed) a decode step's MoE block
- gathers no expert weights (no `index_select`: `entry_sorted_forward` reads the slots' span in place) and
  runs as many grouped matmuls as the stock `grouped_mm` block, deferred (no prefetch) or pinned (pregate);
- deferred, runs no more aten ops than the stock block (counted at the dispatcher: deterministic, unlike timings);
- returns exactly the stock block's output, in float32 and bfloat16, decode steps and the prefill alike;
- falls back to gathering the weights when the slots' span is wider than `MAX_GROUPS`, still exact.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moeflow.models import tiny_model
from moeflow.moe import get_adapter
from moeflow.runtime import experts_call
from moeflow.runtime.generate import build_engine, generate_one
from moeflow.runtime.link import DirectLink

NEW = 5
ARCHS = ("olmoe", "mixtral", "qwen2_moe", "gpt_oss")  # plain, another router, shared expert, biases + transposed


class _Ops(TorchDispatchMode):
    """The aten ops dispatched while active (names)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _run(model, adapter, engine, prompt) -> tuple[torch.Tensor, list[list[str]], list[torch.Tensor]]:
    """Greedy tokens; the aten ops of every decode-step MoE block call (one token); every MoE block's output."""
    ops: list[list[str]] = []
    outs: list[torch.Tensor] = []
    active: list[_Ops] = []

    def enter(module, args):
        if args[0].numel() == args[0].shape[-1]:  # a decode step: one token
            active.append(_Ops())
            active[-1].__enter__()

    def leave(module, args, output):
        if active:
            mode = active.pop()
            mode.__exit__(None, None, None)
            ops.append(mode.ops)
        outs.append((output[0] if isinstance(output, tuple) else output).detach().clone())

    handles = []
    for l in adapter.moe_layers:
        handles.append(adapter.moe_block(l).register_forward_pre_hook(enter))
        handles.append(adapter.moe_block(l).register_forward_hook(leave))
    try:
        out, _ = generate_one(model, prompt, engine, max_new_tokens=NEW, min_new_tokens=NEW)
    finally:
        for h in handles:
            h.remove()
    return out, ops, outs


def _prompt(n: int = 6) -> torch.Tensor:
    return torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(5))  # [1,P]


def _all_resident(model, prefetch: str):
    spec = get_adapter(model).spec
    return build_engine(model, mode="offload", link=DirectLink(), capacity=spec.total_experts, eviction="lru", prefetch=prefetch)


def _stock_and_all_resident(model, adapter, prompt, prefetch: str):
    """The stock run and the warmed all-resident engine's run (no miss), checked equal in tokens and in every MoE
    block's output: (stock tokens, stock block outputs, stock decode ops, engine decode ops)."""
    ref, ref_ops, ref_outs = _run(model, adapter, None, prompt)
    eng = _all_resident(model, prefetch)
    with eng:
        eng.warm()
        out, ops, outs = _run(model, adapter, eng, prompt)
        assert eng.cache.counters.misses == 0
    assert torch.equal(out, ref)
    assert len(outs) == len(ref_outs) and all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
    return ref, ref_outs, ref_ops, ops


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefetch", ["none", "pregate"])
def test_all_hit_decode_reads_weights_in_place(tiny_models, arch, prefetch):
    model = tiny_models(arch)
    adapter = get_adapter(model)
    _, _, ref_ops, ops = _stock_and_all_resident(model, adapter, _prompt(), prefetch)
    assert len(ops) == len(ref_ops) == (NEW - 1) * adapter.spec.num_moe_layers
    for got, stock in zip(ops, ref_ops):
        assert "index_select" not in got, f"{arch}+{prefetch}: expert weights gathered: {got}"
        assert got.count("_grouped_mm") == stock.count("_grouped_mm")
        if prefetch == "none":  # deferred: the mechanism alone (pregate adds its own prediction and host read)
            assert len(got) <= len(stock), f"{arch}+{prefetch}: {len(got)} aten ops > stock {len(stock)}: {got}"


@pytest.mark.parametrize("prefetch", ["none", "pregate"])
def test_all_hit_bf16_exact(prefetch):
    """bf16, a prompt long enough that a token's experts repeat across tokens (the prefill's rows of one expert
    keep the stock order), and a top-k whose experts are spread over non-adjacent slots after evictions."""
    model = tiny_model("olmoe", dtype=torch.bfloat16)
    adapter = get_adapter(model)
    prompt = _prompt(24)
    ref, ref_outs, _, _ = _stock_and_all_resident(model, adapter, prompt, prefetch)
    spec = adapter.spec
    half = build_engine(
        model, mode="offload", link=DirectLink(), capacity=spec.total_experts // 2, eviction="lru", prefetch=prefetch
    )
    with half:  # slots reused across layers: pinned waves over scattered slots
        out, _, outs = _run(model, adapter, half, prompt)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))


def test_wide_span_gathers(tiny_models, monkeypatch):
    """A span wider than `MAX_GROUPS` slots gathers the weights (as before), still exact."""
    model = tiny_models("olmoe")
    adapter = get_adapter(model)
    monkeypatch.setattr(experts_call, "MAX_GROUPS", 1)
    _, _, _, ops = _stock_and_all_resident(model, adapter, _prompt(), "none")
    assert all(o.count("index_select") == 2 for o in ops)  # up and down weights gathered


# ---- a decode step off the CPU: the batched_mm mirror -------------------------------------------------------


@pytest.fixture(scope="module")
def bench():
    """`benchmarks/decode_ops.py`, loaded as a module: its CPU emulation of a GPU's decode (`decode_switch_on_cpu`,
    `as_on_a_gpu`) serves these tests too."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_ops.py"
    spec = importlib.util.spec_from_file_location("decode_ops_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def decode_switch_on_cpu(bench):
    """The stock `grouped_mm` model decodes with `batched_mm` on the CPU, as `generate` does off it, and the engine
    mirrors it (`benchmarks/decode_ops.py:decode_switch_on_cpu`)."""
    from moeflow.moe import tx_compat

    if tx_compat.decode_batched() is None:
        pytest.skip("this transformers has no batched_mm decode switch")
    with bench.decode_switch_on_cpu():
        yield


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefetch", ["none", "pregate"])
@pytest.mark.parametrize("in_order", [True, False])
def test_decode_mirrors_batched_mm_bit_for_bit(tiny_models, arch, prefetch, in_order, decode_switch_on_cpu, monkeypatch):
    """Every decode-step MoE block of the all-resident engine equals the stock block decoding with `batched_mm` bit
    for bit (prefill: the grouped call, as the stock prefill), with no sort and no more aten ops than the stock
    `batched_mm` block when deferred: the layer's own stacked slots indexed by expert id where its experts sit in
    slots lo..lo+E-1 in order (`in_order`, as `warm` loads them), else each row's slot through the device table."""
    if not in_order:  # as if the slots were dealt in another order: the table path
        layout = experts_call.ExpertsCall._layer_layout

        def no_order(self, layer):
            return layout(self, layer)[0], None

        monkeypatch.setattr(experts_call.ExpertsCall, "_layer_layout", no_order)
    model = tiny_models(arch)
    adapter = get_adapter(model)
    _, _, ref_ops, ops = _stock_and_all_resident(model, adapter, _prompt(), prefetch)
    assert all("bmm" in o for o in ref_ops)  # the stock decode ran batched_mm
    for got, stock in zip(ops, ref_ops):
        assert "sort" not in got and "_grouped_mm" not in got and got.count("bmm") == stock.count("bmm")
        if prefetch == "none":  # the table path: one more, the slot lookup (`table[ids]`)
            more = 0 if in_order else 1
            assert len(got) <= len(stock) + more, f"{arch}: {len(got)} aten ops > stock batched_mm {len(stock)}: {got}"


def test_decode_mirror_over_scattered_slots_bf16(decode_switch_on_cpu):
    """bf16, half the experts cached: pinned waves over slots reused across layers, decode steps mirrored where all
    routed experts are resident, the grouped general path elsewhere; tokens as the stock batched_mm decode."""
    model = tiny_model("olmoe", dtype=torch.bfloat16)
    adapter = get_adapter(model)
    prompt = _prompt(24)
    ref, _, _ = _run(model, adapter, None, prompt)
    spec = adapter.spec
    eng = build_engine(model, mode="offload", link=DirectLink(), capacity=spec.total_experts // 2, eviction="lru")
    calls = [0]
    inner = experts_call.entry_batched_forward

    def spy(*a, **k):
        calls[0] += 1
        return inner(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(experts_call, "entry_batched_forward", spy)
        with eng:
            out, _, _ = _run(model, adapter, eng, prompt)
    assert torch.equal(out, ref)
    assert calls[0] > 0  # some decode calls found every routed expert resident and were mirrored


def test_decode_mirror_only_inside_generates_decode_stage(tiny_models, decode_switch_on_cpu):
    """The mirror follows transformers' decode stage, not the shape of a pass: a one-token prompt's prefill (one
    row, outside the stage) keeps the grouped call, as the stock prefill does, and so does a one-token forward
    outside `generate` (`moeflow quality` streams tokens so): each MoE block equals the stock one bit for bit."""
    model = tiny_models("olmoe")
    adapter = get_adapter(model)
    prompt = _prompt(1)  # [1,1]
    ref, _, ref_outs = _run(model, adapter, None, prompt)
    with torch.no_grad():
        ref_logits = model(prompt).logits
    eng = _all_resident(model, "none")
    with eng:
        eng.warm()
        out, _, outs = _run(model, adapter, eng, prompt)
        with torch.no_grad():
            logits = model(prompt).logits  # a one-token pass outside generate: not the decode stage
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
    assert torch.equal(logits, ref_logits)
    assert "_optimize_model_for_decode" not in vars(model)  # detached: the stock method again


def test_decode_mirror_gathers_at_most_its_cap(tiny_models, decode_switch_on_cpu, monkeypatch):
    """Above `BATCHED_GATHER_MAX` bytes of gathered weights a decode call keeps the in-place sorted grouped call
    (no weights gathered), still exact in tokens."""
    model = tiny_models("olmoe")
    adapter = get_adapter(model)
    prompt = _prompt()
    ref, _, _ = _run(model, adapter, None, prompt)
    monkeypatch.setattr(experts_call, "BATCHED_GATHER_MAX", adapter.spec.top_k * adapter.spec.expert_bytes - 1)
    eng = _all_resident(model, "none")
    with eng:
        eng.warm()
        out, ops, _ = _run(model, adapter, eng, prompt)
    assert torch.equal(out, ref)
    assert all("bmm" not in o and "_grouped_mm" in o for o in ops)


def test_decode_stage_wrappers_nest_and_unwind(tiny_models):
    """`tx_compat.decode_stage` on a model that already has one (two engines' worth): both flags follow generate's
    decode stage, the inner exit restores the outer wrapper and the outer exit the class method."""
    from moeflow.moe import tx_compat

    model = tiny_models("olmoe")
    name = "_optimize_model_for_decode"
    a: list[bool] = []
    b: list[bool] = []
    with tx_compat.decode_stage(model, a.append):
        outer = vars(model)[name]
        with tx_compat.decode_stage(model, b.append):
            generate_one(model, _prompt(), None, max_new_tokens=3, min_new_tokens=3)
        assert vars(model)[name] is outer
    assert name not in vars(model)
    assert a[:2] == [True, False] and b[:2] == [True, False]  # entered and left the decode stage once


def test_decode_host_work_as_on_a_gpu_stays_near_the_stock_decode(bench, monkeypatch, capsys):
    """`benchmarks/decode_ops.py` (the ops a GPU would launch, counted on the CPU with CUDA faked): the all-resident
    engine issues at most one more non-view aten op per MoE layer per decode token than the stock `batched_mm`
    decode (the pass's routing read: 4 ops per token), and one CUDA event per token (the replay's marker); the
    sorted grouped call or a replay that packs each routing alone would exceed it."""
    import json
    import sys

    monkeypatch.setattr(sys, "argv", ["decode_ops.py", "--experts", "16", "--top-k", "4", "--layers", "6", "--tokens", "5"])
    bench.main()
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["misses"] == 0 and res["layers"] == 6
    assert 0 <= res["extra_ops_per_token"] <= res["layers"], res  # 4 per token: the replay's stacks and copies
    assert res["engine_cuda_calls_per_token"]["event_new"] <= 1.0
    assert torch.cuda.Event is not bench.CountingEvent  # restored
