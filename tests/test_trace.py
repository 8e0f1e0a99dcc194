"""Tracing: recorded routing equals the router's, generation is unchanged, shards append atomically,
damaged or mismatched traces are refused, statistics are right."""

from __future__ import annotations

import collections
import contextlib
import json
import math

import numpy as np
import pytest
import torch

from moeflow.data import Prompt, prompt_id
from moeflow.errors import ArtifactError
from moeflow.moe import get_adapter
from moeflow.stages.trace import TraceConfig, run_trace
from moeflow.trace import Trace
from moeflow.trace.record import RoutingRecorder, generation_kwargs, trace_one
from moeflow.trace.summary import dead_experts, expert_counts, layer_stats, load_entropy, router_entropy, skewness, trace_summary

from .conftest import ARCHS

GEN = {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "repetition_penalty": 1.0}


def tiny_tokenizer():
    """A byte-level tokenizer with exactly 256 ids (0 <pad>, 1 <s>, 2 </s>, then bytes), for the tiny models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        if len(vocab) < 256:
            vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def prompts(*texts: str) -> list[Prompt]:
    return [Prompt(prompt_id(t), t, "test") for t in texts]


def cfg(out, **kw) -> TraceConfig:
    base = dict(model="unused", prompts="test", out=str(out), max_new_tokens=4, max_prompt_tokens=16, progress=False)
    base.update(kw)
    return TraceConfig(**base)


# ---- what is recorded ----------------------------------------------------------------------------

# Where each family keeps its router (decoder layer attribute, router attribute): written out here, not taken
# from moeflow's adapters, so that the hooks below observe the routers independently of moeflow's own hooks.
ROUTER_AT = {
    **dict.fromkeys(ARCHS, ("mlp", "gate")),  # most families; the others below
    "gpt_oss": ("mlp", "router"),
    "granitemoe": ("block_sparse_moe", "router"),
    "phimoe": ("mlp", "router"),
}


@contextlib.contextmanager
def plain_router_hooks(model, arch: str):
    """layer -> list of (router input [T,H], logits [T,E], weights [T,k], indices [T,k]), one per forward,
    from plain torch forward hooks on the routers (the routers' own outputs)."""
    block_attr, router_attr = ROUTER_AT[arch]
    seen: dict[int, list[tuple[torch.Tensor, ...]]] = {}
    handles = []

    def hook(l):
        def f(module, args, out):
            x = args[0].detach()
            seen.setdefault(l, []).append((x.reshape(-1, x.shape[-1]), *(o.detach().reshape(-1, o.shape[-1]) for o in out[:3])))

        return f

    for l, layer in enumerate(model.model.layers):
        router = getattr(getattr(layer, block_attr), router_attr, None)
        if router is not None:
            handles.append(router.register_forward_hook(hook(l)))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_routing_equals_router(tiny_models, arch):
    """Records of one generate equal the routers' own outputs seen by plain forward hooks on the same run;
    re-running the router on its input reproduces them; the residual pre-hook sees the residual the router's
    norm reads."""
    model = tiny_models(arch)
    ad = get_adapter(model)
    ids = torch.tensor([[5, 77, 120, 33, 201, 9]])  # [1,S]
    rec = RoutingRecorder(ad, record_hidden=True)
    with plain_router_hooks(model, arch) as seen:
        rows, seq = trace_one(model, rec, ids, generation_kwargs(GEN, 0))
    n = seq.shape[0] - 1
    assert n >= ids.shape[1] and len(rows["position"]) == n
    assert rows["token_id"].tolist() == seq[:n].tolist()
    assert rows["phase"].tolist() == [0] * 6 + [1] * (n - 6)
    assert sorted(seen) == list(ad.moe_layers) and len(seen[ad.moe_layers[0]]) == n - 6 + 1  # prefill + decodes
    for l in ad.moe_layers:
        x, logits, w, idx = (torch.cat(parts) for parts in zip(*seen[l]))  # [n,H] [n,E] [n,k] [n,k]
        np.testing.assert_array_equal(rows[f"topk_ids_{l}"], idx.numpy())
        np.testing.assert_array_equal(rows[f"topk_weights_{l}"], w.float().numpy())
        np.testing.assert_allclose(rows[f"probs_{l}"].astype(np.float32), torch.softmax(logits.float(), -1).numpy(), atol=1e-3)
        np.testing.assert_allclose(rows[f"hidden_in_{l}"].astype(np.float32), x.numpy(), rtol=1e-2, atol=1e-2)
        # the router re-run on its recorded input chooses the recorded experts
        with torch.no_grad():
            _, idx2 = ad.select(l, ad.router_logits(l, x))
        assert torch.equal(idx2.reshape(idx.shape), idx)
        # post_attention_layernorm(resid) is the router input
        resid = torch.from_numpy(rows[f"resid_{l}"].astype(np.float32))
        with torch.no_grad():
            normed = ad.layers[l].post_attention_layernorm(resid)
        np.testing.assert_allclose(normed.numpy(), x.numpy(), rtol=2e-2, atol=2e-2)
    assert rows[f"topk_ids_{ad.moe_layers[0]}"].dtype == np.int16


@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v3"])
def test_tracing_leaves_generation_unchanged(tiny_models, arch):
    model = tiny_models(arch)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89]])
    kw = generation_kwargs({**GEN, "max_new_tokens": 6}, 0)
    with torch.no_grad():
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0]
    _, traced = trace_one(model, RoutingRecorder(get_adapter(model), record_hidden=True), ids, kw)
    assert traced.tolist() == plain.tolist()
    assert len(plain) > ids.shape[1]


# ---- batched tracing -----------------------------------------------------------------------------

# transformers' multi-head latent attention (deepseek_v3, deepseek_v2, glm4_moe_lite) refuses a padding mask: the
# trace stage falls back to batch 1 for them (`test_deepseek_v3_batch_falls_back_to_batch_one`)
BATCHABLE = [a for a in ARCHS if a not in ("deepseek_v3", "deepseek_v2", "glm4_moe_lite")]


@pytest.mark.parametrize("arch,temperature", [*((a, 0.0) for a in BATCHABLE), ("olmoe", 1.5), ("qwen3_moe", 1.5)])
def test_batched_records_equal_batch_one(tiny_models, arch, temperature, monkeypatch):
    """A left-padded batch records, per prompt, exactly the rows batch 1 records (no pad rows, nothing after a
    prompt's end-of-sequence token): same sequences, positions, phases, token ids, experts; weights, probabilities
    and hidden states equal up to rounding. Sampled, each prompt draws what it draws alone (its own seed)."""
    from moeflow.trace.record import trace_batch

    model = tiny_models(arch)
    gen = {**GEN, "max_new_tokens": 6, "temperature": temperature, "top_p": 0.9}
    kw = generation_kwargs(gen, 0)
    ps = [torch.tensor([[9, 31, 200, 77, 5]]), torch.tensor([[44]]), torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]])]
    seeds = [7, 8, 9] if temperature else None
    rec = RoutingRecorder(get_adapter(model), record_hidden=True)
    # prompt 0 ends at its first new token after the first that it had not generated before (its 2nd unless a
    # random model repeats itself): that token becomes the end-of-sequence token
    first = trace_one(model, rec, ps[0], kw, seeds[0] if seeds else None)[1]
    P, new = ps[0].shape[1], first[ps[0].shape[1] :].tolist()
    j = next(j for j in range(1, len(new)) if new[j] not in new[:j])
    monkeypatch.setattr(model.generation_config, "eos_token_id", int(new[j]))
    one = [trace_one(model, rec, p, kw, seeds[i] if seeds else None) for i, p in enumerate(ps)]
    assert len(one[0][1]) == P + j + 1 and max(len(q) - p.shape[1] for (_, q), p in zip(one, ps)) == 6
    batched = trace_batch(model, rec, ps, kw, seeds)
    for (r1, s1), (rb, sb) in zip(one, batched, strict=True):
        assert sb.tolist() == s1.tolist()
        assert set(rb) == set(r1)
        for k in r1:
            assert rb[k].shape == r1[k].shape and rb[k].dtype == r1[k].dtype, k
            if k.startswith(("topk_ids", "position", "phase", "token_id")):
                np.testing.assert_array_equal(rb[k], r1[k], err_msg=k)
            else:
                np.testing.assert_allclose(rb[k].astype(np.float32), r1[k].astype(np.float32), atol=5e-3, err_msg=k)


def test_deepseek_v3_batch_falls_back_to_batch_one(tiny_models, tok, tmp_path, monkeypatch):
    """A model whose batched generate fails is traced one prompt at a time; the trace equals a batch-1 trace."""
    import moeflow.stages.trace as run_mod

    model = tiny_models("deepseek_v3")
    ps = prompts("the cat sat", "on the mat", "a dog")
    calls = []
    real = run_mod.trace_batch

    def failing(*a, **k):
        calls.append(1)
        raise RuntimeError("cannot batch")

    monkeypatch.setattr(run_mod, "trace_batch", failing)
    r = run_trace(model, tok, ps, cfg(tmp_path / "a", batch_size=3))
    assert calls == [1] and r["batch_size"] == 1 and r["prompts_added"] == 3
    monkeypatch.setattr(run_mod, "trace_batch", real)
    r = run_trace(model, tok, ps, cfg(tmp_path / "b", batch_size=3))  # batched, or fallen back by itself
    run_trace(model, tok, ps, cfg(tmp_path / "c", batch_size=1))
    a, b, c = (Trace(tmp_path / x) for x in "abc")
    assert a.prompt_ids == b.prompt_ids == c.prompt_ids == [p.id for p in ps]
    assert a.meta["runs"][0]["batch_size"] == 1  # the size it generated with
    for t in (a, b):
        for name in ("prompt_id", "position", "phase", "token_id"):
            np.testing.assert_array_equal(t.tokens()[name], c.tokens()[name])
        for l in c.spec.moe_layers:
            np.testing.assert_array_equal(t.layer(l)["topk_ids"], c.layer(l)["topk_ids"])


def test_batches_group_lengths_keep_order_and_resume(tiny_models, tok, tmp_path, monkeypatch):
    """Batches hold prompts of similar lengths, the trace keeps the prompt order, and an interrupt keeps only whole
    windows of batches (never part of one): the next run adds the rest."""
    import moeflow.stages.trace as run_mod

    model = tiny_models("olmoe")
    texts = [("x" * n) + f" {i}" for i, n in enumerate([9, 1, 5, 12, 3, 7, 2, 11, 4, 6])]
    ps = prompts(*texts)
    c = cfg(tmp_path / "tr", batch_size=2, shard_size=1)
    assert run_mod.sort_window(c, get_adapter(model).spec.to_dict()) == 8  # 4 batches of 2
    real, seen = run_mod.trace_batch, []

    def spy(model, rec, ids, *a, **k):
        seen.append([x.shape[1] for x in ids])
        if len(seen) == 5:  # the first batch of the second window
            raise KeyboardInterrupt
        return real(model, rec, ids, *a, **k)

    monkeypatch.setattr(run_mod, "trace_batch", spy)
    with pytest.raises(KeyboardInterrupt):
        run_trace(model, tok, ps, c)
    lens = [len(tok(t)["input_ids"]) for t in texts[:8]]
    assert [n for b in seen[:4] for n in b] == sorted(lens)  # the first window, shortest first
    t = Trace(tmp_path / "tr", verify=True)
    assert t.prompt_ids == [p.id for p in ps[:8]]  # in prompt order; nothing of the interrupted window
    monkeypatch.setattr(run_mod, "trace_batch", real)
    r = run_trace(model, tok, ps, c)
    assert r["prompts_skipped"] == 8 and r["prompts_added"] == 2
    t = Trace(tmp_path / "tr", verify=True)
    assert t.prompt_ids == [p.id for p in ps]
    whole = tmp_path / "one"
    run_trace(model, tok, ps, cfg(whole, batch_size=1))
    for name in ("prompt_id", "position", "phase", "token_id"):
        np.testing.assert_array_equal(t.tokens()[name], Trace(whole).tokens()[name])


def test_shards_are_written_without_pa_array(tiny_models, tok, tmp_path, monkeypatch):
    """Shards are built from the numpy buffers, not `pa.array` (which imports pandas: seconds per run)."""
    import pyarrow as pa

    def no(*a, **k):
        raise AssertionError("pa.array called")

    monkeypatch.setattr(pa, "array", no)
    run_trace(tiny_models("olmoe"), tok, prompts("hello there", "hi"), cfg(tmp_path / "tr", record_hidden=True))
    monkeypatch.undo()
    t = Trace(tmp_path / "tr", verify=True)
    assert len(t) == len(t.tokens()["position"]) > 0 and t.layer(0)["hidden_in"].dtype == np.float16


# ---- the trace folder ----------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 2])
def test_trace_append_skip_and_reader(tiny_models, tok, tmp_path, batch_size):
    """Appends skip traced prompts; each prompt's rows are consecutive positions whose prefill rows are its tokens
    (batch 2: a padded batch, then a batch of one)."""
    model = tiny_models("olmoe")
    out = tmp_path / "tr"
    a = prompts("the cat sat", "on the mat", "a dog")
    r1 = run_trace(model, tok, a, cfg(out, batch_size=batch_size))
    assert r1["prompts_added"] == 3 and r1["prompts_skipped"] == 0
    r2 = run_trace(model, tok, a[1:] + prompts("new prompt", "another one"), cfg(out, batch_size=batch_size))
    assert r2["prompts_added"] == 2 and r2["prompts_skipped"] == 2
    t = Trace(out, verify=True)
    assert t.prompt_ids == [p.id for p in a] + [prompt_id("new prompt"), prompt_id("another one")]
    assert len(t.meta["shards"]) == 2 and len(t.meta["runs"]) == 2
    assert [r["batch_size"] for r in t.meta["runs"]] == [batch_size] * 2
    assert len(t) == t.num_tokens == r1["tokens_added"] + r2["tokens_added"] == t.meta["num_tokens"]
    tk = t.tokens()
    assert sorted(set(tk["prompt_id"].tolist())) == [0, 1, 2, 3, 4]
    for i, p in enumerate(t.prompt_ids):
        rows = tk["prompt_id"] == i
        pos = tk["position"][rows]
        assert pos.tolist() == list(range(len(pos)))  # consecutive, in order
        text = {q.id: q.text for q in a + prompts("new prompt", "another one")}[p]
        ids = tok(text)["input_ids"]
        assert tk["token_id"][rows][: len(ids)].tolist() == ids  # prefill rows are the prompt tokens
        assert (tk["phase"][rows] == (pos >= len(ids))).all()
    spec = t.spec
    for l in spec.moe_layers:
        d = t.layer(l)
        assert set(d) == {"topk_ids", "topk_weights", "probs"}
        assert d["topk_ids"].shape == (len(t), spec.top_k) and d["probs"].shape == (len(t), spec.num_experts)
        assert d["probs"].dtype == np.float16 and d["topk_weights"].dtype == np.float32
        # the recorded top-k are the top-k of the recorded probabilities
        top = np.argsort(-d["probs"].astype(np.float32), axis=1)[:, : spec.top_k]
        assert (np.sort(top, 1) == np.sort(d["topk_ids"], 1)).mean() > 0.99
    assert t.mask("decode").sum() == (tk["phase"] == 1).sum() > 0
    with pytest.raises(ArtifactError, match="record-hidden"):
        t.layer(spec.moe_layers[0], ["resid"])
    t.check_model(model)
    with pytest.raises(ArtifactError, match="another model"):
        t.check_model(tiny_models("mixtral"))


def test_small_shards_and_crash_resume(tiny_models, tok, tmp_path, monkeypatch):
    """A crash mid-run keeps every finished shard; the next run adds only the missing prompts."""
    import moeflow.stages.trace as run_mod

    model = tiny_models("olmoe")
    out = tmp_path / "tr"
    ps = prompts("one", "two", "three", "four")
    real = run_mod.trace_one
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(run_mod, "trace_one", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_trace(model, tok, ps, cfg(out, shard_size=1, batch_size=1))
    t = Trace(out)
    assert t.prompt_ids == [ps[0].id, ps[1].id] and len(t.meta["shards"]) == 2
    monkeypatch.setattr(run_mod, "trace_one", real)
    r = run_trace(model, tok, ps, cfg(out, shard_size=1, batch_size=1))
    assert r["prompts_added"] == 2 and r["prompts_skipped"] == 2
    t = Trace(out, verify=True)
    assert t.prompt_ids == [p.id for p in ps] and len(t.meta["shards"]) == 4
    assert np.diff(t.tokens()["prompt_id"]).min() >= 0  # rows in prompt order over shards


def test_shard_readable_by_datasets(tiny_models, tok, tmp_path):
    import datasets

    out = tmp_path / "tr"
    run_trace(tiny_models("olmoe"), tok, prompts("hello there"), cfg(out))
    t = Trace(out)
    ds = datasets.Dataset.from_file(str(out / t.meta["shards"][0]["file"]))
    assert ds.num_rows == len(t)
    assert ds[0]["topk_ids_0"] == t.layer(0)["topk_ids"][0].tolist()


def test_damaged_or_mismatched_traces_are_refused(tiny_models, tok, tmp_path):
    model = tiny_models("olmoe")
    out = tmp_path / "tr"
    run_trace(model, tok, prompts("alpha beta"), cfg(out, record_hidden=True))
    t = Trace(out)
    assert set(t.layer(0)) == {"topk_ids", "topk_weights", "probs", "hidden_in", "resid"}
    # another model, another --record-hidden: refused before anything is written
    with pytest.raises(ArtifactError, match="another model"):
        run_trace(tiny_models("mixtral"), tok, prompts("x y"), cfg(out, record_hidden=True))
    with pytest.raises(ArtifactError, match="record-hidden"):
        run_trace(model, tok, prompts("x y"), cfg(out, record_hidden=False))
    assert Trace(out).prompt_ids == t.prompt_ids
    # a truncated shard
    shard = out / t.meta["shards"][0]["file"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="shard-00000.*truncated"):
        Trace(out)
    # same size, flipped bytes: caught by verify=True
    shard.write_bytes(data[:100] + bytes(b ^ 0xFF for b in data[100:200]) + data[200:])
    with pytest.raises(ArtifactError, match="corrupt|unreadable"):
        Trace(out, verify=True)
    shard.write_bytes(data)
    Trace(out, verify=True)
    # a corrupt meta.json
    (out / "meta.json").write_text('{"kind": "trace", "sch')
    with pytest.raises(ArtifactError, match="corrupt"):
        Trace(out)
    # an --out that is some other folder
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    with pytest.raises(ArtifactError, match="not a trace folder"):
        run_trace(model, tok, prompts("x"), cfg(other))


# ---- statistics ----------------------------------------------------------------------------------


def test_summary_statistics():
    ids = np.array([[0, 1], [0, 2], [0, 1], [0, 3]])  # E=5: counts 4,2,1,1,0
    c = expert_counts(ids, 5)
    assert c.tolist() == [4, 2, 1, 1, 0]
    assert skewness(c) == pytest.approx(2.5)  # max 4 / mean 8/5
    assert dead_experts(c).tolist() == [4]
    assert load_entropy(np.ones(8)) == pytest.approx(1.0)
    # loads 4,2,1,1: H = 1/2 ln 2 + 1/4 ln 4 + 2 * 1/8 ln 8 = 1.75 ln 2, over ln 4 = 2 ln 2
    assert load_entropy(np.array([4, 2, 1, 1])) == pytest.approx(0.875)
    uniform = np.full((3, 4), 0.25, np.float16)
    onehot = np.eye(4, dtype=np.float16)[:3]
    assert router_entropy(uniform) == pytest.approx(1.0, abs=1e-3)
    assert router_entropy(onehot) == pytest.approx(0.0, abs=1e-3)
    assert router_entropy(np.concatenate([uniform, onehot]), chunk=2) == pytest.approx(0.5, abs=1e-3)
    s = layer_stats(ids, None, 5, layer=3)
    assert s.layer == 3 and s.tokens == 4 and s.assignments == 8 and s.dead == [4] and math.isnan(s.router_entropy)


def test_statistics_of_a_three_expert_toy_layer():
    """Top-1 routing of 4 tokens over 3 experts, loads 3,1,0; every expected value worked out by hand."""
    ids = np.array([[0], [0], [1], [0]])
    probs = np.array([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0], [0.5, 0.25, 0.25], [1.0, 0.0, 0.0]], np.float16)
    s = layer_stats(ids, probs, 3, layer=0)
    assert s.counts == [3, 1, 0] and s.assignments == 4 and s.tokens == 4
    assert s.skewness == pytest.approx(2.25)  # max 3 / mean 4/3
    assert s.dead == [2]  # 0 < 1% of the mean load
    # load entropy: p = (3/4, 1/4, 0): -(3/4 ln 3/4 + 1/4 ln 1/4) / ln 3
    assert s.load_entropy == pytest.approx(0.5118595071, rel=1e-9)
    # router entropy: rows (1/2, 1/4, 1/4) have H = 1/2 ln 2 + 1/2 ln 4 = 1.5 ln 2, one-hot rows 0;
    # mean 0.75 ln 2 / ln 3
    assert s.router_entropy == pytest.approx(0.4731973152, rel=1e-6)


def test_trace_summary_matches_arrays(tiny_models, tok, tmp_path):
    out = tmp_path / "tr"
    run_trace(tiny_models("qwen2_moe"), tok, prompts("some text", "more text"), cfg(out))
    t = Trace(out)
    s = trace_summary(t)
    assert [L["layer"] for L in s["layers"]] == list(t.spec.moe_layers) == [1, 2]
    E = t.spec.num_experts
    for L in s["layers"]:
        # loads counted in plain Python from the stored ids; skewness = max / mean load
        load = collections.Counter(e for row in t.layer(L["layer"])["topk_ids"].tolist() for e in row)
        counts = [load.get(e, 0) for e in range(E)]
        assert L["counts"] == counts and sum(counts) == len(t) * t.spec.top_k
        assert L["skewness"] == pytest.approx(max(counts) / (sum(counts) / E))
    dec = trace_summary(t, "decode")
    assert dec["tokens"] == s["decode_tokens"] and dec["layers"][0]["tokens"] == s["decode_tokens"]
    json.dumps(s)


def test_bfloat16_model_is_recorded(tiny_models):
    from moeflow.models import tiny_model

    model = tiny_model("mixtral", dtype=torch.bfloat16)
    ad = get_adapter(model)
    with plain_router_hooks(model, "mixtral") as seen:
        rows, _ = trace_one(
            model, RoutingRecorder(ad, record_hidden=True), torch.tensor([[4, 8, 15, 16]]), generation_kwargs(GEN, 0)
        )
    l = ad.moe_layers[-1]
    idx = torch.cat([ev[3] for ev in seen[l]])  # [n,2]
    w = torch.cat([ev[2] for ev in seen[l]])
    np.testing.assert_array_equal(rows[f"topk_ids_{l}"], idx.numpy())
    np.testing.assert_array_equal(rows[f"topk_weights_{l}"], w.float().numpy())
    assert rows[f"hidden_in_{l}"].dtype == np.float16 and rows[f"probs_{l}"].dtype == np.float16


def test_writer_lock_and_nothing_left_on_failure(tiny_models, tmp_path):
    from moeflow.errors import MoeflowError
    from moeflow.moe import model_fingerprint
    from moeflow.trace.writer import TraceWriter

    model = tiny_models("olmoe")
    kw = dict(
        fingerprint=model_fingerprint(model),
        spec=get_adapter(model).spec.to_dict(),
        record_hidden=False,
        generation=GEN,
        prompt_source="test",
    )
    out = tmp_path / "tr"
    with TraceWriter(out, **kw):
        with pytest.raises(MoeflowError, match="another `moeflow trace` is writing"):
            with TraceWriter(out, **kw):
                pass
    assert not out.exists()  # nothing was added: no folder left behind
    with pytest.raises(RuntimeError):
        with TraceWriter(out, **kw):
            raise RuntimeError("boom")
    assert not out.exists()


def test_sampling_is_seeded_per_prompt(tiny_models, tok, tmp_path):
    """Sampled traces depend on (seed, prompt), not on prompt order, so appends reproduce samples."""
    model = tiny_models("olmoe")
    ps = prompts("sample me", "and me too")
    kw = dict(temperature=1.5, top_p=0.95, max_new_tokens=8)

    def token_ids(out, order, seed=0):
        run_trace(model, tok, order, cfg(out, seed=seed, **kw))
        t = Trace(out)
        tk = t.tokens()
        return {pid: tk["token_id"][tk["prompt_id"] == i].tolist() for i, pid in enumerate(t.prompt_ids)}

    a = token_ids(tmp_path / "a", ps)
    b = token_ids(tmp_path / "b", ps[::-1])
    c = token_ids(tmp_path / "c", ps, seed=1)
    assert a == b
    assert a != c
    kw["batch_size"] = 1  # each prompt alone draws what it draws in a batch (its own generator)
    assert token_ids(tmp_path / "d", ps) == a
    assert Trace(tmp_path / "a").meta["generation"]["do_sample"] is True
