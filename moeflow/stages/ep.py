"""`moeflow ep` as a function: `main(EPConfig)` runs greedy generation with the routed experts partitioned
across N torch.distributed processes and reports identity with one process, per-layer times and loads.

Two ways in, one worker (`_worker`):
- `moeflow ep --world-size N`: this process checks everything it can (flags, model folder, placements,
  prompts), then spawns N workers on this machine (`torch.multiprocessing`, start method spawn) that
  join a group over TCP on 127.0.0.1; rank 0 writes the result, this process prints it.
- `torchrun --nproc-per-node G [--nnodes M --rdzv-endpoint HOST:PORT] -m moeflow ep ...`: torchrun's
  environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) is detected; every process is a worker
  (`env://` init) and rank 0 prints. On CUDA each process uses cuda:LOCAL_RANK and NCCL.

Every worker loads the whole model (the non-expert weights stay replicated), rank 0 alone runs the
single-process reference (stock `grouped_mm`) first, then for every placement each worker keeps only its
experts (`ExpertParallel`), runs an untimed warm-up and the timed generation of every prompt batch, and
the per-layer statistics of all ranks are gathered on rank 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..ep.engine import PHASES, ExpertParallel
from ..ep.placement import Placement, check_world_size, default_placement, load_placement
from ..errors import ConfigError, MoeflowError
from .run_config import RunConfig

BACKENDS = ("auto", "gloo", "nccl")
CONTIGUOUS = "contiguous"
MAX_LOCAL_WORLD = 64  # processes spawned on one machine
COLUMNS = ("layer", "calls", "dispatch ms", "compute ms", "combine ms", "gather ms", "rows per rank", "busiest", "imbalance")


@dataclass(frozen=True)
class EPConfig:
    run: RunConfig  # prompts, generation flags, model, dtype, device, threads, batch size, --json
    world_size: int | None = None  # None: torchrun's WORLD_SIZE, else 2
    placements: tuple[str, ...] = (CONTIGUOUS,)  # "contiguous" or JSON files; several are run in turn
    backend: str = "auto"  # auto: nccl on cuda, gloo on cpu
    compare: bool = True  # rank 0 runs the single-process reference and compares token ids
    timeout_s: float = 600.0  # collective timeout
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend {self.backend!r} unknown; use one of {', '.join(BACKENDS)}")
        if self.world_size is not None and self.world_size < 1:
            raise ConfigError(f"--world-size must be >= 1 (got {self.world_size})")
        if self.run.temperature != 0:
            raise ConfigError("moeflow ep is greedy only (token identity with one process); drop --temperature")
        if not self.placements:
            raise ConfigError("give at least one --placement (contiguous or a JSON file)")
        if self.backend == "nccl" and not self.run.device.startswith("cuda"):
            raise ConfigError("--backend nccl needs --device cuda; on CPU use gloo")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout must be > 0 seconds (got {self.timeout_s})")


def torchrun_env() -> dict[str, int] | None:
    """RANK / WORLD_SIZE / LOCAL_RANK when launched by torchrun (or any env:// launcher), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        return {
            "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"]),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        }
    except ValueError:
        raise ConfigError("RANK / WORLD_SIZE / LOCAL_RANK are set but not integers; launch with torchrun") from None


def _backend(cfg: EPConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if cfg.run.device.startswith("cuda") else "gloo"


def _spec(cfg: EPConfig) -> Any:
    """The model's MoESpec from its config alone (no weights): for checks before any worker starts."""
    from ..models import missing_model, read_config
    from ..moe.adapters import ARCHS, SUPPORTED, moe_model_type, spec_from_config

    p = Path(cfg.run.model)
    if not p.is_dir():
        raise MoeflowError(missing_model(p))
    if not (p / "config.json").is_file():
        raise MoeflowError(f"model folder {p} has no config.json; pass --model a local Hugging Face checkpoint folder")
    config = read_config(p)  # transformers' reason in one line for a config.json it cannot read
    if moe_model_type(config) not in ARCHS:
        raise MoeflowError(f"model type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return spec_from_config(config)


def resolve_placements(cfg: EPConfig, spec: Any, world_size: int) -> list[tuple[str, Placement]]:
    """(name, Placement) of every --placement, checked against the model and the world size."""
    check_world_size(world_size, spec.num_experts)
    out = []
    for p in cfg.placements:
        if p == CONTIGUOUS:
            out.append((CONTIGUOUS, default_placement(spec.moe_layers, spec.num_experts, world_size)))
        else:
            out.append((Path(p).name, load_placement(p, spec.moe_layers, spec.num_experts, world_size)))
    return out


def preflight(cfg: EPConfig, world_size: int) -> list[tuple[str, Placement]]:
    """Everything that can be refused before a worker starts: device, backend, model, placements, prompts."""
    from ..checks import check_device
    from .session import read_prompts

    check_device(cfg.run.device)
    if _backend(cfg) == "nccl" and not torch.distributed.is_nccl_available():
        raise ConfigError("this torch has no NCCL; use --backend gloo")
    if cfg.run.device.startswith("cuda") and torchrun_env() is None and world_size > torch.cuda.device_count():
        raise ConfigError(
            f"--world-size {world_size} on one machine needs {world_size} GPUs, it has {torch.cuda.device_count()}; "
            "use torchrun across nodes or a smaller --world-size"
        )
    spec = _spec(cfg)
    placements = resolve_placements(cfg, spec, world_size)
    read_prompts(cfg.run)
    return placements


# ---- the launcher -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(cfg: EPConfig) -> dict[str, Any] | None:
    """Run `cfg` on every rank; return rank 0's result (None on other torchrun ranks)."""
    env = torchrun_env()
    if env is not None:
        if cfg.world_size is not None and cfg.world_size != env["world_size"]:
            raise ConfigError(
                f"--world-size {cfg.world_size} but torchrun started WORLD_SIZE={env['world_size']} processes; "
                "drop --world-size under torchrun"
            )
        placements = preflight(cfg, env["world_size"])
        return _worker(env["rank"], env["world_size"], env["local_rank"], cfg, placements, "env://")
    n = cfg.world_size if cfg.world_size is not None else 2
    if n > MAX_LOCAL_WORLD:
        raise ConfigError(f"--world-size {n} is more than {MAX_LOCAL_WORLD} processes on one machine; use torchrun")
    placements = preflight(cfg, n)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="moeflow-ep-") as tmp:
        init = f"tcp://127.0.0.1:{_free_port()}"
        try:
            mp.start_processes(_spawned, args=(n, cfg, placements, init, tmp), nprocs=n, join=True, start_method="spawn")
        except mp.ProcessRaisedException as e:  # a worker's exception that was not a MoeflowError
            lines = [l for l in str(e).splitlines() if l.strip()]
            raise RuntimeError(f"an expert-parallel worker failed: {lines[-1] if lines else e}") from None
        except mp.ProcessExitedException as e:
            errors = sorted(Path(tmp).glob("error-*.txt"))
            if errors:
                raise MoeflowError(errors[0].read_text().strip()) from None
            raise RuntimeError(f"an expert-parallel worker exited with code {e.exit_code}") from None
        return json.loads((Path(tmp) / "result.json").read_text())


def _spawned(rank: int, world: int, cfg: EPConfig, placements: list[tuple[str, Placement]], init: str, tmp: str) -> None:
    """A spawned worker: run, write rank 0's result; a MoeflowError becomes a file and exit code 2."""
    try:
        res = _worker(rank, world, rank, cfg, placements, init)
    except MoeflowError as e:
        (Path(tmp) / f"error-{rank}.txt").write_text(str(e))
        raise SystemExit(2) from None
    if rank == 0:
        (Path(tmp) / "result.json").write_text(json.dumps(res, default=str))


# ---- one rank -----------------------------------------------------------------------------------------


def _worker(
    rank: int, world: int, local_rank: int, cfg: EPConfig, placements: list[tuple[str, Placement]], init: str
) -> dict[str, Any] | None:
    rc = cfg.run
    device = rc.device
    if device.startswith("cuda"):
        device = f"cuda:{local_rank % max(1, torch.cuda.device_count())}"
        torch.cuda.set_device(torch.device(device))
    from ..threads import resolve_threads, usable_cores

    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or world))  # ranks sharing this machine's CPUs
    choice = resolve_threads(rc.threads, None, _spec(cfg), cores=max(1, usable_cores() // ranks_here))
    threads = choice.n
    torch.set_num_threads(threads)
    backend = _backend(cfg)
    kw: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=cfg.timeout_s)}
    if init == "env://":
        kw["init_method"] = "env://"
    else:
        kw.update(init_method=init, rank=rank, world_size=world)
    if backend == "nccl":
        kw["device_id"] = torch.device(device)
    dist.init_process_group(**kw)
    try:
        res = _run_rank(cfg, dataclasses.replace(rc, device=device), placements, threads, backend)
        return None if res is None else {**res, **choice.to_dict()}  # threads (per rank), threads_source
    finally:
        dist.destroy_process_group()


def _generate_all(
    model: Any, batches: list[list[tuple[str, str, Any]]], rc: RunConfig, eos: Any, max_new: int
) -> tuple[list[list[int]], float]:
    from ..runtime.generate import generate_batch

    ids: list[list[int]] = []
    t0 = time.perf_counter()
    for batch in batches:
        news, _ = generate_batch(
            model,
            [x for _, _, x in batch],
            None,
            max_new_tokens=max_new,
            min_new_tokens=min(rc.min_new_tokens, max_new) if rc.min_new_tokens is not None else None,
            eos_token_id=eos,
        )
        ids += [[int(t) for t in n.tolist()] for n in news]
    return ids, time.perf_counter() - t0


def _run_rank(
    cfg: EPConfig, rc: RunConfig, placements: list[tuple[str, Placement]], threads: int, backend: str
) -> dict[str, Any] | None:
    from ..models import load_model
    from .session import encode_prompts, read_prompts

    rank, world = dist.get_rank(), dist.get_world_size()
    prompts = read_prompts(rc)

    def load() -> tuple[Any, Any]:
        model, tok = load_model(rc.model, dtype=rc.dtype, device=rc.device, experts_implementation="grouped_mm")
        if tok is None:
            raise MoeflowError(f"{rc.model} has no tokenizer files; `moeflow ep` needs one to encode prompts")
        return model, tok

    model, tok = load()
    encoded = encode_prompts(rc, model, tok, prompts)
    batches = [encoded[i : i + rc.batch_size] for i in range(0, len(encoded), rc.batch_size)]
    eos = tok.eos_token_id if tok.eos_token_id is not None else getattr(model.config, "eos_token_id", None)

    reference: list[list[int]] | None = None
    ref_s = None
    if cfg.compare and rank == 0:
        with torch.no_grad():
            reference, ref_s = _generate_all(model, batches, rc, eos, rc.max_new_tokens)
    dist.barrier()

    runs = []
    for i, (name, placement) in enumerate(placements):
        if i > 0:  # the previous placement freed this rank's other experts: start from the checkpoint again
            model, _ = load()
        with ExpertParallel(model, placement) as ep:
            if cfg.warmup:
                _generate_all(model, batches[:1], rc, eos, min(2, rc.max_new_tokens))
                ep.reset_stats()
            dist.barrier()
            with torch.no_grad():
                ids, wall = _generate_all(model, batches, rc, eos, rc.max_new_tokens)
            mine = {
                "rank": rank,
                "held": {str(l): len(e) for l, e in ep.held_experts().items()},
                "stats": {str(l): s.to_dict() for l, s in ep.stats.items()},
                "ids": ids,
                "wall_s": wall,
            }
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        runs.append((name, placement, gathered))
        del model
    if rank != 0:
        return None
    return _report(cfg, rc, world, backend, threads, prompts, reference, ref_s, runs, tok)


def _report(
    cfg: EPConfig,
    rc: RunConfig,
    world: int,
    backend: str,
    threads: int,
    prompts: list[tuple[str, str]],
    reference: list[list[int]] | None,
    ref_s: float | None,
    runs: list[tuple[str, Placement, list[Any]]],
    tok: Any,
) -> dict[str, Any]:
    out_runs = []
    identical_all: bool | None = None if reference is None else True
    for name, placement, gathered in runs:
        ids = gathered[0]["ids"]
        ranks_agree = all(g["ids"] == ids for g in gathered)
        identical = None if reference is None else (ids == reference and ranks_agree)
        if identical is not None:
            identical_all = bool(identical_all and identical)
        layers = []
        for l in sorted(int(k) for k in gathered[0]["stats"]):
            per = [g["stats"][str(l)] for g in gathered]
            row: dict[str, Any] = {"layer": l, "calls": per[0]["calls"]}
            for ph in PHASES:
                vals = [p[f"{ph}_s"] for p in per]
                row[f"{ph}_s"] = max(vals)  # the slowest rank: the layer waits for it
                row[f"{ph}_s_by_rank"] = vals
            rows = [p["rows"] for p in per]
            row["rows_by_rank"] = rows
            row["busiest_rank"] = int(max(range(world), key=lambda r: (rows[r], -r)))
            row["busiest_rows"] = max(rows)
            row["imbalance"] = max(rows) / (sum(rows) / world) if sum(rows) else 0.0
            row["sent_rows"] = sum(p["sent"] for p in per)
            row["held_by_rank"] = [g["held"][str(l)] for g in gathered]
            layers.append(row)
        rows_total = [sum(L["rows_by_rank"][r] for L in layers) for r in range(world)]
        tot = {f"{ph}_s": sum(L[f"{ph}_s"] for L in layers) for ph in PHASES}
        out_runs.append(
            {
                "placement": name,
                "duplicated_experts": placement.duplicated(),
                "identical_to_single_process": identical,
                "ranks_agree": ranks_agree,
                "wall_s": max(g["wall_s"] for g in gathered),
                "new_tokens": sum(len(x) for x in ids),
                **tot,
                "rows_by_rank": rows_total,
                "busiest_rank": int(max(range(world), key=lambda r: (rows_total[r], -r))),
                "busiest_rank_rows": max(rows_total),
                "imbalance": max(rows_total) / (sum(rows_total) / world) if sum(rows_total) else 0.0,
                "layers": layers,
                "outputs": [
                    {"prompt_id": pid, "text": tok.decode(x, skip_special_tokens=True), "token_ids": x}
                    for (pid, _), x in zip(prompts, ids)
                ],
            }
        )
    return {
        "model": rc.model,
        "world_size": world,
        "backend": backend,
        "device": rc.device if world == 1 or not rc.device.startswith("cuda") else "cuda (one per rank)",
        "threads_per_rank": threads,
        "prompts": len(prompts),
        "batch_size": rc.batch_size,
        "max_new_tokens": rc.max_new_tokens,
        "identical_to_single_process": identical_all,
        "single_process_wall_s": ref_s,
        "reference_token_ids": reference,
        "runs": out_runs,
    }


# ---- printing -------------------------------------------------------------------------------------------


def print_report(res: dict[str, Any], *, as_json: bool) -> None:
    from rich.console import Console

    from ..tables import FitTable

    console = Console(stderr=as_json)  # a terminal's width, else 80 or $COLUMNS (FitTables wrap to it)
    ident = res["identical_to_single_process"]
    for run in res["runs"]:
        t = FitTable(
            f"moeflow ep — {Path(res['model']).name}, world size {res['world_size']} ({res['backend']}), "
            f"placement {run['placement']} ({run['duplicated_experts']} duplicated)"
        )
        for c in COLUMNS:
            t.add_column(c, justify="left" if c == "rows per rank" else "right")
        for L in run["layers"]:
            t.add_row(
                str(L["layer"]),
                str(L["calls"]),
                f"{L['dispatch_s'] * 1e3:.1f}",
                f"{L['compute_s'] * 1e3:.1f}",
                f"{L['combine_s'] * 1e3:.1f}",
                f"{L['gather_s'] * 1e3:.1f}",
                " ".join(str(r) for r in L["rows_by_rank"]),
                f"rank {L['busiest_rank']} ({L['busiest_rows']})",
                f"{L['imbalance']:.2f}",
            )
        t.add_row(
            "all",
            "",
            f"{run['dispatch_s'] * 1e3:.1f}",
            f"{run['compute_s'] * 1e3:.1f}",
            f"{run['combine_s'] * 1e3:.1f}",
            f"{run['gather_s'] * 1e3:.1f}",
            " ".join(str(r) for r in run["rows_by_rank"]),
            f"rank {run['busiest_rank']} ({run['busiest_rank_rows']})",
            f"{run['imbalance']:.2f}",
            end_section=True,
        )
        console.print(t)
        same = run["identical_to_single_process"]
        console.print(
            f"[dim]times: slowest rank, summed over the timed generation; wall {run['wall_s']:.2f} s for "
            f"{run['new_tokens']} new tokens[/]  identical to one process: "
            + ("[green]yes[/]" if same else "[red]NO[/]" if same is False else "not compared")
        )
    if res.get("single_process_wall_s") is not None:
        console.print(f"[dim]single-process reference: {res['single_process_wall_s']:.2f} s[/]")
    if not as_json and ident is False:
        console.print("[bold red]expert-parallel output differs from the single-process model[/]")
    if as_json:
        sys.stdout.write(json.dumps(res, default=str) + "\n")


def main(cfg: EPConfig) -> dict[str, Any] | None:
    res = launch(cfg)
    if res is not None:
        print_report(res, as_json=cfg.run.json)
    return res
