"""How many torch CPU threads a command uses: one rule for every command that takes `--threads`.

In order, the first that applies:
1. `--threads N`;
2. the environment: `MOEFLOW_THREADS`, else `OMP_NUM_THREADS` (its first number);
3. `best_threads` of a calibration of this model on this device (`moeflow calibrate` times decode at
   1, 2, 4, ... threads up to the usable CPUs and records the fastest; `calibration/<device>*.json`);
4. a default from the model's size: 1 thread when its largest per-token matrix, hidden_size x
   expert_intermediate_size (or hidden_size^2), has fewer than `SMALL_MATRIX` = 2^20 weights, else
   every CPU this process may use.
A count from 3 or 4 above 1 is then capped at the CPUs idle when the command starts (`cap_to_idle`, rounded,
at least 1): each of torch's parallel regions waits at its end for all its threads, so a thread waiting for a
core that other work holds stalls the rest (beside one busy loop on 2 cores, a 50-prompt `moeflow trace` at
the calibration's 2 threads took twice its quiet time). An explicit count (1, 2) is never capped.

Why 2^20: a decode token multiplies each weight matrix by one vector. Below ~1 Mi weights (4 MiB in
float32) that product takes well under 0.2 ms on one core, the same order as waking and joining an
OpenMP team, so more threads gain little on an idle machine; on a busy one a thread that loses its
time slice stalls every such op at its barrier, which made a 16-token run of the 12-layer test model
(128 x 128 experts) 10-25x slower at 2 threads than at 1. Models in the real size range
(OLMoE-1B-7B: 2048 x 1024 = 2 Mi, Mixtral: 4096 x 14336) are above it.

`resolve_threads` is the rule (pure: the environment and CPU count can be passed in); `apply_threads`
(`moeflow.stages.threads`) resolves it for a loaded model (finding the calibration) and sets torch's count.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

SMALL_MATRIX = 1 << 20  # weights of the largest per-token matrix below which one thread is the default
ENV_VARS = ("MOEFLOW_THREADS", "OMP_NUM_THREADS")
CALIBRATION_ROOT = "calibration"

HELP = (
    "torch CPU threads (>= 1). Default: $MOEFLOW_THREADS, else $OMP_NUM_THREADS, else the fastest count "
    "`moeflow calibrate` measured for this model and device, else 1 for a small model (hidden x expert "
    "size < 2^20) and all usable CPUs otherwise."
)


@dataclass(frozen=True)
class ThreadChoice:
    n: int  # torch intra-op threads
    source: str  # "--threads", "MOEFLOW_THREADS", "OMP_NUM_THREADS", "calibration" or "default"
    why: str  # one line for text output
    idle: float | None = None  # CPUs idle when the count was capped (`cap_to_idle`); None: not measured

    @property
    def cappable(self) -> bool:
        """A calibrated or default count above 1: what `cap_to_idle` may lower (explicit counts are the user's)."""
        return self.source in ("calibration", "default") and self.n > 1

    def to_dict(self) -> dict[str, Any]:
        """The `--json` fields: `threads`, `threads_source`."""
        return {"threads": self.n, "threads_source": self.source}

    def describe(self) -> str:
        return f"{self.n} thread{'s' if self.n != 1 else ''} ({self.why})"


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def idle_cpus(interval: float = 0.1) -> float:
    """CPUs idle over the next `interval` seconds (Linux's /proc/stat; this process's own counts as idle, as it
    sleeps meanwhile); without it, usable CPUs minus the 1-minute load average."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]  # cpu user nice system idle iowait irq softirq steal ...
        return v[3] + v[4], sum(v[:8])

    try:
        i0, t0 = sample()
        time.sleep(interval)
        i1, t1 = sample()
        n = os.cpu_count() or 1
        return n * (i1 - i0) / max(1, t1 - t0)
    except (OSError, ValueError, IndexError):
        try:
            return usable_cores() - os.getloadavg()[0]
        except OSError:
            return 0.0


def cap_to_idle(choice: ThreadChoice, idle: float) -> ThreadChoice:
    """A calibrated or default count above 1 capped at `idle` CPUs (rounded, at least 1; module docstring); an
    explicit one (`--threads`, the environment) as it is. The result records `idle`."""
    if not choice.cappable:
        return choice
    n = max(1, min(choice.n, int(idle + 0.5)))
    why = choice.why if n == choice.n else f"{choice.why}; {n} of {choice.n}: {idle:.1f} CPUs idle now"
    return ThreadChoice(n, choice.source, why, idle)


def env_threads(environ: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """(count, variable) from MOEFLOW_THREADS, else OMP_NUM_THREADS; None when neither is set.

    A MOEFLOW_THREADS that is not an integer >= 1 is refused (ConfigError); an OMP_NUM_THREADS that is
    not one (OpenMP also accepts lists such as `4,2`: its first number is taken) is ignored."""
    env = os.environ if environ is None else environ
    raw = (env.get("MOEFLOW_THREADS") or "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"MOEFLOW_THREADS must be an integer >= 1 (got {raw!r}); fix or unset it")
        return n, "MOEFLOW_THREADS"
    raw = (env.get("OMP_NUM_THREADS") or "").strip().split(",")[0].strip()
    if raw.isdigit() and int(raw) >= 1:
        return int(raw), "OMP_NUM_THREADS"
    return None


def largest_matrix(spec: Any) -> int | None:
    """Weights of the largest matrix a decode token multiplies in one MoE layer: max(hidden x expert
    intermediate, hidden^2); None without a spec. `spec`: a MoESpec or its dict."""
    if spec is None:
        return None
    get = spec.get if isinstance(spec, Mapping) else lambda k: getattr(spec, k, None)
    h, i = get("hidden_size"), get("expert_intermediate_size")
    if not isinstance(h, int) or h <= 0:
        return None
    return max(h * (i if isinstance(i, int) and i > 0 else 0), h * h)


def default_threads(spec: Any, cores: int | None = None) -> tuple[int, str]:
    """(count, why) without a flag, environment or calibration: 1 for a small model, else `cores`."""
    cores = cores or usable_cores()
    size = largest_matrix(spec)
    if size is not None and size < SMALL_MATRIX:
        get = spec.get if isinstance(spec, Mapping) else lambda k: getattr(spec, k, None)
        return 1, f"default: small model, hidden {get('hidden_size')} x expert {get('expert_intermediate_size')} < 2^20 weights"
    return cores, f"default: the {cores} usable CPU{'s' if cores != 1 else ''}"


def resolve_threads(
    flag: int | None,
    calibration: Mapping[str, Any] | None,
    model_spec: Any,
    *,
    environ: Mapping[str, str] | None = None,
    cores: int | None = None,
) -> ThreadChoice:
    """The rule (module docstring): `--threads`, the environment, the calibration's `best_threads`, the
    size default. `calibration`: a calibration record (its `best_threads`, `path`) or None; `model_spec`:
    a MoESpec (or its dict) or None; `cores`: CPUs this process may use (default: `usable_cores()`; a
    calibrated or default count is capped at it, an explicit one is not)."""
    if flag is not None:
        if flag < 1:
            raise ConfigError(f"--threads must be >= 1 (got {flag})")
        return ThreadChoice(flag, "--threads", f"--threads {flag}")
    env = env_threads(environ)
    if env is not None:
        return ThreadChoice(env[0], env[1], f"{env[1]}={env[0]}")
    cores = max(1, cores or usable_cores())
    best = (calibration or {}).get("best_threads")
    if isinstance(best, int) and not isinstance(best, bool) and best >= 1:
        n = min(best, cores)
        where = (calibration or {}).get("path") or "a calibration"
        return ThreadChoice(n, "calibration", f"fastest measured by `moeflow calibrate`, {where}")
    n, why = default_threads(model_spec, cores)
    return ThreadChoice(n, "default", why)
