"""MoE-GPS: distribution-only MLE and error rate, skewness, token-to-expert predictors, placement,
the prefill simulator's terms and direction, and the `moeflow gps` command."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from moeflow.gps import predictors as P
from moeflow.gps import simulator as S
from moeflow.gps import skew as K

# ---- distribution-only ---------------------------------------------------------------------------


def test_mle_and_error_rate_hand_made():
    # 4 experts, top-1: counts 5, 3, 2, 0 of 10 tokens
    train = np.array([[0]] * 5 + [[1]] * 3 + [[2]] * 2)
    p_hat = P.mle(train, 4)
    assert np.allclose(p_hat, [0.5, 0.3, 0.2, 0.0])
    # test set: counts 4, 4, 1, 1 -> p = .4 .4 .1 .1; |diff| = .1 .1 .1 .1 -> mean .1 / (1/4) = .4
    test = np.array([[0]] * 4 + [[1]] * 4 + [[2]] + [[3]])
    assert P.error_rate(p_hat, P.mle(test, 4)) == pytest.approx(0.4)
    # top-2: every (token, slot) is one draw, N = tokens x k
    assert np.allclose(P.mle(np.array([[0, 1], [0, 2]]), 4), [0.5, 0.25, 0.25, 0.0])
    rep = P.distribution_report({0: train}, {0: test}, 4, seq_len=10)
    assert rep["error_rate"] == pytest.approx(0.4) and rep["batch_error_rate"] == pytest.approx(0.4)


def test_batch_skewness_hand_computed():
    # batch 1 (4 tokens): counts 3,1,0,0 -> max 3 / mean 1 = 3; batch 2: 1,1,1,1 -> 1; mean 2
    ids = np.array([[0], [0], [0], [1], [0], [1], [2], [3]])
    assert P.batch_skewness(ids, 4, seq_len=4) == pytest.approx(2.0)


# ---- token-to-expert -------------------------------------------------------------------------------


def _toy(n_prompts=60, T=24, V=40, E=8, seed=0):
    """Token id -> expert (id mod E for layer 0, (3 id) mod E for layer 1), top-2 with a fixed second choice."""
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, V, n_prompts * T)
    pos = np.tile(np.arange(T), n_prompts)
    pid = np.repeat(np.arange(n_prompts), T)
    ids = {
        0: np.stack([tok % E, (tok + 1) % E], 1),
        1: np.stack([(3 * tok) % E, (3 * tok + 2) % E], 1),
    }
    return P.RoutingRows(tok, pos, pid, ids)


def test_tables_and_networks_learn_a_token_mapping(tmp_path):
    torch.manual_seed(0)
    rows = _toy()
    tr = P.RoutingRows(
        rows.token_id[:1200], rows.position[:1200], rows.prompt_id[:1200], {l: a[:1200] for l, a in rows.ids.items()}
    )
    te = P.RoutingRows(
        rows.token_id[1200:], rows.position[1200:], rows.prompt_id[1200:], {l: a[1200:] for l, a in rows.ids.items()}
    )
    emb = torch.randn(40, 16)
    suite = P.GPSSuite(8, 2, [0, 1], 16, P.GPSFitConfig(seq_len=24, steps=250, lr=1e-2, batch=8)).fit(tr, emb)
    rep = suite.evaluate(tr, te, emb)
    t2e = rep["token_to_expert"]
    assert t2e["token-id"]["top1"] == 1.0 and t2e["token-id"]["topk"] == 1.0
    assert t2e["ffn"]["top1"] > 0.95 and t2e["lstm"]["top1"] > 0.9
    assert t2e["probability"]["top1"] < 0.3  # one argmax for every token
    assert all(r["ms_per_batch"] > 0 for r in t2e.values())
    # saved without pickle and loaded back with the same predictions
    suite.save(tmp_path)
    back = P.GPSSuite.load(tmp_path)
    assert np.allclose(back.scores("ffn", te, emb), suite.scores("ffn", te, emb))
    assert np.array_equal(back.scores("token-id", te, emb), suite.scores("token-id", te, emb))
    with np.load(tmp_path / "tables.npz", allow_pickle=False) as z:
        assert "p_hat" in z.files


# ---- placement and simulator terms ------------------------------------------------------------------


def test_replicate_and_pack_hand_checked():
    # 4 experts on 2 GPUs with 3 slots each: expert 0 carries 6 of 9 units -> 3 replicas? no: at most N = 2
    load = np.array([6.0, 1.0, 1.0, 1.0])
    gpus = S.replicate_and_pack(load, N=2, slots=3)
    reps = S.replica_table(gpus, 4)
    assert sorted(reps[0]) == [0, 1]  # the hot expert on both GPUs, never twice on one
    assert all(len(set(g)) == len(g) for g in gpus)
    per_gpu = [sum(load[e] / len(reps[e]) for e in g) for g in gpus]
    assert per_gpu == pytest.approx([4.5, 4.5])  # 3 + 1 + ... balanced: {0,1,2?}
    # below the ridge share no replica is made
    assert S.replica_table(S.replicate_and_pack(load, 2, 3, min_share=4.0), 4)[0] in ([0], [1])
    # an expert's tokens go round-robin over its replicas
    assert S.spread(np.array([0, 0, 0, 0, 1]), [[0, 1], [1]]).tolist() == [0, 1, 0, 1, 1]


def test_all_to_all_is_bytes_over_bandwidth():
    link = S.Interconnect("test", bw=1e9, latency=0.0)
    m = np.array([[5, 2, 0], [1, 9, 0], [3, 0, 7]])  # diagonal stays local
    # sent: 2, 1, 3; received: 4, 2, 0 -> busiest 4 items x 1000 bytes / 1 GB/s
    assert S.all_to_all_time(m, 1000, link) == pytest.approx(4e-6)
    assert S.allreduce_time(4e6, 4, link) == pytest.approx(2 * 3 / 4 * 4e6 / 1e9)


def _synthetic_layers(skew_bias: float, E=32, k=4, n=4096, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, E)) + skew_bias * np.linspace(1, 0, E)[None]
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ids = np.argsort(-logp, 1)[:, :k]
    cnt = np.bincount(ids.reshape(-1), minlength=E) + 1.0
    return K.LayerRouting(logp, ids, np.log(cnt / cnt.sum()))


def _point(interconnect: str, bias: float):
    L = _synthetic_layers(bias)
    inp = S.SweepInput([L], np.arange(2048), np.arange(2048, 4096), 32, 4)
    sysm = S.System(4, S.GPUS["a100"], S.LINKS[interconnect], S.Shape("mixtral-ish", 4096, 14336, 32, 8, 32, 4))
    return S.evaluate_point(inp, 0.0, sysm, 512, S.OverheadCurve.default(512))


def test_direction_of_the_paper():
    """Low skew on NVLink: distribution-only beats token-to-expert; high skew on PCIe: token-to-expert wins."""
    low = _point("nvlink", 0.3)
    high = _point("pcie", 4.0)
    assert low["skewness"] < 1.8 < high["skewness"]
    lo, hi = low["strategies"], high["strategies"]
    assert lo["distribution"]["total"] < lo["token_to_expert"]["total"]
    assert hi["token_to_expert"]["total"] < hi["distribution"]["total"]
    assert high["best"] == "token_to_expert"
    for r in (*lo.values(), *hi.values()):
        assert r["total"] == pytest.approx(r["attention"] + r["ffn"] + r["comm"] + r["overhead"])


def test_overhead_curve_fit_and_shape():
    c = S.OverheadCurve.fit([(0.0, 1e-5), (1.0, 1e-2)])
    assert c(0.3, 0.3) == pytest.approx(1e-5, rel=1e-6) and c(1.0, 0.3) == pytest.approx(1e-2, rel=1e-6)
    assert c(0.6, 0.5) < c(0.6, 0.3)  # the same accuracy is cheaper at higher skew (higher a0)
    assert math.isfinite(S.OverheadCurve.default(512)(0.99, 0.1))


# ---- CLI -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    from moeflow.cli.app import main

    out = tmp_path_factory.mktemp("gps") / "trace"
    prompts = tmp_path_factory.mktemp("gpsp") / "p.txt"
    prompts.write_text("\n".join(f"question {i}: what is {i} plus {i * 7} and why is the sky blue today" for i in range(12)))
    with pytest.raises(SystemExit) as e:
        main(["trace", "--prompts", str(prompts), "--max-new-tokens", "1", "--threads", "1", "--no-progress", "--out", str(out)])
    assert e.value.code == 0
    return out


def test_cli_gps_json_shape(small_trace, capsys, tmp_path):
    from moeflow.cli.app import main

    png = tmp_path / "fig.png"
    with pytest.raises(SystemExit) as e:
        main(["gps", "--trace", str(small_trace), "--gpus", "4", "--interconnect", "pcie", "--seq-len", "64",
              "--skew", "1.5", "--max-batches", "2", "--json", "--plot", str(png)])  # fmt: skip
    assert e.value.code == 0
    res = json.loads(capsys.readouterr().out)
    assert res["recommended"] in ("none", "distribution", "token_to_expert")
    for s in ("none", "distribution", "token_to_expert"):
        r = res["measured"]["strategies"][s]
        assert {"attention", "ffn", "comm", "overhead", "total", "saving"} <= set(r)
    assert res["system"]["gpus"] == 4 and res["system"]["link"]["bw"] == 32e9
    assert png.stat().st_size > 1000
    args = ["gps", "--trace", str(small_trace), "--seq-len", "64", "--skew", "1.5", "--max-batches", "1", "--json"]
    with pytest.raises(SystemExit) as e:  # its own plot is replaced
        main([*args, "--plot", str(png)])
    assert e.value.code == 0
    capsys.readouterr()
    mine = tmp_path / "mine.png"
    mine.write_text("not a plot")
    for plot, words in ((mine, "not a moeflow plot"), (small_trace / "x.png", "inside the input")):
        with pytest.raises(SystemExit) as e:
            main([*args, "--plot", str(plot)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert mine.read_text() == "not a plot" and not (small_trace / "x.png").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--interconnect", "ethernet"], "--interconnect must be one of"),
        (["--gpus", "0"], "--gpus must be >= 1"),
        (["--model-shape", "gpt5"], "--model-shape must be one of"),
    ],
)
def test_cli_gps_bad_input_one_line(small_trace, capsys, args, needle):
    from moeflow.cli.app import main

    with pytest.raises(SystemExit) as e:
        main(["gps", "--trace", str(small_trace), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_cli_gps_missing_trace_one_line(tmp_path, capsys):
    from moeflow.cli.app import main

    with pytest.raises(SystemExit) as e:
        main(["gps", "--trace", str(tmp_path / "nope")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and len(err.splitlines()) == 1


def test_train_only_gps_then_eval(small_trace, capsys, tmp_path):
    """`moeflow train --only gps` writes gps/ (no pickle) and `moeflow eval` reports it."""
    from moeflow.cli.app import main

    out = tmp_path / "pred"
    with pytest.raises(SystemExit) as e:
        main(["train", "--only", "gps", "--trace", str(small_trace), "--out", str(out), "--threads", "1", "--json"])
    assert e.value.code == 0
    rep = json.loads(capsys.readouterr().out)["gps"]
    assert set(rep["token_to_expert"]) == {"probability", "token-id", "position", "ffn", "lstm"}
    assert 0 <= rep["distribution_only"]["error_rate"] and rep["distribution_only"]["skew_test"] >= 1
    assert {p.name for p in (out / "gps").iterdir()} == {"config.json", "tables.npz", "ffn.pt", "lstm.pt"}
    with pytest.raises(SystemExit) as e:
        main(["eval", "--predictors", str(out), "--trace", str(small_trace), "--json"])
    assert e.value.code == 0
    assert "lstm" in json.loads(capsys.readouterr().out)["gps"]["token_to_expert"]
    with pytest.raises(SystemExit) as e:  # --only gps: the suite alone (it was asked of the layer-ahead predictors)
        main(["eval", "--predictors", str(out), "--trace", str(small_trace), "--only", "gps", "--json"])
    assert e.value.code == 0
    got = json.loads(capsys.readouterr().out)
    assert "lstm" in got["gps"]["token_to_expert"] and not got["results"]


def test_gps_sweep_repeats_no_point(small_trace, capsys):
    """Sweep targets the re-routing cannot tell apart (all far below the flattest routing it reaches) give one
    point, not several copies of it: each skewness appears once in the sweep, the plot's points and the table;
    the others are listed as skipped with the point they landed on."""
    from moeflow.cli.app import main
    from moeflow.stages.gps import duplicate_of

    a, b, c = {"skewness": 1.661}, {"skewness": 1.664}, {"skewness": 1.70}
    assert duplicate_of(b, [a, c]) is a and duplicate_of(c, [a, b]) is None and duplicate_of(a, [a]) is None
    with pytest.raises(SystemExit) as e:
        main(["gps", "--trace", str(small_trace), "--seq-len", "64", "--max-batches", "2", "--json",
              "--skew", "1.01", "--skew", "1.02", "--skew", "1.03"])  # fmt: skip
    assert e.value.code == 0
    res = json.loads(capsys.readouterr().out)
    shown = [round(p["skewness"], 2) for p in [res["measured"], *res["sweep"]]]
    assert len(shown) == len(set(shown))
    assert len(res["sweep"]) + len(res["sweep_skipped"]) == 3 and len(res["sweep_skipped"]) >= 2
    assert all("lands on the point at skewness" in x["reason"] for x in res["sweep_skipped"])
