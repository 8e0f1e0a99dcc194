"""Steps several papers share, with one spelling so `make reproduce-all` makes each artifact once.

Every path is under `r.work` (reports/_work/<model>-<tier>-<device>/); every step is `produces=`-stamped,
so a second recipe (or a rerun) reuses it when the command and its inputs are unchanged.
"""

from __future__ import annotations

from pathlib import Path

from moeflow.report import Recipe, StepFailed

# the workload the predictors are trained on, and the held-out sets they are evaluated on
TRAIN_SET = "sharegpt"
HELDOUT_SETS = ("gsm8k", "alpaca")


def trace(r: Recipe, prompts: str = TRAIN_SET, *, limit: int | None = None, hidden: bool = True) -> Path:
    """A trace of `prompts` (sampled at T=0.8, seed 0, for diverse routing); with router inputs and residuals.
    Required: a failed step stops the recipe (StepFailed); `optional_trace` is for traces only some tables need."""
    out = optional_trace(r, prompts, limit=limit, hidden=hidden)
    if out is None:
        raise StepFailed(f"step trace-{prompts} failed; the tables that need it are not in this report")
    return out


def optional_trace(r: Recipe, prompts: str, *, limit: int | None = None, hidden: bool = True) -> Path | None:
    """`trace`, but None when the step failed (recorded as a failed step) instead of stopping the recipe."""
    n = limit if limit is not None else r.pick(40 if prompts == TRAIN_SET else 16, 200 if prompts == TRAIN_SET else 60)
    out = r.work / f"trace-{prompts}-{n}{'-h' if hidden else ''}"
    args = ["trace", "--model", r.model, "--prompts", prompts, "--limit", n, "--out", out, "--device", r.device]
    args += ["--max-new-tokens", r.pick(16, 32), "--max-prompt-tokens", r.pick(96, 256), "--temperature", 0.8, "--seed", 0]
    args += ["--threads", r.threads, "--no-progress"] + (["--record-hidden"] if hidden else [])
    r.moeflow(f"trace-{prompts}", *args, produces=out)
    return out if r.ok(f"trace-{prompts}") else None


def predictors(r: Recipe, tr: Path, *, max_s: int | None = None) -> Path:
    """Every predictor `moeflow train` fits (pregate, router-pf, estimator, hybrid, forest, token-id, frequency),
    for S = 1..4 (QUICK) or 1..6 (full: enough steps for ExpertFlow's fit of accuracy against S)."""
    max_s = max_s if max_s is not None else r.pick(4, 6)
    out = r.work / f"predictors-{tr.name}"
    args = ["train", "--model", r.model, "--trace", tr, "--out", out, "--force", "--max-s", max_s, "--threads", r.threads]
    r.require(r.moeflow("train", *args, produces=out, after=[tr]), "train")
    return out


def calibrate(r: Recipe, link: str | None = None) -> Path:
    """`moeflow calibrate` for the device (and an emulated link `GBPS[,LATENCY_US]` on CPU); the file's path."""
    tag = r.device + (f"-emulated-{link.replace(',', '-')}" if link else "")
    out = r.work / f"calibration-{tag}.json"
    args = ["calibrate", "--model", r.model, "--device", r.device, "--out", out, "--force", "--threads", r.threads]
    if link:
        gbps, _, lat = link.partition(",")
        args += ["--link-gbps", gbps] + (["--link-latency-us", lat] if lat else [])
    r.moeflow(f"calibrate-{tag}", *args, produces=out)
    return out
