"""The on-disk layout of a trace folder, shared by the writer and the reader.

```
<out>/meta.json                 kind "trace", schema, model fingerprint, MoESpec, prompt_ids, shards [...]
<out>/shard-00000/data.arrow    Arrow IPC stream (the format of `datasets` cache files:
<out>/shard-00001/data.arrow    `datasets.Dataset.from_file(path)` reads it), one row per routed token
```
Columns of a shard (one row per token that went through the routers, in generation order):

| column | type | meaning |
|---|---|---|
| `prompt_id` | int32 | index into `meta["prompt_ids"]` (content hashes) |
| `position` | int32 | position in the sequence (prompt tokens first) |
| `phase` | int8 | 0 prefill, 1 decode |
| `token_id` | int32 | the input token whose hidden state was routed |
| `topk_ids_<l>` | fixed_size_list<int16 or int32>[k] | experts chosen at decoder layer l |
| `topk_weights_<l>` | fixed_size_list<float32>[k] | their routing weights |
| `probs_<l>` | fixed_size_list<float16>[E] | softmax of the router logits |
| `hidden_in_<l>` | fixed_size_list<float16>[H] | router input (with --record-hidden) |
| `resid_<l>` | fixed_size_list<float16>[H] | post-attention residual (with --record-hidden) |

Per-layer columns keep one layer's data contiguous in the file, so `Trace.layer(l)` touches only
that layer's pages of the memory map.
"""

from __future__ import annotations

KIND = "trace"
SCHEMA = 1
DATA_FILE = "data.arrow"
TOKEN_FIELDS = ("prompt_id", "position", "phase", "token_id")
LAYER_FIELDS = ("topk_ids", "topk_weights", "probs")
HIDDEN_FIELDS = ("hidden_in", "resid")


def column(field: str, layer: int) -> str:
    return f"{field}_{layer}"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def ids_dtype(num_experts: int) -> str:
    return "int16" if num_experts <= 32767 else "int32"
