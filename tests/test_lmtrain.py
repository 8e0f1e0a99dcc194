"""The embedded-model training code: corpus split, tokenizer, per-layer balance loss, training loop."""

from __future__ import annotations

import pytest
import torch

from moeflow.lmtrain.losses import balance_loss, per_layer_balance_loss, router_z_loss


def _logits(assign: torch.Tensor, E: int, sharp: float = 8.0) -> torch.Tensor:
    """Router logits [T,E] that put almost all probability on expert assign[t]."""
    return torch.nn.functional.one_hot(assign, E).float() * sharp


def test_balance_loss_uniform_is_minimal():
    E, k, T = 8, 2, 512
    uniform = torch.zeros(T, E)                                           # ties: top-k picks 0..k-1, but P is uniform
    assert abs(balance_loss(uniform, k).item() - 1.0) < 1e-5
    spread = _logits(torch.arange(T) % E, E)                              # every expert equally often
    collapsed = _logits(torch.zeros(T, dtype=torch.long), E)              # everything to expert 0
    assert balance_loss(collapsed, k).item() > 2.0 * balance_loss(spread, k).item()


def test_per_layer_loss_sees_a_collapsed_layer_that_pooling_hides():
    E, k, T = 8, 1, 512
    # layer 0 sends everything to experts 0-3, layer 1 to experts 4-7: pooled, every expert gets 1/8.
    l0 = _logits(torch.arange(T) % 4, E)
    l1 = _logits(4 + torch.arange(T) % 4, E)
    balanced = _logits(torch.arange(T) % E, E)
    pooled = balance_loss(torch.cat([l0, l1]), k).item()
    per_layer = per_layer_balance_loss([l0, l1], k).item()
    reference = per_layer_balance_loss([balanced, balanced], k).item()
    assert abs(pooled - reference) < 0.05            # the pooled loss cannot tell
    assert per_layer > 1.8 * reference               # the per-layer loss can (about 2x: half the experts idle)
    # and it is what the transformers pooled loss would compute: same value on the concatenation
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    hf = load_balancing_loss_func((l0, l1), E, k).item()
    assert abs(hf - reference) < 0.1 * reference


def test_router_z_loss_grows_with_logit_scale():
    x = torch.randn(64, 8)
    assert router_z_loss([x * 10]).item() > router_z_loss([x]).item() > 0


def test_tokenizer_round_trips():
    from moeflow.lmtrain.tokenizer import encode_docs, train_tokenizer
    docs = ["The quick brown fox jumps over the lazy dog. " * 20, "Ünïcödé — 3 × 4 = 12\n\nnew paragraph\ttab"] * 5
    tok = train_tokenizer(docs, vocab_size=300)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for d in docs[:2]:
        ids = tok(d, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == d
        assert len(ids) < len(d.encode())            # BPE merges something
    stream = encode_docs(tok, docs[:2])
    assert stream[0] == 1 and stream[-1] == 2 and stream.count(2) == 2


def test_corpus_split_is_deterministic_and_holds_out_each_source(shared_data):
    from moeflow.data.corpus import load_corpus
    a = load_corpus(shared_data, sources=["botchan", "gsm8k", "c4_demo"])
    b = load_corpus(shared_data, sources=["botchan", "gsm8k", "c4_demo"])
    assert a.val == b.val and a.train == b.train
    for name in ("botchan", "gsm8k", "c4_demo"):
        tr, va = a.train[name], a.val[name]
        assert va and not set(va) & set(tr)
        frac = sum(map(len, va)) / (sum(map(len, va)) + sum(map(len, tr)))
        assert 0.005 < frac < 0.06, (name, frac)
        assert max(map(len, tr)) <= 4096 + 200       # chunks of ~4 KB


@pytest.mark.parametrize("name", ["olmoe-mini", "mixtral-mini"])
def test_training_loop_decreases_loss(name):
    from transformers import AutoModelForCausalLM
    from moeflow.lmtrain.configs import model_config
    from moeflow.lmtrain.loop import TrainConfig, eval_loss, train, val_windows
    torch.manual_seed(0)
    base = torch.randint(3, 128, (40,))
    tokens = base.repeat(100)                                   # a learnable stream: 40 tokens repeated
    cfg = model_config(name, tiny=True, vocab_size=128)
    model = AutoModelForCausalLM.from_config(cfg)
    vw = val_windows(tokens, 32, 4)
    before = eval_loss(model, vw)
    res = train(model, tokens, tokens, TrainConfig(seq_len=32, batch_size=4, lr=3e-3, warmup_steps=3,
                                                   minutes=None, max_steps=20, eval_every_s=1e9),
                top_k=cfg.num_experts_per_tok)
    after = eval_loss(model, vw)
    steps = [r for r in res.history if "loss" in r]
    assert res.steps == 20 and len(steps) == 20
    assert after < before - 1.0, (name, before, after)
    assert all(r["balance"] > 0.9 for r in steps)               # >= 1 by construction (up to float error)
    assert steps[-1]["lr"] < steps[5]["lr"]                     # cosine decay reached


def test_recipe_tiny_run_writes_a_loadable_model(tmp_path, shared_data):
    """The recipe's --tiny path end to end (without the card): a folder AutoModelForCausalLM loads."""
    import importlib.util
    from pathlib import Path
    from transformers import AutoModelForCausalLM, AutoTokenizer
    spec = importlib.util.spec_from_file_location(
        "train_models", Path(__file__).resolve().parent.parent / "recipes" / "train_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--tiny", "--only", "mixtral-mini", "--steps", "3", "--no-card", "--data-dir", str(shared_data),
                   "--out", str(tmp_path), "--log-dir", str(tmp_path / "logs")])
    assert rc == 0
    folder = tmp_path / "mixtral-mini"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert model.config.eos_token_id == tok.eos_token_id == 2 and model.config.vocab_size == len(tok)
    assert model.generation_config.pad_token_id == 0
    assert not list(tmp_path.glob(".mixtral-mini.tmp-*"))
