"""Mixed precision: HQQ compact copies of experts, low-bit transfers, the precision miss policies and `lhu`.

The library choice (HQQ over torchao 0.18) was measured on olmoe-mini's experts; the figures are in
`moeflow/quant/__init__.py`.
"""

from __future__ import annotations

import json

import hqq  # noqa: F401  (a hard dependency: a broken install fails here instead of skipping the module)
import pytest
import torch

from moeflow.moe import get_adapter
from moeflow.policies import EVICTION, MISS
from moeflow.policies.base import Position
from moeflow.quant import FULL, CompactLayout, dequantize_row, quantize_rows
from moeflow.runtime.generate import build_engine, generate_one
from moeflow.runtime.link import DirectLink, EmulatedLink
from moeflow.runtime.store import ExpertLayout
from moeflow.sim import simulate, synthetic

H, I, E = 64, 32, 3  # one expert: gate_up [2I,H] = 4096 weights, down [H,I] = 2048


def _rows(seed: int = 0) -> tuple[ExpertLayout, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    stacked = {"gate_up_proj": torch.randn(E, 2 * I, H, generator=g), "down_proj": torch.randn(E, H, I, generator=g)}
    layout = ExpertLayout.of(stacked)
    rows = torch.zeros(E, layout.row_numel)
    for name, v in layout.views(rows).items():
        v.copy_(stacked[name])
    return layout, rows


def _round_trip(layout, rows, bits, optimize=False) -> torch.Tensor:
    q = quantize_rows(layout, rows, bits, optimize=optimize)
    compact = CompactLayout.of(layout, bits)
    out = torch.empty_like(rows)
    for e in range(E):
        dequantize_row(compact, q[e], layout, out[e])
    return out


def test_round_trip_error_matches_uniform_quantization():
    """Min-max asymmetric quantization of groups of 64 Gaussian weights: step = range / (2^b - 1), and the
    rounding error is ~uniform on a step, std step/sqrt(12). The expected range of 64 N(0,1) samples is
    ~4.7 sigma, so the relative error is ~4.7 / ((2^b - 1) sqrt 12): int8 .0053, int4 .090, int2 .45."""
    layout, rows = _rows()
    expected = {b: 4.7 / ((2**b - 1) * 12**0.5) for b in (8, 4, 2)}
    errs = {}
    for b in (8, 4, 2):
        err = ((_round_trip(layout, rows, b) - rows).norm() / rows.norm()).item()
        errs[b] = err
        assert 0.6 * expected[b] < err < 1.4 * expected[b], (b, err, expected[b])
    assert errs[8] < 0.01 < errs[4] < errs[2]
    # HQQ's optimisation of the zero point can only help (int4)
    err_opt = ((_round_trip(layout, rows, 4, optimize=True) - rows).norm() / rows.norm()).item()
    assert err_opt <= errs[4] * 1.01


def test_compact_bytes_vs_full_rows():
    layout, _ = _rows()
    full = layout.row_bytes
    assert full == (2 * I * H + H * I) * 4
    for b in (8, 4, 2):
        c = CompactLayout.of(layout, b)
        # per parameter: codes (n*b/8) + float16 scale and zero per group of 64, each block 64-byte aligned
        want = sum(-(-(n * b // 8) // 64) * 64 + 2 * (-(-(n // 64 * 2) // 64) * 64) for n in (2 * I * H, H * I))
        assert c.row_bytes == want
        assert c.row_bytes < full * (b / 32 + 0.1)
    with pytest.raises(Exception, match="int3"):
        CompactLayout.of(layout, 3)


def test_fetch_priority_tiers_and_lhu_order():
    fp = MISS.create("fetch-priority", percentile=60, bits="8/4/2", min_history=10)
    pos = Position(0, 0, 0, 0)
    from moeflow.policies.base import MissInfo

    assert fp.on_miss((0, 1), pos, MissInfo(0, 0.5, 0)) == "fetch"  # no history yet: full precision
    fp.observe(0, {e: e / 100 for e in range(100)})  # scores 0.00 .. 0.99
    assert fp.on_miss((0, 1), pos, MissInfo(0, 0.70, 0)) == "fetch"
    assert fp.on_miss((0, 1), pos, MissInfo(0, 0.50, 0)) == ("fetch", 8)
    assert fp.on_miss((0, 1), pos, MissInfo(0, 0.30, 0)) == ("fetch", 4)
    assert fp.on_miss((0, 1), pos, MissInfo(0, 0.05, 0)) == ("fetch", 2)
    assert fp.precisions == (8, 4, 2) and fp.changes_output

    ev = EVICTION.create("lhu")
    for k, bits in (((0, 0), FULL), ((0, 1), 4), ((0, 2), FULL)):
        ev.on_precision(k, bits)
        ev.on_insert(k, pos, prefetched=False)
    for _ in range(3):
        ev.on_access((0, 0), pos, score=1.0)
    ev.on_access((0, 2), pos, score=1.0)
    assert ev.victim([(0, 0), (0, 1), (0, 2)], pos) == (0, 1)  # the low-precision slot first
    assert ev.victim([(0, 0), (0, 2)], pos) == (0, 2)  # then fewest high-precision uses
    ev.on_precision((0, 1), FULL)  # cascade upgrade
    assert ev.victim([(0, 0), (0, 1), (0, 2)], pos) == (0, 1)  # 0 high-precision uses so far


def _engine_run(model, prompt, miss, *, cap, link=None, eviction="lru", new=6):
    eng = build_engine(model, mode="offload", link=link or DirectLink(), capacity=cap, eviction=eviction, miss=miss)
    with eng:
        out, _ = generate_one(model, prompt, eng, max_new_tokens=new, min_new_tokens=new)
        c = eng.cache.counters.copy()
        eng.link.drain()
        eng.sizes = {b: eng.store.expert_bytes_at(b) for b in (FULL, *eng.store.precisions)}  # type: ignore[attr-defined]
    return out, c, eng


@pytest.fixture(scope="module")
def olmoe(tiny_models):
    return tiny_models("olmoe")


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(3))


def test_lowbit_moves_compact_bytes_and_counts_lowbit_hits(olmoe, prompt):
    spec = get_adapter(olmoe).spec
    cap = max(spec.top_k, spec.total_experts // 4)
    ref, c_fetch, _ = _engine_run(olmoe, prompt, "fetch", cap=cap)
    _, c_low, eng = _engine_run(olmoe, prompt, "fetch-lowest-bit", cap=cap)
    assert c_low.lowbit_loads == c_low.demand_loads > 0 and c_low.lowbit_hits > 0
    full, small = eng.sizes[FULL], eng.sizes[2]
    assert small < full / 4
    assert c_low.bytes_moved == c_low.demand_loads * small + (c_low.loads - c_low.demand_loads) * full
    assert c_low.bytes_moved < c_fetch.bytes_moved
    assert eng.link.bytes == c_low.bytes_moved  # the link counts the compact transfers too
    eref, _, _ = _engine_run(olmoe, prompt, "fetch", cap=cap, eviction="lhu")
    assert torch.equal(eref, ref)  # fetch stays exact (with lhu as well)


def test_lowbit_slot_is_the_dequantized_copy_and_cascade_upgrades_to_exact(olmoe, prompt):
    spec = get_adapter(olmoe).spec
    cap = max(spec.top_k, spec.total_experts // 4)
    eng = build_engine(olmoe, mode="offload", link=EmulatedLink(50.0), capacity=cap, eviction="lhu", miss="cascade")
    with eng:
        generate_one(olmoe, prompt, eng, max_new_tokens=4, min_new_tokens=4)
        cache, store = eng.cache, eng.store
        assert cache.counters.upgrades > 0 and cache.counters.lowbit_loads > 0
        cache.wait(list(range(cache.capacity)))
        for key, s in cache.slot_of.items():  # every slot: full precision again, bit for bit
            assert cache.slots[s].bits == FULL
            assert torch.equal(cache.buffer[s], store.row(*key))
        # a low-precision load lands as exactly the store's dequantized compact copy
        key = next(iter(cache.slot_of))
        s = cache.slot_of[key]
        cache._evict(s)
        cache.begin_pass(cache.pass_id + 1)
        slots = cache.demand(key[0], [key[1]], {key[1]: 1.0}, {key[1]: 4})
        cache.wait(slots)
        want = torch.empty_like(store.row(*key))
        dequantize_row(store.compact_layout[4], store.compact_row(*key, 4), store.layout, want)
        assert torch.equal(cache.buffer[slots[0]], want) and not torch.equal(want, store.row(*key))
        cache.release(slots)


def test_run_json_lossy_and_fewer_bytes(tmp_path, capsys):
    from moeflow.cli.app import main

    def run(miss: str) -> dict:
        args = ["run", "--prompt", "The history of the city", "--max-new-tokens", "6", "-c", "25%"]
        args += ["--miss", miss, "--threads", "1", "--json", "-f", "none"]
        try:
            main(args)
        except SystemExit as e:
            assert e.code in (0, None)
        out = capsys.readouterr().out
        return json.loads(out[out.index('{"model"') :])["runs"][0]["metrics"]

    fetch, low = run("fetch"), run("fetch-lowest-bit")
    assert fetch["lossy"] is False and low["lossy"] is True
    assert low["bytes_moved"] < fetch["bytes_moved"]
    assert low["counters"]["lowbit_loads"] > 0


def test_lhu_and_lowbit_in_the_simulator():
    acc = synthetic(40, num_experts=16, top_k=4, seed=2)
    acc.expert_bytes = 1 << 20
    st_fetch = simulate(acc, 16, "lhu")
    st_low = simulate(acc, 16, "lhu", miss="fetch-lowest-bit")
    st_cas = simulate(acc, 16, "lhu", miss="cascade")
    assert st_fetch.misses > 0 and st_low.counters.lowbit_loads == st_low.counters.demand_loads
    assert st_low.counters.bytes_moved < st_fetch.counters.bytes_moved
    assert st_cas.counters.upgrades == st_cas.counters.lowbit_loads > 0
