"""The on-disk layout of a trace folder, shared by the writer and the reader.

```
<out>/meta.json                 kind "trace", schema, model fingerprint, MoESpec, prompt_ids, shards [...]
<out>/shard-00000/data.arrow    Arrow IPC stream (the format of `datasets` cache files:
<out>/shard-00001/data.arrow    `datasets.Dataset.from_file(path)` reads it), one row per routed token
```
Each shard's Arrow schema metadata holds `moeflow.prompt_ids`: the JSON list of the prompt ids
(content hashes) whose rows it holds, so the reader can check that meta.json and the shards agree.

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

import hashlib
import os
from pathlib import Path

KIND = "trace"
SCHEMA = 1
DATA_FILE = "data.arrow"
TOKEN_FIELDS = ("prompt_id", "position", "phase", "token_id")
LAYER_FIELDS = ("topk_ids", "topk_weights", "probs")
HIDDEN_FIELDS = ("hidden_in", "resid")
PROMPTS_KEY = b"moeflow.prompt_ids"  # shard schema metadata: JSON list of the shard's prompt ids

# Shards up to FULL_HASH_MAX bytes are verified by the sha256 of the whole file; larger ones by
# `ends_sha256` (sha256 of the first and last ENDS_BYTES and the size), stored as `sha256_ends`:
# reading a trace then costs at most 8 MiB of hashing per large shard, but a changed byte in the
# middle of a large shard is only caught if it breaks the Arrow structure.
FULL_HASH_MAX = 64 << 20
ENDS_BYTES = 4 << 20


def column(field: str, layer: int) -> str:
    return f"{field}_{layer}"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def ids_dtype(num_experts: int) -> str:
    return "int16" if num_experts <= 32767 else "int32"


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a whole file, streamed in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ends_sha256(path: str | os.PathLike) -> str:
    """sha256 of (size, first ENDS_BYTES, last ENDS_BYTES) of a file: the cheap check of large shards."""
    size = Path(path).stat().st_size
    h = hashlib.sha256(str(size).encode() + b"\n")
    with open(path, "rb") as f:
        h.update(f.read(ENDS_BYTES))
        f.seek(max(0, size - ENDS_BYTES))
        h.update(f.read(ENDS_BYTES))
    return h.hexdigest()
