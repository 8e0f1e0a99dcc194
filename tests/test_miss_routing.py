"""Miss policies (fetch, drop, substitute, cpu, auto) and routing policies (cache-aware, hit-first).

Exact ones (fetch, hit-first, cpu and auto on CPU in fp32) must stay token-identical to the resident
model; lossy ones are checked on hand-made routings and must label their runs lossy.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from moeflow.errors import ConfigError
from moeflow.moe import get_adapter
from moeflow.policies import MISS, ROUTING
from moeflow.policies.base import MissInfo, MissPolicy, miss_action
from moeflow.policies.miss import nearest_resident, similarity
from moeflow.policies.routing import dual_select
from moeflow.runtime.generate import build_engine, generate_one
from moeflow.runtime.link import DirectLink, EmulatedLink
from moeflow.runtime.step import apply_miss, miss_infos

NEW = 8


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, 250, (1, 6), generator=g)  # [1,P]


def _run(model, prompt, *, cap, miss="fetch", routing="standard", miss_opts=None, routing_opts=None, link=None):
    eng = build_engine(
        model,
        mode="offload",
        link=link or DirectLink(),
        capacity=cap,
        eviction="lru",
        prefetch="pregate",
        miss=miss,
        routing=routing,
        miss_opts=miss_opts,
        routing_opts=routing_opts,
    )
    with eng:
        out, m = generate_one(model, prompt, eng, max_new_tokens=NEW, min_new_tokens=NEW)
    return out, m, eng


def test_miss_actions_parse():
    assert miss_action("fetch") == ("fetch", None)
    assert miss_action(("fetch", 4)) == ("fetch", 4)
    assert miss_action("substitute:5") == ("substitute", 5)
    assert miss_action("drop") == ("drop", None) and miss_action("cpu") == ("cpu", None)
    with pytest.raises(ValueError):
        miss_action("teleport")


@pytest.mark.parametrize("arch", ["olmoe", "gpt_oss"])
def test_exact_policies_token_identical(tiny_models, arch, prompt):
    """fetch, hit-first (over an emulated link, so some experts are still loading when a layer computes),
    cpu and auto: token-identical to the resident model at top-k and 25% capacity."""
    model = tiny_models(arch)
    spec = get_adapter(model).spec
    ref, _ = generate_one(model, prompt, None, max_new_tokens=NEW, min_new_tokens=NEW)
    for cap in sorted({spec.top_k, max(spec.top_k, spec.total_experts // 4)}):
        for miss, routing, link in [
            ("fetch", "standard", None),
            ("fetch", "hit-first", EmulatedLink(2.0, 2e-4)),
            ("cpu", "standard", None),
            ("cpu", "hit-first", EmulatedLink(2.0, 2e-4)),
            ("auto", "standard", None),
        ]:
            out, _m, eng = _run(model, prompt, cap=cap, miss=miss, routing=routing, link=link)
            assert torch.equal(out, ref), f"{arch} C={cap} {miss}+{routing}: {out.tolist()} != {ref.tolist()}"
            assert not eng.lossy


def test_cpu_computes_misses_on_host(tiny_models, prompt):
    model = tiny_models("olmoe")
    out, m, eng = _run(model, prompt, cap=2, miss="cpu")
    assert eng.miss_counts["cpu"] > 0 and eng.host_s > 0
    ref, m_fetch, _ = _run(model, prompt, cap=2, miss="fetch")
    assert torch.equal(out, ref)
    assert m.counters.loads < m_fetch.counters.loads  # host compute instead of copies


def _fake_cache(resident: set[int]):
    return SimpleNamespace(resident=lambda key: key[1] in resident, position=lambda layer: None)


def test_drop_renorm_hand_computed():
    """Two tokens, top-4, experts {0,1,2} resident. Token 0 routes 0,5,1,6 (ranks 1-4), token 1 routes
    2,6,7,1 (ranks 1-4, 6 ahead of 7 on the tie). Misses 5 and 6 have best rank 2 (fetched), 7 rank 3
    (dropped): token 1's weights .5,.2,0,.1 renormalized to their sum 1.0 -> .625,.25,0,.125, and 7's
    entry points at the token's best kept expert (2) with weight 0."""
    ids = torch.tensor([0, 5, 1, 6, 2, 6, 7, 1])
    w = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.5, 0.2, 0.2, 0.1])
    for renorm, want in [(True, [0.625, 0.25, 0.0, 0.125]), (False, [0.5, 0.2, 0.0, 0.1])]:
        counts = {"drop": 0, "substitute": 0, "cpu": 0}
        pol = MISS.create("drop", renorm=renorm)
        changed, ids2, w2, cpu = apply_miss(pol, _fake_cache({0, 1, 2}), 3, ids, w, torch.Size([2, 4]), counts)  # type: ignore[arg-type]
        assert changed and cpu == []
        assert ids2.tolist() == [0, 5, 1, 6, 2, 6, 2, 1]
        assert torch.allclose(w2[:4], w[:4]) and torch.allclose(w2[4:], torch.tensor(want))
        assert counts["drop"] == 1
    with pytest.raises(ConfigError):
        MISS.create("drop", min_rank=1)


def test_miss_infos_hand_computed():
    """The routing of `test_drop_renorm_hand_computed` (token 0: 0,5,1,6 at .4,.3,.2,.1; token 1: 2,6,7,1 at
    .5,.2,.2,.1): 6 is rank 4 for token 0 and rank 2 for token 1 (ahead of 7 on the tie) -> best rank 2,
    largest weight .2, 2 tokens; 7 rank 3 (.2, 1 token); 1 rank 3 and 4 -> 3 (.2, 2 tokens). What the policy
    is asked with (`MissInfo`) for each missing expert, in ascending expert order."""
    ids = [0, 5, 1, 6, 2, 6, 7, 1]
    w = [0.4, 0.3, 0.2, 0.1, 0.5, 0.2, 0.2, 0.1]
    got = miss_infos(ids, w, 4, {1, 6, 7})
    assert got == {6: (2, 0.2, 2), 7: (3, 0.2, 1), 1: (3, 0.2, 2)}
    asked = []

    class Spy(MissPolicy):
        name, renorm = "spy", False

        def on_miss(self, key, pos, info):
            asked.append((key, info.rank, info.score, info.tokens))
            return "fetch"

    counts = {"drop": 0, "substitute": 0, "cpu": 0}
    wt = torch.tensor(w)
    apply_miss(Spy(), _fake_cache({0, 1, 2}), 3, torch.tensor(ids), wt, torch.Size([2, 4]), counts)  # type: ignore[arg-type]
    assert asked == [((3, 5), 2, pytest.approx(0.3), 1), ((3, 6), 2, pytest.approx(0.2), 2), ((3, 7), 3, pytest.approx(0.2), 1)]


def test_drop_score_threshold():
    pol = MISS.create("drop", min_rank=3, score=0.15)
    assert pol.on_miss((0, 7), None, MissInfo(rank=3, score=0.2, tokens=1)) == "fetch"  # weight above the threshold
    assert pol.on_miss((0, 7), None, MissInfo(rank=3, score=0.1, tokens=1)) == "drop"
    assert pol.on_miss((0, 7), None, MissInfo(rank=2, score=0.01, tokens=1)) == "fetch"  # ranks 1-2 always fetched


def test_substitute_picks_nearest_resident():
    """Router rows e0=(1,0), e1=(0,1), e2=(1,1), e3=(1,.1). For missing e3: cos(e3,e0)=.995,
    cos(e3,e1)=.0995, cos(e3,e2)=.774. Resident {1,2} -> 2; resident {0,1,2} -> 0; tol .1 with {1,2}: fetch."""
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.1]])
    sim = similarity(w)
    assert abs(float(sim[3, 2]) - 1.1 / (2**0.5 * (1.01**0.5))) < 1e-6
    assert nearest_resident(sim, 0, 3, lambda k: k[1] in {1, 2}) == 2
    assert nearest_resident(sim, 0, 3, lambda k: k[1] in {0, 1, 2}) == 0
    pol = MISS.create("substitute")
    pol.sim = {0: sim}
    assert pol.on_miss((0, 3), None, MissInfo(1, 0.5, 1, lambda k: k[1] in {1, 2})) == "substitute:2"
    tight = MISS.create("substitute", tol=0.1)
    tight.sim = {0: sim}
    assert tight.on_miss((0, 3), None, MissInfo(1, 0.5, 1, lambda k: k[1] in {1, 2})) == "fetch"
    # the engine routes the substituted entries to the substitute, weights kept
    counts = {"drop": 0, "substitute": 0, "cpu": 0}
    ids, w = torch.tensor([2, 3]), torch.tensor([0.6, 0.4])
    changed, ids2, w2, _ = apply_miss(pol, _fake_cache({1, 2}), 0, ids, w, torch.Size([1, 2]), counts)  # type: ignore[arg-type]
    assert changed and ids2.tolist() == [2, 2] and w2.tolist() == pytest.approx([0.6, 0.4])


def test_cache_aware_dual_logit(tiny_models):
    """Hand-made logits: expert 3 (resident) is 5th of 8. lambda = 2 lifts it by 2 x D_avg = 5.33 to 5.83,
    above expert 0's 3.0, so it is selected with expert 0; both weights are the ORIGINAL softmax
    probabilities (dual-logit semantics)."""
    model = tiny_models("olmoe")
    ad = get_adapter(model)
    l = ad.moe_layers[0]
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.5, 1.0, -1.0, -2.0, 0.0]])  # [1,8], top-2 = 0,1
    pol = ROUTING.create("cache-aware", **{"lambda": 2.0})
    z2 = pol.select_logits(l, logits, lambda k: k[1] == 3, ad.spec.top_k)
    w, idx = dual_select(ad.select, l, logits, z2)
    assert 3 in idx[0].tolist() and 0 in idx[0].tolist()
    probs = torch.softmax(logits, -1)[0]
    want = probs[idx[0]]
    if getattr(ad.router(l), "norm_topk_prob", False):
        want = want / want.sum()
    assert torch.allclose(w[0].float(), want)
    small = ROUTING.create("cache-aware", lam=0.0)
    assert small.select_logits(l, logits, lambda k: k[1] == 3, ad.spec.top_k) is None
    assert not small.changes_output and pol.changes_output  # lambda = 0 routes as standard
    # D_avg: mean top-2 logit 2.75 minus mean of the other six (0.5+1-1-2+0+2)/6 = 0.0833
    fresh = ROUTING.create("cache-aware")
    assert float(fresh.delta_avg(l, logits, 2)) == pytest.approx(2.75 - 0.5 / 6)


@pytest.mark.parametrize(
    "miss,routing,opts", [("drop", "cache-aware", {"min_rank": 2}), ("substitute", "standard", {"tol": 2.0})]
)
def test_lossy_policies_run_and_are_labelled(tiny_models, prompt, miss, routing, opts):
    model = tiny_models("olmoe")
    out, m, eng = _run(
        model,
        prompt,
        cap=12,  # half of the 24 experts: layers keep resident experts to substitute
        miss=miss,
        routing=routing,
        miss_opts=opts,
        routing_opts={"lambda": 0.3} if routing == "cache-aware" else None,
    )
    assert out.numel() == NEW and eng.lossy and m.lossy
    assert eng.miss_counts[miss] > 0
    assert m.to_dict()["lossy"] is True


def test_cli_lossy_run_json(tmp_path):
    from typer.testing import CliRunner

    from moeflow.cli.app import _register, app

    _register()
    args = ["run", "--model", "models/olmoe-mini", "--prompt", "The capital of France is", "--capacity", "25%"]
    args += ["--miss", "drop", "--routing", "cache-aware", "--routing-opt", "lambda=0.3", "--max-new-tokens", "4"]
    args += ["--threads", "1", "--json", "--link", "direct", "--no-warmup"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("{")][-1]
    run = json.loads(line)["runs"][0]
    assert run["metrics"]["lossy"] is True and run["lossy"] is True  # at the run's level too, as quality's
    assert run["lossy_reasons"] == ["miss policy drop changes the output", "routing policy cache-aware changes the output"]
