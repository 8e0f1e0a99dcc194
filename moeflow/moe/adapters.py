"""Per-architecture adapters: where the router and the experts live, and the exact scoring rule.

An adapter never copies modeling code. It names attributes of the transformers modules and
reproduces each family's router scoring `select(logits, bias) -> (weights, indices)` so that,
with `bias=None`, the result is bit-identical to the router's own output (tested per family).
A `bias` [E] added to the selection scores is how cache-aware routing steers choices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedModelError
from .spec import MoESpec, dtype_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SelectFn = Callable[[Any, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


# ---- scoring rules ------------------------------------------------------------------------------
# Each takes (router module, logits [T,E], bias [E] | None) and returns (weights [T,k], indices [T,k]).


def _softmax_topk(
    router: Any, logits: torch.Tensor, bias: torch.Tensor | None, *, always_norm: bool, cast: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """OLMoE / Qwen2-MoE / Qwen3-MoE (norm if `norm_topk_prob`, cast to logits dtype) and Mixtral."""
    probs = F.softmax(logits.float(), dim=-1)  # [T,E] fp32
    if bias is None:
        top, idx = torch.topk(probs, router.top_k, dim=-1)  # [T,k]
    else:
        _, idx = torch.topk(probs + bias.to(probs), router.top_k, dim=-1)
        top = probs.gather(-1, idx)
    if always_norm or getattr(router, "norm_topk_prob", False):
        top = top / top.sum(dim=-1, keepdim=True)
    return (top.to(logits.dtype) if cast else top), idx


def select_olmoe(router, logits, bias=None):
    return _softmax_topk(router, logits, bias, always_norm=False, cast=True)


def select_mixtral(router, logits, bias=None):
    return _softmax_topk(router, logits, bias, always_norm=True, cast=False)


def select_topk_then_softmax(router, logits, bias=None):
    """GPT-OSS (softmax in logits dtype) and GraniteMoE (logits already fp32, cast to input dtype)."""
    if bias is None:
        top, idx = torch.topk(logits, router.top_k, dim=-1)
    else:
        _, idx = torch.topk(logits + bias.to(logits), router.top_k, dim=-1)
        top = logits.gather(-1, idx)
    return F.softmax(top, dim=-1, dtype=top.dtype), idx


def select_granitemoe(router, logits, bias=None):
    w, idx = select_topk_then_softmax(router, logits.float(), bias)
    return w.type_as(router.weight), idx


def select_deepseek_v3(router, logits, bias=None):
    """Sigmoid scores + e_score_correction_bias, group-limited top-k, norm, routed scaling."""
    scores = logits.float().sigmoid()  # [T,E]
    choice = scores + router.e_score_correction_bias
    if bias is not None:
        choice = choice + bias.to(choice)
    E, G = router.num_experts, router.num_group
    group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [T,G]
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    idx = torch.topk(choice, k=router.top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor, idx


def select_qwen3_5(router, logits, bias=None):
    """Qwen3.5-MoE: the OLMoE rule with the top-k weights always renormalised (cast to the logits' dtype)."""
    return _softmax_topk(router, logits, bias, always_norm=True, cast=True)


def select_ernie4_5(router, logits, bias=None):
    """ERNIE-4.5-MoE: fp32 softmax; top-k of the probabilities plus the correction bias (`moe_statics`); the chosen
    probabilities renormalised (the sum clamped at `norm_min`). The router then casts them to its input's dtype:
    `ArchInfo.weights_in_input_dtype` (`Adapter.select`)."""
    probs = F.softmax(logits.float(), dim=1, dtype=torch.float)  # [T,E]
    choice = probs + router.moe_statics.e_score_correction_bias.squeeze()
    if bias is not None:
        choice = choice + bias.to(choice)
    idx = torch.topk(choice, router.top_k, dim=-1)[1]  # [T,k]
    w = torch.gather(probs, dim=-1, index=idx)
    return w / torch.clamp(w.sum(dim=-1, keepdim=True), min=router.norm_min), idx


DEEPSEEK_V2_METHODS = ("greedy", "group_limited_greedy")  # the `topk_method`s `select_deepseek_v2` reproduces


def select_deepseek_v2(router, logits, bias=None):
    """DeepSeek-V2: fp32 softmax scores, top-k over all experts (`greedy`) or over the `topk_group` groups of best
    single score (`group_limited_greedy`, the other groups' scores zeroed), no norm, routed scaling."""
    scores = logits.float().softmax(dim=-1, dtype=torch.float32)  # [T,E]
    choice = scores if bias is None else scores + bias.to(scores)
    if router.topk_method == "group_limited_greedy":
        E, G = router.num_experts, router.num_group
        group_scores = choice.view(-1, G, E // G).max(dim=-1).values  # [T,G]
        group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
        choice = choice.masked_fill(~score_mask.bool(), 0.0 if bias is None else float("-inf"))
    if bias is None:  # `greedy` or the group-limited scores (any other method is refused by `Adapter`)
        w, idx = torch.topk(scores, k=router.top_k, dim=-1, sorted=False)
    else:
        idx = torch.topk(choice, k=router.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
    return w * router.routed_scaling_factor, idx


def select_phimoe(router, logits, bias=None):
    """PhiMoE's sparsemixer (eval mode), called from transformers itself."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    if bias is not None:
        raise UnsupportedModelError("PhiMoE's sparsemixer has no additive selection bias; use --routing standard")
    return sparsemixer(logits, jitter_eps=router.router_jitter_noise, training=False, top_k=router.top_k)


# ---- adapters -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchInfo:
    model_type: str
    block_attr: str  # the MoE block on a decoder layer
    router_attr: str  # the router on the MoE block
    select: SelectFn
    shared_attr: str | None  # shared expert(s) module on the block, if any
    linear_logits: bool = False  # the router's logits are `F.linear(x [T,H], its weight)` (no bias, no cast)
    weights_in_input_dtype: bool = False  # the router casts its weights to its input's dtype (the hidden states')
    router_weight: str = "weight"  # the router's [E,H] weight, as an attribute path from the router


ARCHS: dict[str, ArchInfo] = {
    a.model_type: a
    for a in [
        ArchInfo("olmoe", "mlp", "gate", select_olmoe, None, linear_logits=True),
        ArchInfo("mixtral", "mlp", "gate", select_mixtral, None, linear_logits=True),
        ArchInfo("qwen2_moe", "mlp", "gate", select_olmoe, "shared_expert", linear_logits=True),
        ArchInfo("qwen3_moe", "mlp", "gate", select_olmoe, None, linear_logits=True),
        ArchInfo("deepseek_v3", "mlp", "gate", select_deepseek_v3, "shared_experts"),
        ArchInfo("gpt_oss", "mlp", "router", select_topk_then_softmax, None),
        ArchInfo("granitemoe", "block_sparse_moe", "router", select_granitemoe, None),
        ArchInfo("phimoe", "mlp", "router", select_phimoe, None),
        # the same rules in other families (each tested like the ones above: tests/conftest.py ARCHS)
        ArchInfo("deepseek_v2", "mlp", "gate", select_deepseek_v2, "shared_experts"),
        ArchInfo("glm4_moe", "mlp", "gate", select_deepseek_v3, "shared_experts"),
        ArchInfo("glm4_moe_lite", "mlp", "gate", select_deepseek_v3, "shared_experts"),
        ArchInfo("dots1", "mlp", "gate", select_deepseek_v3, "shared_experts"),
        ArchInfo("exaone_moe", "mlp", "gate", select_deepseek_v3, "shared_experts"),
        ArchInfo("solar_open", "mlp", "gate", select_deepseek_v3, "shared_experts"),
        ArchInfo("qwen3_next", "mlp", "gate", select_olmoe, "shared_expert", linear_logits=True),
        # Qwen3.5-MoE's text model (a `qwen3_5_moe` checkpoint loads as it: `moe_model_type`)
        ArchInfo("qwen3_5_moe_text", "mlp", "gate", select_qwen3_5, "shared_expert", linear_logits=True),
        ArchInfo("ernie4_5_moe", "mlp", "gate", select_ernie4_5, "shared_experts", weights_in_input_dtype=True),
        ArchInfo("hunyuan_v1_moe", "mlp", "gate", select_qwen3_5, "shared_mlp", router_weight="wg.weight"),
    ]
}

SUPPORTED = tuple(sorted(ARCHS))


def moe_model_type(config: Any) -> str:
    """The `model_type` moeflow adapts for a checkpoint's config: its own, or, for a multimodal checkpoint whose
    text model is a supported family (Qwen3.5-MoE: `qwen3_5_moe` holds a `qwen3_5_moe_text`), the text model's,
    which is what `AutoModelForCausalLM` loads from it."""
    mt = getattr(config, "model_type", None)
    if mt in ARCHS:
        return str(mt)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    tmt = getattr(text, "model_type", None)
    return str(tmt) if tmt in ARCHS else str(mt)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no .model.layers; supported: {', '.join(SUPPORTED)}")
    return layers


class Adapter:
    """Finds the MoE parts of one loaded model and scores routing exactly as it does."""

    def __init__(self, model: nn.Module):
        mt = getattr(model.config, "model_type", None)
        if mt not in ARCHS:
            raise UnsupportedModelError(f"model type {mt!r} is not supported; supported architectures: {', '.join(SUPPORTED)}")
        self.info = ARCHS[mt]
        self._weight_path = tuple(self.info.router_weight.split("."))  # split once: `router_logits` is on a hot path
        self.model = model
        self.layers = _decoder_layers(model)
        self.moe_layers = tuple(i for i, layer in enumerate(self.layers) if self._is_moe(layer))
        if not self.moe_layers:
            raise UnsupportedModelError(f"{mt} model has no MoE layers (num_experts=0?)")
        ks = sorted({int(cast(int, self.router(l).top_k)) for l in self.moe_layers})
        if len(ks) > 1:  # MoESpec has one top-k (capacity checks, prefetch sets, the trace's columns)
            raise UnsupportedModelError(
                f"{mt} model routes a different top-k per layer ({', '.join(map(str, ks))}); moeflow needs one"
            )
        method = getattr(self.router(self.moe_layers[0]), "topk_method", None)
        if self.info.select is select_deepseek_v2 and method not in DEEPSEEK_V2_METHODS:
            raise UnsupportedModelError(f"DeepSeek-V2 topk_method {method!r} is not supported ({', '.join(DEEPSEEK_V2_METHODS)})")
        self.spec = self._read_spec()

    def _is_moe(self, layer: nn.Module) -> bool:
        block = getattr(layer, self.info.block_attr, None)
        return block is not None and hasattr(block, "experts") and hasattr(block, self.info.router_attr)

    # -- where things live --
    def moe_block(self, layer: int) -> nn.Module:
        return getattr(self.layers[layer], self.info.block_attr)

    def router(self, layer: int) -> nn.Module:
        return getattr(self.moe_block(layer), self.info.router_attr)

    def _weight_holder(self, layer: int) -> Any:
        """The module that holds the router's weight (the router itself, or e.g. HunYuan's `gate.wg`)."""
        obj: Any = self.router(layer)
        for name in self._weight_path[:-1]:
            obj = getattr(obj, name)
        return obj

    def router_weight(self, layer: int) -> torch.Tensor:
        """The router's weight [E,H] (where the family keeps it: `ArchInfo.router_weight`)."""
        return cast(torch.Tensor, getattr(self._weight_holder(layer), self._weight_path[-1]))

    def router_bias(self, layer: int) -> torch.Tensor | None:
        """The bias beside the router's weight (`router_weight`'s module's `bias`), or None."""
        bias = getattr(self._weight_holder(layer), "bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    def experts(self, layer: int) -> nn.Module:
        return cast(nn.Module, self.moe_block(layer).experts)

    @staticmethod
    def _num_experts(ex: nn.Module) -> int:
        return int(cast(int, ex.num_experts))

    # -- scoring --
    def select(self, layer: int, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T,k], indices [T,k]) from router logits [T,E], exactly as layer `layer` routes."""
        w, idx = self.info.select(self.router(layer), logits, bias)
        return (w.to(self.input_dtype) if self.info.weights_in_input_dtype else w), idx

    def router_logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Router logits [T,E] of layer `layer` for router inputs x [T,H] (or [B,S,H]). A linear router's
        (`ArchInfo.linear_logits`): its own product computed alone, bit-identical, without its module call (its
        forward hooks, e.g. the engine's router hook, do not fire) nor its softmax and top-k, which a caller that
        wants logits discards (the staged prefill's pre-gate: half the host time of the router's forward)."""
        router = self.router(layer)
        if self.info.linear_logits:
            w = self.router_weight(layer)  # [E,H]
            return F.linear(x.reshape(-1, w.shape[-1]), w)  # [T,E]
        return router(x)[0]

    # -- spec --
    def _read_spec(self) -> MoESpec:
        cfg = cast("PretrainedConfig", self.model.config)
        first = self.moe_layers[0]
        ex = self.experts(first)
        E = self._num_experts(ex)
        per_expert = [p for _, p in ex.named_parameters(recurse=False) if p.shape[:1] == (E,)]
        if not per_expert:
            raise UnsupportedModelError(
                f"layer {first}'s experts hold no stacked [E, ...] weights (offloaded by a moeflow engine?); "
                f"build the adapter before attaching the engine, or close the engine first"
            )
        emb = getattr(self.model, "get_input_embeddings", lambda: None)()
        weight = getattr(emb, "weight", None)
        # the hidden states' dtype, hence the router's input's (`weights_in_input_dtype`): the embeddings', which is
        # not the experts' where those keep a narrower one (`models.float_except_experts`)
        self.input_dtype = weight.dtype if isinstance(weight, torch.Tensor) else per_expert[0].dtype
        params = sum(p[0].numel() for p in per_expert)
        nbytes = sum(p[0].numel() * p.element_size() for p in per_expert)
        inter = (
            getattr(ex, "intermediate_dim", None)
            or getattr(ex, "intermediate_size", None)
            or getattr(cfg, "moe_intermediate_size", None)
            or cfg.intermediate_size
        )
        block = self.moe_block(first)
        shared = 0
        if self.info.shared_attr and getattr(block, self.info.shared_attr, None) is not None:
            names = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
            shared = int(next((getattr(cfg, n) for n in names if getattr(cfg, n, None)), 1))
        return MoESpec(
            arch=self.info.model_type,
            num_layers=len(self.layers),
            moe_layers=self.moe_layers,
            num_experts=E,
            top_k=int(cast(int, self.router(first).top_k)),
            hidden_size=int(cfg.hidden_size),
            expert_intermediate_size=int(inter),
            expert_bytes=int(nbytes),
            expert_params=int(params),
            num_shared_experts=shared,
            dtype=dtype_name(per_expert[0].dtype),
        )

    def per_expert_params(self, layer: int) -> dict[str, nn.Parameter]:
        """The experts module's stacked per-expert tensors, by attribute name (`gate_up_proj`, ...)."""
        ex = self.experts(layer)
        E = self.spec.num_experts
        return {n: p for n, p in ex.named_parameters(recurse=False) if p.shape[:1] == (E,)}


def get_adapter(model: nn.Module) -> Adapter:
    return Adapter(model)


def spec_from_config(config: Any) -> MoESpec:
    """MoESpec of a config without allocating weights (the model is built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return Adapter(model).spec


def model_fingerprint(model: nn.Module, adapter: Adapter | None = None) -> str:
    """Config plus each MoE layer's routing state: its router weight, then every other tensor of its router module
    (a bias, DeepSeek-V3's `e_score_correction_bias`, ...; parameters and buffers by name), so it differs between
    checkpoints that route differently. A router that holds only its weight hashes as before those were counted.
    `adapter`: one built before an engine offloaded the experts (an adapter cannot be built while they are out)."""
    import hashlib

    from ..artifacts import config_fingerprint

    def values(t: torch.Tensor) -> bytes:
        return t.detach().float().cpu().contiguous().numpy().tobytes()

    ad = adapter if adapter is not None else get_adapter(model)
    h = hashlib.sha256()
    for l in ad.moe_layers:
        w = ad.router_weight(l)
        h.update(values(w))
        router = ad.router(l)
        rest: dict[str, torch.Tensor] = dict(router.named_parameters())
        rest.update(router.named_buffers())
        for name in sorted(rest):
            if rest[name] is not w:
                h.update(name.encode() + values(rest[name]))
    return config_fingerprint(model.config, h.digest())
