"""MoESpec: the shape of a model's Mixture-of-Experts part, read from the model itself."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MoESpec:
    """Which decoder layers are MoE and how big their experts are.

    Layer numbers are decoder-layer indices: a DeepSeek-V3 model with one dense first layer has
    `moe_layers == (1, 2, ...)`.
    """

    arch: str  # transformers `model_type`, e.g. "olmoe"
    num_layers: int  # decoder layers, MoE or dense
    moe_layers: tuple[int, ...]  # decoder-layer indices with routed experts
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts chosen per token
    hidden_size: int
    expert_intermediate_size: int
    expert_bytes: int  # one routed expert, all its parameters, in `dtype`
    expert_params: int  # parameters of one routed expert
    num_shared_experts: int  # always-on experts per MoE layer (0 if none)
    dtype: str  # e.g. "float32", "bfloat16"

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def total_experts(self) -> int:
        return self.num_moe_layers * self.num_experts

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoESpec:
        d = dict(d)
        d["moe_layers"] = tuple(d["moe_layers"])
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
