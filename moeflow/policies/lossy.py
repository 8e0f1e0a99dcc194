"""Whether a configuration can change the model's output: ONE answer, from the policies' declared capabilities.

`lossy(device_type=..., eviction=, prefetch=, miss=, routing=, speculative=)` -> `Lossy(lossy, reasons)`.
`moeflow run` (`RunConfig.lossy`, into `RunMetrics.lossy` and `--json`), `moeflow quality` (each row),
`moeflow simulate` (each row), the engine (`OffloadEngine.lossy`) and the reports (which read those
outputs) all take it from here. "Exact" means bit-identical to the resident model's `grouped_mm` outputs:
- a policy whose `changes_output` is true (drop, substitute, the mixed-precision fetches, cache-aware with
  lambda > 0, plan-restricted) is lossy on every device;
- a miss policy with `needs_host` (cpu, auto) runs experts on the host with the same grouped kernels over the
  host store's rows, in the model's dtype: bit-identical when the device is the CPU (the same kernels and
  the same summation order), lossy on any other device type (CUDA's GEMMs sum in another order, so the
  host's result differs in the last bits; `auto` may pick the host for any miss);
- `--speculative` (a predictor's experts run instead of the router's) is lossy;
- eviction and prefetch policies only decide which bytes move: never lossy unless they declare otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from .base import EvictionPolicy, MissPolicy, PrefetchPolicy, RoutingPolicy

HOST_EXACT = ("cpu",)  # device types whose kernels are the host's: host compute is bit-identical there


class Lossy(NamedTuple):
    lossy: bool
    reasons: tuple[str, ...]  # one line per cause, empty when exact


EXACT = Lossy(False, ())


def device_type(device: str) -> str:
    """`cpu`, `cuda`, `cuda:1` -> `cpu`, `cuda`, `cuda` (what `lossy` is asked with)."""
    return str(device).split(":", 1)[0].strip().lower()


def lossy(
    *,
    device_type: str,
    eviction: Iterable[EvictionPolicy] = (),
    prefetch: Iterable[PrefetchPolicy] = (),
    miss: MissPolicy | None = None,
    routing: RoutingPolicy | None = None,
    speculative: bool = False,
) -> Lossy:
    """The one lossy answer for built policies on a device of `device_type` (see the module docstring)."""
    reasons: list[str] = []
    kinds: list[tuple[str, list[EvictionPolicy] | list[PrefetchPolicy] | list[MissPolicy] | list[RoutingPolicy]]] = [
        ("eviction", list(eviction)),
        ("prefetch", list(prefetch)),
        ("miss", [miss] if miss is not None else []),
        ("routing", [routing] if routing is not None else []),
    ]
    for kind, policies in kinds:
        for p in policies:
            if p.changes_output:
                reasons.append(f"{kind} policy {p.name} changes the output")
    if miss is not None and not miss.changes_output and miss.needs_host and device_type not in HOST_EXACT:
        reasons.append(
            f"miss policy {miss.name} runs experts on the host: its kernels sum in another order than the "
            f"{device_type} device's (not bit-identical)"
        )
    if speculative:
        reasons.append("--speculative runs the predicted experts instead of the router's")
    return Lossy(bool(reasons), tuple(reasons))
