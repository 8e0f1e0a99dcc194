"""The `moeflow trace` stage: load the model and prompts, generate with router hooks, write shards.

`TraceConfig`: everything `moeflow trace` needs, as one frozen dataclass (the CLI builds it)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from ..artifacts import META
from ..data import Prompt, load_prompts
from ..data.prompts import resolve_source
from ..errors import ConfigError, MoeflowError
from ..models import check_lengths
from ..moe import get_adapter, model_fingerprint
from ..outputs import check_out, check_writable
from ..trace.format import KIND
from ..trace.record import RoutingRecorder, generation_kwargs, trace_batch, trace_one
from ..trace.writer import SHARD_BYTES, TraceWriter, record_bytes, signals_deferred

DEFAULT_BATCH = 16  # prompts per generate in `moeflow trace` (docs/trace.md: CPU seconds by batch size)


@dataclass(frozen=True)
class TraceConfig:
    model: str  # local checkpoint folder
    prompts: str  # file path, short set name or HF dataset name
    out: str  # trace folder (created, or appended to)
    max_new_tokens: int = 32  # decode steps per prompt
    batch_size: int = DEFAULT_BATCH  # prompts generated at once (left-padded); 1 = each prompt alone, as `moeflow run` routes
    limit: int | None = None  # at most this many prompts (after deduplication)
    record_hidden: bool = False  # also store router input and post-attention residual
    hidden_dtype: str = "float16"  # storage of the hidden states: float16, or float32 (exact for fp32/bf16 models)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0  # per-prompt seed = seed + hash(prompt) (sampling only)
    max_prompt_tokens: int = 256  # longer prompts are truncated (keep the beginning)
    data_dir: str | None = None
    split: str | None = None  # split of a short set name or HF dataset
    column: str | None = None  # prompt field of csv/tsv/json/jsonl records (None: detected)
    dtype: str = "auto"
    device: str = "cpu"
    shard_size: int | None = None  # token records per Arrow shard (None: about 256 MiB); closes at a prompt boundary
    threads: int | None = None  # torch intra-op threads (None: the rule of moeflow.threads)
    progress: bool = True
    wait: bool = False  # wait for another writer of `out` instead of refusing (moeflow.locks.out_lock)
    load_experts: str = "auto"  # auto | device | host: where the routed experts load (as `moeflow run --load-experts`)
    capacity: str = "25%"  # with host-loaded experts: the device expert slots of the engine the trace runs through

    def __post_init__(self) -> None:
        from .run_config import LOAD_EXPERTS, check_capacity_syntax

        if self.load_experts not in LOAD_EXPERTS:
            raise ConfigError(f"--load-experts {self.load_experts!r} unknown; use one of {', '.join(LOAD_EXPERTS)}")
        check_capacity_syntax(self.capacity)
        if not self.prompts or not self.out:
            raise ConfigError(
                "moeflow trace needs --prompts and --out; see `moeflow trace --help` (`moeflow inspect DIR` summarises a trace)"
            )
        if self.hidden_dtype not in ("float16", "float32"):
            raise ConfigError(f"--hidden-dtype must be float16 or float32 (got {self.hidden_dtype!r})")
        if self.hidden_dtype != "float16" and not self.record_hidden:  # meta.json would say float32, storing none
            raise ConfigError("--hidden-dtype is how hidden states are stored: add --record-hidden, or drop it")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1 (got {self.max_new_tokens})")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1 prompt (got {self.batch_size})")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1 (got {self.limit})")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0 = greedy; got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.top_p < 1 and self.temperature == 0:  # greedy decoding never draws: the mass would be ignored
            raise ConfigError(f"--top-p {self.top_p:g} samples: add --temperature > 0 (0 is greedy), or drop --top-p")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"--repetition-penalty must be > 0 (got {self.repetition_penalty})")
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"--max-prompt-tokens must be >= 1 (got {self.max_prompt_tokens})")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1 (got {self.threads})")
        if self.shard_size is not None and self.shard_size < 1:
            raise ConfigError(f"--shard-size must be >= 1 record (got {self.shard_size})")

    def preflight(self) -> None:
        """What depends on this machine, checked before anything loads: the device."""
        from ..checks import check_device

        check_device(self.device)

    def generation(self) -> dict[str, Any]:
        """The settings that shape the generated tokens (stored in meta.json)."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "max_prompt_tokens": self.max_prompt_tokens,
            "do_sample": self.temperature > 0,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TraceConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


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


@contextlib.contextmanager
def _say_what_was_kept(writer: TraceWriter, prompts: Sequence[Prompt], console: Any) -> Iterator[None]:
    """On Ctrl-C / SIGTERM, once `writer` has kept every whole window of prompts finished before it: a line on
    `console` saying how many prompts the trace holds now and that the same command resumes."""
    try:
        yield
    except KeyboardInterrupt:
        note = stopped_note(writer, prompts)
        if console is not None and note:
            console.print(note, soft_wrap=True, highlight=False)
        raise


def stopped_note(writer: TraceWriter, prompts: Sequence[Prompt]) -> str | None:
    """What an interrupted trace kept (`writer` after its exit) and how to go on, as one line; None when the
    writer never opened the trace (stopped before: nothing changed)."""
    from rich.markup import escape

    if not writer.meta:
        return None
    out = escape(str(writer.out))
    kept = set(writer.meta.get("prompt_ids") or ())
    if not kept:
        return f"[yellow]stopped[/] before a whole window of prompts was traced; {out} holds none: run the same command again"
    left = sum(p.id not in kept for p in prompts)
    return (
        f"[yellow]stopped:[/] {out} kept the {writer.added_prompts} prompts this run finished (whole windows) and holds "
        f"{len(kept)} in all; {left} of this command's {len(prompts)} prompts are left: run the same command again to "
        "resume (prompts already in the trace are skipped)"
    )


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


def sort_window(cfg: TraceConfig, spec: dict[str, Any]) -> int:
    """Prompts generated before any is added to the trace, sorted by length into batches of `cfg.batch_size`:
    4 batches, fewer when their records would pass about one shard's bytes (at least one batch)."""
    if cfg.batch_size == 1:
        return 1
    per_token = record_bytes(spec, cfg.record_hidden)
    if cfg.record_hidden and cfg.hidden_dtype == "float32":
        per_token += 4 * spec["hidden_size"] * len(spec["moe_layers"])  # 2 states x 2 more bytes
    per_prompt = per_token * (cfg.max_prompt_tokens + cfg.max_new_tokens)
    return cfg.batch_size * max(1, min(4, SHARD_BYTES // (per_prompt * cfg.batch_size)))


def run_trace(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    cfg: TraceConfig,
    console: Any = None,
    *,
    adapter: Any = None,
) -> dict[str, Any]:
    """Trace `prompts` through `model` into `cfg.out` (appending; prompts already there are skipped). `adapter`: the
    model's, built before an engine attached (`host_engine`: the experts are out of the model while it runs).

    An interrupt (Ctrl-C, SIGTERM, any error) keeps every prompt finished so far in the trace."""
    adapter = adapter if adapter is not None else get_adapter(model)
    gen = cfg.generation()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen_kw = generation_kwargs(gen, pad if pad is not None else getattr(model.config, "eos_token_id", None))
    recorder = RoutingRecorder(adapter, cfg.record_hidden, cfg.hidden_dtype)
    device = next(model.parameters()).device
    writer = TraceWriter(
        cfg.out,
        fingerprint=model_fingerprint(model, adapter),
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
        batch_size=cfg.batch_size,
    )
    tokens, gen_tokens, t0 = 0, 0, time.perf_counter()
    with (
        sigterm_interrupts(),
        _say_what_was_kept(writer, prompts, console),
        writer,
        _progress(console, cfg.progress and console is not None) as bar,
    ):
        if writer.meta["shards"] and writer.meta.get("generation") != gen and console is not None:
            console.print(
                f"[yellow]note:[/] {cfg.out} was traced with other generation settings "
                f"({writer.meta.get('generation')}); each run's settings are in meta.json `runs`"
            )
        todo = [p for p in prompts if not writer.has(p.id)]
        skipped = len(prompts) - len(todo)
        encoded = encode_prompts(tokenizer, todo, cfg, model)
        task = bar.add_task("trace", total=len(todo), unit="prompts", tokens=0, tps=0.0)
        bar.advance(task, sum(ids.shape[1] == 0 for ids in encoded))  # an empty prompt routes nothing
        work = [(p, ids) for p, ids in zip(todo, encoded, strict=True) if ids.shape[1] > 0]
        batch_size = cfg.batch_size
        window = sort_window(cfg, adapter.spec.to_dict())
        for w in range(0, len(work), window):
            chunk = work[w : w + window]
            # batches of similar lengths (less padding); the trace keeps the prompt order
            order = sorted(range(len(chunk)), key=lambda j: chunk[j][1].shape[1]) if batch_size > 1 else list(range(len(chunk)))
            done: list[Any] = [None] * len(chunk)
            j = 0
            while j < len(order):
                picked = order[j : j + batch_size]
                ids = [chunk[k][1].to(device) for k in picked]  # [1,S_b] each
                seeds = [prompt_seed(cfg.seed, chunk[k][0].id) for k in picked] if gen["do_sample"] else None
                if len(picked) == 1:
                    res = [trace_one(model, recorder, ids[0], gen_kw, seeds[0] if seeds else None)]
                else:
                    try:
                        res = trace_batch(model, recorder, ids, gen_kw, seeds)
                    except RuntimeError as e:  # a model that cannot take a padded batch, or out of memory
                        batch_size = 1
                        writer.set_batch_size(1)
                        if console is not None:
                            console.print(
                                f"[yellow]note:[/] batched generate failed ({str(e).splitlines()[0][:120]}); "
                                "tracing one prompt at a time"
                            )
                        continue
                for k, (rows, seq) in zip(picked, res, strict=True):
                    done[k] = (rows, seq)
                    tokens += len(rows["position"])
                    gen_tokens += seq.shape[0] - chunk[k][1].shape[1]
                j += len(picked)
                bar.update(task, advance=len(picked), tokens=tokens, tps=tokens / max(time.perf_counter() - t0, 1e-9))
            with signals_deferred():  # a window is added whole, in prompt order, or (interrupted before this) not at all
                for (p, _), (rows, _) in zip(chunk, done, strict=True):
                    writer.add(p.id, rows)
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
        "batch_size": batch_size,
        "seconds": round(dt, 3),
        "tokens_per_s": round(tokens / dt, 1) if dt > 0 else None,
    }


def check_trace_out(cfg: TraceConfig) -> None:
    """Refuse, before any work, an --out that is, contains or is inside the model or the prompt file, or
    that holds anything but a trace (`outputs.check_out`; a trace is appended to). A folder holding only
    what a killed first run left (shards, no meta.json) is left to the writer, which reuses it (once it is
    known to be writable)."""
    out = Path(cfg.out)
    if out.is_dir() and not (out / META).exists() and all(p.name.startswith((".", "shard-")) for p in out.iterdir()):
        check_writable(out, inside=True)
        return
    src = resolve_source(cfg.prompts, cfg.data_dir, cfg.split)
    check_out(out, kind=KIND, inputs=(cfg.model, src), reuse=True)


@contextlib.contextmanager
def host_engine(model: Any, cfg: TraceConfig) -> Iterator[Any]:
    """An offload engine over `model` for its trace: `cfg.capacity` device slots, lru, no prefetch, the device's
    own link, standard routing and fetched misses, so the routing and the tokens are those of the stock model with
    `grouped_mm` (the engine is exact to it). For experts loaded in host memory only (`--load-experts host`)."""
    from ..runtime.generate import build_engine
    from ..runtime.link import make_link
    from .session import check_capacities

    spec = get_adapter(model).spec
    device = next(model.parameters()).device
    cap = check_capacities((cfg.capacity,), spec, spec.expert_bytes)[cfg.capacity]
    link = make_link("cuda" if device.type == "cuda" else "direct", device)
    eng = build_engine(model, mode="offload", link=link, capacity=cap, eviction="lru", prefetch="none")
    assert eng is not None  # an offload mode always has an engine
    with eng:
        yield eng


def main(cfg: TraceConfig, console: Any = None, json_out: bool = False) -> dict[str, Any]:
    """Load `cfg.model` and `cfg.prompts`, trace, print a result line (or JSON)."""
    from rich.console import Console

    from ..locks import out_lock
    from ..models import load_model, torch_threads
    from .session import check_capacities, placement_for, spec_before_load
    from .threads import apply_threads

    console = console or Console(stderr=True)
    cfg.preflight()
    check_trace_out(cfg)
    with (
        out_lock(cfg.out, wait=cfg.wait, command="moeflow trace", check=lambda: check_trace_out(cfg)),
        torch_threads(cfg.threads),
    ):
        prompts = load_prompts(cfg.prompts, data_dir=cfg.data_dir, limit=cfg.limit, split=cfg.split, column=cfg.column)
        experts, why = placement_for(cfg, "moeflow trace", False)
        host: dict[str, Any] = {}  # load_model's arguments where the experts never reach the device
        if experts == "host":  # the trace runs through an exact offload engine (`host_engine`), checked before the load
            spec = spec_before_load(cfg.model)
            if spec is not None:
                check_capacities((cfg.capacity,), spec, None)
            host = {"experts_implementation": "grouped_mm", "experts_device": "cpu"}
        model, tok = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, **host)
        if tok is None:
            raise MoeflowError(f"{cfg.model} has no tokenizer (tokenizer.json); save one beside the checkpoint")
        threads = apply_threads(cfg.threads, model, cfg.device)
        adapter = get_adapter(model)  # before an engine takes the experts out
        with host_engine(model, cfg) if experts == "host" else contextlib.nullcontext():
            if experts == "host":
                console.print(f"[dim]routed experts in host memory ({escape(why)}); tracing through a {cfg.capacity} cache[/]")
            res = {
                **run_trace(model, tok, prompts, cfg, console, adapter=adapter),
                **threads.to_dict(),
                "experts_loaded": experts,
            }
    if json_out:
        print(json.dumps(res))
    else:
        console.print(
            f"traced {res['prompts_added']} prompts ({res['prompts_skipped']} already in the trace), "
            f"{res['tokens_added']} tokens at {res['tokens_per_s']} tok/s -> {escape(str(res['out']))} "
            f"({res['trace_prompts']} prompts, {res['trace_tokens']} tokens in all); {threads.describe()}"
        )
    return res
