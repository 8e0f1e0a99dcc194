"""What the expert cache counts and how much one layer's access may cover: shared by the cache, the engine
and the simulator.

`CacheCounters` (monotone counters; subtract two snapshots for a window), `needed_experts` (a call's unique
experts in access order with their summed gate weights), `wave_capacity` (experts one grouped call may
cover) and `check_capacity` (a cache size against the model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError

MAX_GROUPS = 1024  # torch._grouped_mm on CUDA refuses more groups than this in one call
GATHER_BYTES = 1 << 30  # at most this many bytes of expert weights gathered per grouped call


def wave_capacity(part_capacity: int, expert_bytes: int) -> int:
    """Most experts one grouped call (one wave) may cover: slots, the kernel's group limit, the gather budget."""
    return max(1, min(part_capacity, MAX_GROUPS, GATHER_BYTES // max(1, expert_bytes)))


def needed_experts(
    flat: torch.Tensor, weights: torch.Tensor, num_experts: int | None = None
) -> tuple[list[int], dict[int, float]]:
    """Unique experts of a call (host tensors `[S]` ids, `[S]` float32 gate weights), sorted by id, and their
    gate weight summed over the call's tokens (float32, in row order): the order of every cache access.
    `num_experts` (E, the ids' range) given and more rows than E: by expert id (`routed_counts`, fewer host ops)."""
    if num_experts is not None and flat.numel() > num_experts:
        experts, scores, _ = routed_counts(flat, weights, num_experts)
        return experts, scores
    ids = flat.tolist()
    if len(set(ids)) == len(ids):  # every expert once (a decode step): nothing to sum
        ws = weights.tolist()
        order = sorted(range(len(ids)), key=ids.__getitem__)
        return [ids[i] for i in order], {ids[i]: ws[i] for i in order}
    uniq = torch.unique(flat)  # sorted [U]
    summed = torch.zeros(uniq.numel(), dtype=torch.float32)
    summed.index_add_(0, torch.searchsorted(uniq, flat), weights)
    experts = uniq.tolist()
    return experts, dict(zip(experts, summed.tolist()))


def routed_counts(flat: torch.Tensor, weights: torch.Tensor, num_experts: int) -> tuple[list[int], dict[int, float], list[int]]:
    """`needed_experts` of ids `flat [S]` in `0..num_experts-1` (host), plus the rows routed to each expert `[E]`.
    Each expert's weights are summed into its own bin by `index_add_` in row order: the same float32 additions in
    the same order as into its rank among the unique ids, so the same sums (a prefill: no sort, no Python set)."""
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # [E] rows per expert
    summed = torch.zeros(num_experts, dtype=torch.float32).index_add_(0, flat, weights).tolist()  # [E]
    experts = [e for e, n in enumerate(counts) if n]
    return experts, {e: summed[e] for e in experts}, counts


@dataclass
class CacheCounters:
    """Monotone counters; subtract two snapshots for a window (one prompt, one forward pass)."""

    accesses: int = 0  # needed experts, one per (forward pass, layer, unique expert)
    hits: int = 0  # needed and already in a slot at routing time (ready or copy in flight)
    misses: int = 0  # needed and not in a slot: a demand load (misses == demand_loads)
    late: int = 0  # hits whose copy was still in flight (a prefetch not finished: stall)
    loads: int = 0  # transfers issued (demand + prefetch)
    demand_loads: int = 0
    prefetch_issued: int = 0  # prefetch transfers issued (requests for resident experts are skipped)
    prefetch_used: int = 0  # prefetched experts accessed before their eviction (counted once)
    prefetch_used_prior_phase: int = 0  # of those, issued before the current phase began (`mark_phase`)
    prefetch_used_prior_generation: int = 0  # of those, issued before the current generation began
    prefetch_unused_evicted: int = 0  # overfetch: prefetched experts evicted without ever being used
    prefetch_refused: int = 0  # proposals (not resident) the prefetch gate did not admit
    prefetch_cancelled: int = 0  # issued prefetches withdrawn before their copy started (stale: their layer
    #   routed to other experts); not in loads / bytes_moved (loads = demand_loads + issued - cancelled)
    collision_misses: int = 0  # needed experts that were evicted earlier in the same forward pass
    evictions: int = 0
    bytes_moved: int = 0  # bytes of every transfer issued: full rows, compact low-precision copies, upgrades
    lowbit_loads: int = 0  # demand loads of a low-precision copy (miss action ("fetch", bits); lossy)
    lowbit_hits: int = 0  # hits on a slot holding a low-precision copy (lossy)
    upgrades: int = 0  # full-precision copies queued over low-precision slots (`cascade`); not in `loads`
    stall_s: float = 0.0  # seconds the compute thread waited for copies

    @property
    def ready_hits(self) -> int:
        """Needed experts whose copy had completed: no wait at all."""
        return self.hits - self.late

    @property
    def waited(self) -> int:
        """Needed experts the layer had to wait for (demand loads + late prefetches): ExpertFlow's stalls."""
        return self.misses + self.late

    def __sub__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)})

    def __add__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)})

    def copy(self) -> CacheCounters:
        return dataclasses.replace(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_capacity(
    spec: Any, capacity: int, *, per_layer: bool = False, given: str | None = None, expert_bytes: int | None = None
) -> None:
    """Refuse a cache of `capacity` experts below top-k (per layer with `per_layer`) or above all routed experts.
    `given`: the --capacity text it came from, echoed when it was not an expert count (a size: with `expert_bytes`,
    one expert's size).

    `moeflow run` calls it for every capacity of a sweep before the first run; the cache calls it again."""
    C, need = capacity, spec.top_k
    plain = given is None or given.strip() == str(C)  # an expert count as typed: shown as it is
    each = f" of {expert_bytes / 2**20:.3g} MiB each" if expert_bytes else ""
    shown = str(C) if plain else f"{(given or '').strip()} ({C} experts{each})"
    if per_layer:
        per = C // spec.num_moe_layers
        if per < need:
            raise ConfigError(
                f"--capacity {shown} with --per-layer-cache gives {per} slots per layer, below top-k={need}; "
                f"use at least {need * spec.num_moe_layers} experts"
            )
    elif C < need:
        raise ConfigError(
            f"--capacity {f'{C} experts' if plain else shown} is below top-k={need}, the experts one decode "
            f"token needs per layer; use at least {need}"
        )
    if C > spec.total_experts:
        raise ConfigError(
            f"--capacity {shown} exceeds the model's {spec.total_experts} routed experts; use at most {spec.total_experts} (100%)"
        )
