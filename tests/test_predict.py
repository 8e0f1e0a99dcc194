"""Layer-ahead predictors: fit on a trace, beat the baselines on held-out prompts, save/load, refuse."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from moeflow.errors import ArtifactError, ConfigError

REPO = Path(__file__).resolve().parent.parent


def write_trace(
    model,
    out: Path,
    prompts: list[list[int]],
    *,
    new_tokens: int = 6,
    record_hidden: bool = True,
    ids: str = "p",
    shard_size: int | None = None,
) -> Path:
    """A real trace folder (moeflow.trace writer) of greedy generation from token-id prompts (ids `{ids}0`, ...)."""
    from moeflow.moe import get_adapter, model_fingerprint
    from moeflow.trace.record import RoutingRecorder, generation_kwargs, trace_one
    from moeflow.trace.writer import TraceWriter

    ad = get_adapter(model)
    gen = {
        "max_new_tokens": new_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
        "seed": 0,
        "max_prompt_tokens": 256,
        "do_sample": False,
    }
    kw = generation_kwargs(gen, 0)
    kw.update(min_new_tokens=new_tokens, eos_token_id=None)
    rec = RoutingRecorder(ad, record_hidden)
    with TraceWriter(
        out,
        fingerprint=model_fingerprint(model),
        spec=ad.spec.to_dict(),
        record_hidden=record_hidden,
        generation=gen,
        prompt_source="test",
        shard_size=shard_size,
    ) as w:
        for i, p in enumerate(prompts):
            rows, _ = trace_one(model, rec, torch.tensor([p]), kw)
            w.add(f"{ids}{i}", rows)
    return out


def structured_prompts(n: int, length: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """Prompts from a few repeated phrases, so token ids carry routing information across prompts."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(3, vocab, size=6).tolist() for _ in range(8)]
    return [[t for j in rng.integers(0, len(phrases), size=length // 6 + 1) for t in phrases[j]][:length] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from moeflow.models import load_model, tiny_model
    from moeflow.predict.data import from_trace

    root = tmp_path_factory.mktemp("tr")
    tiny_model("olmoe", num_hidden_layers=4).save_pretrained(root / "model")
    model, _ = load_model(str(root / "model"), dtype="float32")  # the checkpoint `moeflow train --model` loads
    path = write_trace(model, root / "trace", structured_prompts(10, 16), new_tokens=4)
    return model, path, from_trace(str(path))


def small_cfg(**kw):
    from moeflow.stages.train import TrainConfig

    base = dict(
        trace="",
        out="",
        model="",
        est_epochs=2,
        est_min_steps=60,
        forest_trees=8,
        forest_max_samples=4000,
        forest_depth=10,
        hybrid_val=0.25,
        max_s=3,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_trace_roundtrip_shapes(tiny_setup):
    _, _, data = tiny_setup
    spec = data.spec
    assert data.has_hidden and data.n == 10 * (16 + 4 - 1)
    for l in spec.moe_layers:
        a = data.layers[l]
        assert a.topk_ids.shape == (data.n, spec.top_k) and a.probs.shape == (data.n, spec.num_experts)
        assert a.hidden_in.shape == a.resid.shape == (data.n, spec.hidden_size)
    tr, he = data.split(0.25, 0)
    assert tr.n + he.n == data.n and not set(tr.prompt_id) & set(he.prompt_id)


def test_pregate_matches_router_on_own_layer(tiny_setup):
    """Sanity of the batch plumbing: pre-gate of layer l on its own router input reproduces its routing."""
    from moeflow.predict.data import batch_from_rows
    from moeflow.predict.pregate import PreGatePredictor

    model, _, data = tiny_setup
    l = data.spec.moe_layers[1]
    b = batch_from_rows(data, l, np.arange(data.n))
    top = torch.topk(PreGatePredictor(model).predict(l, 0, b), data.spec.top_k, -1).indices.sort(-1).values
    truth = torch.from_numpy(data.layers[l].topk_ids).sort(-1).values
    assert (top == truth).float().mean() > 0.97  # f16 router inputs flip a few near-ties


def test_quasi_hidden_state_definition(tiny_setup):
    """q_l = post_attention_layernorm_{l+1}(r_l + sum_k g_{l,k} d_{l,e_k}) with layer l's own top-k weights."""
    from moeflow.moe import get_adapter
    from moeflow.predict.data import batch_from_rows
    from moeflow.predict.default_vectors import QuasiHidden, compute_default_vectors

    model, _, data = tiny_setup
    ml = data.spec.moe_layers
    dv = compute_default_vectors(model, data)
    qh = QuasiHidden(model, dv)
    b = batch_from_rows(data, ml[1], np.arange(7))
    r = torch.from_numpy(data.layers[ml[1]].resid[:7]).float()
    ids, w = data.layers[ml[1]].topk_ids[:7], data.layers[ml[1]].topk_weights[:7]
    h = r + sum(torch.from_numpy(w[:, j : j + 1]) * dv[ml[1]][ids[:, j]] for j in range(ids.shape[1]))
    want = get_adapter(model).layers[ml[2]].post_attention_layernorm(h)
    torch.testing.assert_close(qh.chain(b, 1)[0], want)
    assert len(qh.chain(b, 2)) == 2


def test_default_vectors_are_mean_expert_outputs(tiny_setup):
    from moeflow.moe import get_adapter
    from moeflow.predict.default_vectors import compute_default_vectors

    model, _, data = tiny_setup
    l = data.spec.moe_layers[0]
    d = compute_default_vectors(model, data)[l]
    ids = data.layers[l].topk_ids
    e = int(np.bincount(ids.reshape(-1)).argmax())
    rows = np.flatnonzero((ids == e).any(1))
    ex = get_adapter(model).experts(l)
    x = torch.from_numpy(data.layers[l].hidden_in[rows]).float()
    y = ex(x, torch.full((len(rows), 1), e), torch.ones(len(rows), 1))
    torch.testing.assert_close(d[e], y.mean(0), atol=1e-5, rtol=1e-4)


def test_train_keeps_a_bf16_checkpoints_experts_narrow_with_the_same_default_vectors(tiny_setup, tmp_path):
    """`moeflow train` loads the routed experts in the checkpoint's dtype (half the memory of float32 for bf16) and
    the rest in float32; the default vectors, the one fit that runs the experts, equal a float32 load's."""
    from moeflow.models import load_model
    from moeflow.moe import get_adapter, model_fingerprint
    from moeflow.predict.default_vectors import compute_default_vectors
    from moeflow.stages.train import load_cpu_model

    model, _, data = tiny_setup
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")  # the fixture's model stays as it is
    narrow = load_cpu_model(str(tmp_path / "bf16"))
    full, _ = load_model(str(tmp_path / "bf16"), dtype="float32")  # what train loaded before
    ad = get_adapter(narrow)
    experts = {id(p) for l in ad.moe_layers for p in ad.per_expert_params(l).values()}
    assert experts
    for p in narrow.parameters():
        assert p.dtype == (torch.bfloat16 if id(p) in experts else torch.float32)
    assert model_fingerprint(narrow) == model_fingerprint(full)
    a, b = compute_default_vectors(narrow, data), compute_default_vectors(full, data)
    for l in ad.moe_layers:
        assert torch.equal(a[l], b[l])
    assert all(p.dtype == torch.bfloat16 for l in ad.moe_layers for p in ad.per_expert_params(l).values())


def test_max_tokens_loads_whole_prompts_drawn_at_random(tiny_setup):
    """`from_trace(max_tokens=N)` (train's --max-tokens): the rows of whole prompts drawn by the seed until they hold
    N tokens, the same values as the full load's rows; the whole trace where it holds no more than N."""
    from moeflow.predict.data import from_trace, prompt_rows

    _, path, full = tiny_setup
    counts = np.unique(full.prompt_id, return_counts=True)[1]
    assert prompt_rows(full.prompt_id, full.n, 0) is None and prompt_rows(full.prompt_id, None, 0) is None
    rows = prompt_rows(full.prompt_id, 50, 3)
    assert rows is not None and np.array_equal(rows, np.sort(rows))
    kept = np.unique(full.prompt_id[rows])
    assert len(rows) == sum(int((full.prompt_id == p).sum()) for p in kept)  # whole prompts
    assert 50 <= len(rows) < 50 + counts.max() and len(kept) >= 2
    assert np.array_equal(prompt_rows(full.prompt_id, 50, 3), rows)
    assert not np.array_equal(prompt_rows(full.prompt_id, 50, 4), rows)  # another seed, other prompts
    assert len(np.unique(full.prompt_id[prompt_rows(full.prompt_id, 1, 0)])) == 2  # a split needs 2 prompts
    part = from_trace(str(path), need_hidden=True, max_tokens=50, seed=3)
    assert part.n == len(rows) and np.array_equal(part.token_id, full.token_id[rows])
    for l, a in part.layers.items():
        b = full.layers[l]
        assert np.array_equal(a.topk_ids, b.topk_ids[rows]) and np.array_equal(a.probs, b.probs[rows])
        assert np.array_equal(a.hidden_in, b.hidden_in[rows]) and np.array_equal(a.resid, b.resid[rows])
        assert a.hidden_in.flags.writeable


def test_split_from_trace_reads_the_parts_a_split_load_would(tiny_setup):
    """`split_from_trace` (train's and retrain's load): the same train and held-out parts, array for array, as a whole
    load split afterwards (which held the rows twice), with and without --max-tokens; `context(window, rows)` is the
    whole context's rows."""
    from moeflow.predict.data import from_trace, split_from_trace

    _, path, full = tiny_setup
    for kw, whole in (({}, full), ({"max_tokens": 50, "seed": 3}, from_trace(str(path), max_tokens=50, seed=3))):
        seed = kw.get("seed", 0)
        want = whole.split(0.3, seed)
        got = split_from_trace(str(path), 0.3, seed, need_hidden=True, max_tokens=kw.get("max_tokens"))
        for a, b in zip(got, want):
            assert a.n == b.n and a.trace_tokens == b.trace_tokens == full.n
            for f in ("prompt_id", "position", "phase", "token_id"):
                assert np.array_equal(getattr(a, f), getattr(b, f)) and getattr(a, f).dtype == getattr(b, f).dtype, f
            for l in full.layers:
                for f in ("topk_ids", "topk_weights", "probs", "hidden_in", "resid"):
                    x, y = getattr(a.layers[l], f), getattr(b.layers[l], f)
                    assert np.array_equal(x, y) and x.dtype == y.dtype, f
        assert np.intersect1d(got[0].prompt_id, got[1].prompt_id).size == 0
    rows = np.array([0, 3, 17, full.n - 1])
    for w in (1, 3):
        assert np.array_equal(full.context(w, rows), full.context(w)[rows])


def test_tokens_to_load_lowers_the_default_and_refuses_what_cannot_fit(tiny_setup, tmp_path, monkeypatch):
    """`--max-tokens`' default (100,000) drops to the tokens whose loaded arrays take half of the host's available
    memory, with a line; a typed value is kept, told where it takes more than half, refused in one line where the
    rows alone exceed the host; no line where the host's memory is unknown. Through the CLI: the JSON says what was
    loaded, and the refusal leaves no --out."""
    from typer.testing import CliRunner

    import moeflow.models as mm
    from moeflow.cli.app import _register, app
    from moeflow.predict.data import token_bytes
    from moeflow.stages.train import tokens_to_load
    from moeflow.trace import Trace

    _, path, full = tiny_setup
    tr = Trace(path)
    per = token_bytes(tr)
    arrays = [full.prompt_id, full.position, full.phase, full.token_id]
    arrays += [getattr(a, f) for a in full.layers.values() for f in ("topk_ids", "topk_weights", "probs", "hidden_in", "resid")]
    assert per * full.n == sum(x.nbytes for x in arrays)  # what `from_trace` holds per token, exactly
    monkeypatch.setattr(mm, "host_available", lambda swap=True: None)
    assert tokens_to_load(tr, None) == (100_000, None)
    monkeypatch.setattr(mm, "host_available", lambda swap=True: 120 * per + (1000 * per if swap else 0))
    n, line = tokens_to_load(tr, None)  # half of the memory (swap not counted) holds 60 tokens
    assert n == 60 and line is not None and "loading 60 tokens" in line
    assert tokens_to_load(tr, 50) == (50, None)  # typed, within half
    n, line = tokens_to_load(tr, 100, "the scoring")  # typed, above half, within memory
    assert n == 100 and line is not None and "the scoring may run short" in line
    assert tokens_to_load(tr, 0)[0] == 0  # every token: beyond the memory, within memory and swap
    monkeypatch.setattr(mm, "host_available", lambda swap=True: 120 * per)
    with pytest.raises(ConfigError, match=r"--max-tokens 0: .* pass --max-tokens between 1 and 60"):
        tokens_to_load(tr, 0)  # every token: more than the host has
    monkeypatch.setattr(mm, "check_host_memory", lambda *a, **k: None)  # the model's own check reads the same stub
    _register()
    root = path.parent
    argv = ["train", "--trace", str(path), "--model", str(root / "model"), "--only", "forest", "--forest-trees", "2"]
    r = CliRunner().invoke(app, [*argv, "--out", str(tmp_path / "p"), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["max_tokens"] == 60 and 60 <= rep["train_tokens"] + rep["heldout_tokens"] < full.n
    assert json.loads((tmp_path / "p" / "meta.json").read_text())["config"]["max_tokens"] == 60
    r = CliRunner().invoke(app, [*argv, "--out", str(tmp_path / "q"), "--max-tokens", "0"])
    assert r.exit_code != 0 and isinstance(r.exception, ConfigError) and not (tmp_path / "q").exists()


def test_trace_rows_read_across_shards_equal_the_whole_columns(tiny_setup, tmp_path):
    """`Trace.layer(rows=...)`/`_column(rows=...)` (what `from_trace(max_tokens)` reads): the same values as the whole
    column's rows, across shard boundaries, for no row and for every row."""
    from moeflow.trace import Trace

    model = tiny_setup[0]
    tr = Trace(write_trace(model, tmp_path / "t", structured_prompts(6, 16), new_tokens=4, shard_size=25))
    assert len(tr.meta["shards"]) >= 3
    n = tr.num_tokens
    for rows in (np.array([], np.int64), np.arange(n), np.sort(np.random.default_rng(0).choice(n, 37, replace=False))):
        for l in tr.spec.moe_layers:
            whole, part = tr.layer(l), tr.layer(l, rows=rows)
            for f in whole:
                assert np.array_equal(part[f], whole[f][rows]) and part[f].dtype == whole[f].dtype, f
    l = tr.spec.moe_layers[0]
    for bad in (np.array([3, 1]), np.array([-1, 2]), np.array([0, n])):
        with pytest.raises(ValueError, match="sorted row indices"):
            tr.layer(l, rows=bad)


def test_the_estimators_standardisation_is_measured_a_chunk_at_a_time(fitted_tiny, monkeypatch):
    """`Estimator._moments` gives the whole sample's mean and (unbiased) standard deviation while assembling at most
    STD_CHUNK samples at once: the [20000, F] sample of a wide model would take gigabytes."""
    from moeflow.predict import estimator as est_mod

    train, _, preds = fitted_tiny
    est = preds["estimator"]
    c = est._parts(train, np.arange(train.n))
    P, N = c["q"].shape[:2]
    idx = torch.randperm(P * N, generator=torch.Generator().manual_seed(0))[:3000]
    x = est._features_parts(c, idx // N, idx % N)  # [B,F] the whole sample, as the fit measured it before
    monkeypatch.setattr(est_mod, "STD_CHUNK", 256)
    sizes: list[int] = []
    whole = est._features_parts
    monkeypatch.setattr(est, "_features_parts", lambda c_, p, i: sizes.append(len(p)) or whole(c_, p, i))
    mu, sd = est._moments(c, idx // N, idx % N)
    torch.testing.assert_close(mu, x.mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sd, x.std(0), rtol=1e-4, atol=1e-6)
    assert max(sizes) == 256 and sum(sizes) == 2 * len(idx)  # two passes of chunks, never the whole sample


@pytest.fixture(scope="module")
def fitted_tiny(tiny_setup):
    """Every predictor (baselines, pregate and all learned ones) fitted on the training prompts of the tiny trace."""
    from moeflow.predict.train import fit_all

    model, _, data = tiny_setup
    torch.manual_seed(0)
    train, held = data.split(0.3, 0)
    return train, held, fit_all(train, model, small_cfg())


def test_every_predictor_beats_frequency_on_tiny(fitted_tiny):
    from moeflow.predict.evaluate import evaluate

    _, held, preds = fitted_tiny
    rep = evaluate(preds, held, max_s=3)
    freq = rep["by_s"]["frequency"][1]
    # a random tiny model: only one step ahead is reliably predictable from its hidden states
    for name in ("pregate", "router-pf", "estimator", "hybrid", "forest"):
        assert rep["by_s"][name][1] > freq + 0.05, (name, rep["by_s"][name][1], freq)
    assert set(rep["by_s"]["router-pf"]) == {1, 2, 3}
    # the decay fit c(S) = a * exp(-b S) + c of each predictor: numbers only for a fit that determines c (3 S
    # points on a random tiny model often do not), and then its gap to pre-gating's asymptote
    fits, status = rep["fit"], rep["fit_status"]
    for name in ("forest", "pregate"):
        assert (fits[name] is None) == (status[name] != "ok"), (name, status[name])
    forest, pregate = fits["forest"], fits["pregate"]
    if forest is not None and pregate is not None:
        assert forest["delta_inf_vs_pregate"] == pytest.approx(forest["c"] - pregate["c"])


@pytest.fixture(scope="module")
def trained_folder(tiny_setup, tmp_path_factory):
    """`moeflow train` through the CLI on the tiny trace, with the model saved as a checkpoint folder."""
    from typer.testing import CliRunner

    from moeflow.cli.app import _register, app

    model, trace, _ = tiny_setup
    root = trace.parent
    _register()
    out = root / "pred"
    r = CliRunner().invoke(
        app,
        [
            "train",
            "--trace",
            str(trace),
            "--out",
            str(out),
            "--model",
            str(root / "model"),
            "--only",
            "router-pf",
            "--only",
            "forest",
            "--max-s",
            "3",
            "--forest-trees",
            "6",
            "--forest-samples",
            "3000",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    return model, root, out, json.loads(r.stdout.strip().splitlines()[-1])


def test_cli_train_writes_folder_and_report(trained_folder):
    _, _, out, rep = trained_folder
    meta = json.loads((out / "meta.json").read_text())
    assert meta["kind"] == "predictors" and set(meta["predictors"]) == {"frequency", "token-id", "pregate", "router-pf", "forest"}
    assert (out / "recall.png").stat().st_size > 1000 and (out / "forest" / "forest.npz").is_file()
    assert rep["by_s"]["router-pf"]["1"] > rep["by_s"]["frequency"]["1"]
    # no temp folders left: only the published version beside the link
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".pred")] == [".pred.versions"]
    assert [p.name for p in (out.parent / ".pred.versions").iterdir()] == [Path(os.readlink(out)).name]


def test_cli_train_max_tokens_trains_on_drawn_prompts_and_says_so(trained_folder, tiny_setup, tmp_path):
    from typer.testing import CliRunner

    from moeflow.cli.app import app

    _, root, _, rep = trained_folder
    _, trace, full = tiny_setup
    assert rep["trace_tokens"] == full.n == rep["train_tokens"] + rep["heldout_tokens"]  # the default: all of it
    argv = ["train", "--trace", str(trace), "--out", str(tmp_path / "p"), "--model", str(root / "model")]
    argv += ["--only", "forest", "--forest-trees", "2", "--max-tokens", "60", "--json"]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    small = json.loads(r.stdout.strip().splitlines()[-1])
    assert small["trace_tokens"] == full.n and 60 <= small["train_tokens"] + small["heldout_tokens"] < full.n
    ev = ["eval", "--predictors", str(tmp_path / "p"), "--trace", str(trace), "--model", str(root / "model"), "--json"]
    from moeflow.predict.data import prompt_rows

    drawn = len(np.unique(full.prompt_id[prompt_rows(full.prompt_id, 60, 0)]))
    for extra, n, prompts in (
        ([], full.n, len(np.unique(full.prompt_id))),
        (["--max-tokens", "60"], small["train_tokens"] + small["heldout_tokens"], drawn),
    ):
        r = CliRunner().invoke(app, [*ev, *extra])
        assert r.exit_code == 0, r.output
        scored = json.loads(r.stdout.strip().splitlines()[-1])
        assert (scored["scored_tokens"], scored["trace_tokens"]) == (n, full.n)
        assert scored["eval_prompts"] == prompts  # the in-sample check counts the scored prompts only
    bad = CliRunner().invoke(app, [*argv[:-3], "--max-tokens", "-1"])
    assert isinstance(bad.exception, ConfigError) and "--max-tokens must be >= 0" in str(bad.exception)


def test_save_load_roundtrip_identical(fitted_tiny, tiny_setup, tmp_path):
    """Every fitted predictor scores held-out tokens exactly as before once saved and loaded again."""
    from moeflow.predict.data import batch_from_rows
    from moeflow.predict.io import load_predictors, save_predictors

    model, _, data = tiny_setup
    _, held, preds = fitted_tiny
    ml = data.spec.moe_layers
    b = batch_from_rows(held, ml[0], np.arange(held.n), ctx=held.context(4))
    before = {(name, s): p.predict(ml[s], s, b).clone() for name, p in preds.items() for s in (1, 2)}
    assert set(preds) == {"frequency", "token-id", "pregate", "router-pf", "estimator", "hybrid", "forest"}
    save_predictors(tmp_path / "pred", preds, model, trace="t", trace_fingerprint=None, config={}, report=None)
    _, back = load_predictors(tmp_path / "pred", model)
    assert set(back) == set(preds)
    for (name, s), want in before.items():
        got = back[name].predict(ml[s], s, b)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, name=name, s=s: f"{name} S={s}: {m}")
    # the scores are informative (a loader that returned a fresh, unfitted predictor would not match them)
    assert not torch.equal(before[("frequency", 1)][0], torch.full_like(before[("frequency", 1)][0], 1 / 8))
    assert before[("router-pf", 1)].std(0).sum() > 0 and before[("forest", 1)].std(0).sum() > 0


def test_refuses_predictors_of_another_model(trained_folder):
    from moeflow.models import tiny_model
    from moeflow.predict.io import load_predictors

    _, _, out, _ = trained_folder
    other = tiny_model("olmoe", num_hidden_layers=4, seed=1)
    with pytest.raises(ArtifactError, match="made for another model"):
        load_predictors(out, other)


def test_cli_eval_and_refusals(trained_folder, tiny_setup, tmp_path):
    from typer.testing import CliRunner

    from moeflow.cli.app import app

    model, root, out, _ = trained_folder
    held = write_trace(model, tmp_path / "held", structured_prompts(3, 20, seed=5), new_tokens=4)
    r = CliRunner().invoke(
        app, ["eval", "--predictors", str(out), "--trace", str(held), "--model", str(root / "model"), "--max-s", "2", "--json"]
    )
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(rep["results"]) == {"frequency", "token-id", "pregate", "router-pf", "forest"}
    # hidden-less trace + a predictor that needs hidden states: one line naming the flag, nothing written
    bare = write_trace(model, tmp_path / "bare", structured_prompts(3, 12), new_tokens=2, record_hidden=False)
    r = CliRunner().invoke(
        app, ["train", "--trace", str(bare), "--out", str(tmp_path / "x"), "--model", str(root / "model"), "--only", "router-pf"]
    )
    assert r.exit_code != 0 and "--record-hidden" in str(r.exception) and not (tmp_path / "x").exists()


def test_learned_prefetchers_keep_generation_exact(trained_folder, tiny_setup):
    """Prefetch only moves bytes: greedy output with each learned prefetcher equals the resident model's."""
    from moeflow.policies.learned import LearnedPrefetch
    from moeflow.predict.io import save_predictors
    from moeflow.predict.train import fit_all
    from moeflow.runtime.generate import build_engine, generate_one
    from moeflow.runtime.link import DirectLink
    from moeflow.stages.train import TrainConfig

    model, root, out, _ = trained_folder
    _, _, data = tiny_setup
    cfg = TrainConfig(trace="", out="", model="", only=("estimator", "hybrid"), est_min_steps=20, max_s=2)
    fitted = fit_all(data, model, cfg)
    save_predictors(
        root / "est2",
        {n: fitted[n] for n in ("estimator", "hybrid")},
        model,
        trace="t",
        trace_fingerprint=None,
        config={},
        report=None,
    )
    model.set_experts_implementation("grouped_mm")
    prompt = torch.tensor([structured_prompts(1, 9, seed=3)[0]])
    ref, _ = generate_one(model, prompt, None, max_new_tokens=6, min_new_tokens=6)
    spec = data.spec
    for name, folder in (
        ("router-pf", out),
        ("forest", out),
        ("token-id", out),
        ("estimator", root / "est2"),
        ("hybrid", root / "est2"),
    ):
        eng = build_engine(
            model,
            mode="offload",
            link=DirectLink(),
            capacity=spec.top_k * 2,
            eviction="lru",
            prefetch=name,
            prefetch_opts={"predictors": str(folder)},
            lookahead=2,
        )
        pol = eng.prefetcher
        assert isinstance(pol, LearnedPrefetch)
        with eng:  # the engine binds the policy to the model on attach
            got, m = generate_one(model, prompt, eng, max_new_tokens=6, min_new_tokens=6)
        assert torch.equal(got, ref), name
        assert pol.calls > 0 and m.counters.loads > 0, name


def test_speculative_execution_changes_routing_and_is_measured(tiny_setup):
    """Speculation (run the predicted experts) is lossy: Router-PF keeps more of the true routing than a
    constant predictor, and a constant predictor visibly changes the model's perplexity."""
    from moeflow.moe import get_adapter
    from moeflow.predict.data import SourceBatch
    from moeflow.predict.default_vectors import RouterPF, compute_default_vectors
    from moeflow.quality.speculative import measure_quality

    model, _, data = tiny_setup
    seqs = [data.token_id[data.prompt_id == p][:12].tolist() for p in range(3)]
    rpf = RouterPF(model, compute_default_vectors(model, data), 1)
    q = measure_quality(model, rpf, seqs)
    # perplexity of the model's own routing: exp(mean next-token NLL), written out here
    nll = [-torch.log_softmax(model(torch.tensor([sq])).logits[0, :-1].float(), -1)[torch.arange(11), sq[1:]] for sq in seqs]
    assert q["tokens"] == 3 * 11 and q["ppl_resident"] == pytest.approx(torch.cat(nll).mean().exp().item(), rel=1e-5)
    E = get_adapter(model).spec.num_experts

    class Constant:
        max_lookahead = 1

        def predict(self, target, s, batch: SourceBatch):
            return torch.linspace(1.0, 2.0, E).repeat(batch.t, 1)  # always the same top-k

    bad = measure_quality(model, Constant(), seqs)
    assert bad["ppl_speculative"] != pytest.approx(bad["ppl_resident"], rel=1e-4)
    assert q["routing_exact_match"] > bad["routing_exact_match"]


def test_speculative_execution_with_a_perfect_predictor_is_lossless(tiny_setup):
    """A predictor that returns each target layer's true router probabilities (recorded by transformers'
    own `output_router_logits`): speculation then routes exactly as the model does, so nothing changes."""
    from moeflow.predict.data import SourceBatch
    from moeflow.quality.speculative import measure_quality

    model, _, data = tiny_setup
    ml = data.spec.moe_layers
    seqs = [data.token_id[data.prompt_id == p][:10].tolist() for p in range(2)]
    truth: dict[int, list[torch.Tensor]] = {l: [] for l in ml}  # layer -> true probs [T,E], per sequence
    with torch.no_grad():
        for sq in seqs:
            out = model(torch.tensor([sq]), output_router_logits=True)
            for l, lg in zip(ml, out.router_logits):
                truth[l].append(torch.softmax(lg.float(), -1))

    class Perfect:
        max_lookahead = 1
        calls: ClassVar[list[int]] = []

        def predict(self, target, s, batch: SourceBatch):
            assert s == 1 and batch.layer == ml[ml.index(target) - 1]  # asked one MoE layer ahead
            self.calls.append(target)
            return truth[target].pop(0)

    q = measure_quality(model, Perfect(), seqs)
    assert Perfect.calls == list(ml[1:]) * 2  # every MoE layer but the first, per sequence
    assert q["tokens"] == 2 * 9 and q["routing_exact_match"] == 1.0 and q["greedy_agreement"] == 1.0
    assert q["ppl_speculative"] == pytest.approx(q["ppl_resident"], rel=1e-4)


SENTENCES = [
    "The old man walked slowly along the river, thinking of the war and of his sons.",
    "In 1812 the army crossed the Niemen and marched towards Moscow through the summer heat.",
    "She asked whether the train to London would leave before noon or after dinner.",
    "Natalie had 48 apples and gave half of them to her friends; how many apples are left?",
    "The committee published its report on the state of the roads in the northern provinces.",
    "To be, or not to be, that is the question: whether it is nobler in the mind to suffer.",
    "A random forest averages many decision trees, each trained on a bootstrap sample of the data.",
    "The city council voted to build a new bridge across the harbour next spring.",
    "He wrote a long letter to his mother describing the school, the teachers and the weather.",
    "Prices of wheat and coal rose sharply during the winter, and the workers went on strike.",
    "The prince looked at the sky and thought that nothing mattered except this peace.",
    "Water boils at one hundred degrees at sea level, but at a lower temperature on a mountain.",
    "My teacher said the answer was seventeen, because twelve plus five equals seventeen.",
    "The museum opened a new exhibition of paintings from the Dutch golden age.",
    "After the storm the fishermen repaired their nets and waited for the sea to calm.",
    "Einstein published the theory of special relativity in 1905 while working at a patent office.",
]


@pytest.mark.slow
def test_default_model_predictors_beat_baselines(tmp_path):
    """On the project's trained olmoe-mini: every learned predictor beats global frequency one layer ahead."""
    from moeflow.models import default_model_path, load_model
    from moeflow.predict.data import from_trace
    from moeflow.predict.evaluate import evaluate
    from moeflow.predict.train import fit_all

    path = Path(default_model_path()).parent / "olmoe-mini"  # the measured facts below are olmoe-mini's
    if not (path / "config.json").is_file():
        pytest.skip(f"default model {path} not built (make models); the tiny-model tests cover the mechanics")
    model, tok = load_model(str(path), dtype="float32")
    prompts = [tok(s)["input_ids"] for s in SENTENCES]
    data = from_trace(str(write_trace(model, tmp_path / "trace", prompts, new_tokens=12)))
    train, held = data.split(0.25, 0)
    preds = fit_all(train, model, small_cfg(est_min_steps=200, forest_max_samples=8000))
    rep = evaluate(preds, held, max_s=3)
    freq = rep["by_s"]["frequency"][1]
    for name in ("pregate", "router-pf", "estimator", "hybrid", "forest"):
        assert rep["by_s"][name][1] > freq, (name, rep["by_s"][name][1], freq)


def test_speculative_under_offload_matches_speculative_resident(trained_folder, tiny_setup):
    """--speculative with the offload engine runs (and loads) the predicted experts: same tokens as speculative
    execution on the resident model, and different machinery does not change them."""
    from moeflow.moe import get_adapter
    from moeflow.predict.speculative import speculative_routing
    from moeflow.runtime.generate import build_engine, generate_one
    from moeflow.runtime.link import DirectLink

    model, _, out, _ = trained_folder
    model.set_experts_implementation("grouped_mm")
    prompt = torch.tensor([structured_prompts(1, 9, seed=4)[0]])
    eng = build_engine(
        model,
        mode="offload",
        link=DirectLink(),
        capacity=get_adapter(model).spec.top_k * 2,
        eviction="lru",
        prefetch="router-pf",
        prefetch_opts={"predictors": str(out)},
    )
    pol = eng.prefetcher
    ad = get_adapter(model)
    with speculative_routing(model, _load_rpf(model, out)) as st:
        ref, _ = generate_one(model, prompt, None, max_new_tokens=6, min_new_tokens=6)
    assert st["replaced"] > 0
    with eng, speculative_routing(model, pol.pred, engine=eng, adapter=ad):  # attach binds pol (pol.pred)
        got, m = generate_one(model, prompt, eng, max_new_tokens=6, min_new_tokens=6)
    assert torch.equal(got, ref) and m.counters.accesses > 0


def _load_rpf(model, folder):
    from moeflow.predict.io import load_predictors

    return load_predictors(folder, model, ["router-pf"])[1]["router-pf"]


def test_cli_run_with_learned_prefetch_adaptive_s_and_speculative(trained_folder, tmp_path, capsys):
    """`moeflow run --prefetch router-pf|forest --adaptive-s` stays token-identical to resident; --speculative runs."""
    from moeflow.cli.app import main
    from moeflow.lmtrain.tokenizer import train_tokenizer

    _, root, out, _ = trained_folder
    ck = root / "model"
    if not (ck / "tokenizer.json").exists():
        train_tokenizer(["the king said to the queen that the night was long"] * 20, vocab_size=200).save_pretrained(ck)
    prompts = tmp_path / "p.txt"
    prompts.write_text("the king said\nthe night was long\n")

    def run(extra, name):
        jl = tmp_path / f"{name}.jsonl"
        try:
            main(
                [
                    "run",
                    "-m",
                    str(ck),
                    "--prompts",
                    str(prompts),
                    "--max-new-tokens",
                    "6",
                    "--min-new-tokens",
                    "6",
                    "--threads",
                    "1",
                    "--link",
                    "emulated:1,5",
                    "--json",
                    "--out",
                    str(jl),
                    *extra,
                ]
            )
        except SystemExit as e:
            if e.code:
                return e.code, None, capsys.readouterr().err
        res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        return 0, res, [json.loads(l)["text"] for l in jl.read_text().splitlines()]

    code, _, ref = run(["--mode", "resident"], "resident")
    assert code == 0
    for pf in ("router-pf", "forest"):
        code, res, texts = run(["-c", "25%", "-f", pf, "--prefetch-opt", f"predictors={out}", "--adaptive-s"], pf)
        assert code == 0 and texts == ref, pf
        assert "adaptive-S" in res["runs"][0]["run"]
        assert res["runs"][0]["metrics"]["counters"]["prefetch_issued"] > 0
    code, res, _ = run(["-c", "25%", "-f", "router-pf", "--prefetch-opt", f"predictors={out}", "--speculative"], "spec")
    assert code == 0 and "SPECULATIVE" in res["runs"][0]["run"]
    c = res["runs"][0]["metrics"]["counters"]  # the predicted experts are the ones computed: the gate admits them all
    assert c["prefetch_refused"] == 0 and c["prefetch_issued"] > 0
    code, _, err = run(["-c", "25%", "-f", "forest", "--prefetch-opt", f"predictors={out}", "--speculative"], "bad")
    assert code == 2 and "--speculative needs" in err


def test_decay_fit_reports_a_degenerate_fit_instead_of_its_numbers():
    """A near-linear fall (c pinned at its bound 0), no fall at all, and too few S give no asymptote; a decay
    that levels off within the measured S keeps its fitted c."""
    import math
    import re

    from moeflow.predict.evaluate import decay_fit_status, fit_decay, tables

    S = (1, 2, 3, 4)
    curve = fit_decay([(s, 0.3 * math.exp(-s) + 0.5) for s in S])
    assert decay_fit_status(curve, 4) == "ok" and curve["c"] == pytest.approx(0.5, abs=1e-3)
    assert decay_fit_status(fit_decay([(s, 0.8 - 0.05 * s) for s in S]), 4).startswith("degenerate: c at its bound 0")
    assert decay_fit_status(fit_decay([(s, 0.6) for s in S]), 4).startswith("degenerate: a at its bound 0")
    slow = {"a": 0.5, "b": 0.1, "c": 0.2, "rmse": 0.0, "distinct_S": 4, "min_S": 1.0, "max_S": 4.0, "method": "x"}
    assert "less than half the decay" in decay_fit_status(slow, 4)  # type: ignore[arg-type]
    assert decay_fit_status(fit_decay([(1, 0.5), (2, 0.4)]), 2).startswith("too few S")
    # the table says so instead of printing a number
    sets = {"mass_precision": 0.5, "mass_set_size": 2.0}
    res = {
        n: {f"{s}->{s + 1}": {"source": s, "target": s + 1, "S": s, "recall_at_k": y(s), **sets} for s in S}
        for n, y in (("pregate", lambda s: 0.3 * math.exp(-s) + 0.5), ("forest", lambda s: 0.8 - 0.05 * s))
    }
    rep = {"results": res, "n_tokens": 10, "n_prompts": 2, "mass": 0.8}
    rep["fit"] = {"pregate": curve, "forest": None}
    rep["fit_status"] = {"pregate": "ok", "forest": "degenerate: c at its bound 0"}
    from rich.console import Console

    con = Console(record=True, width=200)
    for t in tables(rep):
        con.print(t)
    text = con.export_text()
    row = next(line for line in text.splitlines() if "degenerate fit*" in line)
    assert "forest" in row and not re.findall(r"\d\.\d", row) and "(forest: c at its bound 0)" in " ".join(text.split())
    assert "a fit needs recall at 3 distinct S" not in text  # 4 S were measured: that footnote would mislead
    # no fit at all (the quickstart's case): one line with the reasons, grouped, instead of a table of dashes
    rep["fit"] = {"pregate": None, "forest": None}
    rep["fit_status"] = {"pregate": "degenerate: a at its bound 0", "forest": "degenerate: a at its bound 0"}
    con = Console(record=True, width=200)
    for t in tables(rep):
        con.print(t)
    text = " ".join(con.export_text().split())
    assert "degenerate fit*" not in text and "No fit of recall against S" in text
    assert "pregate, forest: a at its bound 0" in text and "3 distinct S" not in text


def test_evaluate_gives_no_numbers_for_a_degenerate_fit(fitted_tiny):
    from moeflow.predict.evaluate import evaluate

    _, held, preds = fitted_tiny
    rep = evaluate(preds, held, max_s=3)
    assert set(rep["fit_status"]) == set(rep["fit"]) == set(preds)
    for name, f in rep["fit"].items():
        assert (f is None) == (rep["fit_status"][name] != "ok")
        if f is not None:
            ok_g = rep["fit"]["pregate"] is not None
            assert ("delta_inf_vs_pregate" in f) == ok_g


def test_eval_says_in_sample_when_its_prompts_were_trained_on(trained_folder, tiny_setup, tmp_path):
    """`moeflow eval` on the training trace: the figures are labelled in-sample with the overlap; on new prompts
    held out; a folder without training prompt ids falls back to its training trace, or says it cannot tell."""
    from typer.testing import CliRunner

    from moeflow.cli.app import app
    from moeflow.predict.evaluate import sample_label, sample_overlap, trace_prompt_ids

    model, root, out, _ = trained_folder
    trace = tiny_setup[1]
    meta = json.loads((out / "meta.json").read_text())
    trained = meta["trace"]["trained_prompt_ids"]
    every = trace_prompt_ids(trace)
    assert 0 < len(trained) < len(every) and set(trained) <= set(every)  # the training split, not the held-out part

    def ev(tr, *extra):
        args = ["eval", "--predictors", str(out), "--trace", str(tr), "--model", str(root / "model"), "--max-s", "2"]
        r = CliRunner().invoke(app, [*args, "--only", "forest", *extra])
        assert r.exit_code == 0, r.output
        return r.stdout

    rep = json.loads(ev(trace, "--json").strip().splitlines()[-1])
    assert rep["heldout"] is False and rep["overlap_prompts"] == len(trained) and rep["eval_prompts"] == len(every)
    text = ev(trace)
    assert f"in-sample ({len(trained)} of {len(every)} eval prompts were trained on)" in " ".join(text.split())
    assert "held-out recall" not in text
    held = write_trace(model, tmp_path / "held", structured_prompts(3, 20, seed=5), new_tokens=4, ids="new")
    rep = json.loads(ev(held, "--json").strip().splitlines()[-1])
    assert rep["heldout"] is True and rep["overlap_prompts"] == 0 and sample_label(rep) == "held-out"
    old = {"trace": {"path": str(trace)}}  # an older folder: no trained_prompt_ids
    assert sample_overlap(old, every) == {
        "eval_prompts": len(every),
        "overlap_basis": "training trace",
        "heldout": False,
        "overlap_prompts": len(every),
    }
    gone = sample_overlap({"trace": {"path": str(tmp_path / "moved")}}, every)
    assert gone["heldout"] is None and "unknown" in sample_label(gone)


def test_expertflow_table2_marks_a_degenerate_fit_and_keeps_the_measured_gain():
    """`make reproduce-expertflow`'s Table 2: a degenerate forest fit is a marked cell with its reason, not c = 0
    and a Delta_inf; the note still compares the measured per-S accuracies."""
    from moeflow.report import Table
    from recipes.reproduce import expertflow

    class R:
        model = "models/olmoe-deep"

        def table(self, key, title, columns, label="", source=()):
            self.t = Table(key, title, list(columns), label=label, source=list(source))
            return self.t

    g = {"a": 0.3, "b": 1.0, "c": 0.5, "rmse": 0.0, "distinct_S": 4, "min_S": 1.0, "max_S": 4.0, "method": "x"}
    rep = {
        "fit": {"pregate": g, "forest": None},
        "fit_status": {"pregate": "ok", "forest": "degenerate: c at its bound 0"},
        "by_s": {"pregate": {"1": 0.6, "2": 0.55}, "forest": {"1": 0.75, "2": 0.7}},
    }
    r = R()
    expertflow.table2(r, rep, {})
    ours = [cells for label, cells in r.t.rows if label.startswith("ours:") and "forest" in label]
    assert len(ours) == 1 and ours[0][:3] == [expertflow.DEGENERATE, 50.0, expertflow.DEGENERATE]
    notes = " ".join(r.t.notes)
    assert "c at its bound 0" in notes and "+15.0, +15.0 points" in notes and "not given" in notes
