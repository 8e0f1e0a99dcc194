"""`moeflow run` as a function: `main(RunConfig)` loads the model, prompts and calibration, runs every
(mode, capacity, eviction, prefetch) combination asked for, prints text and a metrics table.

Everything that can be refused is refused before the first generation: the flags when the RunConfig is
built, the device and `--out` before the model loads (`RunConfig.preflight`), the calibration when it is
read, and every run of a sweep (its capacity against the model, a learned prefetcher's predictor folder)
by `plan_runs` before the first run."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from ..artifacts import atomic_write
from ..errors import ArtifactError, ConfigError, MoeflowError
from ..moe import get_adapter
from ..policies.parse import build_policy, parse_capacity, policy_args
from .adaptive_s import requested_step_size
from .config import RunConfig
from .generate import build_engine, fastest_experts_impl, generate_batch
from .link import make_link, parse_link
from .metrics import RunMetrics, metrics_table

RESULT_KIND = "run"  # the "kind" of every `--out` JSONL line (moeflow.artifacts.check_out recognises it)

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
    cal = load_calibration(path, model)
    check_step_size(cal, path)
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


# ---- prompts -----------------------------------------------------------------------------------------


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


# ---- runs -----------------------------------------------------------------------------------------------


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
    from .store import ExpertLayout

    ad = get_adapter(model)
    first = ad.per_expert_params(ad.spec.moe_layers[0])
    return ExpertLayout.of({n: p.detach() for n, p in first.items()}).row_bytes


def check_runs(cfg: RunConfig, model: Any, runs: list[dict[str, Any]]) -> dict[str, int]:
    """Check what needs the model for every run before the first one: each capacity (top-k .. all experts)
    and each learned prefetcher's predictor folder (kind, schema, model, predictor present).
    Returns capacity spec -> experts."""
    from ..policies import PREFETCH
    from ..policies.learned import LearnedPrefetch
    from .cache import check_capacity

    spec = get_adapter(model).spec
    caps: dict[str, int] = {}
    if any(r["mode"] == "offload" for r in runs):
        eb = expert_bytes_of(model)
        for c in cfg.capacities:
            caps[c] = parse_capacity(c, total_experts=spec.total_experts, expert_bytes=eb)
            check_capacity(spec, caps[c], per_layer=cfg.per_layer_cache)
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
    )


@contextlib.contextmanager
def _run_hooks(cfg: RunConfig, model: Any, spec: Any, engine: Any, cal: dict[str, Any] | None, lookahead: int):
    """`--adaptive-s` (a StepSizeController driving engine.lookahead) and `--speculative` routing."""
    with contextlib.ExitStack() as st:
        if cfg.adaptive_s and engine is not None:
            from .adaptive_s import StepSizeController

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


class _SRecorder:
    """The step size S (`engine.lookahead`) of every pass of one generate call; `done()` unsubscribes and
    returns the decode passes' (the first pass is the prefill): `RunMetrics.s_history`."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.used: list[int] = []
        if engine is not None:
            engine.observers.append(self.observe)

    def observe(self, st: Any) -> None:
        self.used.append(int(st.lookahead))

    def done(self) -> list[int]:
        if self.engine is not None and self.observe in self.engine.observers:
            self.engine.observers.remove(self.observe)
        return self.used[1:]


NO_PREFETCH = "no prefetch: S is not used"


def use_step_size(engine: Any, requested: int, adaptive: bool) -> dict[str, Any]:
    """What a run reports about S once its engine is bound (and, with --adaptive-s, its controller attached):
    `lookahead` = the S its prefetcher uses (None: it prefetches nothing, or S adapts: `lookahead_adaptive`
    is filled in after the run from `s_history`), `lookahead_requested` and `lookahead_note` when that is not
    the S asked for. A fixed S is set on the engine as used, so `s_history` holds it."""
    from .adaptive_s import prefetch_step_size

    pf = getattr(engine, "prefetcher", None)
    if pf is None or getattr(pf, "name", "none") == "none":
        return {"lookahead": None, "lookahead_requested": requested, "lookahead_note": NO_PREFETCH}
    used, why = prefetch_step_size(pf, requested)
    if adaptive:
        out: dict[str, Any] = {"lookahead": None, "lookahead_requested": requested, "lookahead_adaptive": None}
        if why is not None and getattr(pf, "lookahead", None) is not None:
            out["lookahead_note"] = f"{why}: adaptive S has no effect on it"
        elif why is not None:
            out["lookahead_note"] = f"{why}: adaptive S stays in 1..{used}"
        return out
    engine.lookahead = used
    if why is None:
        return {"lookahead": used}
    return {"lookahead": used, "lookahead_requested": requested, "lookahead_note": f"{why}: S={requested} runs as S={used}"}


def adaptive_summary(s_history: list[int]) -> dict[str, Any] | None:
    """The range and mean of the step sizes an adaptive-S run's decode passes used (None: no decode pass)."""
    if not s_history:
        return None
    return {"min": min(s_history), "max": max(s_history), "mean": sum(s_history) / len(s_history), "passes": len(s_history)}


def _label(run: dict[str, Any], capacity: int | None, total: int, cfg: RunConfig | None = None) -> str:
    suffix = (" adaptive-S" if cfg and cfg.adaptive_s else "") + (" SPECULATIVE(lossy)" if cfg and cfg.speculative else "")
    if cfg and (cfg.miss != "fetch" or cfg.routing != "standard"):
        suffix += f" miss={cfg.miss} routing={cfg.routing}"
    if cfg and cfg.plan:
        mode = dict(cfg.plan_opts).get("mode", "preload")
        suffix += " plan=casmoe:" + ("RESTRICTED(lossy)" if mode == "restricted" else mode)
    if run["mode"] != "offload" or capacity is None:
        return str(run["mode"])
    return f"C={capacity} ({100 * capacity / total:.0f}%) {run['eviction']}+{run['prefetch']}{suffix}"


def _pick_impl(cfg: RunConfig, model: Any, batch: list[tuple[str, str, Any]], console: Console) -> str:
    """`--experts-impl` for the resident run; `auto`: time decode passes of the first prompt (repeated to the
    batch size: decode-shaped) with batched_mm and grouped_mm, after a warm-up of each, and keep the faster."""
    if cfg.experts_impl != "auto":
        return cfg.experts_impl
    ids = batch[0][2].expand(cfg.batch_size, -1)  # [B,P]
    name, times = fastest_experts_impl(model, ids)
    console.print(
        "[dim]resident experts implementation: "
        + ", ".join(f"{k} {v * 1e3:.2f} ms/pass" for k, v in times.items())
        + f" -> {name}[/]"
    )
    return name


def main(cfg: RunConfig, console: Console | None = None) -> list[dict[str, Any]]:
    """Run `cfg`; return one dict per run (its metrics and `outputs`: each prompt's generated text)."""
    cfg.preflight()
    if console is None:
        stream = sys.stderr if cfg.json else sys.stdout
        console = Console(stderr=cfg.json, width=None if stream.isatty() else 160)
    from ..locks import out_lock
    from ..models import torch_threads

    with out_lock(cfg.out, wait=cfg.wait, command="moeflow run", check=cfg.preflight), torch_threads(cfg.threads):
        return _main(cfg, console)


def _main(cfg: RunConfig, console: Console) -> list[dict[str, Any]]:
    from ..models import load_model
    from ..threads import apply_threads

    device = torch.device(cfg.device)
    prompts = read_prompts(cfg)
    model, tok = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, experts_implementation="grouped_mm")
    if tok is None:
        raise MoeflowError(f"{cfg.model} has no tokenizer files; `moeflow run` needs one to encode prompts")
    spec = get_adapter(model).spec
    link_spec = resolve_link(cfg, device)
    cal, cal_path = read_calibration(cfg, model, link_spec)
    threads = apply_threads(cfg.threads, model, cfg.device, calibration=cal)
    if cal is None:
        console.print(
            f"[bold yellow]WARNING: no calibration at {cal_path}: step size S defaults to 1 "
            f"(run `moeflow calibrate` for this device and link).[/]"
        )
    lookahead, s_source = requested_step_size(cfg.lookahead, cal, spec.num_moe_layers, Path(cfg.model).name)
    runs = plan_runs(cfg)
    caps = check_runs(cfg, model, runs)
    encoded = encode_prompts(cfg, model, tok, prompts)
    planner, plans = None, {}
    if cfg.plan is not None:  # CasMoE: one plan per prompt, made before any run decodes it
        from ..plan.run import RunPlanner

        planner = RunPlanner.load(cfg.plan_spec(), model)
        plans = dict(zip([pid for pid, _, _ in encoded], planner.plan([text for _, text, _ in encoded])))
    eos = tok.eos_token_id if tok.eos_token_id is not None else getattr(model.config, "eos_token_id", None)
    console.print(
        f"[dim]{spec.arch}: {spec.num_moe_layers} MoE layers x {spec.num_experts} experts, top-{spec.top_k}, "
        f"{spec.total_experts} routed experts; link {link_spec}; S={lookahead} ({s_source}); {len(prompts)} prompt(s); "
        f"{threads.describe()}[/]"
    )

    batches = [encoded[i : i + cfg.batch_size] for i in range(0, len(encoded), cfg.batch_size)]
    gen_kw: dict[str, Any] = dict(min_new_tokens=cfg.min_new_tokens, temperature=cfg.temperature, seed=cfg.seed, eos_token_id=eos)
    warm_new = min(4, cfg.max_new_tokens)
    resident_impl: str | None = None

    def make_engine(run: dict[str, Any], capacity: int | None, link: Any) -> Any:
        miss_name, miss_opts = policy_args(cfg.miss, cfg.miss_opts)
        routing_name, routing_opts = policy_args(cfg.routing, cfg.routing_opts)
        if planner is not None and planner.spec.lossy and run["mode"] == "offload":
            routing_name, routing_opts = "plan-restricted", {"renorm": planner.spec.renorm}
        if miss_name == "auto" and cal and device.type == "cpu":  # host expert time and copy time, calibrated
            if cal.get("expert_time_s") is not None:
                miss_opts.setdefault("host_s", float(cal["expert_time_s"]))
            if cal.get("bandwidth_bytes_per_s"):
                miss_opts.setdefault("copy_s", expert_bytes_of(model) / float(cal["bandwidth_bytes_per_s"]))
        return engine_for(cfg, model, run, capacity, link, lookahead, miss_name, miss_opts, routing_name, routing_opts)

    out_f = atomic_write(cfg.out) if cfg.out else contextlib.nullcontext()
    results: list[dict[str, Any]] = []
    rows: list[RunMetrics] = []
    try:
        with out_f as fh:
            for run in runs:
                capacity = caps.get(run["capacity"]) if run["mode"] == "offload" else None
                label = _label(run, capacity, spec.total_experts, cfg)
                lossy_run = cfg.lossy(device.type, run)  # the one lossy answer (moeflow.policies.lossy), as quality's
                impl = None
                if run["mode"] == "resident":  # the stock model with its fastest stock experts implementation
                    if resident_impl is None:
                        resident_impl = _pick_impl(cfg, model, batches[0], console)
                    model.set_experts_implementation(resident_impl)
                    impl = resident_impl
                else:  # the engine replaces grouped_mm (and is bit-exact to it)
                    model.set_experts_implementation("grouped_mm")
                if cfg.warmup:  # untimed, on an engine of its own: nothing of it reaches counters or outputs
                    wlink = make_link(link_spec, device)
                    weng = make_engine(run, capacity, wlink)
                    try:
                        with (
                            weng if weng is not None else contextlib.nullcontext(),
                            _run_hooks(cfg, model, spec, weng, cal, lookahead),
                        ):
                            use_step_size(weng, lookahead, cfg.adaptive_s)  # the S the timed run uses
                            wkw = {**gen_kw, "min_new_tokens": min(cfg.min_new_tokens or 0, warm_new) or None}
                            generate_batch(model, [ids for _, _, ids in batches[0]], weng, max_new_tokens=warm_new, **wkw)
                    finally:
                        if weng is None:
                            wlink.close()
                link = make_link(link_spec, device)
                engine = make_engine(run, capacity, link)
                planned = planner if run["mode"] == "offload" and engine is not None else None
                if planned is not None:
                    planned.prepare(engine)
                per_batch: list[RunMetrics] = []
                outputs: list[dict[str, Any]] = []
                try:
                    with (
                        engine if engine is not None else contextlib.nullcontext(),
                        _run_hooks(cfg, model, spec, engine, cal, lookahead),
                    ):
                        s_used = use_step_size(engine, lookahead, cfg.adaptive_s)
                        if s_used.get("lookahead_note") not in (None, NO_PREFETCH):
                            console.print(f"[yellow]{label}: {s_used['lookahead_note']}[/]")
                        from ..progress import progress

                        with progress("run", console=console) as prog:
                            task = prog.add_task(label, total=len(encoded), unit="prompts")
                            for bi, batch in enumerate(batches):
                                s_rec = _SRecorder(engine)
                                sets = planned.begin(engine, [plans[p] for p, _, _ in batch]) if planned else {}
                                with planned.observing(engine, batch) if planned else contextlib.nullcontext():
                                    news, m = generate_batch(
                                        model,
                                        [ids for _, _, ids in batch],
                                        engine,
                                        max_new_tokens=cfg.max_new_tokens,
                                        label=label,
                                        **gen_kw,
                                    )
                                m.experts_impl = impl
                                m.lossy = lossy_run.lossy
                                m.s_history = s_rec.done()
                                if planned is not None:
                                    planned.end(engine)
                                per_batch.append(m)
                                for (pid, text, _), new in zip(batch, news):
                                    gen = tok.decode(new, skip_special_tokens=True)
                                    outputs.append(
                                        {"prompt_id": pid, "prompt": text, "text": gen, "new_tokens": int(new.numel())}
                                    )
                                    if planned is not None:
                                        outputs[-1]["plan"] = planned.report(plans[pid], sets, planned.preloaded)
                                    rec = {
                                        "kind": RESULT_KIND,
                                        "run": label,
                                        **run,
                                        "capacity_experts": capacity,
                                        "link": link.describe(),
                                        "experts_impl": impl,
                                        "batch": bi,
                                        "prompt_id": pid,
                                        "prompt": text,
                                        "text": gen,
                                        "metrics": m.to_dict(),  # the batch's (the prompt's at --batch-size 1)
                                    }
                                    if planned is not None:
                                        rec["plan"] = outputs[-1]["plan"]
                                    if fh is not None:
                                        fh.write(json.dumps(rec, default=str) + "\n")
                                    if not cfg.sweep and not cfg.json:
                                        console.print(f"[bold]{pid}[/] {text[:80]!r}\n[green]{gen}[/]")
                                    if planned is not None and not cfg.json:
                                        pl = outputs[-1]["plan"]
                                        console.print(
                                            f"[dim]  plan {pid}: {pl['path']} (sim {pl['best_sim']:.2f}), "
                                            f"{pl['ms']:.2f} ms, {pl['planned_experts']} planned, {pl['preloaded']} preloaded[/]"
                                        )
                                    prog.advance(task)
                finally:
                    if engine is None:
                        link.close()
                total = RunMetrics.total(per_batch, label=label)
                total.experts_impl = impl
                total.lossy = lossy_run.lossy
                rows.append(total)
                results.append(
                    {
                        "run": label,
                        **run,
                        "capacity_experts": capacity,
                        "link": link.describe(),
                        **s_used,
                        "batch_size": cfg.batch_size,
                        "experts_impl": impl,
                        "warmup": cfg.warmup,
                        "metrics": total.to_dict(),
                        "lossy_reasons": list(lossy_run.reasons),
                        "outputs": outputs,
                    }
                )
                if planned is not None:
                    results[-1]["plan"] = planned.summary([plans[pid] for pid, _, _ in encoded])
                if "lookahead_adaptive" in s_used:
                    ad = results[-1]["lookahead_adaptive"] = adaptive_summary(total.s_history)
                    if ad is not None:
                        console.print(
                            f"[dim]{label}: adaptive S {ad['min']}..{ad['max']}, mean {ad['mean']:.2f} "
                            f"over {ad['passes']} decode passes[/]"
                        )
    finally:
        model.set_experts_implementation("grouped_mm")
    console.print(metrics_table(rows, title=f"moeflow run — {Path(cfg.model).name}, {link_spec}"))
    if planner is not None:
        sm = planner.summary(list(plans.values()))
        console.print(
            f"plan {planner.spec.describe()}{' (LOSSY)' if sm['lossy'] else ''} (offload runs): "
            f"EAM {sm['split']['eam']} / EAP {sm['split']['eap']} prompts, planner {sm['ms_per_prompt']:.2f} ms/prompt"
        )
    update = planner.save_update() if planner is not None else None
    if update is not None:
        console.print(
            f"plan update: {update['added']} observed EP(s) added to the EAM, {update['flushed']} buffer flush(es), "
            f"{update['db_size']} entries" + (f", saved to {update['saved']}" if update["saved"] else "")
        )
    if cfg.json:
        payload: dict[str, Any] = {
            "model": cfg.model,
            "calibration": cal_path if cal else None,
            **threads.to_dict(),
            "runs": results,
        }
        if update is not None:
            payload["plan_update"] = update
        sys.stdout.write(json.dumps(payload, default=str) + "\n")
    return results
