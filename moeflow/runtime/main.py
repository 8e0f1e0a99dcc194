"""`moeflow run` as a function: `main(RunConfig)` loads the model, prompts and calibration, runs every
(mode, capacity, eviction, prefetch) combination asked for, prints text and a metrics table."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from ..artifacts import atomic_write
from ..errors import ConfigError, MoeflowError
from ..moe import get_adapter
from .config import RunConfig, opts_dict, parse_capacity
from .generate import build_engine, generate_one
from .link import make_link, parse_link
from .metrics import RunMetrics, metrics_table

# ---- calibration -------------------------------------------------------------------------------------

def resolve_link(cfg: RunConfig, device: torch.device) -> str:
    """`auto` is `cuda` on a CUDA device and `direct` (a plain copy, no emulation) on CPU."""
    kind, _, _ = parse_link(cfg.link)
    if kind != "auto":
        return cfg.link
    return "cuda" if device.type == "cuda" else "direct"


def read_calibration(cfg: RunConfig, model: Any, link_spec: str) -> tuple[dict[str, Any] | None, str]:
    """(calibration or None, path looked at): `--calibration FILE`, else what `moeflow calibrate` writes for
    this device and link (`calibration/cpu.json`, `calibration/cpu-emulated-2gbps.json`, `calibration/cuda-....json`).
    A calibration made for another model is refused (moeflow.calibrate.load_calibration checks the fingerprint)."""
    from ..calibrate import calibration_path, device_name, load_calibration
    kind, gbps, _ = parse_link(link_spec)
    if cfg.calibration:
        path = Path(cfg.calibration)
    else:
        path = calibration_path(device_name(cfg.device, gbps if kind == "emulated" else None))
    if not path.is_file():
        if cfg.calibration:
            raise MoeflowError(f"calibration file {path} does not exist; run `moeflow calibrate` or drop --calibration")
        return None, str(path)
    return load_calibration(path, model), str(path)


# ---- prompts -----------------------------------------------------------------------------------------

def read_prompts(cfg: RunConfig) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = [(f"prompt-{i}", t) for i, t in enumerate(cfg.prompt)]
    if cfg.prompts:
        from ..data.prompts import load_prompts
        out += [(p.id, p.text) for p in load_prompts(cfg.prompts, data_dir=cfg.data_dir, limit=cfg.limit, split=cfg.split)]
    if cfg.limit is not None:
        out = out[:cfg.limit]
    if not out:
        raise ConfigError("no prompts to run")
    return out


# ---- runs -----------------------------------------------------------------------------------------------

def plan_runs(cfg: RunConfig) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for mode in cfg.modes:
        if mode != "offload":
            runs.append({"mode": mode, "capacity": None, "eviction": None, "prefetch": None})
            continue
        for cap in cfg.capacities:
            for ev in cfg.evictions:
                for pf in cfg.prefetches:
                    runs.append({"mode": mode, "capacity": cap, "eviction": ev, "prefetch": pf})
    return runs


@contextlib.contextmanager
def _run_hooks(cfg: RunConfig, model: Any, spec: Any, engine: Any, cal: dict[str, Any] | None, lookahead: int):
    """`--adaptive-s` (a StepSizeController driving engine.lookahead) and `--speculative` routing."""
    with contextlib.ExitStack() as st:
        if cfg.adaptive_s and engine is not None:
            from .stepsize import StepSizeController
            hi = max(1, spec.num_moe_layers - 1)
            ctrl = (StepSizeController.from_calibration(cal, max_s=hi, num_layers=spec.num_layers) if cal
                    else StepSizeController(initial_s=min(lookahead, hi), max_s=hi, num_layers=spec.num_layers))
            st.callback(ctrl.attach(engine))
        if cfg.speculative:
            pred = getattr(getattr(engine, "prefetcher", None), "pred", None)
            if pred is None or getattr(pred, "name", "") == "forest":
                raise ConfigError("--speculative needs --mode offload --prefetch router-pf|estimator|hybrid "
                                  "--prefetch-opt predictors=DIR")
            from ..predict.speculative import speculative_routing
            st.enter_context(speculative_routing(model, pred, engine=engine, adapter=engine.adapter))
        yield


def _label(run: dict[str, Any], capacity: int | None, total: int, cfg: RunConfig | None = None) -> str:
    suffix = (" adaptive-S" if cfg and cfg.adaptive_s else "") + (" SPECULATIVE(lossy)" if cfg and cfg.speculative else "")
    if run["mode"] != "offload":
        return run["mode"]
    return f"C={capacity} ({100 * capacity / total:.0f}%) {run['eviction']}+{run['prefetch']}{suffix}"


def main(cfg: RunConfig, console: Console | None = None) -> list[dict[str, Any]]:
    if console is None:
        import sys
        stream = sys.stderr if cfg.json else sys.stdout
        console = Console(stderr=cfg.json, width=None if stream.isatty() else 160)
    from ..models import torch_threads
    with torch_threads(cfg.threads):
        return _main(cfg, console)


def _main(cfg: RunConfig, console: Console | None) -> list[dict[str, Any]]:
    from ..models import load_model
    device = torch.device(cfg.device)
    model, tok = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, experts_implementation="grouped_mm")
    if tok is None:
        raise MoeflowError(f"{cfg.model} has no tokenizer files; `moeflow run` needs one to encode prompts")
    spec = get_adapter(model).spec
    link_spec = resolve_link(cfg, device)
    cal, cal_path = read_calibration(cfg, model, link_spec)
    if cal is None:
        console.print(f"[bold yellow]WARNING: no calibration at {cal_path}: step size S defaults to 1 "
                      f"(run `moeflow calibrate` for this device and link).[/]")
    lookahead = cfg.lookahead or int((cal or {}).get("initial_s") or 1)
    prompts = read_prompts(cfg)
    max_pos = int(getattr(model.config, "max_position_embeddings", 4096))
    encoded = []
    for pid, text in prompts:
        keep = max(1, min(cfg.max_prompt_tokens, max_pos - cfg.max_new_tokens))
        ids = tok(text, return_tensors="pt").input_ids[:, :keep]                     # [1,P]
        encoded.append((pid, text, ids))
    eos = tok.eos_token_id if tok.eos_token_id is not None else getattr(model.config, "eos_token_id", None)
    console.print(f"[dim]{spec.arch}: {spec.num_moe_layers} MoE layers x {spec.num_experts} experts, top-{spec.top_k}, "
                  f"{spec.total_experts} routed experts; link {link_spec}; S={lookahead}; {len(prompts)} prompt(s)[/]")

    out_f = atomic_write(cfg.out) if cfg.out else contextlib.nullcontext()
    results: list[dict[str, Any]] = []
    rows: list[RunMetrics] = []
    with out_f as fh:
        for run in plan_runs(cfg):
            link = make_link(link_spec, device)
            expert_bytes = None
            capacity = None
            if run["mode"] == "offload":
                from .store import ExpertLayout
                first = get_adapter(model).per_expert_params(spec.moe_layers[0])
                expert_bytes = ExpertLayout.of({n: p.detach() for n, p in first.items()}).row_bytes
                capacity = parse_capacity(run["capacity"], total_experts=spec.total_experts, expert_bytes=expert_bytes)
            label = _label(run, capacity, spec.total_experts, cfg)
            engine = build_engine(model, mode=run["mode"], link=link, capacity=capacity or 0,
                                  eviction=run["eviction"] or "lru", prefetch=run["prefetch"] or "none",
                                  miss=cfg.miss, routing=cfg.routing, per_layer=cfg.per_layer_cache,
                                  lookahead=lookahead, eviction_opts=opts_dict(cfg.eviction_opts),
                                  prefetch_opts=opts_dict(cfg.prefetch_opts))
            per_prompt: list[RunMetrics] = []
            try:
                with (engine if engine is not None else contextlib.nullcontext()), \
                        _run_hooks(cfg, model, spec, engine, cal, lookahead):
                    from rich.progress import Progress
                    with Progress(console=console, transient=True, disable=not console.is_terminal) as prog:
                        task = prog.add_task(label, total=len(encoded))
                        for pid, text, ids in encoded:
                            new, m = generate_one(model, ids, engine, max_new_tokens=cfg.max_new_tokens,
                                                  min_new_tokens=cfg.min_new_tokens, temperature=cfg.temperature,
                                                  seed=cfg.seed, eos_token_id=eos, label=label)
                            gen = tok.decode(new, skip_special_tokens=True)
                            per_prompt.append(m)
                            rec = {"run": label, **run, "capacity_experts": capacity, "link": link.describe(),
                                   "prompt_id": pid, "prompt": text, "text": gen, "metrics": m.to_dict()}
                            if fh is not None:
                                fh.write(json.dumps(rec, default=str) + "\n")
                            if not cfg.sweep and not cfg.json:
                                console.print(f"[bold]{pid}[/] {text[:80]!r}\n[green]{gen}[/]")
                            prog.advance(task)
            finally:
                if engine is None:
                    link.close()
            total = RunMetrics.total(per_prompt, label=label)
            rows.append(total)
            results.append({"run": label, **run, "capacity_experts": capacity, "link": link.describe(),
                            "lookahead": lookahead, "metrics": total.to_dict()})
    console.print(metrics_table(rows, title=f"moeflow run — {Path(cfg.model).name}, {link_spec}"))
    if cfg.json:
        from ..cli.common import print_json
        print_json({"model": cfg.model, "calibration": cal_path if cal else None, "runs": results})
    return results
