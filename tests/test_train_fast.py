"""`moeflow train`'s default set, its seconds per predictor, and the fast fits (estimator, hybrid, forest)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from moeflow.errors import ConfigError
from tests.test_predict import REPO, small_cfg, structured_prompts, tiny_setup, write_trace  # noqa: F401

STEPS = {"load", "default vectors", "evaluate", "save"}


def _train(args: list[str]) -> tuple[int, str, str]:
    from typer.testing import CliRunner

    from moeflow.cli.app import _register, app

    _register()
    r = CliRunner().invoke(app, ["train", *args])
    return r.exit_code, r.stdout, r.output


def _learned_prefetch_predictors() -> set[str]:
    """The predictor each learned prefetch policy of `moeflow run --prefetch` loads from the folder."""
    from moeflow.policies.base import PREFETCH
    from moeflow.policies.learned import LearnedPrefetch

    return {cls.predictor for cls in PREFETCH.values() if isinstance(cls, type) and issubclass(cls, LearnedPrefetch)}


@pytest.fixture(scope="module")
def default_train(tiny_setup):  # noqa: F811
    """`moeflow train` with its default predictor set, once with --json and once as text."""
    _, trace, _ = tiny_setup
    root = trace.parent
    base = ["--trace", str(trace), "--model", str(root / "model"), "--max-s", "2", "--forest-trees", "4"]
    base += ["--forest-samples", "2000", "--threads", "1"]
    code, out, log = _train([*base, "--out", str(root / "fast-json"), "--json"])
    assert code == 0, log
    code, _, text = _train([*base, "--out", str(root / "fast-text"), "--est-dtype", "float32"])
    assert code == 0, text
    return root, json.loads(out.strip().splitlines()[-1]), text


def test_default_set_is_what_run_prefetchers_load(default_train):
    from moeflow.stages.train import BASELINES, LEARNED

    root, rep, _ = default_train
    meta = json.loads((root / "fast-json" / "meta.json").read_text())
    fitted = set(meta["predictors"])
    assert _learned_prefetch_predictors() <= fitted  # every `run --prefetch <learned>` finds its predictor
    assert fitted == {*LEARNED, *BASELINES, "pregate"} and set(LEARNED) == _learned_prefetch_predictors() - set(BASELINES)
    assert meta["config"]["only"] == list(LEARNED) and "planner" not in rep and "gps" not in rep  # not asked for
    assert meta["extra"] == [] and not {"eam", "eap", "gps"} & {p.name for p in (root / "fast-json").iterdir()}


def test_train_json_has_seconds_per_fitted_predictor(default_train):
    root, rep, _ = default_train
    fitted = json.loads((root / "fast-json" / "meta.json").read_text())["predictors"]
    per = rep["seconds_per_predictor"]
    assert set(per) == set(fitted) and all(v >= 0 for v in per.values())
    assert set(rep["seconds_steps"]) == STEPS
    # the whole stage: every fit and every shared step happened inside it (each figure rounded to 1 ms)
    assert rep["seconds"] >= sum(per.values()) + sum(rep["seconds_steps"].values()) - 0.001 * (len(per) + len(STEPS))
    assert per["estimator"] > 0 and per["forest"] > 0
    assert rep["fit_workers"] == 1 and rep["fit_threads"] == 1  # --threads 1: one fit at a time, on one thread
    from moeflow.predict.estimator import native_bf16

    # the estimator's steps in bfloat16 where this CPU multiplies it in hardware, as its folder records
    est_cfg = json.loads((root / "fast-json" / "estimator" / "config.json").read_text())
    assert rep["est_bf16"] is native_bf16() and est_cfg["train_bf16"] is native_bf16()
    text_cfg = json.loads((root / "fast-text" / "estimator" / "config.json").read_text())
    assert text_cfg["train_bf16"] is False  # --est-dtype float32


def test_train_text_prints_the_seconds_table(default_train):
    _, _, text = default_train
    assert "train seconds" in text
    for row in ("fit estimator", "fit hybrid", "fit forest", "fit router-pf", "default vectors", "evaluate"):
        assert row in text, row


def test_commands_freeze_what_is_left_for_the_exit(monkeypatch, tmp_path):
    """A command (here train) registers `gc.freeze` to run at interpreter exit (the teardown's collections then skip
    the objects left), once, and nothing more: gc is not frozen while the process goes on."""
    import atexit
    import gc

    registered: list = []
    monkeypatch.setattr(atexit, "register", lambda f, *a, **k: registered.append(f) or f)
    monkeypatch.setattr(atexit, "unregister", lambda f: registered.remove(f) if f in registered else None)
    monkeypatch.setattr("moeflow.stages.train.main", lambda cfg, console=None: {"seconds": 0.0})
    frozen = gc.get_freeze_count()
    code, _, log = _train(["--trace", str(tmp_path), "--out", str(tmp_path / "p"), "--json"])
    assert code == 0, log
    assert gc.freeze in registered and gc.get_freeze_count() == frozen
    code, _, log = _train(["--trace", str(tmp_path), "--out", str(tmp_path / "p"), "--json"])
    assert code == 0, log
    assert registered.count(gc.freeze) == 1


def test_only_planners_still_fit_and_are_timed(tmp_path):
    """`--only eam --only eap`: the CasMoE planner alone, each part with its seconds."""
    from moeflow.models import load_model, tiny_model

    tiny_model("olmoe").save_pretrained(tmp_path / "model")
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the planner reads prompt text
        shutil.copy(REPO / "models" / "olmoe-mini" / f, tmp_path / "model" / f)
    model, _ = load_model(str(tmp_path / "model"), dtype="float32")
    trace = write_trace(model, tmp_path / "trace", structured_prompts(8, 8), new_tokens=2, record_hidden=False)
    args = ["-t", str(trace), "-o", str(tmp_path / "pred"), "-m", str(tmp_path / "model"), "--only", "eam", "--only", "eap"]
    args += ["--plan-opt", "eap_layers=1", "--plan-opt", "eap_epochs=1", "--max-s", "1", "--threads", "1", "--json"]
    code, out, log = _train(args)
    assert code == 0, log
    rep = json.loads(out.strip().splitlines()[-1])
    meta = json.loads((tmp_path / "pred" / "meta.json").read_text())
    assert meta["extra"] == ["eam", "eap"] and set(meta["predictors"]) == {"frequency", "token-id"}
    assert set(rep["seconds_per_predictor"]) == {"frequency", "token-id", "eam", "eap"}
    assert "default vectors" not in rep["seconds_steps"]  # nothing needed them


@pytest.fixture(scope="module")
def fitted_default(tiny_setup):  # noqa: F811
    """router-pf, estimator, hybrid and forest with the default training settings (small forest)."""
    from moeflow.predict.train import fit_all
    from moeflow.stages.train import TrainConfig

    model, _, data = tiny_setup
    train, held = data.split(0.3, 0)
    cfg = TrainConfig(trace="", out="", model="", max_s=3, threads=1, forest_trees=8)
    return model, train, held, cfg, fit_all(train, model, cfg)


def test_estimator_and_forest_learn_beyond_the_baselines(fitted_default):
    """Held-out recall@k of the tiny trace, mean over S: the estimator beats pre-gate, Router-PF and token-id
    (an estimator that does not learn, e.g. with a zero learning rate, is below them), the forest beats
    token-id and frequency."""
    from moeflow.predict.evaluate import evaluate

    _, _, held, _, preds = fitted_default
    mean = {n: float(np.mean(list(v.values()))) for n, v in evaluate(preds, held, max_s=3)["by_s"].items()}
    assert mean["estimator"] > max(mean["pregate"], mean["router-pf"], mean["token-id"]) + 0.01, mean
    assert mean["hybrid"] >= min(mean["estimator"], mean["router-pf"]) - 1e-9, mean
    assert mean["forest"] > mean["token-id"] + 0.05 and mean["forest"] > mean["frequency"] + 0.1, mean


def test_hybrid_reuses_the_fitted_estimator(fitted_default):
    _, train, _, cfg, preds = fitted_default
    hyb, est = preds["hybrid"], preds["estimator"]
    assert hyb.estimator is est  # one estimator fit serves both
    assert set(hyb.val) == {f"{l}+{s}" for l, s in train.rank_pairs(cfg.max_s)}
    assert {k: v["estimator"] for k, v in hyb.val.items()} == {f"{l}+{s}": r for (l, s), r in est.val_recall.items()}


def test_training_forward_equals_the_network_and_predict(fitted_default):
    """The per-part first layer of training (rows x all pairs) computes EstimatorNet on the full features,
    plus the target router's logits of q, which is what `predict` scores at run time."""
    from moeflow.predict.data import batch_from_rows, target_of

    _, train, _, _, preds = fitted_default
    est = preds["estimator"]
    rows = np.arange(min(train.n, 40))
    c = est._parts(train, rows)
    P, N = len(est.pairs), len(rows)
    i = torch.arange(N)
    with torch.no_grad():
        got = est._logits_parts(c, i)  # [P,N,E]
        p_ = torch.arange(P).repeat_interleave(N)
        want = est.net(est._features_parts(c, p_, i.repeat(P)), p_).reshape(P, N, -1) + c["rl"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ctx = train.context(max(1, est.context))
    for j, (src, s) in enumerate(est.pairs):
        b = batch_from_rows(train, src, rows, ctx=ctx)
        # training stores q in float16: the same distribution up to that rounding
        torch.testing.assert_close(est.predict(target_of(train.spec, src, s), s, b), torch.softmax(got[j], -1), rtol=0, atol=2e-2)


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    from moeflow.predict.estimator import native_bf16

    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)  # a torch build with oneDNN
    line = "flags\t\t: fpu vme sse2 avx2 avx512f avx512bw"
    assert not native_bf16(f"processor\t: 0\n{line}\n")  # AVX-512 without bfloat16 products: emulated
    assert native_bf16(f"processor\t: 0\n{line} avx512_bf16 avx512_vnni\n")  # AMD Zen 4, Intel Cooper Lake
    assert native_bf16(f"{line} amx_bf16 amx_tile\n")  # Intel Sapphire Rapids
    assert not native_bf16("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # no x86 flags line
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not native_bf16(f"{line} avx512_bf16\n")  # no oneDNN to use them


def test_an_unknown_est_dtype_is_one_line_before_any_work(tiny_setup, tmp_path, capsys):  # noqa: F811
    from tests.test_messages import one_line_error

    _, trace, _ = tiny_setup
    out = tmp_path / "p"
    argv = ["train", "--trace", trace, "--out", out, "--est-dtype", "float16"]
    one_line_error(argv, capsys, "--est-dtype must be one of auto, bfloat16, float32 (got 'float16')")
    assert not out.exists()


def test_only_hybrid_reports_how_its_own_estimator_trained(tiny_setup, tmp_path):  # noqa: F811
    from moeflow.predict.estimator import native_bf16

    _, trace, _ = tiny_setup
    args = ["--trace", str(trace), "--model", str(trace.parent / "model"), "--out", str(tmp_path / "h"), "--only", "hybrid"]
    code, out, log = _train([*args, "--max-s", "2", "--threads", "1", "--json"])
    assert code == 0, log
    assert json.loads(out.strip().splitlines()[-1])["est_bf16"] is native_bf16()  # hybrid fitted the estimator it uses


def test_estimator_steps_in_bf16_learn_as_much_as_in_float32(tiny_setup, tmp_path):  # noqa: F811
    """`est_dtype` bfloat16: the training steps' products in bfloat16 autocast (a different network: the flag takes effect)
    reach the float32 fit's held-out recall; the folder records how it was trained."""
    from moeflow.predict.estimator import Estimator
    from moeflow.predict.evaluate import evaluate
    from moeflow.stages.train import TrainConfig

    model, _, data = tiny_setup
    train, held = data.split(0.3, 0)
    fits, recall = {}, {}
    for bf16 in (False, True):
        cfg = TrainConfig(trace="", out="", model="", max_s=2, est_min_steps=60, est_dtype="bfloat16" if bf16 else "float32")
        est = fits[bf16] = Estimator.create(model, cfg)
        est.fit(train, model, cfg)
        assert est.bf16 is bf16 and all(p.dtype == torch.float32 for p in est.net.parameters())
        recall[bf16] = float(np.mean(list(evaluate({"estimator": est}, held, max_s=2)["by_s"]["estimator"].values())))
        (tmp_path / str(bf16)).mkdir()
        est.save(tmp_path / str(bf16))
        assert Estimator.load(tmp_path / str(bf16), model).bf16 is bf16
    a, b = fits[False].net.state_dict(), fits[True].net.state_dict()
    assert not all(torch.equal(a[k], b[k]) for k in a)
    assert abs(recall[True] - recall[False]) < 0.02, recall


def test_estimator_stops_early_and_keeps_the_best_epoch(tiny_setup, monkeypatch):  # noqa: F811
    from moeflow.predict.estimator import Estimator
    from moeflow.stages.train import TrainConfig

    model, _, data = tiny_setup
    scores = iter([0.5, 0.7, 0.6, 0.65, 0.9, 0.9])
    states: list[dict[str, torch.Tensor]] = []

    def fake_val(self, c, rows_per_step):
        states.append({k: v.clone() for k, v in self.net.state_dict().items()})
        return torch.full((len(self.pairs),), next(scores))

    monkeypatch.setattr(Estimator, "_val_recall", fake_val)
    cfg = TrainConfig(trace="", out="", model="", max_s=2, est_epochs=6, est_min_steps=1, est_batch=64, est_patience=1)
    est = Estimator.create(model, cfg)
    est.fit(data, model, cfg)
    assert [h["epoch"] for h in est.history] == [1, 2, 3]  # epoch 3 did not beat epoch 2
    assert [h["val_recall"] for h in est.history] == pytest.approx([0.5, 0.7, 0.6])
    final = est.net.state_dict()
    assert all(torch.equal(final[k], states[1][k]) for k in final)  # epoch 2's weights
    assert not all(torch.equal(states[1][k], states[2][k]) for k in final)
    assert est.val_recall == {p: pytest.approx(0.7) for p in est.pairs}


def test_residual_flag_round_trips_and_an_older_folder_loads_plain(fitted_default, tmp_path):
    from moeflow.predict.data import batch_from_rows
    from moeflow.predict.estimator import Estimator

    model, _, held, _, preds = fitted_default
    est = preds["estimator"]
    est.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["residual"] is True
    ml = held.spec.moe_layers
    b = batch_from_rows(held, ml[0], np.arange(held.n), ctx=held.context(max(1, est.context)))
    torch.testing.assert_close(Estimator.load(tmp_path, model).predict(ml[1], 1, b), est.predict(ml[1], 1, b), rtol=0, atol=0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["residual"]  # a folder written before the residual form: the network's logits alone
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    old = Estimator.load(tmp_path, model)
    assert old.residual is False
    x = est.features(1, b)
    pair = torch.full((len(x),), est.pairs.index((ml[0], 1)))
    with torch.no_grad():
        torch.testing.assert_close(old.predict(ml[1], 1, b), torch.softmax(est.net(x, pair), -1))


def test_array_forest_predicts_deep_uneven_trees_like_scikit_learn():
    """Walks of different depth per (row, tree), and NaN features (each split's missing-value side)."""
    from sklearn.ensemble import RandomForestRegressor

    from moeflow.predict.forest_arrays import ArrayForest

    rng = np.random.default_rng(1)
    X = rng.standard_normal((800, 6)).astype(np.float32)
    X[rng.random(X.shape) < 0.05] = np.nan
    Y = np.stack([np.nan_to_num(X[:, 0]) > 0.8, np.nan_to_num(X[:, 1] * X[:, 2]) > 0.3], 1).astype(np.float64)
    rf = RandomForestRegressor(n_estimators=6, max_depth=None, min_samples_leaf=1, random_state=0).fit(X, Y)
    depths = [e.tree_.max_depth for e in rf.estimators_]
    assert max(depths) > 10
    Xt = rng.standard_normal((500, 6)).astype(np.float32)
    Xt[rng.random(Xt.shape) < 0.05] = np.nan
    np.testing.assert_allclose(ArrayForest.from_sklearn(rf).predict(Xt), rf.predict(Xt), rtol=0, atol=1e-12)


def test_forest_arrays_saved_at_a_fast_deflate_read_back_by_numpy(tmp_path):
    """`savez_fast` writes an .npz that `np.load` reads back exactly (with no pickle), deflated: smaller than
    the raw arrays, and a forest saved with it loads and predicts the same."""
    import zipfile

    from sklearn.ensemble import RandomForestRegressor

    from moeflow.predict.forest_arrays import ArrayForest, savez_fast

    rng = np.random.default_rng(2)
    X = rng.standard_normal((400, 5)).astype(np.float32)
    rf = RandomForestRegressor(n_estimators=4, min_samples_leaf=2, random_state=0).fit(X, X[:, :2] > 0)
    f = ArrayForest.from_sklearn(rf)
    f.save(tmp_path / "forest.npz")
    with zipfile.ZipFile(tmp_path / "forest.npz") as zf:
        infos = zf.infolist()
    assert {i.compress_type for i in infos} == {zipfile.ZIP_DEFLATED}
    assert sum(i.compress_size for i in infos) < sum(i.file_size for i in infos)
    back = ArrayForest.load(tmp_path / "forest.npz")
    for k in ArrayForest.FIELDS:
        np.testing.assert_array_equal(back.a[k], f.a[k])
    np.testing.assert_array_equal(back.predict(X), f.predict(X))
    savez_fast(tmp_path / "a.npz", {"i": np.arange(7), "s": np.float32(2.5)})
    with np.load(tmp_path / "a.npz", allow_pickle=False) as z:
        assert z["i"].tolist() == list(range(7)) and float(z["s"]) == 2.5


def test_recall_plot_lays_out_without_measuring_text(tmp_path, monkeypatch):
    """The recall plot's margins are fixed: `tight_layout` (which renders every label to measure it, 0.2-0.6 s
    of `moeflow train`) is not called."""
    from matplotlib.figure import Figure

    from moeflow.predict.evaluate import plot

    def refuse(*a, **k):
        raise AssertionError("tight_layout called")

    monkeypatch.setattr(Figure, "tight_layout", refuse)
    report = {"results": {"p": {"1->2": {"S": 1, "target": 2, "recall_at_k": 0.5}}}, "by_s": {"p": {1: 0.5}}, "fit": {}}
    assert plot(report, tmp_path / "r.png").stat().st_size > 0


def test_forest_tries_at_least_the_minimum_features_per_split(tiny_setup, monkeypatch):  # noqa: F811
    """A small model's few features: the forest still tries MIN_SPLIT_FEATURES of them (or all) per split; each
    tree fits on a compact copy of its bootstrap draw of `forest_tree_samples` rows of the pool (the whole pool
    when that is smaller), its repeats as weights, never on weights over the whole pool."""
    import sklearn.tree

    from moeflow.predict.forest import Forest
    from moeflow.predict.forest_arrays import MIN_SPLIT_FEATURES
    from moeflow.stages.train import TrainConfig

    seen: list[tuple[object, int, float]] = []

    class Spy(sklearn.tree.DecisionTreeRegressor):
        def fit(self, X, y, sample_weight=None, check_input=True):
            seen.append((self.max_features, len(X), float(np.sum(sample_weight))))
            return super().fit(X, y, sample_weight=sample_weight, check_input=check_input)

    monkeypatch.setattr(sklearn.tree, "DecisionTreeRegressor", Spy)
    model, _, data = tiny_setup
    cfg = TrainConfig(
        trace="", out="", model="", max_s=2, threads=1, forest_trees=2, forest_max_samples=500, forest_tree_samples=120
    )
    f = Forest.create(model, cfg)
    f.fit(data, model, cfg)
    assert round(cfg.forest_max_features * f.n_features) < MIN_SPLIT_FEATURES  # the floor applies to this model
    assert len(seen) == 2 and f.rf is not None and f.rf.n_estimators == 2
    for feats, rows, weight in seen:  # each tree: its draw of 120 (repeats weighted), no more rows than that
        assert feats == min(f.n_features, MIN_SPLIT_FEATURES) and rows <= 120 and weight == 120
    pool = 2 * (500 // 2)  # max_s=2 on the tiny model: pairs x rows per pair, at most forest_max_samples
    seen.clear()
    f.fit(data, model, dataclasses.replace(cfg, forest_tree_samples=10 * pool))
    assert all(rows <= weight for _, rows, weight in seen) and len({w for _, _, w in seen}) == 1
    with pytest.raises(ConfigError, match="forest_tree_samples"):
        dataclasses.replace(cfg, forest_tree_samples=0)


def test_forest_fit_is_the_same_with_more_threads(tiny_setup):  # noqa: F811
    """`--threads` fits that many trees at once; the forest is the same tree for tree (seeds drawn up front)."""
    from moeflow.predict.forest import Forest
    from moeflow.stages.train import TrainConfig

    model, _, data = tiny_setup
    cfg = TrainConfig(trace="", out="", model="", max_s=2, threads=1, forest_trees=3, forest_max_samples=500)
    one, two = Forest.create(model, cfg), Forest.create(model, cfg)
    one.fit(data, model, cfg)
    two.fit(data, model, dataclasses.replace(cfg, threads=2))
    assert one.rf is not None and two.rf is not None
    for k in ("left", "feature", "threshold", "value", "roots"):
        np.testing.assert_array_equal(one.rf.a[k], two.rf.a[k])


def test_training_rule_fits_two_at_once_unless_told_one_thread():
    """`--threads 1` keeps training on one core; otherwise a free CPU (`IDLE_FOR_TWO`) fits the forest beside the rest."""
    from moeflow.predict.train import fit_workers
    from moeflow.threads import idle_cpus

    assert fit_workers(1, "--threads", cores=16, idle=16) == 1
    assert fit_workers(2, "--threads", cores=1, idle=0) == 2 and fit_workers(8, "--threads", cores=16, idle=0) == 2
    for source in ("calibration", "default", "OMP_NUM_THREADS", "MOEFLOW_THREADS"):
        assert fit_workers(1, source, cores=2, idle=2.0) == 2  # decode's 1 thread for a small model is not training's
        assert fit_workers(1, source, cores=2, idle=1.0) == 2  # one busy job on 2 cores: two fits still sooner
        assert fit_workers(1, source, cores=2, idle=0.5) == 1  # more work than that: one fit at a time
        assert fit_workers(1, source, cores=1, idle=1.0) == 1
    assert 0.0 <= idle_cpus(0.01) <= (__import__("os").cpu_count() or 1) + 1e-6


def test_one_fit_at_a_time_takes_no_more_threads_than_idle_cpus():
    """With one fit at a time the fits' threads are capped by the CPUs idle now (a torch thread waiting for a core
    that other work holds stalls its parallel regions); `--threads N` and two fits at once keep N."""
    from moeflow.predict.train import fit_threads

    assert fit_threads(2, "calibration", 1, idle=1.0) == 1  # one busy loop on 2 cores
    assert fit_threads(2, "calibration", 1, idle=0.2) == 1  # at least one
    assert fit_threads(4, "default", 1, idle=2.6) == 3
    assert fit_threads(2, "calibration", 1, idle=2.0) == 2
    assert fit_threads(2, "--threads", 1, idle=0.0) == 2  # the user's count
    assert fit_threads(2, "calibration", 2, idle=1.0) == 2  # two at once: the stage splits them


def test_fit_workers_flag_replaces_the_idle_rule_but_not_threads():
    """`--fit-workers 1|2` (`requested`) replaces the idle-CPU rule (to compare both beside other work); `--threads`
    still decides, and a count other than 1 or 2, or 2 with `--threads 1`, is refused with what to change."""
    from moeflow.predict.train import fit_workers
    from moeflow.stages.train import TrainConfig, _check

    assert fit_workers(1, "default", cores=2, idle=2.0, requested=1) == 1
    assert fit_workers(1, "default", cores=2, idle=0.0, requested=2) == 2
    assert fit_workers(1, "calibration", cores=1, idle=0.0, requested=2) == 2
    assert fit_workers(1, "--threads", cores=2, idle=2.0, requested=2) == 1
    assert fit_workers(1, "default", cores=2, idle=0.0) == 1  # without a request: the rule
    with pytest.raises(ConfigError, match="--fit-workers must be 1 or 2"):
        TrainConfig(trace="t", out="o", model="m", fit_workers=3)
    with pytest.raises(ConfigError, match="--threads 1 forbids"):
        _check(TrainConfig(trace="t", out="o", model="m", fit_workers=2, threads=1))
    # the stage itself replaces threads with the fits' own (1 each beside the forest's process): not refused
    assert dataclasses.replace(TrainConfig(trace="t", out="o", model="m", fit_workers=2), threads=1).fit_workers == 2


def _child_torch() -> tuple[int, float]:
    x = torch.ones(256, 256)
    return torch.get_num_threads(), float((x @ x).sum())  # [256,256] product: a parallel region with > 1 thread


def test_forked_fit_runs_torch_on_one_thread_after_the_parent_used_more():
    """A forked child cannot use the parent's OpenMP team (a parallel region there waits forever): after the parent
    ran torch on 2 threads, the child's torch runs on 1 and finishes."""
    from moeflow.predict.train import can_fork, in_child

    if not can_fork():
        pytest.skip("no fork start method here")
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.ones(512, 512)
        assert float((x @ x).sum()) == 512.0**3  # the parent's team exists now
        threads, total = in_child(_child_torch).result(timeout=120)
    finally:
        torch.set_num_threads(was)
    assert threads == 1 and total == 256.0**3


def _mark_pid(folder, tag: str) -> None:
    import os

    (folder / f"{tag}-{os.getpid()}").touch()


def _pids(folder, tag: str) -> set[int]:
    return {int(f.name.rsplit("-", 1)[1]) for f in folder.glob(f"{tag}-*")}


def test_forest_fitted_beside_the_others_is_the_same(fitted_default, monkeypatch, tmp_path):
    """workers=2: the forest fits in a process of its own while the rest fit in this one, and every predictor is
    the same as fitted one after the other (the same report order too)."""
    import os

    from moeflow.predict.forest import Forest
    from moeflow.predict.train import fit_all

    model, train, _, cfg, serial = fitted_default
    real = Forest.fit
    monkeypatch.setattr(Forest, "fit", lambda self, *a, **k: _mark_pid(tmp_path, "fit") or real(self, *a, **k))
    both = fit_all(train, model, cfg, workers=2)
    assert _pids(tmp_path, "fit") and os.getpid() not in _pids(tmp_path, "fit")  # the forest fitted elsewhere
    assert list(both) == list(serial)
    for k in ("left", "feature", "threshold", "value", "roots"):
        np.testing.assert_array_equal(both["forest"].rf.a[k], serial["forest"].rf.a[k])
    for k in ("prior_ids", "prior_counts", "prior_freq", "table"):
        np.testing.assert_array_equal(getattr(both["forest"], k), getattr(serial["forest"], k))
    assert both["forest"].fit_seconds > 0
    got, want = both["estimator"].net.state_dict(), serial["estimator"].net.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    for l, d in serial["router-pf"].dvec.items():
        assert torch.equal(both["router-pf"].dvec[l], d)
    assert both["hybrid"].use_estimator == serial["hybrid"].use_estimator


def test_forest_fitted_and_scored_in_one_process_gives_the_serial_report(fitted_default, monkeypatch, tmp_path):
    """workers=2 with a scorer: one forked process fits the forest and scores it, while the others (the baselines
    and pregate too) are fitted and scored in this one; the merged held-out report is the one `evaluate` gives
    for all of them in one call."""
    import os

    from moeflow.predict import evaluate as ev
    from moeflow.predict import train as pt

    model, train, held, cfg, serial = fitted_default
    kw = {"max_s": cfg.max_s, "window": cfg.forest_window, "mass": cfg.mass}
    want = ev.evaluate(serial, held, **kw)
    forks: list[int] = []
    real_child, real_score = pt.in_child, ev.score
    monkeypatch.setattr(pt, "in_child", lambda fn: forks.append(1) or real_child(fn))
    monkeypatch.setattr(ev, "score", lambda p, *a, **k: [_mark_pid(tmp_path, n) for n in p] and real_score(p, *a, **k))
    got: list = []
    preds = pt.fit_all(train, model, cfg, workers=2, score=lambda p, here: ev.score(p, held, **kw), scored=got)
    assert list(preds) == list(serial) and forks == [1]  # the forest's fit and its scores: one process
    here = {n for n in preds if _pids(tmp_path, n) == {os.getpid()}}
    there = {n for n in preds if _pids(tmp_path, n) and os.getpid() not in _pids(tmp_path, n)}
    assert there == {"forest"} and here == set(preds) - there
    report = ev.summarize(*got[0], held, np.arange(held.n), max_s=cfg.max_s, mass=cfg.mass)
    assert json.dumps(report) == json.dumps(want)  # the same figures, in the same order


def test_work_for_later_is_done_while_the_forest_process_runs_on(fitted_default):
    """`idle` runs in this process after its own fits and scores, while the forest's process still scores (here
    held up for a second), and not at all when one fit runs at a time."""
    import time

    from moeflow.predict import evaluate as ev
    from moeflow.predict.train import fit_all

    model, train, held, cfg, _ = fitted_default
    cfg = dataclasses.replace(cfg, only=("forest",), forest_trees=2)
    events: list[str] = []

    def scores(p, here):
        if not here:
            time.sleep(1.0)  # the forest's process: still busy when this one is done
        events.append("scored here") if here else None
        return ev.score(p, held, max_s=cfg.max_s)

    for workers in (2, 1):
        events.clear()
        fit_all(train, model, cfg, workers=workers, score=scores, scored=[], idle=lambda: events.append("idle"))
        assert events == (["scored here", "idle"] if workers == 2 else ["scored here"])


def test_stage_scores_beside_the_forest_on_the_threads_it_leaves(tiny_setup, tmp_path, monkeypatch):  # noqa: F811
    """`--threads 2` (2 fits at once): while the forest's process fits and scores on 1 thread, this process scores
    the others on the other thread (torch and BLAS), not on 2 (3 threads on 2 cores stall torch's parallel
    regions), and gets its counts back after."""
    import os

    from threadpoolctl import threadpool_info

    import moeflow.predict.evaluate as ev
    from moeflow.predict.train import can_fork
    from moeflow.stages.train import TrainConfig, main

    if not can_fork():
        pytest.skip("no fork start method here")
    _, trace, _ = tiny_setup
    seen: list[tuple[int, set[int]]] = []
    real = ev.score

    def spy(*a, **k):
        if os.getpid() == me:
            seen.append((torch.get_num_threads(), {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}))
        return real(*a, **k)

    me = os.getpid()
    monkeypatch.setattr(ev, "score", spy)
    model = str(trace.parent / "model")
    cfg = TrainConfig(trace=str(trace), out=str(tmp_path / "p"), model=model, only=("router-pf", "forest"), max_s=1, threads=2)
    cfg = dataclasses.replace(cfg, forest_trees=2, forest_max_samples=500, forest_tree_samples=200)
    was = torch.get_num_threads()
    rep = main(cfg)
    assert rep["fit_workers"] == 2 and rep["fit_threads"] == 2
    assert seen == [(1, {1})] and torch.get_num_threads() == was


def _count_calls(monkeypatch, objs: dict[str, object], method: str) -> dict[str, int]:
    calls: dict[str, int] = {}
    for name, obj in objs.items():
        orig = getattr(obj, method)

        def counted(*a, _orig=orig, _name=name):
            calls[_name] = calls.get(_name, 0) + 1
            return _orig(*a)

        monkeypatch.setattr(obj, method, counted)
    return calls


def _approx_results(got: dict, want: dict) -> None:
    """The same metrics of every pair, up to float32 rounding of the scores (a tie may break the other way)."""
    assert got.keys() == want.keys()
    for key, m in want.items():
        assert got[key].keys() == m.keys()
        for k, v in m.items():
            assert got[key][k] == pytest.approx(v, abs=2e-3), (key, k)


def test_evaluate_scores_each_pair_once_and_hybrid_reuses_its_parts(fitted_default, monkeypatch):
    """Without `batched`: one predict call per (predictor, layer, S) over all held-out rows: Hybrid's pairs take
    the scores of the estimator or router-pf it delegates to, with the same figures as its own `predict` gives."""
    from moeflow.predict.evaluate import evaluate

    _, _, held, cfg, preds = fitted_default
    hyb = preds["hybrid"]
    assert hyb.router_pf is preds["router-pf"]  # fit_all hands hybrid the fitted router-pf
    calls = _count_calls(monkeypatch, {n: preds[n] for n in ("estimator", "router-pf")}, "predict")
    rep = evaluate(preds, held, max_s=cfg.max_s, chunk=held.n, batched=False)
    pairs = held.rank_pairs(cfg.max_s)
    assert calls == {"estimator": len(pairs), "router-pf": len(pairs)}  # none more for hybrid

    class Plain:  # the hybrid seen only through predict (no delegate)
        max_lookahead = hyb.max_lookahead

        def predict(self, *a):
            return hyb.predict(*a)

    alone = evaluate({"hybrid": Plain()}, held, max_s=cfg.max_s)
    assert rep["results"]["hybrid"] == alone["results"]["hybrid"]
    for (src, s), key in zip(pairs, rep["results"]["hybrid"]):
        part = "estimator" if (src, s) in hyb.use_estimator else "router-pf"
        assert rep["results"]["hybrid"][key] == rep["results"][part][key]


def test_evaluate_batched_scores_every_s_of_a_source_layer_in_one_runner_call(fitted_default, monkeypatch):
    """The default (`batched`): router-pf, estimator and forest score through their run-time runners, ONE
    `scores` call per (source layer, chunk of rows) for all its S, no `predict` call; hybrid takes its parts'
    scores; the figures are those of the per-pair `predict` path up to float32 rounding."""
    from moeflow.predict.evaluate import evaluate

    _, _, held, cfg, preds = fitted_default
    want = evaluate(preds, held, max_s=cfg.max_s, batched=False)
    runners = {n: preds[n].runner() for n in ("router-pf", "estimator", "forest")}
    for n, r in runners.items():
        monkeypatch.setattr(preds[n], "runner", lambda r=r: r)
    scores = _count_calls(monkeypatch, runners, "scores")
    predicts = _count_calls(monkeypatch, {n: preds[n] for n in (*runners, "hybrid")}, "predict")
    chunk = -(-held.n // 2)  # two chunks of rows
    got = evaluate(preds, held, max_s=cfg.max_s, chunk=chunk)
    sources = {src for src, _ in held.rank_pairs(cfg.max_s)}
    assert predicts == {} and scores == {n: 2 * len(sources) for n in runners}
    for name, res in want["results"].items():
        _approx_results(got["results"][name], res)
    for name in ("frequency", "token-id", "pregate"):  # no runner: the same predict calls
        assert got["results"][name] == want["results"][name]


def test_evaluate_gives_decode_recall_in_the_same_pass(fitted_default):
    """`decode_by_s`: recall on the decode tokens alone, equal to evaluating those rows by themselves."""
    from moeflow.predict.evaluate import evaluate

    _, _, held, cfg, preds = fitted_default
    rows = np.flatnonzero(held.phase == 1)
    assert 0 < len(rows) < held.n
    rep = evaluate(preds, held, max_s=cfg.max_s)
    want = evaluate(preds, held, max_s=cfg.max_s, rows=rows)["by_s"]
    assert rep["decode_by_s"].keys() == want.keys()
    for name, by_s in want.items():
        assert rep["decode_by_s"][name] == pytest.approx(by_s, abs=1e-12), name
    assert evaluate(preds, held, max_s=cfg.max_s, rows=np.flatnonzero(held.phase == 0))["decode_by_s"] is None


@pytest.mark.skipif(__import__("importlib").util.find_spec("hqq") is None, reason="hqq is not installed")
def test_model_load_leaves_hqq_unimported():
    """transformers' cache_utils imports hqq (whose module body calls torch.compile, importing TorchInductor) only
    for a KV cache moeflow never uses: loading a model does not import it, and transformers still reports hqq as
    installed afterwards. In a fresh interpreter: this one may have imported hqq already (`moeflow.quant`)."""
    import subprocess
    import sys

    code = (
        "import json, sys; from moeflow.models import load_model; import transformers.utils as u; "
        f"load_model({str(REPO / 'models' / 'olmoe-mini')!r}, dtype='float32'); "
        "print(json.dumps(['hqq' in sys.modules, u.is_hqq_available()]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, True]


def test_trace_columns_read_zero_copy_as_to_numpy_does():
    """`reader._numpy`: a number chunk (sliced, too) as its data buffer, the values and dtype `to_numpy` gives;
    a chunk with nulls or of another type through `to_numpy`."""
    import pyarrow as pa

    from moeflow.trace.reader import _numpy

    for dt in ("int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64"):
        a = pa.array(np.arange(10).astype(dt)).slice(3, 5)
        got = _numpy(a)
        assert got.dtype == np.dtype(dt) and got.tolist() == a.to_numpy().tolist(), dt
    assert np.isnan(_numpy(pa.array([1.0, None]))[1])
    assert _numpy(pa.array([True, False])).tolist() == [True, False]


def test_train_reads_the_trace_without_pandas_and_plots_without_pyplot(tiny_setup, tmp_path):  # noqa: F811
    """Reading a trace does not import pandas (pyarrow's `to_numpy` would: about half a second), and the recall
    plot does not import matplotlib.pyplot. In a fresh interpreter: this one may have imported both already."""
    import subprocess
    import sys

    from tests.test_predict import REPO

    _, trace, _ = tiny_setup
    report = {"results": {"p": {"1->2": {"S": 1, "target": 2, "recall_at_k": 0.5}}}, "by_s": {"p": {1: 0.5}}, "fit": {}}
    code = (
        "import json, sys; from pathlib import Path; from moeflow.predict.data import from_trace; "
        f"d = from_trace({str(trace)!r}); pandas = 'pandas' in sys.modules; "
        "from moeflow.predict.evaluate import plot; "
        f"plot({report!r}, Path({str(tmp_path / 'r.png')!r})); "
        "print(json.dumps([d.n, pandas, 'matplotlib.pyplot' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [tiny_setup[2].n, False, False]
    assert (tmp_path / "r.png").stat().st_size > 0


def test_train_loads_the_model_without_its_tokenizer(monkeypatch):
    """`moeflow train` needs no tokenizer (the CasMoE planner loads its own): the model folder's is not read."""
    import transformers

    from moeflow.stages.train import load_cpu_model
    from tests.test_predict import REPO

    def refuse(*a, **k):
        raise AssertionError("tokenizer loaded")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    model = load_cpu_model(str(REPO / "models" / "olmoe-mini"))
    assert next(model.parameters()).dtype == torch.float32


def test_train_runs_numpy_blas_with_its_threads(tiny_setup, tmp_path, monkeypatch):  # noqa: F811
    """`--threads 1`: numpy's BLAS (the runners' products in the evaluation) runs on 1 thread too, not on every
    core, and gets its count back after."""
    from threadpoolctl import threadpool_info, threadpool_limits

    import moeflow.predict.evaluate as ev
    from moeflow.stages.train import TrainConfig, main

    _, trace, _ = tiny_setup

    def blas() -> set[int]:
        return {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}

    seen: list[set[int]] = []
    real = ev.score

    def spy(*a, **k):
        seen.append(blas())
        return real(*a, **k)

    monkeypatch.setattr(ev, "score", spy)
    cfg = TrainConfig(
        trace=str(trace), out=str(tmp_path / "p"), model=str(trace.parent / "model"), only=("forest",), max_s=1, threads=1
    )
    cfg = dataclasses.replace(cfg, forest_trees=2, forest_max_samples=500, forest_tree_samples=200)
    with threadpool_limits(limits=2, user_api="blas"):
        assert blas() == {2}
        main(cfg)
        assert blas() == {2}
    assert seen == [{1}]


def test_max_s_above_the_models_layers_is_lowered_to_what_it_has(tiny_setup, tmp_path):  # noqa: F811
    """S counts MoE layers ahead: a 4-layer model has S = 1..3. `--max-s 9` fits and reports S up to 3, with a
    line that says so; the default 4 is lowered without one (it is the default, not the user's number)."""
    import io

    from rich.console import Console

    from moeflow.stages.train import EvalConfig, TrainConfig, within_model

    _, trace, _ = tiny_setup
    model = str(trace.parent / "model")
    base = ["--trace", str(trace), "--model", model, "--only", "forest", "--forest-trees", "2", "--forest-samples", "500"]
    code, out, log = _train([*base, "--threads", "1", "--max-s", "9", "--out", str(tmp_path / "p"), "--json"])
    assert code == 0, log
    rep = json.loads(out.strip().splitlines()[-1])
    assert rep["max_s"] == 3 and "--max-s 9: the trace's model has 4 MoE layers, so S goes up to 3" in log
    assert max(int(s) for s in rep["by_s"]["forest"]) == 3
    buf = io.StringIO()
    console = Console(file=buf, width=200)
    assert within_model(TrainConfig(trace="t", out="o", model="m"), 4, console).max_s == 3
    assert within_model(EvalConfig(predictors="p", trace="t", model="m", max_s=2), 4, console).max_s == 2
    assert within_model(EvalConfig(predictors="p", trace="t", model="m", max_s=5), 3, console).max_s == 2
    assert within_model(TrainConfig(trace="t", out="o", model="m", max_s=4), 4, console).max_s == 3  # typed: said
    assert within_model(EvalConfig(predictors="p", trace="t", model="m", max_s=5), 1, console).max_s == 1
    said = buf.getvalue()
    assert said.count("--max-s") == 2 and "--max-s 4:" in said  # the typed 5 and 4; not the default, the 2, 1 layer


def test_eval_above_the_trained_s_says_so_and_reports_the_s_it_scored(default_train, tiny_setup):  # noqa: F811
    """Predictors trained with --max-s 2 are scored up to S = 2 whatever `eval --max-s` says (they predict no
    further): a line says so, and the JSON's `max_s` is 2, not the 3 asked for."""
    from typer.testing import CliRunner

    from moeflow.cli.app import _register, app

    root, _, _ = default_train
    _, trace, _ = tiny_setup
    _register()
    args = ["eval", "--predictors", str(root / "fast-json"), "--trace", str(trace), "--model", str(root / "model")]
    r = CliRunner().invoke(app, [*args, "--only", "forest", "--max-s", "3", "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["max_s"] == 2 and "--max-s 3: the predictors were trained for S <= 2" in r.output
    r = CliRunner().invoke(app, [*args, "--only", "forest", "--threads", "1", "--json"])  # --max-s not typed: no line
    assert r.exit_code == 0 and json.loads(r.stdout.strip().splitlines()[-1])["max_s"] == 2 and "--max-s" not in r.output
