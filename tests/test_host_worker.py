"""Missed experts computed beside the device (`moeflow.runtime.host_worker`) and `auto`'s cost model.

- the threaded host path (`cpu`, `auto`) is token- and logit-identical to the resident model and to the
  serial host path, on the tiny models at several capacities, decode and prefill (several waves);
- a CPU device's all-host calls: serial, split between the worker and the calling thread, or measured
  (`SplitChoice`: the faster mode, the other explored), each token-identical;
- the overlap counters: 0 <= host wait <= host time, hidden share in [0, 1], host time > 0 when cpu
  misses happen, the same figures in `RunMetrics`;
- `auto` on hand-made costs: fetch for an expert with high expected reuse, cpu for one with none; cpu on
  a very slow link, fetch on a very fast one when the device is much faster than the host; on a CPU device
  (device compute = host compute at the measured slowdown) cpu at any link speed and reuse; the reuse it
  learns from hits on the experts it fetched; the host path's slowdown and hidden share and the copy's wait
  it measures, and that the engine feeds them;
- CUDA (`gpu`): the side-stream path gives the same logits as the serial host path.
"""

from __future__ import annotations

import pytest
import torch

from moeflow.errors import ConfigError
from moeflow.moe import get_adapter
from moeflow.policies import MISS
from moeflow.policies.base import CPU, FETCH, BindContext, MissInfo
from moeflow.runtime.generate import build_engine, generate_one
from moeflow.runtime.host_worker import SplitChoice, hidden_share
from moeflow.runtime.link import DirectLink

NEW = 6
# host compute cheap against a copy for 1 token, dear for 2 or more, the device's compute free (GPU-like):
# auto mixes cpu and fetch
MIXED = {"host_s": 1e-4, "per_token_s": 1e-4, "copy_s": 2.5e-4, "device_s": 0.0, "prior": 0.5, "calibrate": False}


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
                    assert (eng.host is not None) == threaded
                assert torch.equal(out, ref_out), f"{arch} C={cap} {miss} threaded={threaded}"
                assert torch.equal(logits, ref_logits), f"{arch} C={cap} {miss} threaded={threaded}"
                got[threaded] = logits
            assert torch.equal(got[True], got[False])


def test_a_cpu_device_runs_host_experts_on_a_worker_only_at_one_thread(tiny_models, prompt):
    """On a CPU device the host worker attaches only at one torch thread (each thread's kernels then run at the count
    the resident model runs at); at two, cpu computes its host experts serially at the user's count, which it leaves
    alone: the logits are the resident model's at that count, bit for bit, on every CPU (a kernel's last bits may
    depend on the count: MKL's sgemm on AMD EPYC); fetch never has a worker."""
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    was = torch.get_num_threads()
    try:
        cap = max(spec.top_k, spec.total_experts // 4)
        for n, miss, worker in ((2, "cpu", False), (1, "cpu", True), (2, "fetch", False), (1, "fetch", False)):
            torch.set_num_threads(n)
            ref_logits = _logits(model, prompt)  # resident, n threads
            eng = _engine(model, cap, miss, True)
            with eng:
                assert (eng.host is not None) == worker and torch.get_num_threads() == n, (n, miss)
                logits = _logits(model, prompt)
                if miss == "cpu":
                    assert eng.miss_counts["cpu"] > 0
            assert torch.get_num_threads() == n
            assert torch.equal(logits, ref_logits), (n, miss)
    finally:
        torch.set_num_threads(was)


def _count_submits(eng) -> list[int]:
    """Spy on the attached engine's host worker: the number of rows of each job handed to it."""
    host = eng.host
    real, rows = host.submit, []

    def spy(x, eg, compute):
        rows.append(x.shape[0])
        return real(x, eg, compute)

    host.submit = spy
    return rows


def test_all_host_call_split_or_serial(tiny_models, prompt):
    """On a CPU device a call whose every expert is a host expert (cpu at a small capacity: nothing ever gets a
    slot): serial (`SplitChoice` forced False) computes them on the calling thread, nothing handed to the
    worker, nothing hidden; split (forced True) hands the worker part of them (at most all but one expert's
    rows) while the calling thread computes the rest; measured (the default) uses both modes. Tokens exact;
    a call with experts in slots too (auto, mixing cpu and fetch) hands all its host experts to the worker."""
    model = tiny_models("olmoe")
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    for forced in (False, True, None):
        eng = _engine(model, 2, "cpu", True)
        with eng:
            split = eng.host.split
            split.forced = forced
            jobs = _count_submits(eng)
            out, _m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
            assert eng.cache.num_resident() == 0 and eng.miss_counts["cpu"] > 0 and eng.host_s > 0
            if forced is False:
                assert jobs == [] and eng.host_wait_s == eng.host_s and split.used[True] == 0
            elif forced is True:
                assert len(jobs) == split.used[True] > 0 and split.used[False] == 0 and eng.host_wait_s < eng.host_s
            else:
                assert split.used[True] > 0 and split.used[False] > 0 and len(jobs) == split.used[True]
        assert torch.equal(out, ref), f"forced={forced}"
    mixed = _engine(model, 8, "auto", True, MIXED)
    with mixed:
        jobs = _count_submits(mixed)
        out, _m = generate_one(model, prompt, mixed, max_new_tokens=NEW, min_new_tokens=NEW)
        assert mixed.miss.decisions[FETCH] > 0 and len(jobs) > 0 and 0 < sum(jobs)
    assert torch.equal(out, ref)


def test_split_choice_follows_the_faster_mode():
    """`SplitChoice`: each mode tried once per size class, then the faster one, the other every `explore`-th
    call; a class's means are its own; `forced` wins."""
    c = SplitChoice(explore=4, decay=0.5)
    assert c.pick(4) is True
    c.record(4, True, 2.0)
    assert c.pick(4) is False
    c.record(4, False, 1.0)
    assert [c.pick(4) for _ in range(6)] == [False, True, False, False, False, True]  # calls 3..8: 4th and 8th explore
    c.record(4, True, 0.1)  # split became faster: 0.5 x 2.0 + 0.5 x 0.1 = 1.05 > 1.0, still serial
    assert c.pick(4) is False
    c.record(4, True, 0.1)  # 0.575 < 1.0
    assert c.pick(4) is True
    assert c.pick(64) is True  # another size class: untried
    assert SplitChoice(forced=False).pick(4) is False and SplitChoice(forced=True).pick(4) is True


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
        assert fetch.host is None and fetch.host_s == 0 and fetch.host_hidden_share is None
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


def test_auto_decides_a_calls_misses_at_once(tiny_models, prompt):
    """`Auto.on_misses`: one cost evaluation per distinct token count of the call (not one per miss), the
    same actions and bookkeeping as asking `on_miss` miss by miss when one decision does not move the next
    (reuse fixed); the engine's router hook uses it (auto mixing cpu and fetch, tokens exact)."""
    opts = {**MIXED, "reuse": 0.0}  # host(1) = 1e-4 < 2.5e-4 copy: cpu; host(3) = 3e-4 > 2.5e-4: fetch
    one, batch = MISS.create("auto", **opts), MISS.create("auto", **opts)
    experts, infos = [3, 5, 9, 12], [(1, 0.5, 1), (2, 0.4, 3), (1, 0.3, 1), (3, 0.2, 3)]
    res = lambda k: True  # noqa: E731
    each = [one.on_miss((2, e), None, MissInfo(*i, res)) for e, i in zip(experts, infos)]
    evaluated = []
    real = batch.costs
    batch.costs = lambda t: evaluated.append(t) or real(t)  # type: ignore[method-assign]
    assert batch.on_misses(2, experts, infos, None, res) == each == [CPU, FETCH, CPU, FETCH]
    assert sorted(evaluated) == [1, 3]  # once per token count
    assert batch.decisions == one.decisions and batch.fetches == one.fetches and batch.hits == one.hits
    assert batch._sent == pytest.approx(one._sent) and batch._followed == one._followed and batch._fresh == one._fresh
    model = tiny_models("olmoe")
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    eng = _engine(model, 8, "auto", True, MIXED)
    with eng:
        calls = []
        real_many = eng.miss.on_misses
        eng.miss.on_misses = lambda *a: calls.append(len(a[1])) or real_many(*a)
        out, _m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
        assert calls and sum(calls) == sum(eng.miss.decisions.values()) and eng.miss.decisions[CPU] > 0
    assert torch.equal(out, ref)


class _Link:
    """A link whose copy of one expert takes `copy_s` (its bandwidth model)."""

    def __init__(self, copy_s: float):
        self.copy_s = copy_s

    def transfer_estimate_s(self, nbytes: int) -> float:
        return self.copy_s


def _bound_auto(copy_s: float, model=None, **opts):
    """`auto` bound to a fake engine: host(n) = 1e-4 + 1e-5 (n - 1) s, one copy `copy_s`; `model` None: a
    device of unknown kind (its compute taken as free unless `device_s` is given)."""
    pol = MISS.create("auto", **opts)
    pol.bind(
        BindContext(
            model=model,
            adapter=None,
            link=_Link(copy_s),
            expert_bytes=1000,
            time_host_expert=lambda n: 1e-4 + 1e-5 * (n - 1),
            time_row_copy=lambda: 1.0,
        )
    )
    return pol


def test_auto_slow_link_cpu_fast_link_fetch():
    """Timings from `bind`: host(1) = 1e-4 s (+1e-5 per token); reuse 1 (the prior) -> cpu costs 2e-4 per
    1-token miss. A 10 ms copy (slow link) -> cpu, also for a 64-token prefill miss (7.3e-4 + 1e-4);
    a 10 us copy (fast link) -> fetch."""
    slow, fast = _bound_auto(1e-2), _bound_auto(1e-5)
    assert slow.estimate(8) == pytest.approx((1.7e-4, 1e-2)) and slow.costs(1) == pytest.approx((2e-4, 1e-2))
    assert slow.on_miss((0, 1), None, _info(tokens=1)) == CPU
    assert slow.on_miss((0, 2), None, _info(tokens=64)) == CPU
    assert fast.on_miss((0, 1), None, _info(tokens=1)) == FETCH
    assert fast.decisions == {FETCH: 1, CPU: 0}


def test_auto_cpu_device_counts_its_compute():
    """A CPU device (the model's parameters on the host): device(n) = host(n), the same kernel, so a fetch
    costs the copy's wait on top of the compute cpu costs: cpu on a slow and on a very fast link (1 us copy),
    for 1 and 64 tokens, at any expected reuse. `device_s` = host_s gives the same model."""
    cpu_model = torch.nn.Linear(2, 2)
    for copy_s in (1e-2, 1e-6):
        for reuse in (0.0, 1.0, 100.0):
            for opts in ({}, {"device_s": 1e-4}):
                pol = _bound_auto(copy_s, cpu_model, reuse=reuse, **opts)
                assert pol.device(1) == pytest.approx(1e-4) and pol.device(64) == pytest.approx(pol.estimate(64)[0])
                work = pol.estimate(64)[0] + reuse * 1e-4  # host(64) + reuse x host(1)
                assert pol.costs(64) == pytest.approx((work, copy_s + work))
                assert pol.on_miss((0, 1), None, _info(tokens=1)) == CPU
                assert pol.on_miss((0, 2), None, _info(tokens=64)) == CPU
    assert _bound_auto(1e-6, None).device(1) == 0.0  # a device of unknown kind: free, as before


def test_auto_cpu_device_slowdown_counts_on_both_sides():
    """CPU device, copy 1.5e-4: the host path measured at 2x the kernel (slowdown 2, waited for in full) is
    the same kernel the device would run under the same load, so device(1) = 2e-4 too: a fetch still only adds
    the copy -> cpu at reuse 0 and 4 (the device's compute free, both would be fetched: 2e-4 x (1 + reuse) >
    1.5e-4). `device_s` given: the device's own time, not scaled."""
    for reuse in (0.0, 4.0):
        pol = _bound_auto(1.5e-4, torch.nn.Linear(2, 2), reuse=reuse, decay=1.0)
        pol.measured(0.0, 0.0, 0.0, 0)
        assert _send(pol, 0, 3e-4, 3e-4) == CPU  # the prior: slowdown 1
        assert pol.slowdown == pytest.approx(2.0) and pol.device(1) == pytest.approx(2e-4)
        assert pol.costs(1) == pytest.approx((2e-4 * (1 + reuse), 1.5e-4 + 2e-4 * (1 + reuse)))
        assert pol.on_miss((1, 7), None, _info()) == CPU
    given = _bound_auto(1.5e-4, torch.nn.Linear(2, 2), reuse=4.0, decay=1.0, device_s=1e-4)
    given.measured(0.0, 0.0, 0.0, 0)
    _send(given, 0, 3e-4, 3e-4)
    assert given.device(1) == pytest.approx(1e-4) and given.on_miss((1, 7), None, _info()) == FETCH


def test_auto_gpu_like_device_keeps_link_decisions():
    """A device 100x faster than the host (device_s = 1e-6, host 1e-4; even with the model on the CPU: a
    given `device_s` wins): fetch on a fast link (10 us copy: 1e-5 + 2e-6 < 2e-4), cpu on a slow one (10 ms)."""
    for model in (None, torch.nn.Linear(2, 2)):
        fast, slow = _bound_auto(1e-5, model, device_s=1e-6), _bound_auto(1e-2, model, device_s=1e-6)
        assert fast.device(1) == pytest.approx(1e-6) and fast.costs(1) == pytest.approx((2e-4, 1e-5 + 2e-6))
        assert fast.on_miss((0, 1), None, _info(tokens=1)) == FETCH
        assert fast.on_miss((0, 2), None, _info(tokens=64)) == FETCH
        assert slow.on_miss((0, 1), None, _info(tokens=1)) == CPU
        assert slow.on_miss((0, 2), None, _info(tokens=64)) == CPU
    with pytest.raises(ConfigError, match="device_s must be >= 0"):
        MISS.create("auto", device_s=-1.0)


def test_auto_on_cpu_engine_sends_every_miss_to_the_host(tiny_models, prompt):
    """On the tiny CPU model a 1 us copy against a 1 ms host kernel (fetch before the device's compute was
    counted): every miss goes to the host, since fetching only adds the copy; tokens exact."""
    model = tiny_models("olmoe")
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    eng = _engine(model, 4, "auto", True, {"host_s": 1e-3, "per_token_s": 0.0, "copy_s": 1e-6, "calibrate": False})
    with eng:
        out, _m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
        assert eng.miss.decisions[CPU] > 0 and eng.miss.decisions[FETCH] == 0
    assert torch.equal(out, ref)


def _send(pol, layer: int, path_s: float, wait_s: float, stall_s: float = 0.0, waited: int = 0) -> object:
    """One layer: ask `pol` about a 1-token miss, then report the engine's totals grown by the host path /
    wait / stall / loads given (what the router hook of the next layer passes to `measured`)."""
    act = pol.on_miss((layer, 7), None, _info(tokens=1))
    h, w, st, n = pol._last
    pol.measured(h + path_s, w + wait_s, st + stall_s, n + waited)
    return act


def test_auto_calibrates_host_path():
    """host(1) = 1e-4, copy 3e-4, reuse 1: cost_cpu = 2e-4 x slowdown x (1 - hidden), cpu at first.
    A host path measured 3x the kernel and waited for in full (3e-4 per expert): after one such layer
    slowdown = (1e-4 + 3e-4) / (1e-4 + 1e-4) = 2 -> cpu costs 4e-4 > 3e-4: fetch. The same 3x path but
    80% hidden (wait 0.6e-4): ratio (1e-4 + 0.6e-4) / 2e-4 = 0.8 -> 1.6e-4: still cpu.
    With `calibrate=False` the kernel model stays."""
    opts = {"host_s": 1e-4, "per_token_s": 0.0, "copy_s": 3e-4, "reuse": 1.0, "decay": 1.0}
    waited = MISS.create("auto", **opts)
    waited.measured(0.0, 0.0, 0.0, 0)
    assert _send(waited, 0, 3e-4, 3e-4) == CPU
    assert waited.slowdown == pytest.approx(2.0) and waited.hidden == 0.0
    assert waited.costs(1) == pytest.approx((4e-4, 3e-4))
    assert waited.on_miss((1, 7), None, _info()) == FETCH
    hidden = MISS.create("auto", **opts)
    hidden.measured(0.0, 0.0, 0.0, 0)
    assert _send(hidden, 0, 3e-4, 0.6e-4) == CPU
    assert hidden.hidden == pytest.approx(1 - 1.6e-4 / 4e-4) and hidden.costs(1)[0] == pytest.approx(1.6e-4)
    assert hidden.on_miss((1, 7), None, _info()) == CPU
    fixed = MISS.create("auto", **opts, calibrate=False)
    fixed.measured(0.0, 0.0, 0.0, 0)
    _send(fixed, 0, 3e-4, 3e-4)
    assert fixed.costs(1) == pytest.approx((2e-4, 3e-4)) and fixed.on_miss((1, 7), None, _info()) == CPU


def test_auto_calibrates_copy_wait():
    """host(1) = 2e-4, reuse 0, the link's estimate of a copy 1e-4: fetch. The compute measured waiting 5e-4
    per load (queued behind copies in flight): the copy's cost (1e-4 + 5e-4) / 2 loads = 3e-4 > 2e-4: cpu."""
    pol = MISS.create("auto", host_s=2e-4, per_token_s=0.0, copy_s=1e-4, reuse=0.0, decay=1.0)
    pol.measured(0.0, 0.0, 0.0, 0)
    assert _send(pol, 0, 0.0, 0.0, stall_s=5e-4, waited=1) == FETCH
    assert pol.costs(1) == pytest.approx((2e-4, 3e-4))
    assert pol.on_miss((1, 7), None, _info()) == CPU


def test_auto_forgets_toward_its_prior():
    """decay 0.5: one load measured waiting 5e-4 (link estimate 1e-4) makes a copy cost
    (0.5 x 1e-4 + 0.5 x 1e-4 + 5e-4) / (0.5 + 0.5 + 1) = 3e-4 > host 2e-4: cpu. With no copy waited for
    since (auto chose cpu), each update moves the copy's cost about halfway back to the link's 1e-4: after 10
    updates it is within 1e-6 of it, below the host's 2e-4, so fetch is tried again."""
    pol = MISS.create("auto", host_s=2e-4, per_token_s=0.0, copy_s=1e-4, reuse=0.0, decay=0.5)
    pol.measured(0.0, 0.0, 0.0, 0)
    assert _send(pol, 0, 0.0, 0.0, stall_s=5e-4, waited=1) == FETCH
    assert pol.costs(1)[1] == pytest.approx(3e-4)
    assert pol.on_miss((1, 7), None, _info()) == CPU
    for _ in range(10):
        pol.measured(*pol._last)  # the totals unchanged: no copy waited for
    assert pol.costs(1)[1] == pytest.approx(1e-4, abs=1e-6)
    assert pol.on_miss((0, 7), None, _info()) == FETCH


def test_engine_feeds_auto_its_timings(tiny_models, prompt):
    """The router hook hands `auto` the engine's running totals (host path, host wait, stall, loads waited
    for): non-decreasing, never past the engine's own; auto's measured ratios move off their priors; the
    tokens stay the model's (those of `fetch`)."""
    model = tiny_models("olmoe")
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)  # = fetch's (exact)
    eng = _engine(model, 2, "auto", True, {"host_s": 1e-4, "per_token_s": 1e-4, "copy_s": 1.0})  # cpu at first
    calls = []
    with eng:
        pol = eng.miss
        real = pol.measured

        def spy(*totals):
            calls.append(totals)
            real(*totals)

        pol.measured = spy
        out, _m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
        assert eng.miss_counts["cpu"] > 0 and len(calls) > 1
        for i in range(4):
            col = [c[i] for c in calls]
            assert col == sorted(col)
        assert 0 < calls[-1][0] <= eng.host_s and 0 <= calls[-1][1] <= eng.host_wait_s
        assert pol.slowdown != 1.0 and 0.0 <= pol.hidden <= 1.0
    assert torch.equal(out, ref)


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


def test_benchmark_pinned_auto_makes_the_pinned_choices(tiny_models, prompt):
    """`benchmarks/cpu_vs_fetch.py --pinned`: auto with the priors of `auto=fetch` fetches every miss and with
    those of `auto=cpu` sends every miss to the host, calibrating as usual on a slow and on a fast emulated link,
    so its TPOT differs from the policy's by its overhead only; tokens exact. `rotation` puts every policy at
    every position once over as many turns as there are policies."""
    import importlib.util
    from pathlib import Path

    from moeflow.runtime.link import EmulatedLink

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_vs_fetch.py"
    spec = importlib.util.spec_from_file_location("cpu_vs_fetch", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = tiny_models("olmoe")
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    for gbps in (0.01, 100.0):
        for name, side in (("auto=fetch", FETCH), ("auto=cpu", CPU)):
            miss, opts = bench.PINNED[name]
            eng = build_engine(
                model, mode="offload", link=EmulatedLink(gbps, 1e-5), capacity=4, eviction="lru", miss=miss, miss_opts=opts
            )
            with eng:
                out, _m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
                dec = eng.miss.decisions
            assert dec[side] > 0 and sum(dec.values()) == dec[side], f"{name} @ {gbps} GB/s: {dec}"
            assert torch.equal(out, ref)
    pols = ("fetch", "cpu", "auto", *bench.PINNED)
    turns = [bench.rotation(t, 1, pols) for t in range(len(pols))]
    assert all(sorted(col) == sorted(pols) for col in zip(*turns))


def test_benchmark_side_by_side_cancels_drift_between_rounds():
    """`benchmarks/cpu_vs_fetch.py`'s `side_by_side`: auto equal to cpu in every round while the machine runs
    rounds at 1x and 2x speed gives 1.0; against two others it is auto over the faster (the larger of the two
    ratios), each the median round's ratio."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_vs_fetch.py"
    spec = importlib.util.spec_from_file_location("cpu_vs_fetch", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    drift = [1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0]
    auto = [10.0 * d for d in drift]
    cpu = [10.0 * d for d in drift]
    fetch = [12.0 * d for d in drift]
    assert bench.side_by_side(auto, fetch, cpu) == pytest.approx(1.0)
    assert bench.side_by_side([11.0 * d for d in drift], fetch, cpu) == pytest.approx(1.1)
    assert bench.side_by_side(auto, fetch) == pytest.approx(10 / 12)
