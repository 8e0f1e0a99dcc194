"""`moeflow run` as a function: `main(RunConfig)` loads the model, prompts and calibration, runs every
(mode, capacity, eviction, prefetch) combination asked for, prints text and a metrics table.

Everything that can be refused is refused before the first generation: the flags when the RunConfig is
built, the device and `--out` before the model loads (`RunConfig.preflight`), the calibration when it is
read, and every run of a sweep (its capacity against the model, a learned prefetcher's predictor folder)
by `check_runs` before the first run (`moeflow.stages.session`, shared with `moeflow quality`)."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from ..artifacts import atomic_write
from ..policies.parse import policy_args
from ..runtime.generate import fastest_experts_impl, generate_batch
from ..runtime.link import make_link
from ..runtime.metrics import RunMetrics, metrics_table
from .run_config import RunConfig
from .session import (
    NO_PREFETCH,
    check_runs,
    encode_prompts,
    engine_for,
    expert_bytes_of,
    host_memory,
    open_session,
    plan_runs,
    run_hooks,
    run_label,
    use_step_size,
    warm_up,
    warn_pageable,
)

RESULT_KIND = "run"  # the "kind" of every `--out` JSONL line (moeflow.outputs.check_out recognises it)


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


def adaptive_summary(s_history: list[int]) -> dict[str, Any] | None:
    """The range and mean of the step sizes an adaptive-S run's decode passes used (None: no decode pass)."""
    if not s_history:
        return None
    return {"min": min(s_history), "max": max(s_history), "mean": sum(s_history) / len(s_history), "passes": len(s_history)}


def _pick_impl(cfg: RunConfig, model: Any, batch: list[tuple[str, str, Any]], console: Console) -> tuple[str, float | None]:
    """`--experts-impl` for the resident run and the decode pass time the probe measured for it (None: not probed);
    `auto`: time the prefill and decode passes of the first prompt (repeated to the batch size) with batched_mm and
    grouped_mm, after a warm-up of each, and keep the one whose generation of --max-new-tokens tokens costs least
    (`pick_impl`)."""
    if cfg.experts_impl != "auto":
        return cfg.experts_impl, None
    ids = batch[0][2].expand(cfg.batch_size, -1)  # [B,P]
    probe = fastest_experts_impl(model, ids, new_tokens=cfg.max_new_tokens)
    console.print(
        "[dim]resident experts implementation: "
        + ", ".join(f"{k} {probe.prefill_s[k] * 1e3:.1f} ms prefill + {v * 1e3:.2f} ms/pass" for k, v in probe.decode_s.items())
        + f" -> {probe.name}[/]"
    )
    return probe.name, probe.decode_s[probe.name]


RESIDENT_SLACK = 2.0  # a resident decode slower than this x its own probe's pass time is reported as unreliable


def resident_check(tpot_s: float | None, probe_s: float | None) -> str | None:
    """One warning line when the resident run decoded more than `RESIDENT_SLACK` x slower per pass than the
    experts-implementation probe timed the same model moments before (`_pick_impl`): every run's TTFT bound and
    `x resident` divide by that run, so they are off by as much. None when the two agree or nothing was probed."""
    if tpot_s is None or probe_s is None or probe_s <= 0 or tpot_s <= RESIDENT_SLACK * probe_s:
        return None
    return (
        f"the resident run decoded at {tpot_s * 1e3:.1f} ms/token, {tpot_s / probe_s:.1f}x the {probe_s * 1e3:.1f} ms/pass "
        "its experts-implementation probe measured just before: the TTFT bounds and ratios to resident rest on it; "
        "re-run on a quiet machine, or compare with benchmarks/engine_overhead.py"
    )


def _resident_bounds(
    rows: list[RunMetrics], run_batches: list[list[RunMetrics]], results: list[dict[str, Any]], resident_ttft: dict[int, float]
) -> None:
    """Runs that ran before the resident run got the engine's own prefill compute as their TTFT bound's prefill
    time: with a resident run in the sweep, every run's bound uses the resident TTFT of the same batch."""
    if not resident_ttft:
        return
    for total, per_batch, res in zip(rows, run_batches, results):
        for bi, m in enumerate(per_batch):
            m.set_ttft_bound(resident_ttft.get(bi))
        fixed = RunMetrics.total(per_batch)
        total.ttft_bound_s_sum, total.ttft_bound_source = fixed.ttft_bound_s_sum, fixed.ttft_bound_source
        res["metrics"].update(
            ttft_bound_s=total.ttft_bound_s, ttft_bound_ratio=total.ttft_bound_ratio, ttft_bound_source=total.ttft_bound_source
        )
        res["ttft_bound_ratio"] = total.ttft_bound_ratio


def main(cfg: RunConfig, console: Console | None = None) -> list[dict[str, Any]]:
    """Run `cfg`; return one dict per run (its metrics and `outputs`: each prompt's generated text)."""
    cfg.preflight()
    if console is None:
        console = Console(stderr=cfg.json)  # a terminal's width, else 80 or $COLUMNS (FitTables wrap to it)
    from ..locks import out_lock
    from ..models import torch_threads

    with out_lock(cfg.out, wait=cfg.wait, command="moeflow run", check=cfg.preflight), torch_threads(cfg.threads):
        return _main(cfg, console)


def calibrate_command(cfg: RunConfig, link_spec: str) -> str:
    """The `moeflow calibrate` command that writes the calibration `cfg` looks for (its model, device and link)."""
    import shlex

    from ..model_paths import default_model_path
    from ..runtime.link import parse_link

    kind, gbps, lat = parse_link(link_spec)
    cmd = "moeflow calibrate"
    if cfg.model != default_model_path():
        cmd += f" --model {shlex.quote(cfg.model)}"
    if cfg.device != "cpu":
        cmd += f" --device {shlex.quote(cfg.device)}"
    if kind == "emulated":
        cmd += f" --link-gbps {gbps:g}" + (f" --link-latency-us {lat * 1e6:g}" if lat else "")
    return cmd


def _main(cfg: RunConfig, console: Console) -> list[dict[str, Any]]:
    ses = open_session(cfg, "moeflow run", resident="resident" in cfg.modes)
    model, tok, spec, device, link_spec = ses.model, ses.tok, ses.spec, ses.device, ses.link_spec
    cal, cal_path, threads, lookahead, s_source, prompts = (
        ses.cal,
        ses.cal_path,
        ses.threads,
        ses.lookahead,
        ses.s_source,
        ses.prompts,
    )
    runs = plan_runs(cfg)
    caps = check_runs(cfg, model, runs)
    encoded = encode_prompts(cfg, model, tok, prompts)
    uses_s = any(r["mode"] == "offload" and r["prefetch"] != "none" for r in runs)  # S matters (adaptive: its start)
    warn = Console(stderr=True) if console.file is sys.stdout else console  # warnings: beside the table, on stderr
    if cal is None and cfg.lookahead is None and uses_s and not console.quiet:  # once the inputs passed their checks
        fix = (  # calibrate loads the whole model on the device: not where the experts had to stay on the host
            "pass -S (`moeflow calibrate` needs the whole model on the device)"
            if ses.experts == "host"
            else f"run `{calibrate_command(cfg, link_spec)}` (or pass -S)"
        )
        warn.print(f"[bold yellow]WARNING: no calibration at {cal_path}: step size S defaults to 1; {fix}.[/]", soft_wrap=True)
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
    if ses.experts == "host":
        console.print(f"[dim]routed experts loaded in host memory, never on {cfg.device} ({escape(ses.experts_why)})[/]")

    batches = [encoded[i : i + cfg.batch_size] for i in range(0, len(encoded), cfg.batch_size)]
    gen_kw: dict[str, Any] = dict(min_new_tokens=cfg.min_new_tokens, temperature=cfg.temperature, seed=cfg.seed, eos_token_id=eos)
    warm_new = min(4, cfg.max_new_tokens)
    resident_impl: str | None = None
    resident_probe_s: float | None = None  # the probe's decode pass time of the resident implementation
    pin_errors: set[str] = set()  # why host rows stayed pageable (`HostExpertStore.pin_error`), each said once

    def make_engine(run: dict[str, Any], capacity: int | None, link: Any) -> Any:
        miss_name, miss_opts = policy_args(cfg.miss, cfg.miss_opts)
        routing_name, routing_opts = policy_args(cfg.routing, cfg.routing_opts)
        if planner is not None and planner.spec.lossy and run["mode"] == "offload":
            routing_name, routing_opts = "plan-restricted", {"renorm": planner.spec.renorm}
        if miss_name == "auto" and cal:  # the calibration timed one expert on one token on the run's device
            if cal.get("expert_time_s") is not None:  # on a CPU device that is the host's time (device(n) = host(n))
                miss_opts.setdefault("host_s" if device.type == "cpu" else "device_s", float(cal["expert_time_s"]))
            if device.type == "cpu" and cal.get("bandwidth_bytes_per_s"):
                miss_opts.setdefault("copy_s", expert_bytes_of(model) / float(cal["bandwidth_bytes_per_s"]))
        return engine_for(cfg, model, run, capacity, link, lookahead, miss_name, miss_opts, routing_name, routing_opts)

    out_f = atomic_write(cfg.out) if cfg.out else contextlib.nullcontext()
    results: list[dict[str, Any]] = []
    rows: list[RunMetrics] = []
    run_batches: list[list[RunMetrics]] = []  # each run's per-batch metrics (the TTFT bound, set per batch)
    resident_ttft: dict[int, float] = {}  # batch -> the resident run's TTFT (the bound's prefill time)
    try:
        with out_f as fh:
            for run in runs:
                capacity = caps.get(run["capacity"]) if run["mode"] == "offload" else None
                label = run_label(run, capacity, spec.total_experts, cfg)
                lossy_run = cfg.lossy(device.type, run)  # the one lossy answer (moeflow.policies.lossy), as quality's
                impl = None
                if run["mode"] == "resident":  # the stock model with its fastest stock experts implementation
                    if resident_impl is None:
                        resident_impl, resident_probe_s = _pick_impl(cfg, model, batches[0], console)
                    model.set_experts_implementation(resident_impl)
                    impl = resident_impl
                else:  # the engine replaces grouped_mm (and is bit-exact to it)
                    model.set_experts_implementation("grouped_mm")
                if cfg.warmup:  # untimed, on an engine of its own: nothing of it reaches counters or outputs
                    wkw = {**gen_kw, "min_new_tokens": min(cfg.min_new_tokens or 0, warm_new) or None}
                    warm_up(
                        ses,
                        cfg,
                        functools.partial(make_engine, run, capacity),  # (link) -> engine
                        [ids for _, _, ids in batches[0]],
                        warm_new,
                        wkw,
                        step_size=True,  # the S the timed run uses
                    )
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
                        run_hooks(cfg, model, spec, engine, cal, lookahead),
                    ):
                        s_used = use_step_size(engine, lookahead, cfg.adaptive_s)
                        if s_used.get("lookahead_note") not in (None, NO_PREFETCH):
                            console.print(f"[yellow]{label}: {s_used['lookahead_note']}[/]")
                        from ..progress import progress

                        with progress("run", enabled=cfg.progress, console=console) as prog:
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
                                if run["mode"] == "resident" and m.ttft_s is not None:
                                    resident_ttft.setdefault(bi, m.ttft_s)
                                m.set_ttft_bound(resident_ttft.get(bi))
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
                                        # the prompt and the text as they are: square brackets are not markup
                                        console.print(
                                            f"[bold]{escape(str(pid))}[/] {escape(repr(text[:80]))}\n[green]{escape(gen)}[/]"
                                        )
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
                    warn_pageable(engine, label, pin_errors, warn)  # when first met: a later run may fail
                total = RunMetrics.total(per_batch, label=label)
                total.experts_impl = impl
                total.lossy = lossy_run.lossy
                rows.append(total)
                run_batches.append(per_batch)
                results.append(
                    {
                        "run": label,
                        **run,
                        "capacity_experts": capacity,
                        "link": link.describe(),
                        **s_used,
                        "batch_size": cfg.batch_size,
                        "experts_impl": impl,
                        "host_memory": host_memory(engine),
                        "warmup": cfg.warmup,
                        "metrics": total.to_dict(),
                        "ttft_bound_ratio": total.ttft_bound_ratio,
                        "lossy": lossy_run.lossy,  # as `moeflow quality --json`'s runs (also in `metrics`)
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
    _resident_bounds(rows, run_batches, results, resident_ttft)
    console.print(metrics_table(rows, title=f"moeflow run — {Path(cfg.model).name}, {link_spec}"))
    for total, res in zip(rows, results):
        if res["mode"] == "resident" and resident_probe_s is not None:
            res["experts_impl_probe_s"] = resident_probe_s
            why = resident_check(total.tpot_s, resident_probe_s)
            if why is not None:
                res["resident_warning"] = why
                if not console.quiet:
                    warn.print(f"[bold yellow]WARNING: {escape(why)}[/]", soft_wrap=True)
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
            "experts_loaded": ses.experts,  # "device" (the whole model loaded there first) or "host" (--load-experts)
            **threads.to_dict(),
            "runs": results,
        }
        if update is not None:
            payload["plan_update"] = update
        sys.stdout.write(json.dumps(payload, default=str) + "\n")
    return results
