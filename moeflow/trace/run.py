"""The `moeflow trace` stage: load the model and prompts, generate with router hooks, write shards."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..artifacts import META, check_out, check_writable
from ..data import Prompt, load_prompts
from ..data.prompts import resolve_source
from ..errors import MoeflowError
from ..models import check_lengths
from ..moe import get_adapter, model_fingerprint
from .config import TraceConfig
from .format import KIND
from .writer import RoutingRecorder, TraceWriter, generation_kwargs, trace_one


def _progress(console: Any, enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from ..progress import progress

    columns = (
        TextColumn("[bold]tracing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("prompts"),
        TextColumn("{task.fields[tokens]} tokens, {task.fields[tps]:.0f} tok/s"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    return progress("trace", enabled=enabled, console=console, columns=columns, transient=False)


def prompt_seed(seed: int, prompt_id: str) -> int:
    """A per-prompt seed independent of prompt order (so appends reproduce the same samples)."""
    return (seed * 1_000_003 + zlib.crc32(prompt_id.encode())) % (2**31)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """For the block, SIGTERM raises KeyboardInterrupt (unless a handler is set already, e.g. by the CLI),
    so the writer keeps every prompt finished so far. Main thread only; the old handler is restored."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt("terminated (SIGTERM)")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def encode_prompts(tokenizer: Any, prompts: Sequence[Prompt], cfg: TraceConfig, model: Any) -> list[torch.Tensor]:
    """Token ids [1,S] of each prompt (at most --max-prompt-tokens, the beginning kept); refuses, before any
    work, a --max-prompt-tokens or a prompt + --max-new-tokens beyond the model's maximum position."""
    check_lengths(model, cfg.max_prompt_tokens, 0)
    out = []
    for p in prompts:
        ids = tokenizer(p.text, return_tensors="pt", truncation=True, max_length=cfg.max_prompt_tokens, add_special_tokens=True)[
            "input_ids"
        ][:, : cfg.max_prompt_tokens]  # [1,S]
        check_lengths(model, ids.shape[1], cfg.max_new_tokens, what=f"prompt {p.id} ({p.text[:30]!r})")
        out.append(ids)
    return out


def run_trace(
    model: torch.nn.Module, tokenizer: Any, prompts: Sequence[Prompt], cfg: TraceConfig, console: Any = None
) -> dict[str, Any]:
    """Trace `prompts` through `model` into `cfg.out` (appending; prompts already there are skipped).

    An interrupt (Ctrl-C, SIGTERM, any error) keeps every prompt finished so far in the trace."""
    adapter = get_adapter(model)
    gen = cfg.generation()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen_kw = generation_kwargs(gen, pad if pad is not None else getattr(model.config, "eos_token_id", None))
    recorder = RoutingRecorder(adapter, cfg.record_hidden, cfg.hidden_dtype)
    device = next(model.parameters()).device
    writer = TraceWriter(
        cfg.out,
        fingerprint=model_fingerprint(model),
        spec=adapter.spec.to_dict(),
        record_hidden=cfg.record_hidden,
        generation=gen,
        prompt_source=cfg.prompts,
        shard_size=cfg.shard_size,
        split=cfg.split,
        limit=cfg.limit,
        column=cfg.column,
        hidden_dtype=cfg.hidden_dtype,
        model=cfg.model,
    )
    tokens, gen_tokens, t0 = 0, 0, time.perf_counter()
    with sigterm_interrupts(), writer, _progress(console, cfg.progress and console is not None) as bar:
        if writer.meta["shards"] and writer.meta.get("generation") != gen and console is not None:
            console.print(
                f"[yellow]note:[/] {cfg.out} was traced with other generation settings "
                f"({writer.meta.get('generation')}); each run's settings are in meta.json `runs`"
            )
        todo = [p for p in prompts if not writer.has(p.id)]
        skipped = len(prompts) - len(todo)
        encoded = encode_prompts(tokenizer, todo, cfg, model)
        task = bar.add_task("trace", total=len(todo), unit="prompts", tokens=0, tps=0.0)
        for p, ids in zip(todo, encoded, strict=True):
            if ids.shape[1] == 0:
                bar.advance(task)
                continue
            ids = ids.to(device)  # [1,S]
            rows, seq = trace_one(model, recorder, ids, gen_kw, prompt_seed(cfg.seed, p.id) if gen["do_sample"] else None)
            writer.add(p.id, rows)
            tokens += len(rows["position"])
            gen_tokens += seq.shape[0] - ids.shape[1]
            bar.update(task, advance=1, tokens=tokens, tps=tokens / max(time.perf_counter() - t0, 1e-9))
    dt = time.perf_counter() - t0
    return {
        "out": str(cfg.out),
        "prompts_total": len(prompts),
        "prompts_skipped": skipped,
        "prompts_added": writer.added_prompts,
        "tokens_added": writer.added_tokens,
        "generated_tokens": gen_tokens,
        "shards_added": writer.new_shards,
        "trace_prompts": len(writer.meta["prompt_ids"]),
        "trace_tokens": int(writer.meta["num_tokens"]),
        "seconds": round(dt, 3),
        "tokens_per_s": round(tokens / dt, 1) if dt > 0 else None,
    }


def check_trace_out(cfg: TraceConfig) -> None:
    """Refuse, before any work, an --out that is, contains or is inside the model or the prompt file, or
    that holds anything but a trace (`artifacts.check_out`; a trace is appended to). A folder holding only
    what a killed first run left (shards, no meta.json) is left to the writer, which reuses it (once it is
    known to be writable)."""
    out = Path(cfg.out)
    if out.is_dir() and not (out / META).exists() and all(p.name.startswith((".", "shard-")) for p in out.iterdir()):
        check_writable(out, inside=True)
        return
    src = resolve_source(cfg.prompts, cfg.data_dir, cfg.split)
    check_out(out, kind=KIND, inputs=(cfg.model, src), reuse=True)


def main(cfg: TraceConfig, console: Any = None, json_out: bool = False) -> dict[str, Any]:
    """Load `cfg.model` and `cfg.prompts`, trace, print a result line (or JSON)."""
    from rich.console import Console

    from ..locks import out_lock
    from ..models import load_model, torch_threads
    from ..threads import apply_threads

    console = console or Console(stderr=True)
    cfg.preflight()
    check_trace_out(cfg)
    with (
        out_lock(cfg.out, wait=cfg.wait, command="moeflow trace", check=lambda: check_trace_out(cfg)),
        torch_threads(cfg.threads),
    ):
        prompts = load_prompts(cfg.prompts, data_dir=cfg.data_dir, limit=cfg.limit, split=cfg.split, column=cfg.column)
        model, tok = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
        if tok is None:
            raise MoeflowError(f"{cfg.model} has no tokenizer (tokenizer.json); save one beside the checkpoint")
        threads = apply_threads(cfg.threads, model, cfg.device)
        res = {**run_trace(model, tok, prompts, cfg, console), **threads.to_dict()}
    if json_out:
        print(json.dumps(res))
    else:
        console.print(
            f"traced {res['prompts_added']} prompts ({res['prompts_skipped']} already in the trace), "
            f"{res['tokens_added']} tokens at {res['tokens_per_s']} tok/s -> {res['out']} "
            f"({res['trace_prompts']} prompts, {res['trace_tokens']} tokens in all); {threads.describe()}"
        )
    return res
