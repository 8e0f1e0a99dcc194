"""HQQ-quantized compact expert rows: layout, quantization of a layer's rows, dequantization on the device."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..moe.layout import ExpertLayout

BITS = (8, 4, 2)  # the low precisions the store can hold
FULL = 0  # "bits" of a full-precision (model dtype) copy
GROUP_SIZES = (64, 32, 16, 8)  # the largest that divides a parameter (for every packing) is used
META_DTYPE = torch.float16  # scales and zeros, as HQQ stores them by default
ALIGN = 64


def _quantizer():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from hqq.core.quantize import Quantizer
    return Quantizer


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class CompactParam:
    name: str
    shape: tuple[int, ...]
    group_size: int  # 0: stored raw, in the model dtype (biases, shapes no group divides)
    codes: int  # byte offset of the packed codes (or of the raw values)
    codes_bytes: int
    scale: int  # byte offset of the [groups] float16 scales
    zero: int  # byte offset of the [groups] float16 zeros

    @property
    def groups(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n // self.group_size if self.group_size else 0


@dataclass(frozen=True)
class CompactLayout:
    """Where one expert's packed codes, scales and zeros sit inside one flat uint8 row, at `bits` bits."""

    bits: int
    params: tuple[CompactParam, ...]
    row_bytes: int
    dtype: torch.dtype  # the model dtype (raw parameters, dequantized values)

    @classmethod
    def of(cls, layout: ExpertLayout, bits: int) -> CompactLayout:
        if bits not in BITS:
            raise ConfigError(f"precision int{bits} is not stored; choose among {', '.join(f'int{b}' for b in BITS)}")
        esize = torch.empty((), dtype=layout.dtype).element_size()
        params, off = [], 0
        for p in layout.params:
            gs = next((g for g in GROUP_SIZES if len(p.shape) >= 2 and p.numel % (g * 4) == 0), 0)
            if gs:  # codes, then scales, then zeros
                nb = p.numel * bits // 8
                codes, scale = off, _align(off + nb)
                zero = _align(scale + (p.numel // gs) * 2)
                off = _align(zero + (p.numel // gs) * 2)
            else:
                nb = p.numel * esize
                codes = scale = zero = off
                off = _align(off + nb)
            params.append(CompactParam(p.name, p.shape, gs, codes, nb, scale, zero))
        return cls(bits, tuple(params), off, layout.dtype)


def compact_bytes_estimate(expert_bytes: int, bits: int, weight_bits: int = 16) -> int:
    """Bytes of a compact copy when only a full row's bytes are known (the simulator): codes + float16
    scale and zero per 64 weights, for `weight_bits`-bit weights (16: bf16/fp16 checkpoints)."""
    if bits == FULL:
        return expert_bytes
    return max(1, int(expert_bytes * (bits + 32 / 64) / weight_bits))


@torch.no_grad()
def quantize_rows(layout: ExpertLayout, rows: torch.Tensor, bits: int, *, optimize: bool = True) -> torch.Tensor:
    """`[E, row_numel]` full-precision expert rows -> `[E, compact.row_bytes]` uint8 compact rows (on the host).

    Each parameter of all E experts is quantized in ONE HQQ call (groups never span experts: a group
    size divides one expert's parameter), then each expert's codes are packed by HQQ's bit packing."""
    Q = _quantizer()
    compact = CompactLayout.of(layout, bits)
    E = rows.shape[0]
    out = torch.zeros(E, compact.row_bytes, dtype=torch.uint8)
    views = layout.views(rows)
    for cp in compact.params:
        w = views[cp.name].reshape(E, -1)  # [E, n]
        if not cp.group_size:
            out[:, cp.codes : cp.codes + cp.codes_bytes] = w.contiguous().view(torch.uint8)
            continue
        W_q, meta = Q.quantize(
            w.float(), nbits=bits, group_size=cp.group_size, axis=1, optimize=optimize, bitpack=False, device="cpu"
        )  # W_q [E*g, gs] codes as floats; scale, zero [E*g, 1]
        g = cp.groups
        packing = Q.bit_to_packing[bits]
        codes = W_q.reshape(E, g, cp.group_size)
        scale = meta["scale"].reshape(E, g).to(META_DTYPE)
        zero = meta["zero"].reshape(E, g).to(META_DTYPE)
        for e in range(E):
            packed = Q.pack[packing](codes[e])  # [g*bits/8, gs] uint8
            out[e, cp.codes : cp.codes + cp.codes_bytes] = packed.reshape(-1)
        out[:, cp.scale : cp.scale + 2 * g] = scale.view(torch.uint8)
        out[:, cp.zero : cp.zero + 2 * g] = zero.view(torch.uint8)
    return out


@torch.no_grad()
def dequantize_row(compact: CompactLayout, src: torch.Tensor, layout: ExpertLayout, dst: torch.Tensor) -> None:
    """Write the full-precision expert of compact row `src` `[compact.row_bytes]` uint8 into `dst` `[row_numel]`
    (model dtype, same device). `src` may alias `dst`'s memory: every parameter is dequantized before any is written."""
    Q = _quantizer()
    packing = Q.bit_to_packing[compact.bits]
    vals = {}
    for cp in compact.params:
        raw = src[cp.codes : cp.codes + cp.codes_bytes]
        if not cp.group_size:
            vals[cp.name] = raw.view(compact.dtype).clone()
            continue
        g = cp.groups
        meta = {
            "nbits": compact.bits,
            "group_size": cp.group_size,
            "shape": torch.Size(cp.shape),
            "scale": src[cp.scale : cp.scale + 2 * g].view(META_DTYPE).view(g, 1).to(compact.dtype),
            "zero": src[cp.zero : cp.zero + 2 * g].view(META_DTYPE).view(g, 1).to(compact.dtype),
            "axis": 1,
            "packing": packing,
            "view_as_float": False,
            "unpack_view_dtype": torch.uint8,
            "compute_dtype": compact.dtype,
        }
        vals[cp.name] = Q.dequantize(raw.view(g * compact.bits // 8, cp.group_size), meta)  # [*shape]
    views = layout.views(dst.unsqueeze(0))
    for name, v in vals.items():
        views[name][0].copy_(v.reshape(views[name].shape[1:]))
