"""Low-precision copies of routed experts (int8 / int4 / int2) for the mixed-precision miss policies.

Made by HQQ (Half-Quadratic Quantization, `hqq.core.quantize.Quantizer`, the library SpecMD used for
int2), not by hand-written packing: HQQ quantizes each expert parameter per group of `group_size`
weights (asymmetric, scale + zero per group, proximal optimisation of the zero), packs the codes
(int8: 1 per byte, int4: 2, int2: 4) and dequantizes with plain torch ops, so the same code runs on
CPU and CUDA.

Why HQQ and not torchao 0.18 (measured on olmoe-mini's 128 experts, group 64, 1 CPU thread, torch
2.13 CPU): relative Frobenius error of W / of the expert's output on the hidden states the router
sent it (256 tokens of text), quantize ms per expert, compact bytes / fp32 row:

| | int8 | int4 | int2 | quantize | bytes int8/int4/int2 |
|---|---|---|---|---|---|
| HQQ (optimize) | .0049 / .0027 | .084 / .047 | .42 / .24 | 3.9 ms | .28 / .16 / .09 |
| HQQ (round only) | .0051 / .0029 | .087 / .049 | .44 / .25 | 0.26 ms | same |
| torchao `IntxWeightOnlyConfig` | .0059 / .0033 | .100 / .056 | .50 / .28 | 0.6 ms | .27 / .27 / .27 |

HQQ is more accurate at every precision, and its codes are packed; torchao's CPU int-x weight-only
tensor keeps every int4/int2 code in a full int8 byte (no transfer saving below int8; its bit
packing is prototype-only in 0.18) and its importable quantize primitives are private
(`_quantize_affine`). torchao also logs failed loads of its CUDA extensions on a CPU torch 2.13.

`CompactLayout` fixes where each parameter's packed codes, scales and zeros (float16, HQQ's
default metadata dtype) sit in ONE flat uint8 row per expert, so a transfer moves one contiguous
buffer; `dequantize_row` turns such a row (already on the device) back into the store's
full-precision row layout.
"""

from .hqq import BITS, FULL, CompactLayout, compact_bytes_estimate, dequantize_row, quantize_rows

__all__ = ["BITS", "FULL", "CompactLayout", "compact_bytes_estimate", "dequantize_row", "quantize_rows"]
