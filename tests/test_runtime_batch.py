"""Batches, warm-up and link accounting.

- `generate_batch` decodes B left-padded prompts of different lengths together; every prompt's greedy
  tokens equal a batch-1 run's, resident and offloaded (2 capacities, prefetch none / pregate), on a tiny
  model and on `models/olmoe-mini`. Each decode pass routes B rows: the cache's counters still add up.
- `link_bytes == bytes_moved` by construction: copies still in flight when generation ends (a prefetch
  nobody waited for) are drained and counted (the CUDA link lost them: `test_cuda_link_exact`).
- `moeflow run --batch-size`, the warm-up (excluded from counters and outputs) and `experts_impl`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from moeflow.moe import get_adapter
from moeflow.runtime.generate import build_engine, fastest_experts_impl, generate_batch, generate_one, pad_left, pick_impl
from moeflow.runtime.link import DirectLink, EmulatedLink

NEW = 8
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 250, (1, n), generator=g) for n in (5, 9, 2, 7)]  # [1,P_i], different lengths


def _check_counters(m, eng, B: int) -> None:
    c, spec = m.counters, eng.spec
    assert c.hits + c.misses == c.accesses and c.misses == c.demand_loads
    assert c.loads == c.demand_loads + c.prefetch_issued
    assert c.bytes_moved == c.loads * eng.store.expert_bytes
    assert m.link_bytes == c.bytes_moved == eng.link.submitted_bytes
    assert m.decode_counters.accesses <= m.decode_tokens * spec.num_moe_layers * min(B * spec.top_k, spec.num_experts)


def test_pad_left():
    ids, mask = pad_left([torch.tensor([[5, 6, 7]]), torch.tensor([[9]])], 0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_batch_token_identical_tiny(tiny_models, prompts):
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    ref = [generate_one(model, p, None, max_new_tokens=NEW, min_new_tokens=NEW)[0] for p in prompts]
    news, m = generate_batch(model, prompts, None, max_new_tokens=NEW, min_new_tokens=NEW)
    assert all(torch.equal(a, b) for a, b in zip(news, ref)), "resident B=4 differs from B=1"
    assert m.prompts == 4 and m.batch_size == 4 and m.decode_tokens == NEW - 1
    assert m.new_tokens == 4 * NEW and m.decode_row_tokens == 4 * (NEW - 1)
    assert m.throughput_tok_s == pytest.approx(4 * (NEW - 1) / m.decode_s)
    for cap in (spec.top_k, spec.total_experts // 4):  # top-k: the batched prefill runs in waves
        for pf in ("none", "pregate"):
            eng = build_engine(model, mode="offload", link=DirectLink(), capacity=cap, eviction="lru", prefetch=pf)
            passes = []
            eng.observers.append(passes.append)
            with eng:
                news, m = generate_batch(model, prompts, eng, max_new_tokens=NEW, min_new_tokens=NEW)
            assert all(torch.equal(a, b) for a, b in zip(news, ref)), f"C={cap} {pf}"
            _check_counters(m, eng, 4)
            # one PassStats per pass; a decode pass routes B rows; per-pass counters add up to the run
            assert [p.tokens for p in passes] == [4 * 9] + [4] * (NEW - 1)
            assert sum(p.counters.accesses for p in passes) == m.counters.accesses
            assert sum(sum(p.loads_by_layer.values()) for p in passes) == m.counters.loads
            if pf == "pregate":
                assert m.counters.prefetch_issued > 0


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_batch_offload_equals_resident_batch(tiny_models, prompts, arch):
    """Other families: offloaded batched output equals the resident batched output (and B=1)."""
    model = tiny_models(arch)
    spec = get_adapter(model).spec
    ref, _ = generate_batch(model, prompts[:3], None, max_new_tokens=NEW, min_new_tokens=NEW)
    one = [generate_one(model, p, None, max_new_tokens=NEW, min_new_tokens=NEW)[0] for p in prompts[:3]]
    assert all(torch.equal(a, b) for a, b in zip(ref, one))
    eng = build_engine(model, mode="offload", link=DirectLink(), capacity=spec.top_k, eviction="lru", prefetch="pregate")
    with eng:
        news, m = generate_batch(model, prompts[:3], eng, max_new_tokens=NEW, min_new_tokens=NEW)
    assert all(torch.equal(a, b) for a, b in zip(news, ref))
    _check_counters(m, eng, 3)


def test_batch_stops_rows_at_eos(tiny_models, prompts):
    """A row that reaches EOS ends there, as at batch size 1 (generate pads it while the others run)."""
    model = tiny_models("olmoe")
    ref = [generate_one(model, p, None, max_new_tokens=NEW, min_new_tokens=NEW)[0] for p in prompts]
    eos = int(ref[1][2])  # make the 3rd new token of prompt 1 an EOS
    ref_eos = [generate_one(model, p, None, max_new_tokens=NEW, eos_token_id=eos)[0] for p in prompts]
    news, m = generate_batch(model, prompts, None, max_new_tokens=NEW, eos_token_id=eos)
    assert all(torch.equal(a, b) for a, b in zip(news, ref_eos))
    assert news[1].numel() <= 3 and m.new_tokens == sum(n.numel() for n in ref_eos)


@pytest.mark.skipif(not (REPO / "models" / "olmoe-mini").is_dir(), reason="models/olmoe-mini missing")
def test_batch_token_identical_olmoe_mini():
    from moeflow.models import load_model

    model, tok = load_model(str(REPO / "models" / "olmoe-mini"), experts_implementation="grouped_mm")
    texts = ["The king said", "Once upon a time there was a little girl who lived near the forest", "Natalia sold clips"]
    ps = [tok(t, return_tensors="pt").input_ids for t in texts]
    n = 12
    ref = [generate_one(model, p, None, max_new_tokens=n, min_new_tokens=n)[0] for p in ps]
    news, _ = generate_batch(model, ps, None, max_new_tokens=n, min_new_tokens=n)
    assert all(torch.equal(a, b) for a, b in zip(news, ref)), "resident"
    spec = get_adapter(model).spec
    for cap in (spec.top_k, spec.total_experts // 4):
        eng = build_engine(model, mode="offload", link=DirectLink(), capacity=cap, eviction="lru", prefetch="pregate")
        with eng:
            news, m = generate_batch(model, ps, eng, max_new_tokens=n, min_new_tokens=n)
        assert all(torch.equal(a, b) for a, b in zip(news, ref)), f"C={cap}"
        _check_counters(m, eng, 3)


def test_link_bytes_count_copies_in_flight_at_the_end(tiny_models, prompts):
    """The accounting `test_cuda_link_exact` caught, on CPU: a copy nobody waits for is still in flight when
    generation ends (on CUDA: a prefetch whose event nobody queried). A virtual-clock link completes copies
    only when time is slept through, and an observer issues one more prefetch after the last pass."""
    from moeflow.policies.base import PrefetchRequest

    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    now = [0.0]
    link = EmulatedLink(0.01, 0.0, clock=lambda: now[0], sleep=lambda d: now.__setitem__(0, now[0] + d))
    eng = build_engine(model, mode="offload", link=link, capacity=spec.total_experts // 2, eviction="lru", prefetch="pregate")
    in_flight = []

    def late_prefetch(st) -> None:
        if st.pass_id == NEW - 1:  # the last pass: prefetch one expert that is not resident, never used
            l = spec.moe_layers[0]
            e = next(e for e in range(spec.num_experts) if not eng.cache.resident((l, e)))
            assert eng.cache.prefetch([PrefetchRequest((l, e))], l) == 1
            in_flight.append(link.submitted_bytes - link.bytes)

    eng.observers.append(late_prefetch)
    with eng:
        _, m = generate_one(model, prompts[1], eng, max_new_tokens=NEW, min_new_tokens=NEW)
        assert in_flight == [eng.store.expert_bytes]  # in flight when generation ended ...
        assert m.link_bytes == m.counters.bytes_moved == link.submitted_bytes  # ... and counted
        assert m.link_busy_s == pytest.approx(m.counters.bytes_moved / 0.01e9)


def test_fastest_experts_impl(tiny_models, prompts):
    model = tiny_models("olmoe")
    probe = fastest_experts_impl(model, prompts[0], steps=2, rounds=1, new_tokens=8)
    try:
        assert probe.name in ("batched_mm", "grouped_mm")
        assert set(probe.decode_s) == set(probe.prefill_s) == {"batched_mm", "grouped_mm"}
        assert all(v > 0 for v in [*probe.decode_s.values(), *probe.prefill_s.values()])
        assert probe.name == pick_impl(probe.prefill_s, probe.decode_s, 8)  # the rule, on what the probe measured
        assert model.config._experts_implementation == probe.name
    finally:
        model.set_experts_implementation("grouped_mm")


def test_pick_impl_counts_the_prefill_and_treats_noise_level_decode_gaps_as_none():
    """The rule `--experts-impl auto` keeps: prefill + (tokens - 1) decode passes. On CUDA both implementations decode
    with batched_mm, so their decode gap is noise (an H100 probe: batched_mm 18.89, grouped_mm 19.42 ms/pass; another
    run: 19.68 and 19.55), while batched_mm's prefill took 305.7 ms against 23.5 ms at 256 tokens. Without the 5% tie,
    1024 tokens of that noise outweigh the prefill gap and keep batched_mm."""
    from moeflow.runtime.generate import pick_impl

    prefill = {"batched_mm": 0.3057, "grouped_mm": 0.0235}
    cuda_like = {"batched_mm": 0.01889, "grouped_mm": 0.01942}
    assert pick_impl(prefill, cuda_like, 1024) == "grouped_mm"
    assert pick_impl(prefill, cuda_like, 1024, tie=0.0) == "batched_mm"  # the rule without the tie
    cpu_like = {"batched_mm": 0.010, "grouped_mm": 0.020}  # a real decode gap: many tokens outweigh the prefill
    assert pick_impl(prefill, cpu_like, 100) == "batched_mm"
    assert pick_impl(prefill, cpu_like, 20) == "grouped_mm"  # 0.3057 + 19 x 0.010 > 0.0235 + 19 x 0.020
    assert pick_impl(prefill, {"batched_mm": 0.001, "grouped_mm": 0.5}, 1) == "grouped_mm"  # one token: prefill only


def test_fastest_experts_impl_counts_the_prefill(tiny_models, prompts, monkeypatch):
    """The probe times both phases and keeps the cheaper generation, prefill included (a probe that looked at decode
    passes alone kept batched_mm on an H100, whose prefill there took 306 ms against 24 ms)."""
    import moeflow.runtime.generate as gen

    model = tiny_models("olmoe")
    real = gen._generate

    def slow_batched_prefill(m, ids, **kw):  # batched_mm: a prefill 200 ms slower; grouped_mm: decode passes 40 ms slower
        impl = m.config._experts_implementation

        def delay(mod, args, kwargs):
            prefill = kwargs["input_ids"].shape[1] > 1
            time.sleep((0.2 if prefill else 0.0) if impl == "batched_mm" else (0.0 if prefill else 0.04))

        hook = m.register_forward_pre_hook(delay, with_kwargs=True)
        try:
            return real(m, ids, **kw)
        finally:
            hook.remove()

    monkeypatch.setattr(gen, "_generate", slow_batched_prefill)
    try:
        short = fastest_experts_impl(model, prompts[0], steps=2, rounds=1, new_tokens=2)
        assert short.name == "grouped_mm" and short.prefill_s["batched_mm"] > short.prefill_s["grouped_mm"] + 0.1
        assert short.decode_s["grouped_mm"] > short.decode_s["batched_mm"] + 0.02
        assert model.config._experts_implementation == "grouped_mm"
        long = fastest_experts_impl(model, prompts[0], steps=2, rounds=1, new_tokens=1000)  # decode passes dominate
        assert long.name == "batched_mm" and model.config._experts_implementation == "batched_mm"
    finally:
        model.set_experts_implementation("grouped_mm")


# ---- moeflow run --batch-size / warm-up ----------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(ckpt_with):
    return ckpt_with(p_txt="the king said\nto be or not to be that is\nthe night\n")


def _run_json(ckpt, capsys, *extra: str) -> dict:
    from moeflow.cli.app import main

    args = ["run", "-m", str(ckpt), "--prompts", str(ckpt.parent / "p.txt"), "--max-new-tokens", "5", "--min-new-tokens", "5"]
    args += ["--sweep", "--mode", "resident,offload", "-c", "2,50%", "-f", "none,pregate", "--link", "direct", "--json", *extra]
    try:
        main(args)
    except SystemExit as e:
        assert e.code in (0, None)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_run_batch_size_and_warmup(ckpt, capsys):
    b1 = _run_json(ckpt, capsys, "--no-warmup")
    b1w = _run_json(ckpt, capsys)
    b2 = _run_json(ckpt, capsys, "--batch-size", "2", "--experts-impl", "grouped_mm")

    def texts(r: dict) -> list[str]:
        return [o["text"] for o in r["outputs"]]

    for a, w, b in zip(b1["runs"], b1w["runs"], b2["runs"]):
        assert texts(a) == texts(w) == texts(b) == texts(b1["runs"][0])  # same text: every mode, B, warm-up
        if a["mode"] == "offload":  # the warm-up runs on an engine of its own: counters are the timed run's only
            assert a["metrics"]["counters"] == w["metrics"]["counters"]
            assert a["metrics"]["decode_counters"] == w["metrics"]["decode_counters"]
        assert w["warmup"] is True and a["warmup"] is False
        m = b["metrics"]
        assert b["batch_size"] == 2 and m["batch_size"] == 2 and m["prompts"] == 3
        assert m["decode_passes"] == 2 * 4 and m["decode_tokens"] == 3 * 4  # batches of 2 + 1 prompts
        assert m["throughput_tok_s"] > 0
    assert b1w["runs"][0]["experts_impl"] in ("batched_mm", "grouped_mm")
    assert b2["runs"][0]["experts_impl"] == "grouped_mm" and b2["runs"][1]["experts_impl"] is None


def test_generation_runs_without_cudnn_attention(tiny_models, prompts, monkeypatch):
    """cuDNN's attention plans every new sequence length on the host (on an H100 a decode step at a new length took
    63 ms, 21 ms at a length seen before): moeflow's generations, timed or traced, run with the other backends, and
    the setting is restored after."""
    from moeflow.runtime.generate import generate_exactly
    from moeflow.trace.record import RoutingRecorder, trace_batch, trace_one

    model = tiny_models("olmoe")
    seen: list[bool] = []
    real = type(model).generate

    def spy(self, *a, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(self, *a, **kw)

    monkeypatch.setattr(type(model), "generate", spy)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    generate_one(model, prompts[0], None, max_new_tokens=2)
    generate_exactly(model, prompts[0], 2)
    fastest_experts_impl(model, prompts[0], steps=1, rounds=1)
    model.set_experts_implementation("grouped_mm")
    rec = RoutingRecorder(get_adapter(model))
    trace_one(model, rec, prompts[0], {"max_new_tokens": 2, "do_sample": False})
    trace_batch(model, rec, prompts[:2], {"max_new_tokens": 2, "do_sample": False, "pad_token_id": 0})
    assert len(seen) == 8 and not any(seen)  # 1 + 1 + the probe's 4 + 1 + 1
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored


def test_no_cudnn_attention_leaves_the_other_backends_as_set():
    """Only cuDNN's flag changes: a backend the caller turned off stays off inside, and everything is restored after,
    also when the block raises."""
    from moeflow.models import no_cudnn_attention

    cuda = torch.backends.cuda
    flags = (cuda.flash_sdp_enabled, cuda.mem_efficient_sdp_enabled, cuda.math_sdp_enabled, cuda.cudnn_sdp_enabled)
    before = [f() for f in flags]
    cuda.enable_flash_sdp(False)
    try:
        with no_cudnn_attention():
            assert [f() for f in flags] == [False, before[1], before[2], False]
        assert [f() for f in flags] == [False, *before[1:]]
        with pytest.raises(RuntimeError), no_cudnn_attention():
            raise RuntimeError("boom")
        assert cuda.cudnn_sdp_enabled() == before[3]
    finally:
        cuda.enable_flash_sdp(before[0])
