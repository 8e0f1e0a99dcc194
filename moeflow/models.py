"""Loading local checkpoints, and tiny random MoE models built from real transformers configs."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from .errors import ConfigError, MoeflowError, UnsupportedModelError

DEFAULT_MODEL = "models/olmoe-mini"

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype | str:
    """`auto` means float32 on CPU (fast there) and the checkpoint's own dtype on CUDA."""
    if name == "auto":
        return torch.float32 if device == "cpu" else "auto"
    if name not in DTYPES:
        raise ConfigError(f"unknown --dtype {name!r}; use one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with `n` torch intra-op threads (None: leave as is); restore the count after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def default_model_path() -> str:
    """`models/olmoe-mini` of the source checkout (or MOEFLOW_MODEL), whatever the working directory."""
    env = os.environ.get("MOEFLOW_MODEL")
    if env:
        return env
    here = Path(__file__).resolve().parent.parent / DEFAULT_MODEL
    return str(here) if here.exists() else DEFAULT_MODEL


def load_model(path: str | os.PathLike, *, dtype: str = "auto", device: str = "cpu",
               experts_implementation: str | None = None):
    """(model, tokenizer) from a local Hugging Face checkpoint folder, in eval mode.

    Raises MoeflowError with a one-line fix when the folder is missing or not an MoE model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from .moe import get_adapter

    p = Path(path)
    if not p.is_dir():
        raise MoeflowError(f"model folder {path} does not exist; pass --model DIR with a local Hugging Face "
                           f"checkpoint (config.json + safetensors), e.g. {DEFAULT_MODEL} after `make models`")
    if not (p / "config.json").is_file():
        raise MoeflowError(f"{path} has no config.json; pass --model a folder written by save_pretrained")
    try:
        config = AutoConfig.from_pretrained(p)
    except (ValueError, OSError) as e:
        raise MoeflowError(f"cannot read {p}/config.json: {str(e).splitlines()[0]}") from e
    from .moe.adapters import ARCHS, SUPPORTED
    if config.model_type not in ARCHS:
        raise UnsupportedModelError(
            f"model type {config.model_type!r} is not supported; supported architectures: {', '.join(SUPPORTED)}")
    kw: dict[str, Any] = {"dtype": resolve_dtype(dtype, device)}
    if experts_implementation:
        kw["experts_implementation"] = experts_implementation
    model = AutoModelForCausalLM.from_pretrained(p, **kw).to(device).eval()
    tok = AutoTokenizer.from_pretrained(p) if _has_tokenizer(p) else None
    get_adapter(model)  # fail early on a checkpoint without MoE layers
    return model, tok


def _has_tokenizer(p: Path) -> bool:
    return any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


# ---- tiny random models for tests and examples ---------------------------------------------------
# Real transformers config classes, all sizes multiples of 8 (CPU grouped_mm needs 16-byte strides).

_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
               pad_token_id=0, tie_word_embeddings=False)


def tiny_config(arch: str, *, num_experts: int = 8, top_k: int = 2, **over: Any):
    """A small but real config of architecture `arch` (transformers `model_type`)."""
    from transformers import AutoConfig
    c: dict[str, Any] = dict(_COMMON)
    if arch == "olmoe":
        c.update(num_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=32, norm_topk_prob=False)
    elif arch == "mixtral":
        c.update(num_local_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=32, head_dim=16)
    elif arch == "qwen2_moe":
        c.update(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=32, intermediate_size=64,
                 shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[0],
                 norm_topk_prob=False)
    elif arch == "qwen3_moe":
        c.update(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=32, intermediate_size=64,
                 decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, head_dim=16)
    elif arch == "deepseek_v3":
        c.update(n_routed_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=32,
                 intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                 kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                 routed_scaling_factor=2.5, norm_topk_prob=True, rope_scaling=None)
    elif arch == "gpt_oss":
        c.update(num_local_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=32, head_dim=16,
                 sliding_window=32, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    elif arch == "granitemoe":
        c.update(num_local_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=32)
    elif arch == "phimoe":
        c.update(num_local_experts=num_experts, num_experts_per_tok=2, intermediate_size=32)
    else:
        raise UnsupportedModelError(f"no tiny config for {arch!r}")
    c.update(over)
    return AutoConfig.for_model(arch, **c)


def tiny_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **over: Any):
    """A randomly initialised tiny model of `arch` in eval mode (deterministic for a seed)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **over), dtype=dtype).eval()
    # Some families initialise routers to zero (all ties): give them random weights so routing varies.
    from .moe import get_adapter
    ad = get_adapter(model)
    with torch.no_grad():
        for l in ad.moe_layers:
            r = ad.router(l)
            r.weight.normal_(0.0, 0.5)
            if getattr(r, "bias", None) is not None and isinstance(r.bias, torch.Tensor):
                r.bias.normal_(0.0, 0.1)
            if hasattr(r, "e_score_correction_bias"):
                r.e_score_correction_bias.normal_(0.0, 0.1)
    return model
