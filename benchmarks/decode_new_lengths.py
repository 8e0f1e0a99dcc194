"""Decode at sequence lengths not seen before: the stock `generate` (cuDNN attention allowed) vs moeflow's
`generate_batch` (`moeflow.models.no_cudnn_attention`), side by side in one process.

cuDNN's attention builds an execution plan on the host for every sequence length it has not seen; a generation
decodes through lengths it has not seen, so on a GPU where SDPA picks cuDNN every first decode at a new length
pays it. For each prompt length L of `--lengths` the stock model decodes `--new-tokens` tokens from the first L
tokens of a real prompt (lengths L .. L+N, new to the process), then moeflow's `generate_batch` from the first
L + `--offset` tokens (new lengths again); then both repeat at the same lengths (seen: no plan to build). Rows:
TPOT (mean decode pass, each pass synchronized) of each (with the defaults, moeflow's last lengths are the
next row's stock first four). `new ratio` = stock ÷ moeflow at new lengths (the
planning cost, where there is one), `seen ratio` the same at lengths seen before (≈ 1: the backends cost alike).
On the CPU there is no cuDNN: both ratios are ≈ 1. `--profile` adds, to stderr, torch.profiler's top host-time
ops of one stock decode at new lengths (`aten::_cudnn_attention_forward` where cuDNN plans).

    python benchmarks/decode_new_lengths.py --shape olmoe-1b-7b-shape --device cuda     # built in memory, bf16
    python benchmarks/decode_new_lengths.py --model models/olmoe-mini --threads 1       # CPU: ratios ≈ 1

Measured on an H100 (torch 2.11, 2026-11-27, the OLMoE-1B-7B shape; the same measurement by a scratch script
before this one was written): stock ÷ moeflow 84.4/27.2, 52.3/18.4, 55.4/18.7, 71.1/20.0 ms at lengths 40, 90,
140, 190, median 3.04x; 0.99x at lengths seen before. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder with a tokenizer (default: models/olmoe-mini)")
    ap.add_argument("--shape", default=None, help="instead of --model: a random-weight OLMoE shape (engine_overhead.py's)")
    ap.add_argument("--device", default="cpu", help="torch device: cpu or cuda (default %(default)s)")
    ap.add_argument("--dtype", default="auto", help="auto (default): bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default %(default)s)")
    ap.add_argument("--lengths", default="40,90,140,190", help="prompt lengths, tokens (default %(default)s)")
    ap.add_argument("--offset", type=int, default=30, help="moeflow's prompt is this many tokens longer (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=24, help="tokens decoded per generation (default %(default)s)")
    ap.add_argument("--tokenizer", default="models/olmoe-mini", help="tokenizer folder with --shape (default %(default)s)")
    ap.add_argument("--data-dir", default=None, help="data directory of the ShareGPT prompt (default: $MOEFLOW_DATA)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler's top host-time ops of one stock decode, to stderr")
    a = ap.parse_args()
    if a.shape and a.model:
        ap.error("give --model or --shape, not both")
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths takes prompt lengths in tokens, comma-separated (got {a.lengths!r})")
    if min(lengths) < 4 or a.new_tokens < 2 or a.offset < 0:
        ap.error("--lengths must be >= 4 tokens, --new-tokens >= 2 and --offset >= 0")

    from rich.console import Console

    from moeflow.data.prompts import load_prompts
    from moeflow.runtime.generate import PassClock, generate_batch
    from moeflow.tables import FitTable

    torch.set_num_threads(a.threads)
    if a.shape and a.shape not in shape_names():
        ap.error(f"--shape must be one of {', '.join(shape_names())} (got {a.shape!r})")
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_overhead import model_and_tokenizer  # benchmarks/engine_overhead.py

    model, tok, name = model_and_tokenizer(a.model or "models/olmoe-mini", a.shape, a.tokenizer, a.device, a.dtype)
    vocab = model.config.vocab_size
    text = "\n\n".join(p.text for p in load_prompts("sharegpt", a.data_dir, limit=20))
    need = max(lengths) + a.offset
    base = tok(text, return_tensors="pt").input_ids[:, :need].clamp(max=vocab - 1)  # [1,need]
    if base.shape[1] < need:
        raise SystemExit(f"only {base.shape[1]} tokens of prompt text; lower --lengths or --offset")
    cuda = torch.device(a.device).type == "cuda"

    def stock(ids: torch.Tensor) -> float:  # the stock generate, whatever attention backend PyTorch picks
        ids = ids.to(a.device)
        clock = PassClock(model)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens,
                           min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0,
                           **({"disable_compile": True} if cuda else {}))  # fmt: skip
        clock.remove()
        e = clock.ends
        return (e[-1] - e[0]) / (len(e) - 1)

    def ours(ids: torch.Tensor) -> float:
        _, m = generate_batch(model, [ids], None, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, eos_token_id=None)
        return float(m.tpot_s or 0.0)

    stock(base[:, :8]), ours(base[:, :8])  # untimed warm-up of both paths, at a length no row uses
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=acts) as prof:
            stock(base[:, : lengths[0] - 3])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40), file=sys.stderr)
    rows = []
    for L in lengths:
        new_s, new_o = stock(base[:, :L]), ours(base[:, : L + a.offset])  # lengths neither decoded before
        seen_s, seen_o = stock(base[:, :L]), ours(base[:, : L + a.offset])  # the same lengths again
        rows.append({"length": L, "stock_new_s": new_s, "moeflow_new_s": new_o, "stock_seen_s": seen_s, "moeflow_seen_s": seen_o})
    new_ratio = statistics.median(r["stock_new_s"] / r["moeflow_new_s"] for r in rows)
    seen_ratio = statistics.median(r["stock_seen_s"] / r["moeflow_seen_s"] for r in rows)

    t = FitTable(title=f"decode at new lengths: {name} on {a.device}, {a.new_tokens} tokens (TPOT ms)")
    for col in ("L", "stock new", "moeflow new", "new ratio", "stock seen", "moeflow seen"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["length"]), f"{r['stock_new_s'] * 1e3:.2f}", f"{r['moeflow_new_s'] * 1e3:.2f}",
                  f"{r['stock_new_s'] / r['moeflow_new_s']:.2f}", f"{r['stock_seen_s'] * 1e3:.2f}",
                  f"{r['moeflow_seen_s'] * 1e3:.2f}")  # fmt: skip
    console = Console(stderr=True)
    console.print(t)
    console.print(f"stock ÷ moeflow TPOT, median: {new_ratio:.2f} at new lengths, {seen_ratio:.2f} at lengths seen before")
    print(json.dumps({
        "model": name, "device": a.device, "new_tokens": a.new_tokens, "offset": a.offset,
        "cudnn_sdp_available": bool(cuda and torch.backends.cudnn.is_available()),
        "rows": rows, "new_ratio": round(new_ratio, 4), "seen_ratio": round(seen_ratio, 4),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }))  # fmt: skip


def shape_names() -> tuple[str, ...]:
    """The random-weight shapes `engine_overhead.py` builds."""
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_overhead import SHAPES

    return tuple(SHAPES)


if __name__ == "__main__":
    from moeflow.errors import MoeflowError

    try:
        main()
    except MoeflowError as e:  # a missing model or data directory: moeflow's one line, exit 1
        raise SystemExit(f"decode_new_lengths.py: {e}") from None
