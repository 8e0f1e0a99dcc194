"""Where the routed experts load (`moeflow run --load-experts`): a model whose experts do not fit in device memory
loads with them in host memory only (`models.place_model`), chosen by `run_config.experts_placement`."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from moeflow.errors import ConfigError
from moeflow.models import place_model, tiny_model, weights_bytes
from moeflow.moe import get_adapter
from moeflow.moe.adapters import SUPPORTED
from moeflow.stages.run_config import FIT_SHARE, RunConfig, experts_placement

GIB = 1 << 30


def _expert_ids(model) -> set[int]:
    ad = get_adapter(model)
    return {id(p) for l in ad.spec.moe_layers for p in ad.per_expert_params(l).values()}


@pytest.mark.parametrize("arch", SUPPORTED)
def test_place_model_keeps_the_routed_experts_off_the_device(arch):
    """Everything but the stacked routed experts goes to the device (meta here, as a stand-in for CUDA); the
    experts go to `experts_device` with their values, and never pass through the device."""
    model = tiny_model(arch)
    ad = get_adapter(model)
    before = {(l, n): p.detach().clone() for l in ad.spec.moe_layers for n, p in ad.per_expert_params(l).items()}
    place_model(model, "meta", "cpu")
    ad = get_adapter(model)
    for (l, n), ref in before.items():
        got = getattr(ad.experts(l), n)
        assert got.device.type == "cpu" and torch.equal(got.detach(), ref), (l, n)
    experts = _expert_ids(model)
    others = [n for n, p in model.named_parameters() if id(p) not in experts]
    assert others and all(p.device.type == "meta" for p in model.parameters() if id(p) not in experts), others
    assert all(b.device.type == "meta" for b in model.buffers())


def test_place_model_without_experts_device_is_to():
    model = tiny_model("olmoe")
    place_model(model, "meta")
    assert all(p.device.type == "meta" for p in model.parameters())


def test_experts_placement_rule():
    # a CPU device: host and device are one memory
    assert experts_placement("host", "cpu", None, None, True) == ("device", "")
    # asked for
    assert experts_placement("device", "cuda", 100 * GIB, 10 * GIB, True)[0] == "device"
    assert experts_placement("host", "cuda", GIB, 80 * GIB, False)[0] == "host"
    # auto: fits -> device, does not fit -> host (with the sizes in the reason)
    assert experts_placement("auto", "cuda", 10 * GIB, 80 * GIB, True) == ("device", "")
    assert experts_placement("auto", "cuda", int(FIT_SHARE * 80 * GIB), 80 * GIB, True)[0] == "device"
    where, why = experts_placement("auto", "cuda", 90 * GIB, 80 * GIB, False)
    assert where == "host" and "90.0 GiB" in why and "80.0 GiB free" in why
    # a stock-model run cannot run with experts kept on the host: one line saying what to drop
    with pytest.raises(ConfigError, match="--mode resident needs every expert there; drop it"):
        experts_placement("auto", "cuda", 90 * GIB, 80 * GIB, True)
    with pytest.raises(ConfigError, match="moeflow quality`'s stock-model reference"):
        experts_placement("auto", "cuda", 90 * GIB, 80 * GIB, True, "moeflow quality")


def test_an_explicit_host_with_a_stock_model_run_is_refused():
    with pytest.raises(ConfigError, match="--mode resident runs the stock model"):
        experts_placement("host", "cuda", None, None, True)
    with pytest.raises(ConfigError, match="moeflow quality`'s stock-model reference runs the stock model"):
        experts_placement("host", "cuda", None, None, True, "moeflow quality")


def _fake_cuda(monkeypatch, free: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))


def test_placement_for_measures_the_checkpoint_against_free_memory(tiny_checkpoint, tmp_path, monkeypatch):
    """auto, on a (faked) CUDA device: the weight files' bytes in the dtype they load in against the free memory."""
    from moeflow.stages.session import placement_for

    size = weights_bytes(tiny_checkpoint)  # a float32 checkpoint
    assert size and size > 0

    def where(free: int, **kw) -> str:
        _fake_cuda(monkeypatch, free)
        cfg = RunConfig(**{"model": str(tiny_checkpoint), "prompt": ("x",), "device": "cuda", **kw})
        return placement_for(cfg, "moeflow run", False)[0]

    assert where(2 * size) == "device" and where(size) == "host"
    assert where(size, dtype="bfloat16") == "device"  # loaded in half the bytes it is saved in
    assert where(size, load_experts="device") == "device" and where(100 * size, load_experts="host") == "host"
    with pytest.raises(ConfigError, match="--mode resident needs every expert there"):
        _fake_cuda(monkeypatch, size)
        placement_for(RunConfig(model=str(tiny_checkpoint), prompt=("x",), device="cuda"), "moeflow run", True)
    # a folder that is not a checkpoint: the whole model is asked for, and load_model says what is wrong
    assert where(1, model=str(tmp_path / "nope")) == "device"


def test_weights_bytes_counts_the_indexed_files_and_not_a_quantized_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "olmoe"}))
    (tmp_path / "a.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "consolidated.safetensors").write_bytes(b"x" * 1000)  # a copy beside the shards, not listed
    assert weights_bytes(tmp_path) == 1100
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "a.safetensors"}}))
    assert weights_bytes(tmp_path) == 100
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "olmoe", "quantization_config": {"bits": 4}}))
    assert weights_bytes(tmp_path) is None  # larger once loaded than on disk: unknown
    assert weights_bytes(tmp_path / "nope") is None


def test_closing_an_engine_leaves_host_experts_in_its_rows_not_in_a_second_copy():
    """Experts that live in host memory beside a CUDA device are given back as views of the store's (pinned) rows:
    a copy held them twice in host memory when the engine closed. The model computes the same after a second round."""
    from moeflow.runtime.store import HostExpertStore

    model = tiny_model("olmoe")
    ad = get_adapter(model)
    before = {(l, n): p.detach().clone() for l in ad.spec.moe_layers for n, p in ad.per_expert_params(l).items()}
    ids = torch.tensor([[5, 9, 33, 2]])
    with torch.no_grad():
        ref = model(ids).logits
    for pinned in (True, False):  # pin: the CUDA engine's store (rows not pinned here: no CUDA runtime)
        store = HostExpertStore(ad, pin=pinned)
        store.offload()
        ptrs = {l: rows.untyped_storage().data_ptr() for l, rows in store.rows.items()}
        store.restore()
        for l in ad.spec.moe_layers:
            for n, p in ad.per_expert_params(l).items():
                assert torch.equal(p.detach(), before[l, n])
                shared = p.untyped_storage().data_ptr() == ptrs[l]
                assert shared == pinned, (pinned, l, n)  # pinned: views of the rows; else contiguous copies
                assert p.is_contiguous() or pinned
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def test_the_next_engine_takes_the_rows_a_closed_one_left_without_copying():
    """Host-loaded experts left as views of a closed engine's rows are taken as they are by the next engine's store
    (no second copy of every expert, no second pinning: a sweep's runs and warm-ups each attach an engine); rows
    the parameters are not views of (the first engine, a CPU device's contiguous copies) are copied as before."""
    from moeflow.runtime.store import HostExpertStore

    model = tiny_model("olmoe")
    ad = get_adapter(model)
    before = {(l, n): p.detach().clone() for l in ad.spec.moe_layers for n, p in ad.per_expert_params(l).items()}
    first = HostExpertStore(ad, pin=True)
    first.offload()
    ptrs = {l: rows.untyped_storage().data_ptr() for l, rows in first.rows.items()}
    first.restore()
    second = HostExpertStore(ad, pin=True)
    second.offload()
    assert {l: rows.untyped_storage().data_ptr() for l, rows in second.rows.items()} == ptrs  # taken, not copied
    for l in ad.spec.moe_layers:
        for n in ad.per_expert_params(l):
            assert torch.equal(second.layout.views(second.rows[l])[n], before[l, n])
    second.restore()
    third = HostExpertStore(ad, pin=False)  # a CPU engine: restore copies, so the next one copies too
    third.offload()
    third.restore()
    fourth = HostExpertStore(ad, pin=False)
    assert all(fourth._rows_of(ad.per_expert_params(l)) is None for l in ad.spec.moe_layers)  # contiguous copies
    fourth.offload()
    fourth.restore()
    for l in ad.spec.moe_layers:
        for n, p in ad.per_expert_params(l).items():
            assert torch.equal(p.detach(), before[l, n]) and p.is_contiguous()


def test_run_config_refuses_host_experts_with_a_resident_run():
    with pytest.raises(ConfigError, match="--mode resident runs the stock model"):
        RunConfig(model="m", prompt=("x",), device="cuda", load_experts="host", modes=("resident", "offload"), sweep=True)
    with pytest.raises(ConfigError, match="--load-experts 'gpu' unknown"):
        RunConfig(model="m", prompt=("x",), load_experts="gpu")
    RunConfig(model="m", prompt=("x",), device="cpu", load_experts="host", modes=("resident",))  # one memory on a CPU: accepted


def test_the_cli_passes_load_experts_to_the_run(monkeypatch):
    import moeflow.stages.run as run_stage
    from moeflow.cli.app import main

    seen = {}
    monkeypatch.setattr(run_stage, "main", lambda cfg: seen.setdefault("cfg", cfg))
    with pytest.raises(SystemExit) as e:
        main(["run", "-m", "m", "--prompt", "x", "--load-experts", "host"])
    assert e.value.code in (0, None) and seen["cfg"].load_experts == "host"


def test_run_with_load_experts_on_cpu_reports_where_they_loaded(ckpt_with, capsys):
    from moeflow.cli.app import main

    ckpt = ckpt_with(p_txt="the king said\n")
    args = ["run", "-m", str(ckpt), "--prompt", "the king", "--max-new-tokens", "3", "--threads", "1", "--json"]
    try:
        main([*args, "--load-experts", "host", "--no-progress"])
    except SystemExit as e:
        assert e.code in (0, None)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["experts_loaded"] == "device"  # CPU: one memory


@pytest.mark.gpu
def test_experts_loaded_on_host_offload_is_token_identical_on_cuda(tiny_checkpoint):
    """On CUDA, a model loaded with its experts in host memory (never on the device) generates through the
    offload engine exactly the tokens of the model loaded whole on the device; the experts stay on the host
    after the engine closes."""
    from moeflow.models import load_model
    from moeflow.runtime.generate import build_engine, generate_one
    from moeflow.runtime.link import CudaLink

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ids = torch.randint(3, 150, (1, 6), generator=torch.Generator().manual_seed(3))  # [1,P]
    ref_model, _ = load_model(tiny_checkpoint, device="cuda", experts_implementation="grouped_mm")
    ref, _ = generate_one(ref_model, ids, None, max_new_tokens=8, min_new_tokens=8)
    model, _ = load_model(tiny_checkpoint, device="cuda", experts_implementation="grouped_mm", experts_device="cpu")
    ad = get_adapter(model)
    assert all(p.device.type == "cpu" for l in ad.spec.moe_layers for p in ad.per_expert_params(l).values())
    assert next(model.parameters()).device.type == "cuda"
    for cap in (ad.spec.top_k * len(ad.spec.moe_layers), ad.spec.total_experts):
        link = CudaLink(torch.device("cuda"))
        eng = build_engine(model, mode="offload", link=link, capacity=cap, eviction="lru", prefetch="pregate")
        with eng:
            out, _ = generate_one(model, ids, eng, max_new_tokens=8, min_new_tokens=8)
        assert torch.equal(out, ref), (cap, out.tolist(), ref.tolist())
    assert all(p.device.type == "cpu" for l in ad.spec.moe_layers for p in ad.per_expert_params(l).values())


def test_a_trace_through_the_offload_engine_records_what_the_stock_model_routes(tiny_checkpoint, tmp_path):
    """`moeflow trace` with host-loaded experts runs through an offload engine (`host_engine`: a 25% cache, lru,
    no prefetch): its records (tokens, experts, weights, router probabilities, hidden states) equal those of the
    model traced whole with grouped_mm, the numerics the engine is exact to. On CPU here; the same engine on CUDA."""
    import numpy as np

    from moeflow.data import Prompt
    from moeflow.models import load_model
    from moeflow.stages.trace import TraceConfig, host_engine, run_trace
    from moeflow.trace.reader import Trace

    prompts = [Prompt(id=f"p{i}", text=t, source="t") for i, t in enumerate(["the king said", "to be or not to be"])]
    model, tok = load_model(tiny_checkpoint, experts_implementation="grouped_mm")
    adapter = get_adapter(model)  # built before the engine takes the experts out (as `moeflow trace` does)
    traces = []
    for name, engine in (("whole", False), ("engine", True)):
        cfg = TraceConfig(model=str(tiny_checkpoint), prompts="-", out=str(tmp_path / name), max_new_tokens=6,
                          batch_size=2, record_hidden=True, hidden_dtype="float32", progress=False)  # fmt: skip
        with host_engine(model, cfg) if engine else contextlib.nullcontext() as eng:
            run_trace(model, tok, prompts, cfg, adapter=adapter)
            if engine:
                assert eng.cache.counters.misses > 0  # the engine computed the experts (2 of 8 per layer cached)
        traces.append(Trace(tmp_path / name))
    whole, through = traces
    assert whole.num_tokens == through.num_tokens > 0
    for k, v in whole.tokens().items():
        assert np.array_equal(v, through.tokens()[k]), k
    for layer in get_adapter(model).spec.moe_layers:
        a, b = whole.layer(layer), through.layer(layer)
        assert a and set(a) == set(b)
        for k in a:
            assert np.array_equal(a[k], b[k]), (layer, k)


def test_trace_cli_runs_through_the_engine_where_the_experts_stay_on_the_host(ckpt_with, tmp_path, monkeypatch, capsys):
    """The command's host branch (taken on CUDA when the experts do not fit; forced here on CPU): loaded with the
    engine's numerics, traced through `host_engine`, said in the JSON."""
    import moeflow.stages.session as session
    from moeflow.cli.app import main
    from moeflow.trace.reader import Trace

    monkeypatch.setattr(session, "placement_for", lambda cfg, command, resident: ("host", "forced by the test"))
    ckpt = ckpt_with(p_txt="the king said\nto be or not\n")
    out = tmp_path / "tr"
    args = ["trace", "-m", str(ckpt), "-p", str(ckpt.parent / "p.txt"), "--max-new-tokens", "3", "-c", "50%"]
    with pytest.raises(SystemExit) as e:
        main([*args, "--threads", "1", "--json", "--out", str(out)])
    assert e.value.code in (0, None)
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["experts_loaded"] == "host" and res["prompts_added"] == 2 and Trace(out).num_tokens > 0


def test_trace_checks_its_engine_capacity_before_the_weights_load(ckpt_with, tmp_path, monkeypatch, capsys):
    import moeflow.stages.session as session
    from moeflow.cli.app import main

    def refuse(*a, **k):
        raise AssertionError("the model loaded before --capacity was checked")

    monkeypatch.setattr(session, "placement_for", lambda cfg, command, resident: ("host", "forced by the test"))
    monkeypatch.setattr("moeflow.models.load_model", refuse)
    ckpt = ckpt_with(p_txt="the king said\n")
    with pytest.raises(SystemExit) as e:
        main(["trace", "-m", str(ckpt), "-p", str(ckpt.parent / "p.txt"), "-c", "1", "--out", str(tmp_path / "tr")])
    assert e.value.code == 2 and "below top-k=2" in capsys.readouterr().err


def refuse_page_locking(monkeypatch) -> None:
    """Every page-locked allocation of the store fails, as cudaHostAlloc does where the host cannot lock that much."""
    import moeflow.runtime.store as store_mod

    def refuse(*a, **k):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(store_mod, "_alloc_pinned", refuse)
    monkeypatch.setattr(store_mod, "_pin_copy", refuse)


def test_experts_stay_in_pageable_memory_where_page_locking_fails(monkeypatch):
    """Page-locking many GB fails on some hosts (WSL2, capped containers): the store keeps pageable rows, says why
    once (`pin_error`), and the experts come back bit for bit."""
    from moeflow.runtime.store import HostExpertStore

    refuse_page_locking(monkeypatch)
    model = tiny_model("olmoe")
    ad = get_adapter(model)
    before = {(l, n): p.detach().clone() for l in ad.spec.moe_layers for n, p in ad.per_expert_params(l).items()}
    store = HostExpertStore(ad, pin=True)
    assert store.pin_error is None
    store.offload()
    assert store.pin_error is not None and "could not be page-locked" in store.pin_error
    assert "cudaHostAlloc" in store.pin_error  # the allocator's own words, first line
    assert "pageable" in store.pin_error and "\n" not in store.pin_error
    assert len(store.rows) == ad.spec.num_moe_layers
    store.quantize([4])  # the compact copies: pageable too, no second failure raised
    assert set(store.compact[4]) == set(ad.spec.moe_layers)
    store.restore()
    for l in ad.spec.moe_layers:
        for n, p in ad.per_expert_params(l).items():
            assert torch.equal(p.detach(), before[l, n])
    assert HostExpertStore(ad, pin=False).pin_error is None
    cpu_store = HostExpertStore(ad, pin=False)
    cpu_store.offload()
    assert cpu_store.pin_error is None  # a CPU engine asks for no page-locked memory
    cpu_store.restore()


@pytest.mark.gpu
def test_pageable_host_rows_still_give_the_resident_tokens_on_cuda(tiny_checkpoint, monkeypatch):
    """Where page-locking fails, a CUDA engine copies from pageable rows (staged by the driver): slower, and the
    tokens are still those of the model loaded whole; the experts come back to the device bit for bit."""
    from moeflow.models import load_model
    from moeflow.runtime.generate import build_engine, generate_one
    from moeflow.runtime.link import CudaLink

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    refuse_page_locking(monkeypatch)
    ids = torch.randint(3, 150, (1, 6), generator=torch.Generator().manual_seed(4))  # [1,P]
    model, _ = load_model(tiny_checkpoint, device="cuda", experts_implementation="grouped_mm")
    ref, _ = generate_one(model, ids, None, max_new_tokens=8, min_new_tokens=8)
    ad = get_adapter(model)
    before = {(l, n): p.detach().clone() for l in ad.spec.moe_layers for n, p in ad.per_expert_params(l).items()}
    eng = build_engine(
        model, mode="offload", link=CudaLink(torch.device("cuda")), capacity=ad.spec.top_k * len(ad.spec.moe_layers)
    )
    with eng:
        out, _ = generate_one(model, ids, eng, max_new_tokens=8, min_new_tokens=8)
        assert eng.store.pin_error is not None and not any(r.is_pinned() for r in eng.store.rows.values())
    assert torch.equal(out, ref), (out.tolist(), ref.tolist())
    for l in ad.spec.moe_layers:
        for n, p in ad.per_expert_params(l).items():
            assert p.device.type == "cuda" and torch.equal(p.detach(), before[l, n])
