"""`moeflow quality` as a function: `main(QualityConfig)` loads the model once, runs the reference (`resident`,
the stock model with the `grouped_mm` experts the engine is bit-exact to) and every configuration of the sweep
on the same prompts, text windows and questions, and prints one table (with --json: one JSON object).

Each configuration runs on a fresh engine: an untimed warm-up, the greedy generations (TPOT, bytes per token:
`RunMetrics`), then the perplexity windows and the task questions under the same engine, so its expert cache
carries over as it would in a session. Everything that can be refused is refused before the first run.

With `--plan casmoe` the offload runs use `moeflow.plan.run.RunPlanner` as `moeflow run` does: one plan per
greedy prompt, per task question and per perplexity window (planned from the window's own text: it has no
prompt), applied around that prompt / question / window; `mode=restricted` is labelled lossy."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
from itertools import product
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from ..policies.lossy import device_type
from ..policies.parse import policy_args
from ..quality import measure
from ..runtime.generate import generate_batch
from ..runtime.link import make_link
from ..runtime.metrics import RunMetrics
from .quality_config import QualityConfig, run_config_for
from .run_config import RunConfig
from .session import (
    check_runs,
    encode_prompts,
    engine_for,
    host_memory,
    open_session,
    plan_runs,
    run_hooks,
    run_label,
    warm_up,
    warn_pageable,
)

RESULT_KIND = "quality"


def plan(cfg: QualityConfig) -> list[dict[str, Any]]:
    """The reference first, then every (miss, routing) x (mode, capacity, eviction, prefetch) of the sweep
    (on-demand once: it always fetches and keeps the router's choice)."""
    runs: list[dict[str, Any]] = [{"mode": "resident", "capacity": None, "eviction": None, "prefetch": None}]
    runs[0].update(miss=None, routing=None, speculative=False, lossy=False, lossy_reasons=[], plan=None)
    pspec = cfg.run.plan_spec()
    seen_on_demand = False
    for miss, routing in product(cfg.misses, cfg.routings):
        rc = run_config_for(cfg.run, miss, routing)
        for r in plan_runs(rc):
            if r["mode"] == "resident" or (r["mode"] == "on-demand" and seen_on_demand):
                continue
            seen_on_demand |= r["mode"] == "on-demand"
            off = r["mode"] == "offload"
            why = rc.lossy(device_type(cfg.run.device), r)  # the one lossy answer, as `moeflow run`'s
            runs.append(
                {
                    **r,
                    "miss": miss if off else None,
                    "routing": routing if off else None,
                    "speculative": cfg.run.speculative and off,
                    "lossy": why.lossy,
                    "lossy_reasons": list(why.reasons),
                    "plan": pspec.describe() if off and pspec is not None else None,
                }
            )
    return runs


def label(run: dict[str, Any], capacity: int | None, total: int, cfg: RunConfig) -> str:
    base = run_label(run, capacity, total)
    if run["mode"] == "offload":
        extra = [x for x in (run["miss"], run["routing"]) if x not in ("fetch", "standard")]
        base += "".join(f" {x}" for x in extra) + (" speculative" if run["speculative"] else "")
        if run.get("plan"):
            base += f" plan={run['plan'].split()[0]}"
    return base


def make_engine(
    cfg: RunConfig, model: Any, run: dict[str, Any], capacity: int | None, link: Any, lookahead: int, planner: Any = None
) -> Any:
    """`build_engine` for one run, with the miss / routing policies' inline options (a restricted CasMoE plan's
    routing on offload runs, as `moeflow run`)."""
    miss_name, miss_opts = policy_args(run["miss"] or "fetch", cfg.miss_opts)  # inline options win, as `run`
    rt_name, rt_opts = policy_args(run["routing"] or "standard", cfg.routing_opts)
    if planner is not None and planner.spec.lossy and run["mode"] == "offload":
        rt_name, rt_opts = "plan-restricted", {"renorm": planner.spec.renorm}
    return engine_for(cfg, model, run, capacity, link, lookahead, miss_name, miss_opts, rt_name, rt_opts)


def main(cfg: QualityConfig, console: Console | None = None) -> dict[str, Any]:
    """Run `cfg`; return {"model", "reference", "text", "task", "runs": [...]} (what --json prints, and each run's
    per-token NLLs `ppl_token_nll`, left out of --json)."""
    cfg.preflight()
    if console is None:
        console = Console(stderr=cfg.run.json)  # a terminal's width, else 80 or $COLUMNS (FitTables wrap to it)
    from ..models import torch_threads

    with torch_threads(cfg.run.threads):
        return _main(cfg, console)


def _main(cfg: QualityConfig, console: Console) -> dict[str, Any]:
    rc = cfg.run
    ses = open_session(rc, "moeflow quality", resident=True)  # its reference is the stock model
    model, tok, spec, device, link_spec = ses.model, ses.tok, ses.spec, ses.device, ses.link_spec
    cal, cal_path, threads, lookahead, prompts = ses.cal, ses.cal_path, ses.threads, ses.lookahead, ses.prompts
    runs = plan(cfg)
    caps: dict[str, int] = {}
    for miss, routing in product(cfg.misses, cfg.routings):
        caps.update(check_runs(run_config_for(rc, miss, routing), model, runs))
    encoded = encode_prompts(rc, model, tok, prompts)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    text, text_desc = measure.load_text(cfg.text, rc.data_dir) if cfg.ppl_windows else ("", "none")
    windows = measure.text_windows(tok, text, cfg.ppl_tokens, cfg.ppl_windows, max_pos) if cfg.ppl_windows else []
    items: list[measure.Item] = []
    letters: list[int] = []
    if cfg.task == "mmlu":
        items = measure.mmlu_items(rc.data_dir, cfg.task_limit)
        letters = measure.letter_ids(tok)
    elif cfg.task == "gsm8k":
        items = measure.gsm8k_items(rc.data_dir, cfg.task_limit)
    keep = (max_pos or 1 << 30) - (cfg.task_new_tokens if cfg.task == "gsm8k" else 0)
    item_ids = [tok(it.prompt, return_tensors="pt", verbose=False).input_ids[:, -max(1, keep) :] for it in items]  # the end kept
    planner, prompt_plans, window_plans, item_plans = None, [], [], []
    if rc.plan is not None:  # CasMoE (moeflow.plan.run, as `run`): plans made before any run
        from ..plan.run import RunPlanner

        planner = RunPlanner.load(rc.plan_spec(), model)
        prompt_plans = planner.plan([text for _, text, _ in encoded])
        window_plans = planner.plan([tok.decode(w[0]) for w in windows]) if windows else []  # the window's own text
        item_plans = planner.plan([it.prompt for it in items]) if items else []
    chance = 1 / len(letters) if cfg.task == "mmlu" else 0.0
    eos = tok.eos_token_id if tok.eos_token_id is not None else getattr(model.config, "eos_token_id", None)
    new_min = rc.min_new_tokens if rc.min_new_tokens is not None else rc.max_new_tokens
    gen_kw: dict[str, Any] = dict(temperature=0.0, seed=rc.seed, eos_token_id=eos)
    console.print(
        f"[dim]{spec.arch}: {spec.num_moe_layers} MoE layers x {spec.num_experts} experts, top-{spec.top_k}; link "
        f"{link_spec}; S={lookahead}; {len(encoded)} prompt(s) x {rc.max_new_tokens} tokens; perplexity "
        f"{sum(int(w.shape[1]) - 1 for w in windows)} tokens of {text_desc}; task {cfg.task} ({len(items)}); "
        f"{threads.describe()}[/]"
    )

    results: list[dict[str, Any]] = []
    pin_errors: set[str] = set()  # why host rows stayed pageable (`HostExpertStore.pin_error`), each said once
    ref_outs: list[torch.Tensor] = []
    ref_score: measure.StreamScore | None = None
    model.set_experts_implementation("grouped_mm")  # the engine is bit-exact to it: resident's numerics
    for run in runs:
        capacity = caps.get(run["capacity"]) if run["mode"] == "offload" else None
        name = label(run, capacity, spec.total_experts, rc)
        run_rc = run_config_for(rc, run["miss"] or rc.miss, run["routing"] or rc.routing)  # resident: rc's own
        spec_rc = run_rc if run["speculative"] else dataclasses.replace(run_rc, speculative=False)
        if rc.warmup:
            warm_up(
                ses,
                spec_rc,
                functools.partial(
                    make_engine, rc, model, run, capacity, lookahead=lookahead, planner=planner
                ),  # (link) -> engine
                [encoded[0][2]],
                min(4, rc.max_new_tokens),
                gen_kw,
            )
        link = make_link(link_spec, device)
        engine = make_engine(rc, model, run, capacity, link, lookahead, planner)
        planned = planner if run["mode"] == "offload" and engine is not None else None
        if planned is not None:
            planned.prepare(engine)

        def with_plan(p: Any, planned: Any = planned, engine: Any = engine) -> Any:
            return _planned(planned, engine, p)

        outs: list[torch.Tensor] = []
        per: list[RunMetrics] = []
        correct = 0
        try:
            with (
                engine if engine is not None else contextlib.nullcontext(),
                run_hooks(spec_rc, model, spec, engine, cal, lookahead),
            ):
                for pi, (_, _, ids) in enumerate(encoded):
                    with with_plan(prompt_plans[pi] if planned else None):
                        news, m = generate_batch(
                            model, [ids], engine, max_new_tokens=rc.max_new_tokens, min_new_tokens=new_min, label=name, **gen_kw
                        )
                    outs.append(news[0])
                    per.append(m)
                around = (lambda i: with_plan(window_plans[i])) if planned else None
                score = measure.stream_nll(model, windows, device, around)
                for qi, (it, ids) in enumerate(zip(items, item_ids)):
                    with with_plan(item_plans[qi] if planned else None):
                        if cfg.task == "mmlu":
                            correct += measure.mmlu_correct(model, ids, it.answer, letters, device)
                        else:
                            news, _ = generate_batch(model, [ids], engine, max_new_tokens=cfg.task_new_tokens, **gen_kw)
                            correct += measure.final_number(tok.decode(news[0], skip_special_tokens=True)) == it.answer
        finally:
            if engine is None:
                link.close()
            warn_pageable(engine, name, pin_errors, console)  # slower copies: the speed column is affected
        total = RunMetrics.total(per, label=name)
        if run["mode"] == "resident":
            ref_outs, ref_score = outs, score
        agree, first = measure.agreement(outs, ref_outs)
        assert ref_score is not None
        delta = 100 * (score.ppl / ref_score.ppl - 1) if score.ppl is not None and ref_score.ppl is not None else None
        ci = measure.dppl_interval(score.token_nll, ref_score.token_nll) if delta is not None else None
        task = None
        if items:
            task = {
                "name": cfg.task,
                "correct": int(correct),
                "n": len(items),
                "accuracy": correct / len(items),
                "chance": chance,
                "above_chance": measure.above_chance(int(correct), len(items), chance),
            }
        results.append(
            {
                "kind": RESULT_KIND,
                "run": name,
                **run,
                "capacity_experts": capacity,
                "link": link.describe(),
                "host_memory": host_memory(engine),
                "ppl": score.ppl,
                "ppl_tokens": score.tokens,
                "ppl_delta_pct": delta,
                "dppl_ci95": list(ci) if ci is not None else None,  # percent, paired block bootstrap vs resident
                "dppl_within_noise": measure.within_noise(ci),
                "ppl_token_nll": score.token_nll,  # per window, per scored token (nats); not in --json
                "tf_agreement": measure.tf_agreement(score, ref_score),
                "agreement": agree,
                "first_divergence": first,
                "generated_tokens": sum(int(o.numel()) for o in outs),
                "task": task,
                "tpot_s": total.tpot_s,
                "bytes_per_token": total.bytes_per_token,
                "metrics": total.to_dict(),
            }
        )
    ref_tpot = results[0]["tpot_s"]
    for r in results:
        r["tpot_delta_pct"] = 100 * (r["tpot_s"] / ref_tpot - 1) if r["tpot_s"] and ref_tpot else None
    console.print(quality_table(results, title=f"moeflow quality — {Path(rc.model).name}, {link_spec}, vs resident"))
    report = {
        "model": rc.model,
        "reference": "resident",
        "calibration": cal_path if cal else None,
        **threads.to_dict(),
        "text": {"source": text_desc, "tokens": sum(int(w.shape[1]) - 1 for w in windows), "windows": len(windows)},
        "task": cfg.task,
        "prompts": len(encoded),
        "max_new_tokens": rc.max_new_tokens,
        "runs": results,
    }
    if planner is not None:
        report["plan"] = planner.summary(prompt_plans + window_plans + item_plans)
    if rc.json:
        runs_out = [{k: v for k, v in r.items() if k != "ppl_token_nll"} for r in results]
        sys.stdout.write(json.dumps({**report, "runs": runs_out}, default=str) + "\n")
    return report


@contextlib.contextmanager
def _planned(planner: Any, engine: Any, plan: Any) -> Any:
    """One CasMoE plan applied around a prompt, a question or a perplexity window (nothing without one)."""
    if planner is None or plan is None:
        yield
        return
    planner.begin(engine, [plan])
    try:
        yield
    finally:
        planner.end(engine)


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def task_cell(task: dict[str, Any] | None) -> str:
    if not task:
        return "-"
    k, n = task["correct"], task["n"]
    return f"{task['accuracy']:.3f} ({k}/{n})" if task["above_chance"] else f"at chance ({k}/{n})"


def quality_table(results: list[dict[str, Any]], title: str = "moeflow quality"):
    """One row per configuration: exact/LOSSY, perplexity and its change, agreement, task, TPOT, bytes/token
    (readable at 80 columns: `moeflow.tables.FitTable`)."""
    from rich.text import Text

    from ..runtime.metrics import _bytes
    from ..tables import FitTable

    t = FitTable(title)
    cols = ("run", "exact", "ppl", "Δppl %", "agree", "1st div", "tf agree", "task", "TPOT ms", "ΔTPOT %", "bytes /tok")
    for c in cols:
        t.add_column(c, justify="left" if c in ("run", "exact", "task") else "right")
    for r in results:
        t.add_row(
            r["run"],
            Text("LOSSY", style="bold red") if r["lossy"] else Text("exact"),
            _f(r["ppl"], ".3f"),
            measure.dppl_cell(r["ppl_delta_pct"], r.get("dppl_ci95")),
            _f(r["agreement"], ".3f"),
            _f(r["first_divergence"], ".1f"),
            _f(r["tf_agreement"], ".3f"),
            task_cell(r["task"]),
            _f(r["tpot_s"] * 1e3 if r["tpot_s"] is not None else None, ".2f"),
            _f(r["tpot_delta_pct"], "+.1f"),
            _bytes(r["bytes_per_token"]),
        )
    notes = []
    if any(r.get("dppl_ci95") for r in results):
        notes.append(
            f"Δppl %: vs resident, [95% interval] from a paired bootstrap over blocks of {measure.BOOT_BLOCK} scored "
            f"tokens ({measure.BOOT_RESAMPLES} resamples); within noise: the interval holds 0, the sample cannot tell "
            "the change from none"
        )
    if any(r["task"] and not r["task"]["above_chance"] for r in results):
        notes.append("at chance: the task accuracy is not above chance (one-sided binomial, p < 0.05); it says nothing")
    if notes:
        t.caption = "; ".join(notes)
    return t
