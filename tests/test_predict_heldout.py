"""Token-id as a first-class predictor, the grouped forest call, the estimator's inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_predict import small_cfg, tiny_setup, trained_folder  # noqa: F401  (module fixtures)


def test_token_id_is_in_train_output_and_round_trips(trained_folder, tiny_setup, tmp_path):  # noqa: F811
    """`moeflow train` reports and saves token-id; loaded back it scores held-out rows bit for bit alike,
    and its scores depend on the token (a loader returning frequency rows would fail)."""
    from moeflow.predict.data import batch_from_rows
    from moeflow.predict.io import load_predictors
    from moeflow.predict.train import fit_all

    model, _, out, rep = trained_folder
    _, _, data = tiny_setup
    assert "token-id" in rep["by_s"] and set(rep["by_s"]["token-id"]) == {"1", "2", "3"}
    assert "token-id" in rep["results"] and rep["results"]["token-id"]
    assert rep["decode_by_s"] is None or "token-id" in rep["decode_by_s"]
    train, held = data.split(0.2, 0)
    fitted = fit_all(train, model, small_cfg(only=()))["token-id"]
    _, back = load_predictors(out, model, ["token-id"])
    ml = data.spec.moe_layers
    b = batch_from_rows(held, ml[0], np.arange(held.n), ctx=held.context(4))
    for s in (1, 2, 3):
        want, got = fitted.predict(ml[s], s, b), back["token-id"].predict(ml[s], s, b)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got.std(0).sum() > 0  # rows differ with the token id
    # without token ids it falls back to the global frequency (the run-time path without a context)
    b.token_ctx = None
    torch.testing.assert_close(back["token-id"].predict(ml[1], 1, b), back["token-id"].freq.predict(ml[1], 1, b))


def test_token_id_is_a_prefetch_policy():
    from moeflow.policies import PREFETCH
    from moeflow.policies.learned import LearnedPrefetch

    pol = PREFETCH["token-id"](predictors="somewhere")
    assert isinstance(pol, LearnedPrefetch) and pol.predictor == "token-id"


@pytest.fixture(scope="module")
def forest(tiny_setup):  # noqa: F811
    from moeflow.predict.forest import Forest

    model, _, data = tiny_setup
    f = Forest(model, 3)
    f.fit(data, model, small_cfg(forest_trees=4, forest_max_samples=2000))
    return model, data, f


def test_grouped_forest_call_equals_per_token_calls(forest):
    """ONE `predict_group` call over every (target, S) of a layer = the per-pair, per-token `predict` calls."""
    from moeflow.predict.data import batch_from_rows, target_of

    _model, data, f = forest
    ml = data.spec.moe_layers
    rows = np.arange(0, data.n, 7)[:12]
    ctx = data.context(f.window)
    b = batch_from_rows(data, ml[0], rows, ctx=ctx)
    pairs = [(target_of(data.spec, ml[0], s), s) for s in (1, 2, 3)]
    grouped = f.predict_group(pairs, b)
    assert len(grouped) == 3 and all(g.shape == (len(rows), data.spec.num_experts) for g in grouped)
    for (t, s), g in zip(pairs, grouped):
        for i, r in enumerate(rows):
            one = f.predict(t, s, batch_from_rows(data, ml[0], np.array([r]), ctx=ctx)).numpy()
            np.testing.assert_allclose(g[i : i + 1], one, rtol=1e-6, atol=1e-7)
    # the pairs really differ (a grouped call that returned one pair's rows for all would fail)
    assert not np.allclose(grouped[0], grouped[2])


def test_async_forest_makes_one_call_per_layer(forest):
    from moeflow.predict.data import batch_from_rows, target_of
    from moeflow.predict.forest_async import AsyncForest

    _model, data, f = forest
    ml = data.spec.moe_layers
    ctx = data.context(f.window)
    rows = np.arange(5)
    b = batch_from_rows(data, ml[0], rows, ctx=ctx)
    keys = [tuple(r) for r in ctx[rows].tolist()]
    pairs = [(target_of(data.spec, ml[0], s), s) for s in (1, 2, 3)]
    runner = AsyncForest(f)
    try:
        runner.submit_group(pairs, b, keys)
        runner.pool.shutdown(wait=True)
        assert runner.calls == 1 and len(runner.cache) == len(set(keys)) * 3
        want = f.predict_group(pairs, b)
        for (t, s), w in zip(pairs, want):
            got = np.stack([runner.cache[(q, t, s)] for q in keys])
            np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-7)
    finally:
        runner.close()


def test_estimator_input_features(tiny_setup):  # noqa: F811
    """x = [q_S, u_l, e_t, e_t-1, gates of layers <= source]: shape, token part, history part."""
    from moeflow.predict.data import batch_from_rows
    from moeflow.predict.estimator import Estimator

    model, _, data = tiny_setup
    spec = data.spec
    est = Estimator(model, 3, m=16, n=32, context=2)
    est.fit(data, model, small_cfg(est_epochs=1, est_min_steps=5, est_max_tokens=200))
    H, L, E = spec.hidden_size, len(spec.moe_layers), spec.num_experts
    assert est.feature_dim == 4 * H + L * E
    ml = spec.moe_layers
    b = batch_from_rows(data, ml[1], np.arange(6), ctx=data.context(2))
    x = est.features(2, b)
    assert x.shape == (6, 4 * H + L * E)
    emb = model.get_input_embeddings().weight
    torch.testing.assert_close(x[:, 2 * H : 3 * H], emb[b.token_ctx[:, -1]].float())
    gates = x[:, 4 * H :].reshape(6, L, E)
    assert (gates[:, 2:] == 0).all() and (gates[:, 0] > 0).sum(1).eq(spec.top_k).all()
    torch.testing.assert_close(gates[:, 1].gather(1, b.topk_ids), b.topk_weights)
    # tokens matter: other token ids, other features and other scores
    b2 = batch_from_rows(data, ml[1], np.arange(6), ctx=(data.context(2) + 1) % 200)
    assert not torch.equal(est.features(2, b2), x)
    assert est.predict(ml[3], 2, b).shape == (6, E)
