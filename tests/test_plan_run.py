"""`moeflow run --plan casmoe`: preload is exact and leaves the plan resident; restricted routes inside it."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from moeflow.errors import ConfigError
from moeflow.moe import get_adapter
from moeflow.plan import CascadePlanner
from moeflow.plan.run import KeepPlanned, PlanSpec, RunPlanner
from moeflow.runtime.generate import build_engine, generate_one
from moeflow.runtime.link import DirectLink

NEW = 6


class _ConstEAP:
    def __init__(self, ep):
        self.ep = ep

    def predict(self, texts):
        return np.stack([self.ep] * len(texts))


def _planner(spec, ep, **kw) -> RunPlanner:
    return RunPlanner(PlanSpec("unused", **kw), CascadePlanner(None, _ConstEAP(ep), None), spec)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(7))


def test_preload_is_exact_and_the_plan_is_resident_after_prefill(tiny_models, prompt):
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    ep = np.random.default_rng(0).random((spec.num_moe_layers, spec.num_experts)).astype(np.float32)
    rp = _planner(spec, ep, k=spec.top_k)
    (plan,) = rp.plan(["a prompt"])
    assert plan.path == "eap" and plan.ms > 0
    cap = max(spec.top_k * spec.num_moe_layers, spec.total_experts // 2)
    for pf in ("none", "pregate"):
        eng = build_engine(model, mode="offload", link=DirectLink(), capacity=cap, eviction="lru", prefetch=pf)
        assert eng is not None
        rp.prepare(eng)
        assert isinstance(eng.eviction, KeepPlanned)
        after_prefill: list[set] = []
        with eng:
            sets = rp.begin(eng, [plan])
            planned = {(l, e) for l, ids in sets.items() for e in ids}
            assert len(planned) == spec.top_k * spec.num_moe_layers
            assert all(list(ids) == list(np.argsort(-ep[i], kind="stable")[: spec.top_k]) for i, ids in enumerate(sets.values()))
            eng.pass_start_hooks.append(lambda a=after_prefill, c=eng.cache: a.append(set(c.slot_of)))  # after the plan's
            out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
            rp.end(eng)
        assert torch.equal(out, ref), f"{pf}: {out.tolist()} != {ref.tolist()}"
        assert not m.lossy
        assert rp.preloaded > 0 and planned <= after_prefill[1]  # resident at the first decode step


def test_restricted_routes_only_inside_the_plan(tiny_models, prompt):
    model = tiny_models("olmoe")
    spec = get_adapter(model).spec
    allowed = [1, 4, 6][: max(spec.top_k, 3)]
    ep = np.zeros((spec.num_moe_layers, spec.num_experts), dtype=np.float32)
    ep[:, allowed] = [3.0, 2.0, 1.0]
    rp = _planner(spec, ep, k=len(allowed), mode="restricted")
    (plan,) = rp.plan(["x"])
    eng = build_engine(
        model, mode="offload", link=DirectLink(), capacity=spec.total_experts // 2, routing="plan-restricted", prefetch="pregate"
    )
    assert eng is not None
    rp.prepare(eng)
    routed: list[int] = []

    def spy(routings):
        out = orig(routings)
        routed.extend(int(i) for i in out[0][0].tolist())
        return out

    with eng:
        orig = eng.step.to_host
        eng.step.to_host = spy  # type: ignore[method-assign]
        rp.begin(eng, [plan])
        out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
        rp.end(eng)
    assert routed and set(routed) <= set(allowed)
    assert m.lossy and eng.lossy
    assert out.numel() == NEW


def test_plan_flags_are_checked_before_the_model_loads(tmp_path):
    from moeflow.stages.run_config import RunConfig

    base: dict = dict(model="m", prompt=("hi",))
    with pytest.raises(ConfigError, match="mode='fast' unknown"):
        RunConfig(**base, plan="casmoe", plan_opts=(("predictors", str(tmp_path)), ("mode", "fast")))
    with pytest.raises(ConfigError, match="predictors=DIR"):
        RunConfig(**base, plan="casmoe")
    with pytest.raises(ConfigError, match="plan-restricted is set by"):
        RunConfig(**base, routing="plan-restricted")
    cfg = RunConfig(**base, plan="casmoe", plan_opts=(("predictors", str(tmp_path / "nope")),))
    with pytest.raises(ConfigError, match="does not exist.*moeflow train --only eam --only eap"):
        cfg.preflight()
    cfg = RunConfig(**base, plan="casmoe", plan_opts=(("predictors", str(tmp_path)),))
    with pytest.raises(ConfigError, match="no eam/ or eap/.*moeflow train --only eam --only eap"):
        cfg.preflight()
    (tmp_path / "eap").mkdir()
    cfg.preflight()  # found: loading (fingerprint, files) is checked when the model is there


class _HashEmbedder:
    """A deterministic stand-in for sentence-transformers: one unit vector per text."""

    dim = 16

    def encode(self, texts):
        out = [np.random.default_rng(zlib.crc32(t.encode())).standard_normal(self.dim) for t in texts]
        return np.stack([v / np.linalg.norm(v) for v in out]).astype(np.float32)


def test_plan_update_feeds_observed_eps_to_the_eam_and_saves_it(tiny_models, tmp_path):
    from moeflow.moe import router_hooks
    from moeflow.plan.eam import EAM
    from moeflow.plan.labels import ep_from_routing, normalize
    from moeflow.plan.run import parse_plan

    model = tiny_models("olmoe")
    ad = get_adapter(model)
    spec = ad.spec
    L, E = spec.num_moe_layers, spec.num_experts
    emb = _HashEmbedder()
    rng = np.random.default_rng(1)
    seed_texts = [f"seed {i}" for i in range(4)]
    eam = EAM(emb.dim, L, E, k_prime=1).build(emb.encode(seed_texts), rng.random((4, L, E)).astype(np.float32))
    eam.save_atomic(tmp_path / "eam", fingerprint="fp", embedder="hash", extra={"note": "kept"})
    loaded, meta = EAM.load(tmp_path / "eam")
    pspec = parse_plan("casmoe", (("predictors", str(tmp_path)), ("update", "true"), ("buffer", "2")))
    assert pspec is not None and pspec.update and pspec.buffer == 2
    rp = RunPlanner(pspec, CascadePlanner(loaded, None, emb, info={"eam": meta}), spec)
    assert loaded.buffer_size == 2
    g = torch.Generator().manual_seed(3)
    prompts = [(f"p{i}", f"prompt number {i}", torch.randint(3, 250, (1, 4 + i), generator=g)) for i in range(3)]
    eng = build_engine(model, mode="offload", link=DirectLink(), capacity=spec.total_experts // 2, eviction="lru")
    assert eng is not None
    rp.prepare(eng)
    with eng:
        for item in prompts:
            rp.begin(eng, rp.plan([item[1]]))
            with rp.observing(eng, [item]):
                generate_one(model, item[2], eng, max_new_tokens=3, min_new_tokens=3)
            rp.end(eng)
        with rp.observing(eng, [prompts[0]]):  # observed already: not added again
            generate_one(model, prompts[0][2], eng, max_new_tokens=2, min_new_tokens=2)
    rep = rp.save_update()
    assert rep is not None and rep["added"] == 3 and rep["flushed"] == 1 and rep["db_size"] == 7
    saved, meta2 = EAM.load(tmp_path / "eam", fingerprint="fp")
    assert len(saved) == 7 and meta2["note"] == "kept" and meta2["embedder"] == "hash"
    for _, text, ids in prompts:  # the exact text retrieves its own EP: eq. 3 over a plain prefill's routing
        got: dict[int, tuple] = {}
        with (
            torch.no_grad(),
            router_hooks(
                ad, lambda ev, got=got: got.setdefault(ev.layer, (ev.indices.numpy(), ev.weights.float().numpy())) and None
            ),
        ):
            model(input_ids=ids)
        want = ep_from_routing([got[l][0] for l in spec.moe_layers], [got[l][1] for l in spec.moe_layers], E)
        (m,) = saved.query(emb.encode([text]))
        assert m.best_sim > 0.999
        np.testing.assert_allclose(m.ep, normalize(want, "mean1"), rtol=1e-5, atol=1e-5)
