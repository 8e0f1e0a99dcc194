"""A command on a tiny checkpoint prints none of transformers' noise: the "Loading weights" bar, the
`past_key_values` FutureWarning (the KV cache is passed under the forward's current keyword), the
tokenizer's "sequence length is longer than the specified maximum" for text moeflow cuts itself."""

from __future__ import annotations

import json
import logging
import warnings

import pytest

NOISE = ("Loading weights", "past_key_values", "longer than the specified maximum")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from moeflow.lmtrain.tokenizer import train_tokenizer
    from moeflow.models import tiny_model

    d = tmp_path_factory.mktemp("nckpt")
    text = ["the king said to the queen that the night was long", "to be or not to be, that is the question"] * 20
    tok = train_tokenizer(text, vocab_size=200)
    tok.model_max_length = 64  # the prompt and the perplexity text below are longer
    tiny_model("olmoe", num_experts=8, top_k=2).save_pretrained(d)
    tok.save_pretrained(d)
    (d.parent / "p.txt").write_text(" ".join(text) + "\n")  # ~900 tokens, cut to --max-prompt-tokens
    (d.parent / "text.txt").write_text(" ".join(text))
    return d


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_quality_prints_no_transformers_noise(ckpt, capsys):
    """`moeflow quality` loads weights, encodes a prompt longer than the tokenizer's maximum and scores
    perplexity with the KV cache (one forward per token): stderr, transformers' log and Python warnings stay clean."""
    from moeflow.cli.app import main

    args = ["quality", "-m", str(ckpt), "--prompts", str(ckpt.parent / "p.txt"), "--max-new-tokens", "2"]
    args += ["--max-prompt-tokens", "32", "--text", str(ckpt.parent / "text.txt"), "--ppl-tokens", "8", "--ppl-windows", "1"]
    args += ["--task", "none", "--mode", "on-demand", "--no-warmup", "--threads", "1", "--json"]
    log = _Records()
    tx_log = logging.getLogger("transformers")
    tx_log.addHandler(log)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                main(args)
            except SystemExit as e:
                assert e.code in (0, None)
    finally:
        tx_log.removeHandler(log)
    out = capsys.readouterr()
    res = json.loads(out.out.strip().splitlines()[-1])
    assert res["runs"][0]["ppl"] is not None and res["text"]["tokens"] == 8  # the cached forward pass ran
    said = [out.err, *log.messages, *(str(w.message) for w in caught)]
    for needle in NOISE:
        assert not any(needle in s for s in said), (needle, [s for s in said if needle in s])


def test_kv_cache_keyword_matches_the_model(tiny_models):
    """The cache goes under the keyword the model's forward declares, and fills in place (one forward per token
    with it gives the logits of one forward over the whole sequence)."""
    import inspect

    import torch

    from moeflow.moe.tx_compat import kv_cache_kwargs

    model = tiny_models("olmoe")
    kw = kv_cache_kwargs(model)
    (name,) = kw
    assert name in inspect.signature(type(model).forward).parameters
    ids = torch.tensor([[5, 9, 3, 7]])  # [1,4]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        steps = [model(input_ids=ids[:, i : i + 1], use_cache=True, **kw).logits[0, -1] for i in range(4)]  # 4 x [V]
        full = model(input_ids=ids).logits[0]  # [4,V]
    torch.testing.assert_close(torch.stack(steps), full, rtol=1e-4, atol=1e-4)


def test_the_planner_embedder_loads_without_the_weights_bar(capsys):
    """CasMoE's EAM embedder (sentence-transformers over MiniLM) loads its weights through transformers, whose
    "Loading weights" bar showed in `train --only eam`, `eval` and `run --plan casmoe`."""
    from moeflow.plan.eam import Embedder

    capsys.readouterr()
    assert Embedder().dim > 0
    out, err = capsys.readouterr()
    assert "Loading weights" not in out + err, err
