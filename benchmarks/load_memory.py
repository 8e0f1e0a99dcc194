"""Peak memory and time of the stages that route without running the whole model (`train`, `simulate`) on a bf16
checkpoint, against a float32 load of the whole model.

1. a bf16 OLMoE-shaped checkpoint of `--layers` layers, each with `--experts` experts (top-8) of hidden size
   `--hidden` and intermediate size `--intermediate` (default 3 x 64 x 1024 x 1024: 0.63 B parameters, 1.27 GB on
   disk), random weights and models/olmoe-deep's tokenizer (vocabulary 8192); or `--model`, an existing checkpoint;
2. `moeflow trace` of `--prompts` ShareGPT prompts with `--record-hidden` (not measured);
3. each of the following in a process of its own, timed, with its peak resident set (`os.wait4`; the touched pages of
   the memory-mapped checkpoint and trace shards count, clean pages the kernel can drop) and its peak anonymous
   memory (RssAnon polled every 50 ms: what the process allocated; train's forked forest process is not in it):
   the whole model loaded in float32 (`load_model(dtype="float32")`, what `train` and
   `eval` loaded before they kept the experts in the checkpoint's dtype, and `simulate` and `tune` on a CPU);
   `moeflow train`; `moeflow simulate --prefetch pregate --capacity 25%`.

4. a long trace: `--long-model`'s (default models/olmoe-deep) trace of `--prompts` prompts (up to 128 new tokens
   each), written again and again under new prompt ids until it holds `--long-tokens` tokens (default 400,000:
   about 2.7 GB on disk for olmoe-deep, mostly hidden states), then `moeflow train` on it with every token loaded
   (`--max-tokens 0`) and with the default `--max-tokens`, which loads only whole prompts drawn until they hold
   100,000 tokens (`predict.data.prompt_rows`; fewer on a host without the memory for them). `--long-tokens 0`
   skips this part.

Prints two tables, then one JSON line: `peak_gb`, `peak_anon_gb` and `seconds` per step (`long_...` for part 4),
`train_vs_float32_load` and `simulate_vs_float32_load` (peak over peak), `long_trace_tokens` and
`long_train_default_vs_all` (peak over peak).

    .venv/bin/python benchmarks/load_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_checkpoint(out: Path, layers: int, experts: int, hidden: int, intermediate: int) -> int:
    """A random bf16 OLMoE checkpoint with olmoe-deep's tokenizer at `out`; its parameter count."""
    import torch

    from moeflow.models import tiny_model

    heads = max(1, hidden // 128)
    model = tiny_model(
        "olmoe",
        num_experts=experts,
        top_k=min(8, experts),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=8192,
    )
    n = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "models" / "olmoe-deep" / f, out / f)
    return n


def repeat_trace(src: Path, dst: Path, copies: int) -> int:
    """`src`'s prompts written `copies` times to a new trace `dst` (prompt ids `{id}~{c}`); its tokens."""
    import numpy as np

    from moeflow.trace import Trace
    from moeflow.trace.format import column
    from moeflow.trace.writer import TraceWriter

    tr = Trace(src)
    meta = tr.meta
    toks = tr.tokens()
    cols = {f: np.asarray(v) for f, v in toks.items() if f != "prompt_id"}  # [N] or [N,w] per column
    for layer in tr.spec.moe_layers:
        cols.update({column(f, layer): np.asarray(v) for f, v in tr.layer(layer).items()})
    pid = np.asarray(toks["prompt_id"])
    prompts = [(meta["prompt_ids"][int(p)], np.flatnonzero(pid == p)) for p in np.unique(pid)]
    with TraceWriter(
        dst,
        fingerprint=meta["model_fingerprint"],
        spec=meta["spec"],
        record_hidden=tr.record_hidden,
        generation=meta["generation"],
        prompt_source="repeated",
        hidden_dtype=meta.get("hidden_dtype", "float16"),
    ) as w:
        for c in range(copies):
            for name, rows in prompts:
                w.add(f"{name}~{c}", {n: v[rows] for n, v in cols.items()})
    return int(Trace(dst).num_tokens)


def _anon_bytes(pid: int) -> int:
    """Process `pid`'s resident anonymous memory (RssAnon: no file-backed pages); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("RssAnon:")), 0)
    except OSError:
        return 0


def measured(cmd: list[str]) -> tuple[float, float, float]:
    """(wall seconds, peak resident GB, peak anonymous GB) of `cmd` run to completion in a process of its own; a
    failure exits. Peak resident: `os.wait4`'s, which counts the memory-mapped pages a process touched (the
    checkpoint's, the trace's shards: clean pages the kernel can drop). Peak anonymous: the process's own RssAnon,
    polled every 50 ms (what it allocated; a forked child, such as train's forest, is not counted)."""
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: a child writing much to stderr never blocks
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO)
        peak, stop = [0], threading.Event()

        def poll() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _anon_bytes(p.pid))
                stop.wait(0.05)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        _, status, usage = os.wait4(p.pid, 0)
        took = time.perf_counter() - t
        stop.set()
        watcher.join()
        p.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: Popen must not wait again
        if p.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed:\n{err.read().decode(errors='replace')[-2000:]}")
    return took, usage.ru_maxrss / 1e6, peak[0] / 1e9  # ru_maxrss: KB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="an existing checkpoint instead of the random one")
    ap.add_argument("--layers", type=int, default=3, help="layers of the random checkpoint (default %(default)s)")
    ap.add_argument("--experts", type=int, default=64, help="experts per layer (default %(default)s)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (default %(default)s)")
    ap.add_argument("--intermediate", type=int, default=1024, help="expert intermediate size (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=20, help="ShareGPT prompts traced (default %(default)s)")
    ap.add_argument("--long-model", default="models/olmoe-deep", help="the long trace's model (default %(default)s)")
    ap.add_argument("--long-tokens", type=int, default=400_000, help="the long trace's tokens (default %(default)s; 0: skip)")
    ap.add_argument("--data-dir", default=None, help="data directory (default: $MOEFLOW_DATA or ../shared/data)")
    a = ap.parse_args()

    from rich.console import Console

    from moeflow.tables import FitTable

    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="moeflow-loadmem-") as tmp:
        root = Path(tmp)
        model = Path(a.model) if a.model else root / "model"
        params = None if a.model else make_checkpoint(model, a.layers, a.experts, a.hidden, a.intermediate)
        data = ["--data-dir", a.data_dir] if a.data_dir else []
        trace = [py, "-m", "moeflow", "trace", "--model", str(model), "--prompts", "sharegpt", "--limit", str(a.prompts)]
        trace += ["--record-hidden", "--max-new-tokens", "8", "--max-prompt-tokens", "64", "--out", str(root / "trace")]
        measured([*trace, "--no-progress", *data])
        load = "from moeflow.models import load_model; load_model(sys.argv[1], dtype='float32', tokenizer=False)"
        common = ["--model", str(model), "--trace", str(root / "trace")]
        steps = {
            "float32 load": [py, "-c", f"import sys; {load}", str(model)],
            "train": [py, "-m", "moeflow", "train", *common, "--out", str(root / "pred"), "--no-progress"],
            "simulate": [py, "-m", "moeflow", "simulate", *common, "--prefetch", "pregate", "--capacity", "25%", "--json"],
        }
        res = {name: measured(cmd) for name, cmd in steps.items()}
        disk = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e9
        long_res, long_tokens = {}, 0
        if a.long_tokens > 0:
            short = [py, "-m", "moeflow", "trace", "--model", a.long_model, "--prompts", "sharegpt", "--limit"]
            short += [str(a.prompts), "--record-hidden", "--out", str(root / "short"), "--no-progress", *data]
            measured(short)
            from moeflow.trace import Trace

            copies = -(-a.long_tokens // int(Trace(root / "short").num_tokens))
            long_tokens = repeat_trace(root / "short", root / "long", copies)
            shutil.rmtree(root / "short")
            train = [py, "-m", "moeflow", "train", "--model", a.long_model, "--trace", str(root / "long"), "--no-progress"]
            for name, extra in (("train, every token", ["--max-tokens", "0"]), ("train, default --max-tokens", [])):
                long_res[name] = measured([*train, "--out", str(root / "p"), "--force", *extra])

    t = FitTable(title=f"Peak memory, checkpoint {disk:.2f} GB on disk (bf16)")
    t.add_column("step")
    t.add_column("seconds", justify="right")
    t.add_column("peak GB", justify="right")
    t.add_column("÷ float32 load", justify="right")
    t.add_column("anon GB", justify="right")
    base = res["float32 load"][1]
    for name, (s, gb, anon) in res.items():
        t.add_row(name, f"{s:.1f}", f"{gb:.2f}", f"{gb / base:.2f}", f"{anon:.2f}")
    Console().print(t)
    if long_res:
        t = FitTable(title=f"train on a long trace ({long_tokens:,} tokens, {a.long_model})")
        t.add_column("step")
        t.add_column("seconds", justify="right")
        t.add_column("peak GB", justify="right")
        t.add_column("anon GB", justify="right")
        for name, (s, gb, anon) in long_res.items():
            t.add_row(name, f"{s:.1f}", f"{gb:.2f}", f"{anon:.2f}")
        Console().print(t)
    Console().print("peak: resident set, the touched pages of the checkpoint and trace files included; anon: the process's own")
    long_ratio = None
    if long_res:
        long_ratio = round(long_res["train, default --max-tokens"][1] / long_res["train, every token"][1], 3)
    print(
        json.dumps(
            {
                "checkpoint_gb": round(disk, 3),
                "params": params,
                "seconds": {n: round(r[0], 2) for n, r in res.items()},
                "peak_gb": {n: round(r[1], 3) for n, r in res.items()},
                "peak_anon_gb": {n: round(r[2], 3) for n, r in res.items()},
                "train_vs_float32_load": round(res["train"][1] / base, 3),
                "simulate_vs_float32_load": round(res["simulate"][1] / base, 3),
                "long_trace_tokens": long_tokens,
                "long_seconds": {n: round(r[0], 2) for n, r in long_res.items()},
                "long_peak_gb": {n: round(r[1], 3) for n, r in long_res.items()},
                "long_peak_anon_gb": {n: round(r[2], 3) for n, r in long_res.items()},
                "long_train_default_vs_all": long_ratio,
                "flags": vars(a),
            }
        )
    )


if __name__ == "__main__":
    main()
