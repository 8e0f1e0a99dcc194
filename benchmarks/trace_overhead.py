"""Tracing overhead: `generate` with router hooks (and record conversion) vs plain `generate`, side by side.

For each prompt the three modes (plain, traced, traced with --record-hidden) run back to back in a
rotating order, so machine load affects all of them alike. Shard writing is timed separately (it is
amortised over a shard) and reported both alone and added to the traced time.

    python benchmarks/trace_overhead.py --model models/olmoe-mini --prompts sharegpt --n 20

Prints a rich table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: models/olmoe-deep, or $MOEFLOW_MODEL)")
    ap.add_argument("--prompts", default="sharegpt", help="prompt file or set name (default sharegpt)")
    ap.add_argument("--n", type=int, default=10, help="prompts (default 10)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="greedy new tokens per prompt (default %(default)s)")
    ap.add_argument(
        "--max-prompt-tokens", type=int, default=128, help="prompt truncated to this many tokens (default %(default)s)"
    )
    ap.add_argument("--reps", type=int, default=1, help="passes over the prompts (default 1)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on shared cores the intra-op pool makes 2-thread timings noise)",
    )
    ap.add_argument(
        "--data-dir", default=None, help="data directory for prompt set names (default: $MOEFLOW_DATA or ../shared/data)"
    )
    a = ap.parse_args()

    from rich.console import Console

    from moeflow.data import load_prompts
    from moeflow.models import default_model_path, load_model, no_cudnn_attention
    from moeflow.moe import get_adapter, model_fingerprint
    from moeflow.tables import FitTable
    from moeflow.trace.record import RoutingRecorder, generation_kwargs, trace_one
    from moeflow.trace.writer import TraceWriter

    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_model(a.model or default_model_path())
    ad = get_adapter(model)
    prompts = load_prompts(a.prompts, data_dir=a.data_dir, limit=a.n)
    gen = {"max_new_tokens": a.max_new_tokens, "temperature": 0.0, "top_p": 1.0, "repetition_penalty": 1.0}
    kw = generation_kwargs(gen, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    inputs = [
        tok(p.text, return_tensors="pt", truncation=True, max_length=a.max_prompt_tokens)["input_ids"][:, : a.max_prompt_tokens]
        for p in prompts
    ]
    rec = {False: RoutingRecorder(ad, False), True: RoutingRecorder(ad, True)}
    rows: dict[bool, list] = {False: [], True: []}

    def plain(ids):
        with torch.no_grad(), no_cudnn_attention():  # as trace_one generates
            return model.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0]

    def traced(ids, hidden):
        r, seq = trace_one(model, rec[hidden], ids, kw)
        rows[hidden].append(r)
        return seq

    modes = {
        "plain": lambda ids: plain(ids),
        "trace": lambda ids: traced(ids, False),
        "trace+hidden": lambda ids: traced(ids, True),
    }
    secs = {m: 0.0 for m in modes}
    tokens = 0
    plain(inputs[0]), traced(inputs[0], False), traced(inputs[0], True)  # warm-up
    rows[False].clear(), rows[True].clear()
    names = list(modes)
    step = 0
    for _ in range(a.reps):
        for ids in inputs:
            order = names[step % 3 :] + names[: step % 3]
            step += 1
            lens = {}
            for m in order:
                t0 = time.perf_counter()
                seq = modes[m](ids)
                secs[m] += time.perf_counter() - t0
                lens[m] = len(seq)
            if len(set(lens.values())) != 1:
                raise SystemExit(f"tracing changed the generated length: {lens}")
            tokens += lens["plain"] - 1
    # shard writing, timed separately (one shard per mode)
    write = {}
    for hidden in (True, False, True):  # the first is a warm-up
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            with TraceWriter(
                d + "/tr",
                fingerprint=model_fingerprint(model),
                spec=ad.spec.to_dict(),
                record_hidden=hidden,
                generation=gen,
                prompt_source=a.prompts,
                shard_size=1 << 30,
            ) as w:
                for i, r in enumerate(rows[hidden]):
                    w.add(f"p{i}", r)
            write[hidden] = time.perf_counter() - t0

    res = {
        "model": a.model or default_model_path(),
        "arch": ad.spec.arch,
        "prompts": len(inputs),
        "reps": a.reps,
        "routed_tokens": tokens,
        "max_new_tokens": a.max_new_tokens,
        "threads": torch.get_num_threads(),
        "plain_s": round(secs["plain"], 3),
        "trace_s": round(secs["trace"], 3),
        "trace_hidden_s": round(secs["trace+hidden"], 3),
        "write_s": round(write[False], 3),
        "write_hidden_s": round(write[True], 3),
        "ratio_trace": round(secs["trace"] / secs["plain"], 4),
        "ratio_trace_hidden": round(secs["trace+hidden"] / secs["plain"], 4),
        "ratio_trace_with_write": round((secs["trace"] + write[False]) / secs["plain"], 4),
        "ratio_trace_hidden_with_write": round((secs["trace+hidden"] + write[True]) / secs["plain"], 4),
        "plain_tokens_per_s": round(tokens / secs["plain"], 1),
    }
    t = FitTable(title=f"trace overhead: {res['arch']}, {len(inputs)} prompts x {a.reps}, {tokens} routed tokens (interleaved)")
    for c in ("mode", "seconds", "tok/s", "x plain", "x plain incl. shard write"):
        t.add_column(c, justify="right" if c != "mode" else "left")
    t.add_row("generate", f"{secs['plain']:.2f}", f"{tokens / secs['plain']:.0f}", "1.000", "")
    t.add_row(
        "trace",
        f"{secs['trace']:.2f}",
        f"{tokens / secs['trace']:.0f}",
        f"{res['ratio_trace']:.3f}",
        f"{res['ratio_trace_with_write']:.3f}",
    )
    t.add_row(
        "trace --record-hidden",
        f"{secs['trace+hidden']:.2f}",
        f"{tokens / secs['trace+hidden']:.0f}",
        f"{res['ratio_trace_hidden']:.3f}",
        f"{res['ratio_trace_hidden_with_write']:.3f}",
    )
    Console().print(t)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
