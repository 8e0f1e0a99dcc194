"""Missed experts computed beside the device (`moeflow.runtime.host_worker`) and `auto`'s cost model.

- the threaded host path (`cpu`, `auto`) is token- and logit-identical to the resident model and to the
  serial host path, on the tiny models at several capacities, decode and prefill (several waves);
- the overlap counters: 0 <= host wait <= host time, hidden share in [0, 1], host time > 0 when cpu
  misses happen, the same figures in `RunMetrics`;
- `auto` on hand-made costs: fetch for an expert with high expected reuse, cpu for one with none; the
  reuse it learns from hits on the experts it fetched;
- CUDA (`gpu`): the side-stream path gives the same logits as the serial host path.
"""

from __future__ import annotations

import pytest
import torch

from moeflow.moe import get_adapter
from moeflow.policies import MISS
from moeflow.policies.base import CPU, FETCH, MissInfo
from moeflow.runtime.generate import build_engine, generate_one
from moeflow.runtime.host_worker import hidden_share
from moeflow.runtime.link import DirectLink

NEW = 6
# host compute cheap against a copy for 1 token, dear for 2 or more: auto mixes cpu and fetch
MIXED = {"host_s": 1e-4, "per_token_s": 1e-4, "copy_s": 2.5e-4, "prior": 0.5}


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(3, 250, (1, 7), generator=g)  # [1,P]


def _logits(model, prompt: torch.Tensor, steps: int = 3) -> torch.Tensor:
    """Logits [1+steps, V] of the prefill's last position and `steps` greedy decode steps (KV cache)."""
    from moeflow.moe.tx_compat import kv_cache_kwargs

    rows = []
    kv = kv_cache_kwargs(model)  # filled in place by each call
    with torch.no_grad():
        out = model(prompt, use_cache=True, **kv)
        rows.append(out.logits[0, -1])
        for _ in range(steps):
            nxt = rows[-1].argmax().view(1, 1)  # [1,1]
            out = model(nxt, use_cache=True, **kv)
            rows.append(out.logits[0, -1])
    return torch.stack(rows)


def _engine(model, cap: int, miss: str, threaded: bool, miss_opts=None):
    eng = build_engine(model, mode="offload", link=DirectLink(), capacity=cap, eviction="lru", miss=miss, miss_opts=miss_opts)
    assert eng is not None
    eng.host_worker = threaded
    return eng


@pytest.mark.parametrize("arch", ["olmoe", "gpt_oss"])
def test_threaded_host_path_identical(tiny_models, prompt, arch):
    """cpu and auto with the host worker: the same tokens and bit-identical logits as resident and as the
    serial host path, at top-k (prefill needs several waves) and at a quarter of the experts."""
    model = tiny_models(arch)
    spec = get_adapter(model).spec
    ref_out, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    ref_logits = _logits(model, prompt)
    for cap in sorted({spec.top_k, max(spec.top_k, spec.total_experts // 4)}):
        for miss, opts in (("cpu", None), ("auto", MIXED)):
            got = {}
            for threaded in (True, False):
                eng = _engine(model, cap, miss, threaded, opts)
                with eng:
                    logits = _logits(model, prompt)
                    out, _m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
                    assert eng.miss_counts["cpu"] > 0, f"{arch} C={cap} {miss}: no host expert ran"
                    assert (eng._call.host is not None) == threaded  # type: ignore[union-attr]
                assert torch.equal(out, ref_out), f"{arch} C={cap} {miss} threaded={threaded}"
                assert torch.equal(logits, ref_logits), f"{arch} C={cap} {miss} threaded={threaded}"
                got[threaded] = logits
            assert torch.equal(got[True], got[False])


def test_overlap_counters(tiny_models, prompt):
    model = tiny_models("olmoe")
    eng = _engine(model, 2, "cpu", True)
    with eng:
        _out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
        assert eng.miss_counts["cpu"] > 0
        assert eng.host_s > 0 and 0 <= eng.host_wait_s <= eng.host_s
        share = eng.host_hidden_share
        assert share is not None and 0.0 <= share <= 1.0
    assert 0 < m.host_s <= eng.host_s and 0 <= m.host_wait_s <= m.host_s
    d = m.to_dict()
    assert d["host_hidden_share"] == pytest.approx(1 - m.host_wait_s / m.host_s)
    serial = _engine(model, 2, "cpu", False)
    with serial:
        generate_one(model, prompt, serial, max_new_tokens=NEW, min_new_tokens=NEW)
        assert serial.host_s > 0 and serial.host_hidden_share == 0.0  # serial: nothing hidden
    fetch = _engine(model, 2, "fetch", True)
    with fetch:
        _o, mf = generate_one(model, prompt, fetch, max_new_tokens=NEW, min_new_tokens=NEW)
        assert fetch._call.host is None and fetch.host_s == 0 and fetch.host_hidden_share is None  # type: ignore[union-attr]
    assert mf.to_dict()["host_hidden_share"] is None
    assert hidden_share(2.0, 0.5) == 0.75 and hidden_share(0.0, 0.0) is None and hidden_share(1.0, 2.0) == 0.0


def _info(tokens: int = 1, resident=lambda k: True) -> MissInfo:
    return MissInfo(rank=1, score=0.5, tokens=tokens, resident=resident)


def test_auto_cost_model_counts_reuse():
    """host(1) = 1e-4 s, copy = 3e-4 s. cpu costs host now + reuse x host(1) later (never cached):
    reuse 0 -> 1e-4 < 3e-4: cpu; reuse 4 -> 5e-4 > 3e-4: fetch. Without reuse counted (the per-miss rule)
    both would go to the host."""
    none = MISS.create("auto", host_s=1e-4, per_token_s=0.0, copy_s=3e-4, reuse=0.0)
    high = MISS.create("auto", host_s=1e-4, per_token_s=0.0, copy_s=3e-4, reuse=4.0)
    assert none.costs(1) == pytest.approx((1e-4, 3e-4)) and high.costs(1) == pytest.approx((5e-4, 3e-4))
    assert none.on_miss((0, 1), None, _info()) == CPU
    assert high.on_miss((0, 1), None, _info()) == FETCH
    assert none.decisions == {FETCH: 0, CPU: 1} and high.decisions == {FETCH: 1, CPU: 0}
    # the host time the device hides is not a cost: half hidden -> high's cpu costs 2.5e-4 < 3e-4
    high._hidden = lambda: 0.5
    assert high.costs(1) == pytest.approx((2.5e-4, 3e-4)) and high.on_miss((0, 2), None, _info()) == CPU


def test_auto_learns_reuse_from_hits():
    """prior 0 (one pseudo-fetch without hits), decay 1: a 3-token miss (host 3e-4 > copy 2.5e-4) is fetched;
    the call that fetched it is no hit; two later calls needing it are two hits -> reuse = 2 / 2 fetches = 1,
    so a 1-token miss now costs 1e-4 + 1e-4 = 2e-4 on the host... still cpu; one more hit -> 1.5 -> 2.5e-4,
    not below the copy: fetch. An evicted expert earns no hits."""
    pol = MISS.create("auto", host_s=1e-4, per_token_s=1e-4, copy_s=2.5e-4, prior=0.0, decay=1.0)
    assert pol.reuse == 0.0
    assert pol.on_miss((3, 5), None, _info(tokens=3)) == FETCH
    pol.observe(3, {5: 1.0})  # the fetching call itself
    assert pol.reuse == 0.0
    pol.observe(3, {5: 0.7})
    pol.observe(4, {5: 0.7})  # another layer: not this expert
    pol.observe(3, {5: 0.2, 6: 0.1})
    assert pol.reuse == pytest.approx(1.0)
    assert pol.on_miss((3, 9), None, _info(tokens=1)) == CPU
    pol.observe(3, {5: 0.3})
    assert pol.reuse == pytest.approx(1.5)
    assert pol.on_miss((3, 9), None, _info(tokens=1)) == FETCH
    gone = MISS.create("auto", host_s=1e-4, per_token_s=1e-4, copy_s=2.5e-4, prior=0.0, decay=1.0)
    assert gone.on_miss((3, 5), None, _info(tokens=3, resident=lambda k: False)) == FETCH
    gone.observe(3, {5: 1.0})
    gone.observe(3, {5: 1.0})  # not resident any more: no hit
    assert gone.reuse == 0.0


@pytest.mark.gpu
def test_cuda_side_stream_matches_serial(prompt):
    """On CUDA the host worker copies rows to pinned memory on a side stream, computes on its thread and
    copies back; the compute stream waits on an event. Same host kernels as the serial path: identical."""
    from moeflow.models import tiny_model

    model = tiny_model("olmoe").to("cuda")
    got = {}
    for threaded in (True, False):
        eng = build_engine(model, mode="offload", link=DirectLink(), capacity=2, eviction="lru", miss="cpu")
        assert eng is not None
        eng.host_worker = threaded
        with eng:
            got[threaded] = _logits(model, prompt.to("cuda"))
            assert eng.miss_counts["cpu"] > 0 and eng.host_s > 0
            assert 0 <= eng.host_wait_s <= eng.host_s
    assert torch.equal(got[True], got[False])
