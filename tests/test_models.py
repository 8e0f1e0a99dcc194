"""The committed embedded models (models/olmoe-deep, olmoe-mini, mixtral-mini): load, generate, spec, size, trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
MAX_BYTES = {"olmoe-deep": 48 * 2**20, "olmoe-mini": 25 * 2**20, "mixtral-mini": 25 * 2**20}  # committed folder limits
EXPECTED = {  # name -> (arch, layers, experts, top-k, hidden, expert intermediate)
    "olmoe-deep": ("olmoe", 12, 32, 4, 128, 128),
    "olmoe-mini": ("olmoe", 4, 32, 4, 128, 128),
    "mixtral-mini": ("mixtral", 4, 8, 2, 128, 256),
}
TEXT = (
    "It was a bright cold day in April, and the old man walked slowly along the road towards the village. "
    "He had not seen his brother for many years, and he wondered whether he would know him again."
)


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def committed(request):
    folder = REPO / "models" / request.param
    if not (folder / "config.json").is_file():
        pytest.skip(f"{folder} is absent: run `make models` (recipes/train_models.py) to train it")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    return request.param, folder, model, tok


def test_folder_is_small_and_complete(committed):
    name, folder, _, _ = committed
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size <= MAX_BYTES[name], f"{folder} is {size / 2**20:.1f} MiB"
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
        "README.md",
        "training_curve.png",
        "card.json",
        "training.json",
    ):
        assert (folder / f).is_file(), f


def test_spec(committed):
    from moeflow.moe import get_adapter

    name, _, model, _ = committed
    spec = get_adapter(model).spec
    arch, layers, E, k, H, inter = EXPECTED[name]
    assert (
        spec.arch,
        spec.num_layers,
        spec.moe_layers,
        spec.num_experts,
        spec.top_k,
        spec.hidden_size,
        spec.expert_intermediate_size,
    ) == (arch, layers, tuple(range(layers)), E, k, H, inter)
    assert spec.num_shared_experts == 0


def test_token_ids_are_inside_the_vocabulary(committed):
    _, _, model, tok = committed
    c = model.config
    assert (c.pad_token_id, c.bos_token_id, c.eos_token_id) == (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    assert max(c.pad_token_id, c.bos_token_id, c.eos_token_id) < c.vocab_size == len(tok)
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_generates_and_is_trained(committed):
    _, _, model, tok = committed
    ids = tok(TEXT, return_tensors="pt").input_ids  # [1,S]
    assert ids[0, 0].item() == tok.bos_token_id
    with torch.no_grad():
        out = model(input_ids=ids)
        loss = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), ids[0, 1:]).item()
        g = model.generate(
            ids[:, :12], attention_mask=torch.ones_like(ids[:, :12]), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
    # a random model scores ~ln(8192) = 9.0 nats/token; the trained one knows English
    assert loss < 6.5, loss
    assert g.shape == (1, 20) and int(g.max()) < len(tok)
    assert tok.decode(g[0, 12:], skip_special_tokens=True).strip()


def test_card_numbers_are_consistent(committed):
    _, folder, model, _ = committed
    card = json.loads((folder / "card.json").read_text())
    assert card["params"]["total"] == sum(p.numel() for p in model.parameters())
    assert card["params"]["active"] < card["params"]["total"]
    assert 1 < card["val_perplexity"] < card["random_init_val_perplexity_32_windows"]
    assert f"{card['val_perplexity']:.1f}" in (folder / "README.md").read_text()


def test_traces_prompts(committed, tmp_path):
    pytest.importorskip("moeflow.trace")
    from moeflow.data.prompts import Prompt, prompt_id
    from moeflow.stages.trace import TraceConfig, run_trace
    from moeflow.trace import Trace

    name, folder, model, tok = committed
    texts = ["Question: What is 3 plus 4?\nAnswer:", "The king said to his son"]
    prompts = [Prompt(id=prompt_id(t), text=t, source="test") for t in texts]
    cfg = TraceConfig(model=str(folder), prompts="inline", out=str(tmp_path / "trace"), max_new_tokens=4, progress=False)
    res = run_trace(model, tok, prompts, cfg)
    assert res["prompts_added"] == 2
    tr = Trace(tmp_path / "trace")
    k = EXPECTED[name][3]
    ids = tr.layer(0, ("topk_ids",))["topk_ids"]
    assert ids.shape[1] == k and ids.shape[0] == res["trace_tokens"]
