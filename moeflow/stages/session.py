"""What `moeflow run`, `moeflow quality` and `moeflow ep` share: the session (`open_session`: the model and
tokenizer loaded under the thread rule, the link resolved, the calibration found and checked, the step size
S asked for), the prompts (`read_prompts`, `encode_prompts`), the checks made before the first generation
(`plan_runs`, `check_runs`), the engine of one planned run (`engine_for`, `run_hooks`, `use_step_size`) and
its untimed warm-up (`warm_up`).

Everything that can be refused is refused before the first generation: the flags when the RunConfig is
built, the device and `--out` before the model loads (`RunConfig.preflight`), the calibration when it is
read, and every run of a sweep (its capacity against the model, a learned prefetcher's predictor folder)
by `check_runs` before the first run."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ArtifactError, ConfigError, MoeflowError
from ..moe import get_adapter
from ..policies.parse import build_policy, parse_capacity, policy_args
from ..runtime.adaptive_s import requested_step_size
from ..runtime.generate import build_engine, generate_batch
from ..runtime.link import make_link, parse_link
from ..runtime.timing import settle_heap
from .run_config import RunConfig, check_config_model, experts_placement
from .threads import apply_threads


@dataclass
class Session:
    """What one `moeflow run` / `moeflow quality` works with, loaded once (`open_session`)."""

    model: Any
    tok: Any  # its tokenizer
    spec: Any  # `moeflow.moe.MoESpec`
    device: torch.device
    link_spec: str  # `--link` with `auto` resolved
    cal: dict[str, Any] | None  # the calibration found (None: none)
    cal_path: str  # where it was looked for
    threads: Any  # `moeflow.threads.ThreadChoice`
    lookahead: int  # the step size S asked for (-S, the calibration's, or 1)
    s_source: str  # where S comes from
    prompts: list[tuple[str, str]]  # (id, text)
    experts: str = "device"  # where the routed experts loaded: "device" (with the model) or "host" (never on it)
    experts_why: str = ""  # why (`experts_placement`)


def open_session(cfg: RunConfig, command: str, *, resident: bool) -> Session:
    """Read the prompts, load the model and tokenizer (`command` needs one: refused without), resolve the link,
    read the calibration, apply the thread rule (`moeflow.threads`) and resolve the step size S. `resident`: a run
    of the stock model follows (every expert must then load on the device)."""
    from ..models import load_model

    device = torch.device(cfg.device)
    prompts = read_prompts(cfg)
    check_before_load(cfg)
    experts, experts_why = placement_for(cfg, command, resident)
    model, tok = load_model(
        cfg.model,
        dtype=cfg.dtype,
        device=cfg.device,
        experts_implementation="grouped_mm",
        experts_device="cpu" if experts == "host" else None,
    )
    check_config_model(cfg, model)  # a --config file tuned for another model, before its calibration is read
    if tok is None:
        raise MoeflowError(f"{cfg.model} has no tokenizer files; `{command}` needs one to encode prompts")
    spec = get_adapter(model).spec
    link_spec = resolve_link(cfg, device)
    cal, cal_path = read_calibration(cfg, model, link_spec)
    threads = apply_threads(cfg.threads, model, cfg.device, calibration=cal)
    flag = f"--config {cfg.config}" if "lookahead" in cfg.config_keys else "-S"
    lookahead, s_source = requested_step_size(cfg.lookahead, cal, spec.num_moe_layers, Path(cfg.model).name, flag)
    settle_heap()  # no full collection over the loaded model's objects in the middle of a timed decode step
    return Session(
        model, tok, spec, device, link_spec, cal, cal_path, threads, lookahead, s_source, prompts, experts, experts_why
    )


def host_memory(engine: Any) -> str | None:
    """Where an engine on a CUDA device keeps the experts' host rows: "pinned", or "pageable" where page-locking
    failed (`HostExpertStore.pin_error`, a warning); None without an engine or on a CPU device (nothing to lock)."""
    if engine is None or not engine.store.pin:
        return None
    return "pageable" if engine.store.pin_error is not None else "pinned"


def warn_pageable(engine: Any, label: str, seen: set[str], warn: Any) -> None:
    """Print, on `warn` (a rich Console), one warning per distinct reason an engine's host rows stayed pageable
    (`HostExpertStore.pin_error`), when first met: copies from pageable memory are slower, so the run's speed is."""
    why = None if engine is None else engine.store.pin_error
    if why is None or why in seen:
        return
    seen.add(why)
    if not warn.quiet:
        from rich.markup import escape

        warn.print(f"[bold yellow]WARNING: {escape(label)}: {escape(why)}.[/]", soft_wrap=True)


def placement_for(cfg: Any, command: str, resident: bool) -> tuple[str, str]:
    """`experts_placement` for a config with `model`, `dtype`, `device` and `load_experts` (run's, trace's): the
    checkpoint's size (in the dtype it loads in) and the device's free memory measured now, before the load."""
    device = torch.device(cfg.device)
    if device.type == "cpu" or cfg.load_experts != "auto":
        return experts_placement(cfg.load_experts, device.type, None, None, resident, command)
    from ..models import loaded_bytes

    weights = loaded_bytes(cfg.model, cfg.dtype, cfg.device)  # None: unknown (no folder, a quantized checkpoint)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    return experts_placement(cfg.load_experts, device.type, weights, free, resident, command)


def check_before_load(cfg: RunConfig) -> None:
    """What the checkpoint's config alone decides, before its weights load (seconds to minutes for a large one):
    `-S` against its MoE layers, and each capacity given as experts or a percentage against top-k .. all experts
    (a size in bytes needs the loaded experts: `check_runs`). The MoE shape comes from the model built on the meta
    device; where that fails, the same checks run after the load."""
    from ..runtime.adaptive_s import check_step_size

    offload = "offload" in cfg.modes
    if cfg.lookahead is None and not offload:  # nothing the config decides: no model built
        return
    spec = spec_before_load(cfg.model)
    if spec is None:
        return
    if cfg.lookahead is not None:
        check_step_size(cfg.lookahead, spec.num_moe_layers, Path(cfg.model).name)
    if offload:
        check_capacities(cfg.capacities, spec, None, per_layer=cfg.per_layer_cache)


def spec_before_load(model: str) -> Any:
    """The checkpoint's MoE shape from its config alone (the model built on the meta device, no weights read), or
    None where that fails (load_model then says what is wrong with the checkpoint, in one line)."""
    from ..models import read_config
    from ..moe import spec_from_config

    try:
        return spec_from_config(read_config(model))
    except Exception:
        return None


def check_capacities(
    capacities: tuple[str, ...], spec: Any, expert_bytes: int | None, *, per_layer: bool = False
) -> dict[str, int]:
    """Capacity spec -> experts for every capacity, each checked against `spec` (top-k .. all experts, per layer
    with `per_layer`); without `expert_bytes` a size in bytes is left out (checked once the experts' bytes are known)."""
    from ..runtime.cache import check_capacity

    caps: dict[str, int] = {}
    for c in capacities:
        try:
            caps[c] = parse_capacity(c, total_experts=spec.total_experts, expert_bytes=expert_bytes)
        except ConfigError:
            if expert_bytes is not None:
                raise
            continue  # a size in bytes, before the load
        check_capacity(spec, caps[c], per_layer=per_layer, given=c, expert_bytes=expert_bytes)
    return caps


def warm_up(
    s: Session,
    cfg: RunConfig,
    make_engine: Callable[[Any], Any],
    inputs: list[Any],
    max_new_tokens: int,
    gen_kw: dict[str, Any],
    *,
    step_size: bool = False,
) -> None:
    """One untimed generation of `inputs` (input ids [1,P] each) on an engine and link of its own
    (`make_engine(link)`), so nothing of it reaches the timed run's counters or outputs; `step_size`: set the
    S the timed run uses on it first (`use_step_size`). An emulated link warms up at a fast rate: the warm-up runs
    the same code paths, and on a slow emulated link its copies would take seconds that measure nothing."""
    wlink = make_link(warm_up_link(s.link_spec), s.device)
    weng = make_engine(wlink)
    try:
        with weng if weng is not None else contextlib.nullcontext(), run_hooks(cfg, s.model, s.spec, weng, s.cal, s.lookahead):
            if step_size:
                use_step_size(weng, s.lookahead, cfg.adaptive_s)
            generate_batch(s.model, inputs, weng, max_new_tokens=max_new_tokens, **gen_kw)
    finally:
        if weng is None:
            wlink.close()


WARM_UP_GBPS = 1000.0  # an emulated link's rate during the untimed warm-up (GB/s)


def warm_up_link(link_spec: str) -> str:
    """The link the untimed warm-up uses: `link_spec` itself, except that an emulated link runs at
    `WARM_UP_GBPS` with no latency (a CUDA or direct link is the real one)."""
    kind, _, _ = parse_link(link_spec)
    return f"emulated:{WARM_UP_GBPS:g}" if kind == "emulated" else link_spec


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
    from ..calibrate import calibration_path, check_calibration, device_name, load_calibration, missing_calibration

    kind, gbps, _ = parse_link(link_spec)
    if cfg.calibration:
        path = Path(cfg.calibration)
    else:
        path = calibration_path(device_name(cfg.device, gbps if kind == "emulated" else None))
    if not path.is_file():
        if cfg.calibration:
            raise MoeflowError(missing_calibration(path))
        return None, str(path)
    cal = load_calibration(path, model)
    check_step_size(cal, path)
    check_calibration(cal, path, cfg.device)  # measured here, with positive times and bandwidth
    return cal, str(path)


def check_step_size(cal: dict[str, Any], path: str | Path) -> None:
    """Refuse a calibration whose step size S (`initial_s`) is not an integer >= 1 (S = 0 would prefetch the
    layer that is already running)."""
    s = cal.get("initial_s")
    if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
        raise ArtifactError(
            f"calibration {path} has step size S = {s!r}, S must be an integer >= 1; "
            f"re-run `moeflow calibrate` or pass another --calibration"
        )


def read_prompts(cfg: RunConfig) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = [(f"prompt-{i}", t) for i, t in enumerate(cfg.prompt)]
    if cfg.prompts:
        from ..data.prompts import load_prompts

        out += [
            (p.id, p.text)
            for p in load_prompts(cfg.prompts, data_dir=cfg.data_dir, limit=cfg.limit, split=cfg.split, column=cfg.column)
        ]
    if cfg.limit is not None:
        out = out[: cfg.limit]
    if not out:
        raise ConfigError("no prompts to run")
    return out


def plan_runs(cfg: RunConfig) -> list[dict[str, Any]]:
    """Every (mode, capacity, eviction, prefetch) combination, in flag order (non-offload modes once)."""
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


def expert_bytes_of(model: Any) -> int:
    """Bytes of one routed expert as the host store lays it out (the unit of a byte-size --capacity)."""
    from ..runtime.store import ExpertLayout

    ad = get_adapter(model)
    first = ad.per_expert_params(ad.spec.moe_layers[0])
    return ExpertLayout.of({n: p.detach() for n, p in first.items()}).row_bytes


def check_runs(cfg: RunConfig, model: Any, runs: list[dict[str, Any]]) -> dict[str, int]:
    """Check what needs the model for every run before the first one: each capacity (top-k .. all experts)
    and each learned prefetcher's predictor folder (kind, schema, model, predictor present).
    Returns capacity spec -> experts."""
    from ..policies import PREFETCH
    from ..policies.learned import LearnedPrefetch

    spec = get_adapter(model).spec
    caps: dict[str, int] = {}
    if any(r["mode"] == "offload" for r in runs):
        caps = check_capacities(cfg.capacities, spec, expert_bytes_of(model), per_layer=cfg.per_layer_cache)
        for text in cfg.prefetches:
            pol = build_policy(PREFETCH, text, cfg.prefetch_opts)
            if isinstance(pol, LearnedPrefetch):
                from ..artifacts import check_fingerprint
                from ..moe import model_fingerprint
                from ..predict.io import read_predictor_meta

                meta = read_predictor_meta(pol.folder)
                check_fingerprint(meta, model_fingerprint(model), "predictor folder", pol.folder)
                if pol.predictor not in meta.get("predictors", []):
                    raise ArtifactError(
                        f"{pol.folder} has no {pol.predictor} predictor; re-run "
                        f"`moeflow train --only {pol.predictor}` or pick another --prefetch"
                    )
    return caps


def encode_prompts(cfg: RunConfig, model: Any, tok: Any, prompts: list[tuple[str, str]]) -> list[tuple[str, str, Any]]:
    """(id, text, input ids [1,P]) per prompt, at most --max-prompt-tokens (the beginning kept). A
    --max-prompt-tokens, or a prompt + --max-new-tokens, beyond the model's maximum position is refused
    before the first generation (`moeflow.models.check_lengths`); nothing is cut to make it fit."""
    from ..models import check_lengths

    check_lengths(model, cfg.max_prompt_tokens, 0)
    encoded = []
    for pid, text in prompts:
        ids = tok(text, return_tensors="pt", truncation=True, max_length=cfg.max_prompt_tokens).input_ids  # [1,P<=max]
        check_lengths(model, ids.shape[1], cfg.max_new_tokens, what=f"prompt {pid} ({text[:30]!r})")
        encoded.append((pid, text, ids))
    return encoded


def engine_for(
    cfg: RunConfig,
    model: Any,
    run: dict[str, Any],
    capacity: int | None,
    link: Any,
    lookahead: int,
    miss: str,
    miss_opts: dict[str, Any],
    routing: str,
    routing_opts: dict[str, Any],
) -> Any:
    """`build_engine` for one planned run: its eviction / prefetch (with the config's --*-opt pairs), and the
    miss / routing policies the caller resolved."""
    ev_name, ev_opts = policy_args(run["eviction"] or "lru", cfg.eviction_opts)
    pf_name, pf_opts = policy_args(run["prefetch"] or "none", cfg.prefetch_opts)
    if cfg.speculative and "gate" not in pf_opts:
        # speculative execution computes exactly the predicted experts: refusing their prefetch only makes misses
        pf_opts = {**pf_opts, "gate": "off"}
    return build_engine(
        model,
        mode=run["mode"],
        link=link,
        capacity=capacity or 0,
        eviction=ev_name,
        prefetch=pf_name,
        miss=miss,
        routing=routing,
        miss_opts=miss_opts,
        routing_opts=routing_opts,
        per_layer=cfg.per_layer_cache,
        lookahead=lookahead,
        eviction_opts=ev_opts,
        prefetch_opts=pf_opts,
        prefill=getattr(cfg, "prefill", "staged"),
    )


@contextlib.contextmanager
def run_hooks(cfg: RunConfig, model: Any, spec: Any, engine: Any, cal: dict[str, Any] | None, lookahead: int):
    """`--adaptive-s` (a StepSizeController driving engine.lookahead) and `--speculative` routing."""
    with contextlib.ExitStack() as st:
        if cfg.adaptive_s and engine is not None:
            from ..runtime.adaptive_s import StepSizeController

            ctrl = StepSizeController.for_engine(  # the engine is entered first: its prefetcher is bound
                engine, num_moe_layers=spec.num_moe_layers, num_layers=spec.num_layers, calib=cal, lookahead=lookahead
            )
            st.callback(ctrl.attach(engine))
        if cfg.speculative:
            pf = engine.prefetcher if engine is not None else None
            pred = pf.pred if pf is not None and pf.speculates else None
            if pred is None:
                raise ConfigError(
                    "--speculative needs --mode offload --prefetch router-pf|estimator|hybrid --prefetch-opt predictors=DIR"
                )
            from ..predict.speculative import speculative_routing

            st.enter_context(speculative_routing(model, pred, engine=engine, adapter=engine.adapter))
        yield


NO_PREFETCH = "no prefetch: S is not used"


def use_step_size(engine: Any, requested: int, adaptive: bool) -> dict[str, Any]:
    """What a run reports about S once its engine is bound (and, with --adaptive-s, its controller attached):
    `lookahead` = the S its prefetcher uses (None: it prefetches nothing, or S adapts: `lookahead_adaptive`
    is filled in after the run from `s_history`), `lookahead_requested` and `lookahead_note` when that is not
    the S asked for. A fixed S is set on the engine as used, so `s_history` holds it."""
    from ..runtime.adaptive_s import prefetch_step_size

    pf = engine.prefetcher if engine is not None else None
    if pf is None or not pf.proposes:
        return {"lookahead": None, "lookahead_requested": requested, "lookahead_note": NO_PREFETCH}
    used, why = prefetch_step_size(pf, requested)
    if adaptive:
        out: dict[str, Any] = {"lookahead": None, "lookahead_requested": requested, "lookahead_adaptive": None}
        if why is not None and pf.lookahead is not None:
            out["lookahead_note"] = f"{why}: adaptive S has no effect on it"
        elif why is not None:
            out["lookahead_note"] = f"{why}: adaptive S stays in 1..{used}"
        return out
    engine.lookahead = used
    if why is None:
        return {"lookahead": used}
    return {"lookahead": used, "lookahead_requested": requested, "lookahead_note": f"{why}: S={requested} runs as S={used}"}


def run_label(run: dict[str, Any], capacity: int | None, total: int, cfg: RunConfig | None = None) -> str:
    suffix = (" adaptive-S" if cfg and cfg.adaptive_s else "") + (" SPECULATIVE(lossy)" if cfg and cfg.speculative else "")
    if cfg and (cfg.miss != "fetch" or cfg.routing != "standard"):
        suffix += f" miss={cfg.miss} routing={cfg.routing}"
    if cfg and cfg.plan:
        mode = dict(cfg.plan_opts).get("mode", "preload")
        suffix += " plan=casmoe:" + ("RESTRICTED(lossy)" if mode == "restricted" else mode)
    if run["mode"] != "offload" or capacity is None:
        return str(run["mode"])
    return f"C={capacity} ({100 * capacity / total:.0f}%) {run['eviction']}+{run['prefetch']}{suffix}"
