"""The predictors' run-time path (`moeflow.predict.fast`): every S of a source layer in ONE call that equals
`predict`, the model's norms and routers without their hooks, and the prefetch requests built from it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.test_predict import small_cfg, tiny_setup  # noqa: F401  (module fixture)

LEARNED = ("router-pf", "estimator", "hybrid", "forest")


@pytest.fixture(scope="module")
def fitted(tiny_setup):  # noqa: F811
    from moeflow.predict.train import fit_all

    model, _, data = tiny_setup
    cfg = small_cfg(only=LEARNED, est_epochs=1, est_min_steps=30, est_max_tokens=300, forest_trees=4, forest_max_samples=2000)
    preds = fit_all(data, model, cfg)
    h = preds["hybrid"]  # the estimator on S = 1, Router-PF beyond: both branches of one call
    h.use_estimator = {(l, 1) for l in data.spec.moe_layers}
    return model, data, preds


def _decode_batches(data, ctx, horizon: int):
    """(source layer, S, one-token batch) for two decode rows, every source layer and every S up to `horizon`."""
    from moeflow.predict.data import batch_from_rows

    ml = data.spec.moe_layers
    for rows in (np.array([7]), np.array([40])):
        tok = torch.from_numpy(ctx[rows])
        for src in ml[:-1]:
            for steps in range(1, min(horizon, len(ml) - 1 - ml.index(src)) + 1):
                b = batch_from_rows(data, src, rows, ctx=ctx)
                b.token_ctx = tok
                yield src, steps, b


def _spy(seen: list[str]) -> type[torch.Tensor]:
    """A tensor subclass that records the name of every torch function called on it into `seen`."""

    class Spy(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return super().__torch_function__(func, types, args, kwargs or {})

    return Spy


def test_one_call_gives_every_s_as_predict_does(fitted):
    """runner.scores(batch, S)[s-1] = predict(l+s, s, batch) for every source layer and s; the per-pass parts
    (token terms) are reused across the layers of one pass (one token-context tensor) and redone for the next."""
    from moeflow.predict.data import batch_from_rows, target_of

    _model, data, preds = fitted
    ml, spec = data.spec.moe_layers, data.spec
    ctx = data.context(4)
    for name in LEARNED:
        p = preds[name]
        run = p.runner()
        for rows in (np.arange(0, data.n, 5)[:9], np.arange(3, data.n, 11)[:9]):  # two "passes", as many rows
            tok = torch.from_numpy(ctx[rows])  # one object per pass, as the policy passes it
            for src in ml[:-1]:
                steps = min(p.max_lookahead, len(ml) - 1 - ml.index(src))
                b = batch_from_rows(data, src, rows, ctx=ctx)
                b.token_ctx = tok
                got = run.scores(b, steps)
                assert got.shape == (steps, len(rows), spec.num_experts), name
                for s in range(1, steps + 1):
                    want = p.predict(target_of(spec, src, s), s, b).float().numpy()
                    np.testing.assert_allclose(got[s - 1], want, rtol=1e-4, atol=2e-6, err_msg=f"{name} {src}+{s}")
                if steps > 1:
                    assert not np.allclose(got[0], got[-1]), name  # each s its own target


def test_router_pf_decode_call_is_one_compiled_call_equal_to_predict(fitted, monkeypatch):
    """A call of at most 4 tokens runs Router-PF's whole chain in the compiled kernel (`chain_probs`), never the
    numpy chain, and gives predict's scores for every S; a longer call still runs the numpy chain."""
    from moeflow.predict import fast
    from moeflow.predict.data import batch_from_rows, target_of

    _model, data, preds = fitted
    ml, spec = data.spec.moe_layers, data.spec
    ctx = data.context(4)
    p = preds["router-pf"]
    run = p.runner()
    numpy_chain = run.run
    monkeypatch.setattr(run, "run", lambda *a, **k: pytest.fail("the numpy chain ran for a decode call"))
    for rows in (np.array([7]), np.arange(2, data.n, 13)[:4]):
        for src in ml[:-1]:
            steps = min(p.max_lookahead, len(ml) - 1 - ml.index(src))
            b = batch_from_rows(data, src, rows, ctx=ctx)
            got = run.scores(b, steps)
            assert got.shape == (steps, len(rows), spec.num_experts) and got.dtype == np.float32
            for s in range(1, steps + 1):
                want = p.predict(target_of(spec, src, s), s, b).float().numpy()
                np.testing.assert_allclose(got[s - 1], want, rtol=1e-4, atol=2e-6, err_msg=f"{src}+{s}")
            np.testing.assert_allclose(got, fast.softmax(numpy_chain(b, steps, need_q=False)[1]), rtol=1e-5, atol=1e-7)
    calls = []
    monkeypatch.setattr(run, "run", lambda *a, **k: calls.append(1) or numpy_chain(*a, **k))
    run.scores(batch_from_rows(data, ml[0], np.arange(5), ctx=ctx), 1)
    assert calls == [1]


def _topk_sets(x: np.ndarray, k: int) -> np.ndarray:
    return np.sort(np.argsort(-x, -1, kind="stable")[..., :k], -1)


@pytest.mark.parametrize("name", ["estimator", "hybrid"])
def test_estimator_decode_call_is_one_compiled_call_equal_to_numpy(fitted, monkeypatch, name):
    """A call of at most 4 tokens runs the estimator's (and Hybrid's) chain, network and softmax in the compiled
    kernel (`estimator_probs`), never the numpy chain, and gives the numpy path's probabilities and top k (and
    predict's scores) for every S, across the layers of a pass (the per-pass terms reused)."""
    from moeflow.predict.data import batch_from_rows, target_of

    _model, data, preds = fitted
    ml, spec = data.spec.moe_layers, data.spec
    ctx = data.context(4)
    p = preds[name]
    run, ref = p.runner().warm(), p.runner()
    chain = run.est.chain if name == "hybrid" else run.chain
    monkeypatch.setattr(chain, "run", lambda *a, **k: pytest.fail("the numpy chain ran for a decode call"))
    n = 0
    for rows in (np.array([7]), np.arange(2, data.n, 13)[:4], np.array([40])):
        tok = torch.from_numpy(ctx[rows])
        for src in ml[:-1]:
            steps = min(p.max_lookahead, len(ml) - 1 - ml.index(src))
            b = batch_from_rows(data, src, rows, ctx=ctx)
            b.token_ctx = tok
            got = run.scores(b, steps)
            assert got.shape == (steps, len(rows), spec.num_experts) and got.dtype == np.float32
            b2 = batch_from_rows(data, src, np.concatenate([rows] * 2), ctx=ctx)  # 2x the tokens: the numpy path
            want = ref.scores(b2, steps)[:, : len(rows)]
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
            assert np.array_equal(_topk_sets(got, spec.top_k), _topk_sets(want, spec.top_k))
            for s in range(1, steps + 1):
                pr = p.predict(target_of(spec, src, s), s, b).float().numpy()
                np.testing.assert_allclose(got[s - 1], pr, rtol=1e-4, atol=2e-6, err_msg=f"{src}+{s}")
            n += 1
    assert n > 0


@pytest.mark.parametrize("kind", ["none", "prior", "pregate"])
def test_forest_compiled_call_equals_the_numpy_features_and_walk(fitted, monkeypatch, kind):
    """The forest's call in one compiled kernel (`forest_scores`: pre-gate, rows, walk, base, finish) gives exactly
    the scores of the numpy rows walked by `forest_walk` (`prepare` then `finish`) on the pre-gate probabilities it
    computed, which are numpy's (`probs`) up to float32 rounding, for every base, at a decode step's one token and
    at more; the call runs no numpy pre-gate."""
    from moeflow.predict import fast_forest
    from moeflow.predict.data import batch_from_rows

    _model, data, preds = fitted
    ml = data.spec.moe_layers
    ctx = data.context(4)
    f = preds["forest"]
    monkeypatch.setattr(f, "base_kind", kind)
    run = f.runner().warm()
    numpy_probs, kernel, seen = run.probs, fast_forest.forest_scores, []
    monkeypatch.setattr(run, "probs", lambda *a: pytest.fail("the numpy pre-gate ran in a compiled forest call"))
    monkeypatch.setattr(fast_forest, "forest_scores", lambda *a: seen.append(a[0]) or kernel(*a))
    for rows in (np.array([7]), np.arange(2, data.n, 13)[:4], np.arange(1, data.n, 7)[:9]):
        tok = torch.from_numpy(ctx[rows])
        for src in ml[:-1]:
            r = ml.index(src)
            steps = min(f.max_lookahead, len(ml) - 1 - r)
            pairs = [(ml[r + s], s) for s in range(1, steps + 1)]
            b = batch_from_rows(data, src, rows, ctx=ctx)
            b.token_ctx = tok
            got = run.scores(b, steps)
            probs = seen.pop()  # [P,T,E] the kernel's pre-gate
            np.testing.assert_allclose(probs, numpy_probs(b, [t for t, _ in pairs]), rtol=1e-5, atol=1e-7)
            want = run.finish(*run.prepare(pairs, b, probs), probs)
            np.testing.assert_array_equal(got, want, err_msg=f"{kind} {src}")


def test_forest_decode_steps_compute_each_token_prior_once(fitted, monkeypatch):
    """At a decode step (one token) the forest's per-pass priors are `prior_all`'s, and the previous token's is the
    one the last step computed for its current token: one `prior_all` per new token id, none for a repeated one."""
    from moeflow.predict.data import batch_from_rows

    _model, data, preds = fitted
    f = preds["forest"]
    run = f.runner()
    real, calls = f.prior_all, []
    monkeypatch.setattr(f, "prior_all", lambda tok: calls.append(tok.tolist()) or real(tok))
    src = data.spec.moe_layers[0]
    ids = [11, 12, 13, 12]
    for i, tok in enumerate(ids):  # consecutive decode steps: [.., prev, tok]
        b = batch_from_rows(data, src, np.array([7]))
        b.token_ctx = torch.tensor([[-1, -1, ids[i - 1] if i else -1, tok]])
        _emb, pc, pp = run.per_pass(b)
        np.testing.assert_array_equal(pc, real(np.array([tok])))
        np.testing.assert_array_equal(pp, real(np.array([ids[i - 1] if i else -1])))
    assert calls == [[11], [-1], [12], [13]]


def test_layer_ops_fall_back_to_the_module_when_numpy_differs(fitted):
    """A norm the numpy RMSNorm does not reproduce (here a LayerNorm) runs as its module's `forward`."""
    from moeflow.moe import get_adapter
    from moeflow.predict.fast import LayerOps

    model, data, _ = fitted
    ml = list(data.spec.moe_layers)
    m2 = copy.deepcopy(model)
    ad = get_adapter(m2)
    H = data.spec.hidden_size
    ln = torch.nn.LayerNorm(H)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.3, 0.3)
    ad.layers[ml[1]].post_attention_layernorm = ln
    ops = LayerOps(ad, ml)
    assert ops.nw[ml[1]] is None and ops.nw[ml[0]] is not None and all(ops.rw[l] is not None for l in ml)
    x = np.random.default_rng(0).standard_normal((5, H)).astype(np.float32)
    with torch.no_grad():
        np.testing.assert_allclose(ops.norm(ml[1], x), ln(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6)
        norm0 = ad.layers[ml[0]].post_attention_layernorm
        np.testing.assert_allclose(ops.norm(ml[0], x), norm0(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6)
        want = ad.router_logits(ml[2], torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ops.logits(ml[2], x), want, rtol=1e-5, atol=1e-6)
    ops.rw[ml[2]] = None  # the module path gives the same logits
    np.testing.assert_allclose(ops.logits(ml[2], x), want, rtol=1e-5, atol=1e-6)


def test_forest_prior_of_every_target_at_once(fitted):
    _, data, preds = fitted
    f = preds["forest"]
    tok = np.concatenate([data.token_id[:7], [-1, 10**6]])  # seen ids, an unseen one, padding
    allp = f.prior_all(tok)
    for r, l in enumerate(data.spec.moe_layers):
        np.testing.assert_array_equal(allp[r], f.prior(l, tok))


def _old_requests(sc: np.ndarray, targets: list[int], k: int, overfetch: float, mass: float | None):
    """The per-target request building the policies used before the batched call (the reference)."""
    from moeflow.moe.sets import mass_mask, topk_mask
    from moeflow.policies.base import PrefetchRequest
    from moeflow.policies.prefetch import topk_confidence

    out = []
    for s, t in enumerate(targets, start=1):
        x = torch.from_numpy(sc[s - 1])
        if mass is not None:
            mask = mass_mask(x / x.sum(-1, keepdim=True).clamp(min=1e-12), mass)
        else:
            mask = topk_mask(x, min(x.shape[1], max(1, round(k * overfetch))))
        p = x / x.sum(-1, keepdim=True).clamp(min=1e-12)
        best = p.masked_fill(~mask, -1.0).amax(0)
        near = float(len(targets) - s + 1)
        out += [
            PrefetchRequest((t, e), priority=near + float(best[e]), confidence=topk_confidence(float(best[e]), k))
            for e in mask.any(0).nonzero().flatten().tolist()
        ]
    out.sort(key=lambda r: -r.priority)
    return out


@pytest.mark.parametrize("t", [4, 1])  # a prefill's tokens, a decode step's one token (its own path)
@pytest.mark.parametrize("opts", [{}, {"overfetch": 1.5}, {"mass": 0.6}])
def test_requests_of_all_targets_at_once_equal_per_target(opts, t):
    from moeflow.policies.learned import EstimatorPrefetch

    pol = EstimatorPrefetch(predictors="x", **opts)
    rng = np.random.default_rng(3)
    sc = rng.dirichlet(np.ones(16), size=(3, t)) * rng.uniform(0.5, 2.0, size=(3, t, 1))  # [S,T,E] unnormalised
    sc = sc.astype(np.float32)
    targets = [5, 6, 7]
    got = pol._requests(targets, sc, 2)
    want = _old_requests(sc, targets, 2, pol.overfetch, pol.mass)
    assert [r.key for r in got] == [r.key for r in want]
    np.testing.assert_allclose([(r.priority, r.confidence) for r in got], [(r.priority, r.confidence) for r in want], atol=1e-6)
    assert len({r.key[0] for r in got}) == 3


def test_decode_requests_kernel_takes_the_raw_scores_of_the_step():
    """`decode_requests` takes a decode call's scores [S,1,E] as the runner returns them (unnormalised) and
    normalises each row itself: the per-target reference's requests, priorities and confidences."""
    from moeflow.predict.kernels import decode_requests

    rng = np.random.default_rng(4)
    sc = (rng.dirichlet(np.ones(16), size=(3, 1)) * rng.uniform(0.5, 4.0, size=(3, 1, 1))).astype(np.float32)  # [S,1,E]
    tg, ex, pr, cf = decode_requests(sc, 2, np.array([5, 6, 7]), 2.0)
    want = _old_requests(sc, [5, 6, 7], 2, 1.0, None)
    assert list(zip(tg.tolist(), ex.tolist())) == [r.key for r in want]
    np.testing.assert_allclose(np.stack([pr, cf], 1), [(r.priority, r.confidence) for r in want], atol=1e-6)


@pytest.mark.parametrize("name", LEARNED)
def test_runner_requests_are_decode_requests_of_its_scores_in_one_call(fitted, monkeypatch, name):
    """`runner.requests` (a decode step's one compiled call: the runner's kernel and `decode_into` together, into
    the caller's buffers) gives exactly `decode_requests(runner.scores(...))` for every source layer, S and
    overfetch, without calling the scores kernel from Python; a call of more than one token has none (None: the
    scores path runs)."""
    from moeflow.predict import fast, fast_estimator, fast_forest
    from moeflow.predict.data import batch_from_rows
    from moeflow.predict.kernels import decode_requests

    _model, data, preds = fitted
    ml, k = data.spec.moe_layers, data.spec.top_k
    ctx = data.context(4)
    p = preds[name]
    run = p.runner().warm().precompute(p.max_lookahead)
    n = 0
    for src, steps, b in _decode_batches(data, ctx, p.max_lookahead):
        tga = np.arange(100, 100 + steps, dtype=np.int64)
        for m in (k, k + 2):
            want = decode_requests(run.scores(b, steps), m, tga, float(k))
            with monkeypatch.context() as mp:
                for mod in (fast, fast_estimator, fast_forest):
                    for kern in ("chain_probs", "estimator_probs", "forest_scores"):
                        if hasattr(mod, kern):
                            fail = lambda *a, kern=kern: pytest.fail(f"{kern} called from Python")  # noqa: E731
                            mp.setattr(mod, kern, fail)
                ib, fb = np.full((2, 40), -7, np.int64), np.full((2, 40), np.nan)
                n_req = run.requests(b, steps, m, tga, float(k), ib, fb)
            assert n_req == len(want[0]) > 0, name
            for g, w in zip((ib[0, :n_req], ib[1, :n_req], fb[0, :n_req], fb[1, :n_req]), want):
                np.testing.assert_array_equal(g, w, err_msg=f"{name} {src} S={steps} m={m}")
            assert (ib[:, n_req:] == -7).all()  # nothing written past the count
            n += 1
    assert n > 0
    b5 = batch_from_rows(data, ml[0], np.arange(5), ctx=ctx)
    assert run.requests(b5, 1, k, np.arange(1), float(k), *np.zeros((2, 2, 40))) is None


@pytest.mark.parametrize("name", LEARNED)
def test_a_batch_with_host_arrays_runs_the_decode_call_without_touching_a_tensor(fitted, name):
    """With `SourceBatch.arrays` (the policy's host copies of the residual, router input, gate weights and ids) a
    decode step's `runner.requests` reads no tensor of the batch (no torch call on them), and gives the requests of
    the tensors."""
    from dataclasses import replace

    from moeflow.predict.data import batch_from_rows

    seen: list[str] = []
    Spy = _spy(seen)

    _model, data, preds = fitted
    ml, k = data.spec.moe_layers, data.spec.top_k
    ctx = data.context(4)
    p = preds[name]
    run = p.runner().warm().precompute(p.max_lookahead)
    tok = torch.from_numpy(ctx[[7]])
    for src in ml[:-1]:
        steps = min(p.max_lookahead, len(ml) - 1 - ml.index(src))
        b = batch_from_rows(data, src, np.array([7]), ctx=ctx)
        b.token_ctx = tok
        tga = np.arange(steps, dtype=np.int64)
        arrays = tuple(
            np.ascontiguousarray(t.numpy(), dt)
            for t, dt in zip((b.residual, b.router_input, b.topk_weights, b.topk_ids), (np.float32,) * 3 + (np.int64,))
        )
        spied = {f: getattr(b, f).as_subclass(Spy) for f in ("residual", "router_input", "topk_weights", "topk_ids")}
        b2 = replace(b, arrays=arrays, **spied)
        ib, fb = np.zeros((2, 40), np.int64), np.zeros((2, 40))
        ib0, fb0 = np.zeros((2, 40), np.int64), np.zeros((2, 40))
        n0 = run.requests(b, steps, k, tga, float(k), ib0, fb0)
        seen.clear()
        n = run.requests(b2, steps, k, tga, float(k), ib, fb)
        assert seen == [], (name, seen)
        assert n == n0 and n0 > 0 and np.array_equal(ib[:, :n], ib0[:, :n]) and np.array_equal(fb[:, :n], fb0[:, :n])


def test_decode_requests_are_the_dataclass_objects_without_its_init(monkeypatch):
    """A decode step's requests are PrefetchRequest objects equal (and hashing equal) to the constructed ones,
    made without the frozen dataclass's `__init__` (one `object.__setattr__` per field)."""
    from moeflow.policies.base import PrefetchRequest
    from moeflow.policies.learned import EstimatorPrefetch

    pol = EstimatorPrefetch(predictors="x")
    sc = np.random.default_rng(5).dirichlet(np.ones(16), size=(3, 1)).astype(np.float32)  # [S,1,E]
    want = pol._requests([5, 6, 7], sc, 2)
    monkeypatch.setattr(PrefetchRequest, "__init__", lambda *a, **k: pytest.fail("PrefetchRequest.__init__ called"))
    got = pol._requests([5, 6, 7], sc, 2)
    assert got == want and [hash(r) for r in got] == [hash(r) for r in want] and len(got) == 6
    assert all(type(r) is PrefetchRequest and r.key == (int(r.key[0]), int(r.key[1])) for r in got)


@pytest.mark.parametrize("name", ["router-pf", "estimator", "hybrid", "forest"])
def test_the_policy_makes_one_call_per_layer_and_never_runs_a_router_hook(fitted, tmp_path, monkeypatch, name):
    """In a generation, propose calls the runner once per MoE layer (all S at once, a decode step's requests in one
    compiled call: `runner.requests`, never `scores`), never `predict`, and never the engine's hooked router
    (`predict_logits`), with the pass's gate history as rows (`history_rows`) too: the output stays the resident
    model's."""
    from dataclasses import replace

    from moeflow.policies.learned import LearnedPrefetch
    from moeflow.predict.fast import history_rows
    from moeflow.predict.io import save_predictors
    from moeflow.runtime.generate import build_engine, generate_one
    from moeflow.runtime.link import DirectLink

    model, data, preds = fitted
    folder = tmp_path / "pred"
    save_predictors(folder, {name: preds[name]}, model, trace="t", trace_fingerprint=None, config={}, report=None)
    model.set_experts_implementation("grouped_mm")
    prompt = torch.tensor([[3, 9, 27, 4, 17, 8, 30, 2]])
    ref, _ = generate_one(model, prompt, None, max_new_tokens=5, min_new_tokens=5)
    cls = type(preds[name])
    monkeypatch.setattr(cls, "predict", lambda *a, **k: pytest.fail("predict called at run time"))
    eng = build_engine(
        model,
        mode="offload",
        link=DirectLink(),
        capacity=data.spec.top_k * 2,
        eviction="lru",
        prefetch=name,
        prefetch_opts={"predictors": str(folder)},
        lookahead=2,
    )
    pol = eng.prefetcher
    assert isinstance(pol, LearnedPrefetch)
    hooked: list[int] = []  # hooked-router calls made while the policy proposes (the staged prefill makes its own)
    calls: list[tuple[int, int]] = []
    proposing = [False]
    real_logits, real_propose = eng._predict_logits, pol.propose

    def logits(t, h):
        if proposing[0]:
            hooked.append(t)
        return real_logits(t, h)

    def propose(ctx):
        proposing[0] = True
        try:
            return real_propose(ctx)
        finally:
            proposing[0] = False

    eng._predict_logits = logits  # type: ignore[method-assign]
    pol.propose = propose  # type: ignore[method-assign]
    rank, E = {l: i for i, l in enumerate(data.spec.moe_layers)}, data.spec.num_experts
    kept: list[bool] = []  # whether a batch's history rows are its history's (the policy's pass buffer), and its arrays

    def keep(b):
        rows = history_rows(replace(b, history_rows=None), rank, E)
        kept.append(b.history_rows is not None and np.array_equal(b.history_rows, rows))
        host = (b.residual, b.router_input, b.topk_weights, b.topk_ids)  # the policy's host arrays are the tensors'
        kept.append(b.arrays is not None and all(np.array_equal(a, t.numpy()) for a, t in zip(b.arrays, host)))

    scored: list[int] = []  # runner calls that handed scores back (`scores`) instead of the requests (`requests`)
    with eng:
        run, req = pol.fast.scores, pol.fast.requests
        pol.fast.scores = lambda b, s: scored.append(b.layer) or run(b, s)
        pol.fast.requests = lambda b, s, *a: calls.append((b.layer, s)) or keep(b) or req(b, s, *a)
        sizes = {k: len(v) for k, v in _stores(pol.fast).items()}  # bind built every (layer, S)'s arrays
        got, _ = generate_one(model, prompt, eng, max_new_tokens=5, min_new_tokens=5)
        assert {k: len(v) for k, v in _stores(pol.fast).items()} == sizes
    assert torch.equal(got, ref)
    ml = data.spec.moe_layers
    assert hooked == [] and pol.calls > 0 and kept and all(kept)
    assert scored == []  # a decode step's scores and requests come from the runner's ONE compiled call
    decode = pol.decode_passes  # one prefill, then a pass per decoded token after the first
    assert decode == 4
    # propose runs at every MoE layer of a decode pass; the staged prefill's after its last MoE layer only (its
    # pre-gate stages each next layer), where there is no target, so every runner call is a decode pass's
    assert pol.calls == decode * len(ml) + 1 and len(calls) == decode * (len(ml) - 1)  # the last layer has no target
    assert all(s == min(2, len(ml) - 1 - ml.index(l)) for l, s in calls)
    assert 0.0 < pol.predict_decode_s < pol.predict_s  # the decode steps' share of the time, the prefill's excluded
    assert pol.predict_decode_cpu_s > 0.0  # and the model thread's CPU time in them


def test_forest_worker_mode_runs_the_trees_off_the_models_thread(fitted, tmp_path):
    """`worker=on`: ExpertFlow's asynchronous dual mode (one worker call per source layer for every later layer,
    cache lookups or the pre-gate); the output stays exact. Off (the default) no worker thread exists."""
    import threading

    from moeflow.predict.io import save_predictors
    from moeflow.runtime.generate import build_engine, generate_one
    from moeflow.runtime.link import DirectLink

    model, data, preds = fitted
    folder = tmp_path / "pred"
    save_predictors(folder, {"forest": preds["forest"]}, model, trace="t", trace_fingerprint=None, config={}, report=None)
    model.set_experts_implementation("grouped_mm")
    prompt = torch.tensor([[3, 9, 27, 4, 17, 8, 30, 2]])
    ref, _ = generate_one(model, prompt, None, max_new_tokens=5, min_new_tokens=5)
    for worker in ("off", "on"):
        eng = build_engine(
            model,
            mode="offload",
            link=DirectLink(),
            capacity=data.spec.top_k * 2,
            eviction="lru",
            prefetch="forest",
            prefetch_opts={"predictors": str(folder), "worker": worker},
            lookahead=2,
        )
        pol = eng.prefetcher
        with eng:
            got, _ = generate_one(model, prompt, eng, max_new_tokens=5, min_new_tokens=5)
            threads = [t.name for t in threading.enumerate() if t.name.startswith("moeflow-forest")]
        assert torch.equal(got, ref), worker
        if worker == "on":
            assert pol.fast is None and pol.runner.calls > 0 and pol.runner.hits + pol.runner.fallbacks > 0 and threads
        else:
            assert pol.fast is not None and not hasattr(pol, "runner") and not threads


@pytest.mark.parametrize("name", ["router-pf", "estimator", "hybrid"])
def test_fused_chain_equals_the_norm_and_router_modules(fitted, name):
    """The chain folds the norm's weight into the router (and the estimator's q-term) and never forms q; with
    every norm and router run as its module (no fold) the scores are the same, and the folded products exist
    only where the numpy norm and router do."""
    from moeflow.predict.data import batch_from_rows

    _model, data, preds = fitted
    ml = data.spec.moe_layers
    ctx = data.context(4)
    rows = np.arange(0, data.n, 7)[:6]
    run, ref = preds[name].runner(), preds[name].runner()
    chain = getattr(ref, "chain", None) or getattr(getattr(ref, "est", None), "chain", None) or ref
    chain.ops.nw = {l: None for l in ml}  # the modules' forward for every norm and router
    chain.ops.rw = {l: None for l in ml}
    for src in ml[:-1]:
        steps = min(preds[name].max_lookahead, len(ml) - 1 - ml.index(src))
        b = batch_from_rows(data, src, rows, ctx=ctx)
        np.testing.assert_allclose(run.scores(b, steps), ref.scores(b, steps), rtol=1e-4, atol=2e-6, err_msg=f"{src}")
    assert all(F is None for F in chain._fused.values()) and chain._fused
    c2 = getattr(run, "chain", None) or getattr(getattr(run, "est", None), "chain", None) or run
    assert all(F is not None for F in c2._fused.values()) and c2._fused


@pytest.mark.parametrize("renorm", [False, True])
def test_chain_probs_routes_each_step_by_its_top_k(renorm):
    """`chain_probs` (the compiled Router-PF chain) equals a plain numpy chain: RMS-normed state times the fused
    router, softmax, and the next state grown by the top-k experts' default vectors weighted by their
    probabilities (renormalised to sum 1 where the target renormalises); with and without renormalisation."""
    from moeflow.predict.kernels import chain_probs

    rng = np.random.default_rng(3)
    T, H, E, S, k = 3, 16, 8, 3, 2
    f32 = np.float32
    r0, w0 = rng.normal(size=(T, H)).astype(f32), rng.random((T, k)).astype(f32)
    ids0 = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
    Fs, Ds = rng.normal(size=(S, H, E)).astype(f32), rng.normal(size=(S, E, H)).astype(f32)
    eps, rn = np.full(S, 1e-6, f32), np.full(S, renorm, np.bool_)
    got = chain_probs(r0, w0, ids0, Fs, eps, Ds, k, rn)  # [S,T,E]
    for t in range(T):
        h = r0[t].astype(np.float64) + sum(float(w0[t, i]) * Ds[0, ids0[t, i]].astype(np.float64) for i in range(k))
        for s in range(S):
            z = (h @ Fs[s].astype(np.float64)) / np.sqrt(np.mean(h * h) + eps[s])
            p = np.exp(z - z.max())
            p /= p.sum()
            np.testing.assert_allclose(got[s, t], p, rtol=2e-4, atol=1e-6, err_msg=f"t={t} s={s}")
            top = np.argsort(-p, kind="stable")[:k]
            w = p[top] / p[top].sum() if renorm else p[top]
            h = h + w @ Ds[s + 1][top].astype(np.float64) if s + 1 < S else h


def _stores(run) -> dict[str, dict]:
    """The per-(layer, S) stores a runner fills on its first call for a key."""
    est = getattr(run, "est", run)
    stores = {"stacked": getattr(run, "_stacked", {}), "pairs": getattr(run, "_pairs", {}), "use": getattr(run, "_use", {})}
    if hasattr(est, "_compiled"):
        stores.update(compiled=est._compiled, all=getattr(est, "_all", {}), tails=getattr(est, "_tails", {}))
    chain = getattr(est, "chain", None)
    if chain is not None:
        stores["chain"] = chain._compiled
    return stores


@pytest.mark.parametrize("name", LEARNED)
def test_precompute_builds_every_s_at_bind_and_the_scores_stay_the_same(fitted, name):
    """`runner.precompute(S)` (the policy calls it at bind) builds every source layer's per-S arrays for S up to the
    horizon, the shorter S as views of the longest; a decode call then adds nothing to them, and its scores are
    exactly those of a runner that builds them on first use."""
    _model, data, preds = fitted
    ml = data.spec.moe_layers
    ctx = data.context(4)
    p = preds[name]
    run, ref = p.runner().precompute(p.max_lookahead), p.runner()
    sizes = {k: len(v) for k, v in _stores(run).items()}
    assert any(sizes.values()), name
    comp = _stores(run).get("compiled") or _stores(run).get("chain") or {}
    for (l, s), c in comp.items():  # a shorter S shares the longest S's arrays
        longest = comp.get((l, min(p.max_lookahead, len(ml) - 1 - ml.index(l))))
        if c is not None and longest is not None and s > 1:
            assert np.shares_memory(c[0], longest[0]) and c[0].flags.c_contiguous
    for src, steps, b in _decode_batches(data, ctx, p.max_lookahead):
        np.testing.assert_array_equal(run.scores(b, steps), ref.scores(b, steps), err_msg=f"{name} {src} S={steps}")
    assert {k: len(v) for k, v in _stores(run).items()} == sizes, name  # nothing built in a call


def test_np32_of_a_float32_cpu_tensor_is_its_view_without_a_conversion_call():
    """`np32` returns a float32 CPU tensor's own memory without calling `.to` (a decode call converts a few of
    them); any other tensor is converted."""
    from moeflow.predict.fast import np32

    seen: list[str] = []
    Spy = _spy(seen)

    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).as_subclass(Spy)
    seen.clear()
    a = np32(x)
    assert a.dtype == np.float32 and np.shares_memory(a, x.numpy()) and "to" not in seen
    b = np32(torch.arange(6, dtype=torch.float64).reshape(2, 3))
    assert b.dtype == np.float32 and np.array_equal(b, a)


@pytest.mark.parametrize("name", ["estimator", "hybrid", "forest"])
def test_history_rows_stand_for_the_gate_history_in_the_compiled_call(fitted, name):
    """A decode call's gate history comes from `SourceBatch.history_rows` (rank x E + expert, the policy's per-pass
    buffer) when the batch has them: the same scores as from the `history` dict, without reading that dict."""
    from dataclasses import replace

    from moeflow.predict.data import batch_from_rows
    from moeflow.predict.fast import history_rows

    _model, data, preds = fitted
    ml, E = data.spec.moe_layers, data.spec.num_experts
    rank = {l: i for i, l in enumerate(ml)}
    ctx = data.context(4)
    p = preds[name]
    run = p.runner().warm()
    for rows in (np.array([7]), np.array([40])):
        for src in ml[1:-1]:
            steps = min(p.max_lookahead, len(ml) - 1 - ml.index(src))
            b = batch_from_rows(data, src, rows, ctx=ctx)
            hr = history_rows(b, rank, E)  # [T,c]
            assert hr.shape == (1, data.spec.top_k * (rank[src] + 1))
            want = run.scores(b, steps)
            got = run.scores(replace(b, history={}, history_rows=hr), steps)
            np.testing.assert_array_equal(got, want, err_msg=f"{name} {src}")


def test_every_runtime_runner_has_the_runner_protocol_methods():
    """A learned prefetch policy calls `warm`, `precompute`, `scores` and `requests` on its predictor's runner
    without probing for them (`moeflow.predict.base.Runner`): every runner class must define all four, with
    `requests` taking the decode step's buffers."""
    import inspect

    from moeflow.predict.base import Runner
    from moeflow.predict.fast import ChainRunner
    from moeflow.predict.fast_estimator import EstimatorRunner, HybridRunner
    from moeflow.predict.fast_forest import ForestRunner

    want = {n: inspect.signature(getattr(Runner, n)) for n in ("warm", "precompute", "scores", "requests")}
    for cls in (ChainRunner, EstimatorRunner, HybridRunner, ForestRunner):
        for name, sig in want.items():
            got = getattr(cls, name, None)
            assert callable(got), f"{cls.__name__} lacks {name}"
            assert list(inspect.signature(got).parameters) == list(sig.parameters), f"{cls.__name__}.{name}"
