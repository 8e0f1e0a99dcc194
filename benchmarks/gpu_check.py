"""GPU check: every test marked `gpu` and the GPU benchmarks, one table and one JSON line (`make gpu-check`).

Without a CUDA device it prints "no CUDA device: gpu-check skipped" and `{"cuda": false, ...}` and exits 0.
With one, in order, each step a subprocess with its own time limit and its output in `--log-dir`:

1. transformers: `moeflow.moe.tx_compat.check()`; outside the supported range nothing else runs (exit 1);
2. `pytest -m gpu tests` (passed / failed / skipped from its junit XML);
3. engine overhead: `benchmarks/engine_overhead.py --shape olmoe-1b-7b-shape --device cuda` (a random-weight
   OLMoE-1B-7B-shaped model built in memory, bf16): engine with every expert cached / resident TPOT;
4. offload: `benchmarks/offload.py --model MODEL --device cuda --link cuda` (every run token-identical?);
5. host compute: `benchmarks/cpu_vs_fetch.py --model MODEL --device cuda`, when that script takes `--device`;
6. prefill: `benchmarks/prefill.py --model MODEL --device cuda` (staged vs serial prefill, TTFT / bound, exactness).

A step that cannot run is a `skip` row with its reason. Exit status 1 when a step failed, timed out or
printed no JSON line, else 0. The summary JSON is also written to `--log-dir`/gpu-check.json.

    .venv/bin/python benchmarks/gpu_check.py --model models/olmoe-mini
    .venv/bin/python benchmarks/gpu_check.py --model models/olmoe-mini --quick   # smaller benchmark runs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
NO_CUDA = "no CUDA device: gpu-check skipped"
OK, FAIL, SKIP, TIMEOUT, ERROR = "ok", "fail", "skip", "timeout", "error"
BAD = (FAIL, TIMEOUT, ERROR)


@dataclass
class Check:
    check: str
    status: str
    figure: str = ""
    seconds: float = 0.0
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)


# ---- helpers (pure; tests/test_gpu_check.py) -------------------------------------------------------------


def last_json_line(text: str) -> dict[str, Any] | None:
    """The last line of `text` that parses as a JSON object (a benchmark's final line), or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def junit_counts(path: Path) -> dict[str, Any]:
    """{passed, failed, errors, skipped, failed_tests, uncollected} from a pytest junit XML file; `uncollected`:
    the test modules pytest could not import ("module: last error line"), which `failed_tests` leaves out."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    bad, uncollected = [], []
    for c in root.iter("testcase"):
        err = c.find("error")
        if err is not None and not c.get("classname") and err.get("message") == "collection failure":
            lines = [ln[1:].strip() for ln in (err.text or "").splitlines() if ln.startswith("E ")]
            uncollected.append(f"{c.get('name', '')}: {lines[-1] if lines else 'collection failure'}")
        elif c.find("failure") is not None or err is not None:
            bad.append(f"{c.get('classname', '')}::{c.get('name', '')}")
    return {
        "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
        "failed": n["failures"],
        "errors": n["errors"],
        "skipped": n["skipped"],
        "failed_tests": bad,
        "uncollected": uncollected,
    }


def accepts_flag(script: Path, flag: str) -> bool:
    """True when `script` declares `flag` with argparse's `add_argument`."""
    return bool(re.search(r"add_argument\(\s*(\"-\w\",\s*)?\"" + re.escape(flag) + '"', script.read_text()))


def _ms(v: Any) -> str:
    return f"{v:.2f} ms" if isinstance(v, (int, float)) else "?"


def engine_figure(r: dict[str, Any]) -> tuple[str, str, str]:
    """(status, figure, reason) of engine_overhead.py's JSON line."""
    med = r.get("tpot_ms_median") or {}
    ratio = r.get("ratio")
    fig = f"engine/resident {ratio:.2f}x ({_ms(med.get('engine'))} / {_ms(med.get('resident'))})" if ratio else "?"
    if r.get("resident_decode_impl"):  # transformers may decode the stock model with batched_mm off the CPU
        fig += f"; resident decodes with {r['resident_decode_impl']}"
    misses = r.get("misses")
    if misses:
        return FAIL, fig, f"{misses} misses with every expert cached"
    return OK, fig, ""


def offload_figure(r: dict[str, Any]) -> tuple[str, str, str]:
    """(status, figure, reason) of offload.py's JSON line: the fastest run; FAIL when a run was not exact."""
    runs = r.get("runs") or []
    res = r.get("resident_tpot_s")
    if not runs:
        return ERROR, "", "no runs in the JSON line"
    best = min(runs, key=lambda x: x.get("tpot_s") or float("inf"))
    inexact = [x.get("run", "?") for x in runs if x.get("exact") is False]
    fig = (
        f"best {best.get('run')} {_ms((best.get('tpot_s') or 0) * 1e3)} vs resident "
        f"{_ms((res or 0) * 1e3)}; exact {len(runs) - len(inexact)}/{len(runs)}"
    )
    if inexact:
        return FAIL, fig, f"not token-identical to resident: {', '.join(inexact)}"
    probe = (r.get("resident_impl_probe_s") or {}).get(r.get("resident_experts_impl"))
    if res and probe:  # the resident decode against the probe that picked its implementation: `moeflow run`'s rule
        from moeflow.stages.run import resident_check

        fig += f"; resident/probe {res / probe:.2f}"
        if resident_check(res, probe) is not None:
            return FAIL, fig, f"the resident run decoded {res / probe:.1f}x slower than its probe: every ratio to it is off"
    return OK, fig, ""


def host_figure(r: dict[str, Any]) -> tuple[str, str, str]:
    """(status, figure, reason) of cpu_vs_fetch.py's JSON line."""
    rows = r.get("rows") or []
    if not rows:
        return ERROR, "", "no rows in the JSON line"
    fig = "; ".join(
        f"{row['gbps']:.3g} GB/s: fetch {_ms(row['tpot_fetch_s'] * 1e3)}, cpu {_ms(row['tpot_cpu_s'] * 1e3)}, "
        f"auto {_ms(row['tpot_auto_s'] * 1e3)} (auto/best {row['auto_over_best']:.2f})"
        for row in rows
    )
    x = r.get("measured_crossover_gbps")
    if isinstance(x, (int, float)):
        fig += f"; cpu beats fetch below {x:.3g} GB/s"
    return OK, fig + ("" if r.get("token_identical") else "; cpu/auto not token-identical (lossy on this device)"), ""


def prefill_figure(r: dict[str, Any]) -> tuple[str, str, str]:
    """`benchmarks/prefill.py`'s line: TTFT / bound per path at its largest capacity, and exactness."""
    ratios = r.get("ttft_bound_ratio") or {}
    parts = []
    for path, by_cap in ratios.items():
        if by_cap:
            cap = max(by_cap, key=lambda c: float(c))
            parts.append(f"{path} {by_cap[cap]:.2f}x bound")
    fig = "TTFT " + ", ".join(parts) if parts else "no TTFT / bound figure"
    if not r.get("exact", False):
        return FAIL, fig, "prefill output differs from the resident model"
    return OK, fig, ""


def tests_figure(n: dict[str, Any]) -> tuple[str, str, str]:
    """A module pytest could not import is a failure of its own (a missing package, say), named apart: the gpu
    tests of the other modules still ran (`--continue-on-collection-errors`)."""
    unc = n.get("uncollected") or []
    fig = f"{n['passed']} passed, {n['failed'] + n['errors'] - len(unc)} failed, {n['skipped']} skipped"
    if unc:
        fig += f", {len(unc)} module{'s' if len(unc) != 1 else ''} not collected"
    why = []
    if n["failed_tests"]:
        why.append("failed: " + ", ".join(n["failed_tests"][:8]))
    if unc:
        why.append("not collected: " + "; ".join(unc[:4]))
    return (FAIL, fig, "; ".join(why)) if why else (OK, fig, "")


# ---- running --------------------------------------------------------------------------------------------


def run_logged(cmd: list[str], timeout_s: float, log: Path) -> tuple[int | None, str, float]:
    """Run `cmd` in the repository root in its own process group; (exit code or None on timeout, stdout,
    seconds). stdout and stderr go to `log`; on timeout the whole group is killed."""
    t0 = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:
        err.write("$ " + " ".join(cmd) + "\n")
        err.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            rc = None
        err.write(out or "")
    return rc, out or "", time.perf_counter() - t0


Runner = Callable[[list[str], float, Path], tuple[int | None, str, float]]


def run_tests(py: str, timeout_s: float, logs: Path, runner: Runner) -> Check:
    xml = logs / "gpu-tests.xml"
    xml.unlink(missing_ok=True)
    cmd = [
        py,
        *("-m", "pytest", "-q", "-m", "gpu", "tests", f"--junitxml={xml}", "-p", "no:cacheprovider"),
        "--continue-on-collection-errors",  # a module that cannot be imported here does not stop the gpu tests
    ]
    rc, _, s = runner(cmd, timeout_s, logs / "gpu-tests.log")
    if rc is None:
        return Check("pytest -m gpu", TIMEOUT, "", s, f"over {timeout_s:g} s")
    if not xml.is_file():
        return Check("pytest -m gpu", ERROR, "", s, f"pytest exited {rc} without a junit XML; see {logs / 'gpu-tests.log'}")
    n = junit_counts(xml)
    status, fig, reason = tests_figure(n)
    if status == OK and rc not in (0, 5):  # 5: nothing collected
        status, reason = ERROR, f"pytest exited {rc}"
    return Check("pytest -m gpu", status, fig, s, reason, n)


def run_bench(
    name: str,
    cmd: list[str],
    timeout_s: float,
    logs: Path,
    figure: Callable[[dict[str, Any]], tuple[str, str, str]],
    runner: Runner,
) -> Check:
    log = logs / f"{name.replace(' ', '-')}.log"
    rc, out, s = runner(cmd, timeout_s, log)
    if rc is None:
        return Check(name, TIMEOUT, "", s, f"over {timeout_s:g} s; see {log}")
    res = last_json_line(out)
    if rc != 0 or res is None:
        return Check(name, ERROR, "", s, f"exit {rc}{'' if res else ', no JSON line'}; see {log}")
    status, fig, reason = figure(res)
    return Check(name, status, fig, s, reason, res)


def print_table(checks: list[Check], title: str) -> None:
    """check | status | seconds | key figure (the figure wraps; the other columns never do)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    t = Table(title=title)
    t.add_column("check", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("seconds", justify="right", no_wrap=True)
    t.add_column("key figure", overflow="fold")
    for c in checks:
        fig = c.figure + (f" ({c.reason})" if c.reason and c.figure else c.reason)
        t.add_row(Text(c.check), Text(c.status), f"{c.seconds:.0f}", Text(fig or "-"))  # Text: no markup
    Console().print(t)


def main(argv: list[str] | None = None, *, runner: Runner = run_logged) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/olmoe-mini", help="checkpoint for offload.py / cpu_vs_fetch.py (with tokenizer)")
    ap.add_argument("--quick", action="store_true", help="smaller benchmark runs (fewer rounds, prompts and tokens)")
    ap.add_argument("--tests-timeout", type=float, default=1800.0, help="seconds for `pytest -m gpu` (default 1800)")
    ap.add_argument("--bench-timeout", type=float, default=1200.0, help="seconds per benchmark (default 1200)")
    ap.add_argument("--log-dir", default="reports/gpu-check", help="each step's output and gpu-check.json")
    ap.add_argument("--no-bench", action="store_true", help="run the gpu tests only")
    a = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA)
        print(json.dumps({"cuda": False, "skipped": "no CUDA device", "torch": torch.__version__}))
        return 0

    from moeflow.artifacts import write_json_atomic
    from moeflow.moe import tx_compat

    logs = REPO / a.log_dir if not Path(a.log_dir).is_absolute() else Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    model = a.model
    bench = REPO / "benchmarks"
    checks: list[Check] = []
    t0 = time.perf_counter()
    try:
        tx_compat.check()
        checks.append(Check("transformers", OK, tx_compat._version()))
        supported = True
    except tx_compat.TransformersVersionError as e:
        print(f"gpu-check: {e}")
        checks.append(Check("transformers", FAIL, tx_compat._version(), 0.0, str(e)))
        supported = False

    plan: list[tuple[str, list[str] | str, Callable[[dict[str, Any]], tuple[str, str, str]]]] = []
    q = a.quick
    rounds = ["--rounds", "2" if q else "6", "--new-tokens", "16" if q else "32"]
    plan.append(
        (
            "engine overhead",
            [py, str(bench / "engine_overhead.py"), "--shape", "olmoe-1b-7b-shape", "--device", "cuda", *rounds],
            engine_figure,
        )
    )
    plan.append(
        (
            "offload cuda link",
            [py, str(bench / "offload.py"), "--model", model, "--device", "cuda", "--link", "cuda"]
            + (["--limit", "2", "--new-tokens", "12", "--policies", "lru,least-stale", "--no-profile"] if q else []),
            offload_figure,
        )
    )
    cvf = bench / "cpu_vs_fetch.py"
    plan.append(
        (
            "host compute",
            [py, str(cvf), "--model", model, "--device", "cuda"] + (["--rounds", "3", "--limit", "2"] if q else [])
            if accepts_flag(cvf, "--device")
            else "cpu_vs_fetch.py has no --device flag",
            host_figure,
        )
    )
    mpath = Path(model) if Path(model).is_absolute() else REPO / model
    no_model = None if (mpath / "config.json").is_file() else f"no checkpoint at {model}; pass --model (make models builds them)"
    pre = bench / "prefill.py"
    plan.append(
        (
            "prefill",
            [py, str(pre), "--model", model, "--device", "cuda"] + (["--prompts", "2", "--repeats", "2"] if q else [])
            if pre.is_file() and accepts_flag(pre, "--device")
            else "prefill benchmark: not implemented",
            prefill_figure,
        )
    )

    if not supported:
        why = "transformers outside the supported range"
        checks.append(Check("pytest -m gpu", SKIP, "", 0.0, why))
        checks += [Check(name, SKIP, "", 0.0, why) for name, _, _ in plan]
    else:
        checks.append(run_tests(py, a.tests_timeout, logs, runner))
        for name, cmd, fig in plan:
            if a.no_bench:
                checks.append(Check(name, SKIP, "", 0.0, "--no-bench"))
            elif isinstance(cmd, str):
                checks.append(Check(name, SKIP, "", 0.0, cmd))
            elif no_model and "--model" in cmd:
                checks.append(Check(name, SKIP, "", 0.0, no_model))
            else:
                checks.append(run_bench(name, cmd, a.bench_timeout, logs, fig, runner))

    ok = not any(c.status in BAD for c in checks)
    dev = torch.cuda.get_device_name(0)
    summary = {
        "cuda": True,
        "device": dev,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "transformers": tx_compat._version(),
        "transformers_supported": supported,
        "model": model,
        "quick": q,
        "ok": ok,
        "seconds": round(time.perf_counter() - t0, 1),
        "checks": [asdict(c) for c in checks],
        "logs": str(logs),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_json_atomic(logs / "gpu-check.json", summary)
    print_table(checks, f"gpu-check on {dev} ({'all passed' if ok else 'FAILED'}; logs in {logs})")
    print(json.dumps(summary, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
