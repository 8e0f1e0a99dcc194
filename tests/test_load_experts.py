"""Where the routed experts load (`moeflow run --load-experts`): a model whose experts do not fit in device memory
loads with them in host memory only (`models.place_model`), chosen by `session.experts_placement`."""

from __future__ import annotations

import json

import pytest
import torch

from moeflow.errors import ConfigError
from moeflow.models import place_model, tiny_model
from moeflow.moe import get_adapter
from moeflow.stages.run_config import RunConfig
from moeflow.stages.session import FIT_SHARE, experts_placement

GIB = 1 << 30


def _expert_ids(model) -> set[int]:
    ad = get_adapter(model)
    return {id(p) for l in ad.spec.moe_layers for p in ad.per_expert_params(l).values()}


@pytest.mark.parametrize("arch", ["olmoe", "mixtral", "qwen3_moe"])
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


def test_run_config_refuses_host_experts_with_a_resident_run():
    with pytest.raises(ConfigError, match="--mode resident runs the stock model"):
        RunConfig(model="m", prompt=("x",), device="cuda", load_experts="host", modes=("resident", "offload"), sweep=True)
    with pytest.raises(ConfigError, match="--load-experts 'gpu' unknown"):
        RunConfig(model="m", prompt=("x",), load_experts="gpu")
    RunConfig(model="m", prompt=("x",), device="cpu", load_experts="host", modes=("resident",))  # one memory on a CPU: accepted


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
