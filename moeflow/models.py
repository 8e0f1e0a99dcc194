"""Loading local checkpoints, and tiny random MoE models built from real transformers configs."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import ArtifactError, ConfigError, MoeflowError, UnsupportedModelError, brief
from .model_paths import DEFAULT_MODEL as DEFAULT_MODEL  # re-exported: the CLI reads them from the torch-free module
from .model_paths import default_model_path as default_model_path
from .model_paths import shipped_models as shipped_models

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str, device: str) -> torch.dtype | str:
    """`auto` means float32 on CPU (fast there) and the checkpoint's own dtype on CUDA; `checkpoint` the checkpoint's
    own dtype everywhere (transformers' "auto")."""
    if name == "auto":
        return torch.float32 if device == "cpu" else "auto"
    if name == "checkpoint":
        return "auto"
    if name not in DTYPES:
        raise ConfigError(f"unknown --dtype {name!r}; use one of auto, checkpoint, {', '.join(sorted(DTYPES))}")
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


@contextlib.contextmanager
def no_cudnn_attention() -> Iterator[None]:
    """Run the block with PyTorch's cuDNN attention backend off (`torch.backends.cuda.enable_cudnn_sdp`); restore
    the flag after. The other backends stay as the caller set them.

    cuDNN's attention builds an execution plan for every sequence length it has not seen, on the host: on an H100
    (torch 2.11, OLMoE-1B-7B shape, bf16) about 2.4 ms per attention call, so a decode step at a new length took
    63 ms where the same step at a length seen before took 21 ms, and every generation decodes through lengths
    it has not seen. Flash and memory-efficient attention have no such cost. On the CPU nothing changes (cuDNN is a
    CUDA backend). The flag is the process's: threads that generate at once see it together."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def skip_transformers_hqq() -> None:
    """Import transformers' cache_utils telling it hqq is absent. It imports hqq (when installed) only for its
    HQQ-quantized KV cache, which moeflow never uses, and hqq's module body calls `torch.compile`, importing
    TorchInductor: about 2 CPU seconds on every model load. `moeflow.quant` imports hqq itself when it quantizes.
    Only that cache sees the change (it would report hqq missing); `transformers.utils.is_hqq_available` is restored
    after the import."""
    import sys

    if "transformers.cache_utils" in sys.modules:
        return
    import transformers.utils as tx_utils

    found = tx_utils.is_hqq_available
    tx_utils.is_hqq_available = lambda *a, **k: False
    try:
        import transformers.cache_utils  # noqa: F401
    finally:
        tx_utils.is_hqq_available = found


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """For the block, no transformers progress bars (its per-checkpoint "Loading weights" bar); the previous
    setting is restored after, so nothing changes for other code in the process."""
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as tx_logging

    was, hub_off = tx_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled()
    tx_logging.disable_progress_bar()  # also huggingface_hub's
    try:
        yield
    finally:
        if was:
            tx_logging.enable_progress_bar()
        (hub_utils.disable_progress_bars if hub_off else hub_utils.enable_progress_bars)()


def missing_model(path: str | os.PathLike) -> str:
    """The one line for a --model folder that does not exist: the shipped checkpoints and $MOEFLOW_MODEL."""
    shipped = shipped_models()
    ships = f"the repository ships {', '.join(shipped)}; " if shipped else ""
    exists = Path(path).exists()
    if os.environ.get("MOEFLOW_MODEL") and str(path) == os.environ["MOEFLOW_MODEL"]:  # no --model: the variable's
        what = f"$MOEFLOW_MODEL names {path}, which " + ("is a file, not a model folder" if exists else "does not exist")
    else:
        what = f"--model {path} is a file, not a model folder" if exists else f"model folder {path} does not exist"
    return (
        f"{what}; check the path, or pass --model with a local Hugging Face checkpoint "
        f"folder (config.json + safetensors): {ships}or set MOEFLOW_MODEL"
    )


def load_model(
    path: str | os.PathLike,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    experts_implementation: str | None = None,
    tokenizer: bool = True,
    experts_device: str | None = None,
):
    """(model, tokenizer) from a local Hugging Face checkpoint folder, in eval mode (tokenizer None with
    `tokenizer=False`: `moeflow train` needs none). `dtype`: `resolve_dtype`'s names ("auto" is float32 on the CPU,
    "checkpoint" the checkpoint's own dtype on any device). `experts_device` (e.g.
    "cpu" beside a CUDA `device`): the routed experts' stacked weights stay there and everything else goes to
    `device` (`place_model`), so a model whose experts do not fit in device memory loads; only an offload engine can
    then run it.

    Raises MoeflowError with a one-line fix when the folder is missing or not an MoE model.
    """
    skip_transformers_hqq()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .moe import get_adapter

    p = Path(path)
    if not p.is_dir():
        raise MoeflowError(missing_model(path))
    if not (p / "config.json").is_file():
        raise ArtifactError(f"{p / 'config.json'} is missing; pass --model a folder written by save_pretrained")
    config = read_config(p)
    from .moe.adapters import ARCHS, SUPPORTED, moe_model_type

    if moe_model_type(config) not in ARCHS:
        raise UnsupportedModelError(
            f"model type {config.model_type!r} is not supported; supported architectures: {', '.join(SUPPORTED)}"
        )
    kw: dict[str, Any] = {"dtype": resolve_dtype(dtype, device)}
    if experts_implementation:
        kw["experts_implementation"] = experts_implementation
    check_weights(p)
    check_host_memory(p, dtype, device, config)
    from safetensors import SafetensorError

    try:
        with quiet_loading():
            model: Any = AutoModelForCausalLM.from_pretrained(p, **kw)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ArtifactError(f"cannot load the weights in {p}: {_first_line(e)}; re-save or re-download the checkpoint") from e
    model = place_model(model, device, experts_device).eval()
    tok = AutoTokenizer.from_pretrained(p) if tokenizer and _has_tokenizer(p) else None
    get_adapter(model)  # fail early on a checkpoint without MoE layers
    return model, tok


def place_model(model: Any, device: str, experts_device: str | None = None) -> Any:
    """`model.to(device)`, except, with an `experts_device` other than `device`, each MoE layer's stacked
    routed-expert tensors (`Adapter.per_expert_params`: `gate_up_proj`, `down_proj`, ...), which go to
    `experts_device` without ever being on `device` (`_experts_aside`). Shared experts, routers, attention and
    embeddings go to `device`. Returns the model."""
    if experts_device is None or torch.device(experts_device) == torch.device(device):
        return model.to(device)
    return _experts_aside(model, lambda m: m.to(device), lambda t: t.to(experts_device))


def _experts_aside(model: Any, apply: Any, put_back: Any) -> Any:
    """`apply(model)` with each MoE layer's stacked routed-expert tensors set aside (swapped for empty tensors, so
    `apply` neither moves nor casts them), then `put_back(tensor)` of each as its parameter again. Returns the model."""
    from .moe import get_adapter

    adapter = get_adapter(model)
    held: dict[tuple[int, str], torch.Tensor] = {}  # (layer, parameter name) -> its stacked tensor [E, ...]
    for layer in adapter.spec.moe_layers:
        for name, prm in adapter.per_expert_params(layer).items():
            held[layer, name] = prm.data
            prm.data = torch.empty(0, dtype=prm.dtype, device=prm.device)
    apply(model)
    for (layer, name), data in held.items():  # a new Parameter: `.data` cannot change a tensor's type or dtype
        module = adapter.experts(layer)
        setattr(module, name, torch.nn.Parameter(put_back(data), requires_grad=getattr(module, name).requires_grad))
    return model


def load_routing_model(path: str | os.PathLike) -> Any:
    """The model for the stages that route but never run the experts at scale (`train`, `eval`, `simulate`, `tune`):
    on the CPU in float32, as `load_model` gives it there, except the routed experts' stacked weights, which keep the
    checkpoint's dtype (`float_except_experts`): a bf16 checkpoint takes its own size in memory instead of twice it
    (more while converting). Routers, norms and embeddings, hence the fingerprint and every router output, are those
    of a float32 load. No tokenizer."""
    model, _ = load_model(path, dtype="checkpoint", device="cpu", tokenizer=False)
    return float_except_experts(model)


HALF_DTYPES = (torch.float16, torch.bfloat16)  # the float dtypes `float_except_experts` widens (not fp8 and its scales)


def float_except_experts(model: Any) -> Any:
    """`model`'s float16 and bfloat16 tensors in float32 except each MoE layer's stacked routed-expert tensors
    (`Adapter.per_expert_params`), which keep their dtype (`_experts_aside`). Other dtypes (a quantized checkpoint's
    fp8 weights and their scales) stay as they are. Returns the model."""
    return _experts_aside(model, lambda m: m._apply(_widen), lambda t: t)


def _widen(t: torch.Tensor) -> torch.Tensor:
    """`Module.float`'s cast for float16 and bfloat16 tensors only."""
    return t.float() if t.dtype in HALF_DTYPES else t


def weights_bytes(folder: str | os.PathLike) -> int | None:
    """Bytes of the checkpoint's weight files (those `model.safetensors.index.json` lists, else every safetensors
    file, else pytorch_model*.bin): what loading it whole takes in its own dtype. None where that is unknown: no
    readable weights, or a quantized checkpoint (`quantization_config`: larger once loaded than on disk)."""
    p = Path(folder)
    try:
        if "quantization_config" in json.loads((p / "config.json").read_text()):
            return None
        files = _safetensors_files(p) or list(p.glob("pytorch_model*.bin"))
        return sum(f.stat().st_size for f in files) or None
    except (OSError, ValueError, TypeError, ArtifactError):
        return None


def loaded_bytes(folder: str | os.PathLike, dtype: str, device: str, config: Any = None) -> int | None:
    """Bytes the checkpoint's weights take once loaded in `dtype` (`resolve_dtype`'s names) on `device`:
    `weights_bytes` scaled by the target dtype's size over the saved one's; None where unknown. `config`: the
    checkpoint's config where already read."""
    return _in_dtype(weights_bytes(folder), dtype, device, saved_dtype(folder, config))


def _in_dtype(weights: int | None, dtype: str, device: str, saved: torch.dtype | None) -> int | None:
    """`weights` bytes saved in `saved` once loaded in `dtype` on `device` (unchanged where either dtype is unknown)."""
    target = resolve_dtype(dtype, device)
    if weights is not None and isinstance(target, torch.dtype) and saved is not None:  # loaded in another dtype
        return weights * target.itemsize // saved.itemsize
    return weights


def saved_dtype(folder: str | os.PathLike, config: Any = None) -> torch.dtype | None:
    """The dtype its config.json says the checkpoint was saved in (`config`: that config where already read), or
    None (no dtype, an unreadable config: `load_model` says what is wrong with it, in one line)."""
    if config is None:
        try:
            config = read_config(folder)
        except ArtifactError:
            return None
    saved = getattr(config, "dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    return saved if isinstance(saved, torch.dtype) else None


def host_available(swap: bool = True) -> int | None:
    """Bytes the host can still give a process: MemAvailable plus (`swap`) SwapFree (/proc/meminfo); None where
    unknown."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemAvailable", "SwapFree")[: 2 if swap else 1])
    except (OSError, KeyError, ValueError, IndexError):
        return None


def check_host_memory(folder: str | os.PathLike, dtype: str, device: str, config: Any = None) -> None:
    """Refuses, in one line and before any byte loads, a load whose weights alone exceed what the host has
    (`host_available`): transformers reads every weight into host memory in the dtype it loads in, also for a CUDA
    `device` (the model moves there after), and the kernel would kill the process part way, with no message. Only a
    certain failure is refused: the load needs more (its conversion, activations). `config`: as `loaded_bytes`."""
    own, saved = weights_bytes(folder), saved_dtype(folder, config)
    need, avail = _in_dtype(own, dtype, device, saved), host_available()
    if own is None or need is None or avail is None or need <= avail:
        return
    target = resolve_dtype(dtype, device)
    name = "its own dtype" if target == "auto" else str(target).removeprefix("torch.")
    hint = ""
    if saved is not None and own < need:  # the checkpoint is narrower than the dtype it loads in
        hint = f", or load it in its own dtype, {str(saved).removeprefix('torch.')} ({own / 1e9:.3g} GB: `--dtype checkpoint`)"
    raise ConfigError(
        f"{folder} takes {need / 1e9:.3g} GB once loaded in {name}, and this host has {avail / 1e9:.3g} GB available "
        f"(memory and swap); free memory or use a larger host{hint}"
    )


def read_config(folder: str | os.PathLike) -> Any:
    """`AutoConfig.from_pretrained(folder)`, or one ArtifactError line with transformers' own reason (`load_model`,
    `moeflow ep`'s spec)."""
    from transformers import AutoConfig

    p = Path(folder)
    try:
        return AutoConfig.from_pretrained(p)
    except _config_errors() as e:
        raise ArtifactError(
            f"transformers could not read {p / 'config.json'}: {_first_line(e)}; fix or re-save the checkpoint"
        ) from e


def _config_errors() -> tuple[type[Exception], ...]:
    """What `AutoConfig.from_pretrained` raises for a config.json it cannot read: ValueError, OSError, TypeError,
    KeyError, and huggingface_hub's strict dataclass validation (a transformers config class's
    `validate_architecture`, a field of the wrong type)."""
    errors: tuple[type[Exception], ...] = (ValueError, OSError, TypeError, KeyError)
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: its configs raise the others
        return errors
    return (*errors, StrictDataclassError)


def _first_line(e: BaseException) -> str:
    """The error's first meaningful line, at most 200 characters (`errors.brief`), without a trailing period. A
    first line that only introduces its cause (ends in ":", the error raised from another) gives way to the
    cause's: huggingface_hub's "Class validation error for validator 'validate_architecture':" is followed by
    the config's own "The hidden size (8) is not a multiple of the number of attention heads (32)"."""
    text = brief(str(e))
    if text.endswith(":") and e.__cause__ is not None:
        return _first_line(e.__cause__)
    return (text[:-1] if text.endswith(".") and not text.endswith("...") else text) or type(e).__name__


def _safetensors_files(p: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its `model.safetensors.index.json` lists (present or not), else
    every one in the folder. A corrupt index is one ArtifactError line."""
    index = p / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(p.glob("*.safetensors"))
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ArtifactError(f"{index} is corrupt ({_first_line(e)}); re-save or re-download the checkpoint") from e
    return [p / n for n in names]


def check_weights(folder: str | os.PathLike) -> None:
    """Refuse, with one ArtifactError line naming the file, a checkpoint whose safetensors files are
    missing (also those its `model.safetensors.index.json` lists), truncated or have a corrupt header."""
    p = Path(folder)
    files = _safetensors_files(p)
    if not files and not any(p.glob("pytorch_model*.bin")):
        raise ArtifactError(f"{p} has no weights (model.safetensors); pass --model a folder written by save_pretrained")
    for f in files:
        _check_safetensors(f)


def _check_safetensors(f: Path) -> None:
    """One safetensors file: 8-byte header length, a JSON header, and tensor data that ends exactly at the file end."""
    fix = "re-save or re-download the checkpoint"
    if not f.is_file():
        raise ArtifactError(f"weights file {f} is missing; {fix}")
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise ArtifactError(f"weights file {f} is truncated ({size} bytes); {fix}")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ArtifactError(f"weights file {f} is corrupt (bad safetensors header: {_first_line(e)}); {fix}") from e
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "corrupt"
        raise ArtifactError(f"weights file {f} is {what} ({size} bytes, its header describes {8 + n + end}); {fix}")


def max_positions(model_or_config: Any) -> int | None:
    """The model's maximum sequence length (`max_position_embeddings`), or None if its config has none."""
    cfg = getattr(model_or_config, "config", model_or_config)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def check_lengths(model_or_config: Any, prompt_tokens: int, new_tokens: int, *, what: str = "a prompt") -> None:
    """Raise ConfigError (one line naming the limit) if `prompt_tokens` + `new_tokens` positions do not fit
    the model's maximum position (`max_position_embeddings`); nothing is ever truncated to make it fit."""
    limit = max_positions(model_or_config)
    if limit is None or prompt_tokens + new_tokens <= limit:
        return
    if new_tokens <= 0:
        raise ConfigError(
            f"--max-prompt-tokens {prompt_tokens} is beyond the model's maximum position "
            f"{limit} (max_position_embeddings); pass at most {limit}"
        )
    if new_tokens >= limit:  # no prompt length makes room: only --max-new-tokens can change
        fix = f"pass --max-new-tokens {max(limit - prompt_tokens, 1)} or less"
    else:
        fix = f"lower --max-new-tokens to {max(limit - prompt_tokens, 1)} or --max-prompt-tokens to {limit - new_tokens}"
    raise ConfigError(
        f"{what} of {prompt_tokens} tokens + {new_tokens} new tokens = {prompt_tokens + new_tokens} "
        f"positions, beyond the model's maximum of {limit} (max_position_embeddings); {fix}"
    )


def _has_tokenizer(p: Path) -> bool:
    return any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


# ---- tiny random models for tests and examples ---------------------------------------------------
# Real transformers config classes, all sizes multiples of 8 (CPU grouped_mm needs 16-byte strides).

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


_DEEPSEEK_V3_LIKE = ("glm4_moe", "glm4_moe_lite", "dots1", "exaone_moe", "solar_open")
_MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)


def _moe(top_k: int, **names: Any) -> dict[str, Any]:
    """A routed-expert block of intermediate size 32 beside a dense MLP of 64, with the family's own names."""
    return dict(num_experts_per_tok=top_k, moe_intermediate_size=32, intermediate_size=64, **names)


def tiny_config(arch: str, *, num_experts: int = 8, top_k: int = 2, **over: Any):
    """A small but real config of architecture `arch` (transformers `model_type`)."""
    from transformers import AutoConfig

    c: dict[str, Any] = dict(_COMMON)
    if arch == "olmoe":
        c.update(num_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=32, norm_topk_prob=False)
    elif arch == "mixtral":
        c.update(num_local_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=32, head_dim=16)
    elif arch == "qwen2_moe":
        c.update(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=32,
            intermediate_size=64,
            shared_expert_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            norm_topk_prob=False,
        )
    elif arch == "qwen3_moe":
        c.update(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=32,
            intermediate_size=64,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            head_dim=16,
        )
    elif arch == "deepseek_v3":
        c.update(
            n_routed_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=32,
            intermediate_size=64,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_scaling=None,
        )
    elif arch == "gpt_oss":
        c.update(
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
            intermediate_size=32,
            head_dim=16,
            sliding_window=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    elif arch == "granitemoe":
        c.update(num_local_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=32)
    elif arch == "phimoe":
        c.update(num_local_experts=num_experts, num_experts_per_tok=2, intermediate_size=32)
    elif arch in _DEEPSEEK_V3_LIKE:  # DeepSeek-V3's router and a shared expert; the first layer dense where the family
        # has one (first_k_dense_replace: glm4_moe, dots1; mlp_layer_types: exaone_moe, glm4_moe_lite); solar_open: all MoE
        c.update(n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1)
        if arch == "exaone_moe":
            c.update(_moe(top_k, num_experts=num_experts, num_shared_experts=1), head_dim=16, sliding_window=32)
            c.update(layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        else:
            c.update(_moe(top_k, n_routed_experts=num_experts, n_shared_experts=1))
        if arch == "glm4_moe_lite":  # multi-head latent attention, as deepseek_v3 / v2
            c.update(_MLA)
        elif arch != "exaone_moe":
            c.update(head_dim=16)
        if arch in ("glm4_moe_lite", "exaone_moe"):
            c.update(mlp_layer_types=["dense", "sparse", "sparse"])
        if arch == "dots1":
            c.update(layer_types=["full_attention"] * 3)
    elif arch == "deepseek_v2":  # softmax scores, group-limited greedy top-k
        c.update(_moe(top_k, n_routed_experts=num_experts, n_shared_experts=1, first_k_dense_replace=1))
        c.update(_MLA, n_group=2, topk_group=1, topk_method="group_limited_greedy", routed_scaling_factor=2.5, head_dim=8)
    elif arch == "hunyuan_v1_moe":  # the router's weight in `gate.wg`; a shared MLP beside the experts
        c.update(num_experts=num_experts, moe_topk=top_k, intermediate_size=32, head_dim=16)
    elif arch == "ernie4_5_moe":  # the first layer dense; a correction bias in the router's `moe_statics`
        c.update(moe_num_experts=num_experts, moe_k=top_k, moe_intermediate_size=32, intermediate_size=64, head_dim=16)
        c.update(moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=2, moe_layer_interval=1)
    elif arch in ("qwen3_next", "qwen3_5_moe_text"):  # gated delta-net and full attention layers, gated shared expert
        c.update(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=32)
        c.update(shared_expert_intermediate_size=32, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16)
        c.update(linear_num_key_heads=2, linear_num_value_heads=4)
        c.update(layer_types=["linear_attention", "full_attention", "linear_attention"])
        if arch == "qwen3_next":
            c.update(intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
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
            r: Any = ad.router(l)
            ad.router_weight(l).normal_(0.0, 0.5)
            bias = ad.router_bias(l)
            if bias is not None:
                bias.normal_(0.0, 0.1)
            if hasattr(r, "e_score_correction_bias"):
                r.e_score_correction_bias.normal_(0.0, 0.1)
            if hasattr(r, "moe_statics"):  # ERNIE-4.5 keeps its correction bias there
                r.moe_statics.e_score_correction_bias.normal_(0.0, 0.1)
    return model
