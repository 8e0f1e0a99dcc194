"""One routed expert as ONE flat row: where each per-expert parameter sits inside it.

For each MoE layer the experts module holds stacked per-expert tensors (`gate_up_proj [E,2I,H]`,
`down_proj [E,H,I]`, GPT-OSS biases `[E,...]`). `ExpertLayout` fixes where each of them lives inside
one flat expert row (offsets padded to 64 bytes, so every parameter view is aligned). The host store
(`moeflow.runtime.store`) keeps `[E, row_numel]` rows in this layout, the device cache `[C, row_numel]`
slots, and the compact low-precision copies (`moeflow.quant`) are laid out from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError

ALIGN_BYTES = 64


@dataclass(frozen=True)
class ParamSlice:
    name: str  # attribute on the experts module, e.g. "gate_up_proj"
    shape: tuple[int, ...]  # one expert's shape, e.g. (2I, H)
    offset: int  # start inside the expert row, in elements
    numel: int


@dataclass(frozen=True)
class ExpertLayout:
    """Where each per-expert parameter sits inside one flat expert row (same for every MoE layer)."""

    params: tuple[ParamSlice, ...]
    row_numel: int  # padded row length, in elements
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.dtype.itemsize  # (no tensor made: read per transfer)

    def views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-parameter views `[N, *shape]` of a `[N, row_numel]` tensor (no copy)."""
        out = {}
        for p in self.params:
            out[p.name] = rows[:, p.offset : p.offset + p.numel].unflatten(1, p.shape)
        return out

    @classmethod
    def of(cls, stacked: dict[str, torch.Tensor]) -> ExpertLayout:
        dtypes = {t.dtype for t in stacked.values()}
        if len(dtypes) != 1:
            raise ConfigError(f"experts mix dtypes {sorted(map(str, dtypes))}; load the model with one --dtype")
        dtype = dtypes.pop()
        esize = torch.empty((), dtype=dtype).element_size()
        step = max(1, ALIGN_BYTES // esize)
        params, off = [], 0
        for name, t in stacked.items():
            shape = tuple(t.shape[1:])
            n = int(t[0].numel())
            params.append(ParamSlice(name, shape, off, n))
            off += -(-n // step) * step
        return cls(tuple(params), off, dtype)
