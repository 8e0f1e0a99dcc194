"""The sizes of the embedded models (all hidden/intermediate sizes multiples of 8 for CPU grouped_mm)."""

from __future__ import annotations

from typing import Any

# Token ids set explicitly: OlmoeConfig's defaults (eos 50279) lie outside a small vocabulary.
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

MODELS: dict[str, dict[str, Any]] = {
    # OLMoE: many small experts, top-4 of 32 (the pilot's size).
    "olmoe-mini": dict(
        arch="olmoe",
        vocab_size=8192,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    # OLMoE, deep: 12 MoE layers of 32 experts top-4, the per-layer shape of olmoe-mini (so a step
    # size S can range over 1..11 and a layer-ahead predictor has 11 source layers).
    "olmoe-deep": dict(
        arch="olmoe",
        vocab_size=8192,
        hidden_size=128,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    # Mixtral: few larger experts, top-2 of 8; same active expert width per token (2 x 256 = 4 x 128).
    "mixtral-mini": dict(
        arch="mixtral",
        vocab_size=8192,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        sliding_window=None,
    ),
}

# --tiny: the same architectures, small enough for a smoke run or a unit test in seconds.
TINY: dict[str, dict[str, Any]] = {
    "olmoe-mini": dict(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "olmoe-deep": dict(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "mixtral-mini": dict(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
}


def model_config(name: str, *, tiny: bool = False, vocab_size: int | None = None, **over: Any):
    """A transformers config for embedded model `name` (`olmoe-mini`, `olmoe-deep` or `mixtral-mini`)."""
    from transformers import AutoConfig

    from ..errors import ConfigError

    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; use one of {', '.join(MODELS)}")
    c = dict(MODELS[name])
    if tiny:
        c.update(TINY[name])
    if vocab_size is not None:
        c["vocab_size"] = vocab_size
    c.update(TOKEN_IDS)
    c.update(over)
    arch = c.pop("arch")
    return AutoConfig.for_model(arch, **c)
