"""Expert placement for expert-parallel execution: which rank(s) hold each routed expert of each MoE layer.

File format (JSON), the one MoE-GPS placements are written in as well:

    {"<layer>": {"<expert>": [rank, ...], ...}, ...}

`<layer>` is the decoder-layer index of an MoE layer (as in traces), or `"*"` for every MoE layer not
named; `<expert>` an expert id. An expert listed with several ranks is duplicated: every one of them
holds its weights, and each experts call sends all of that expert's rows to ONE of them, the replica
with the fewest rows so far in that call (ties: the first listed), so an expert's rows are never split
and the grouped compute stays bit-identical to one process. MoE layers the file does not name (and no
`"*"`) get the default: contiguous blocks, expert e on rank e * N // E. A top-level
`{"placement": {...}}` wrapper (with any other keys beside it) is accepted too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError


@dataclass(frozen=True)
class Placement:
    """`replicas[layer][e]`: the ranks holding expert e of MoE layer `layer`, in preference order."""

    world_size: int
    num_experts: int
    replicas: dict[int, tuple[tuple[int, ...], ...]]
    source: str = "contiguous"

    def experts_of(self, layer: int, rank: int) -> list[int]:
        """The experts of `layer` whose weights `rank` holds, ascending."""
        return [e for e, rs in enumerate(self.replicas[layer]) if rank in rs]

    def duplicated(self) -> int:
        """Extra expert copies over one per expert, all layers."""
        return sum(len(rs) - 1 for per in self.replicas.values() for rs in per)

    def assign(self, layer: int, counts: Sequence[int]) -> list[int]:
        """Owner rank of every expert for one call whose expert `e` got `counts[e]` rows.

        Single-replica experts first; then duplicated experts, most rows first (ties: lower id), each to
        its replica with the fewest rows so far (ties: the first listed). Deterministic in `counts`, so
        every rank (they all see the same routing) computes the same owners without talking."""
        reps = self.replicas[layer]
        load = [0] * self.world_size
        owner = [0] * self.num_experts
        multi = []
        for e, rs in enumerate(reps):
            if len(rs) == 1:
                owner[e] = rs[0]
                load[rs[0]] += int(counts[e])
            else:
                multi.append(e)
        for e in sorted(multi, key=lambda e: (-int(counts[e]), e)):
            r = min(reps[e], key=lambda r: (load[r], reps[e].index(r)))
            owner[e] = r
            load[r] += int(counts[e])
        return owner

    def to_json(self) -> dict[str, dict[str, list[int]]]:
        return {str(l): {str(e): list(rs) for e, rs in enumerate(per)} for l, per in self.replicas.items()}


def contiguous_blocks(num_experts: int, world_size: int) -> tuple[tuple[int, ...], ...]:
    """Expert e on rank e * N // E: N contiguous blocks of (nearly) equal size."""
    return tuple((e * world_size // num_experts,) for e in range(num_experts))


def check_world_size(world_size: int, num_experts: int) -> None:
    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1 (got {world_size})")
    if world_size > num_experts:
        raise ConfigError(
            f"--world-size {world_size} exceeds the model's {num_experts} experts per layer: "
            f"every rank needs at least one expert; use --world-size <= {num_experts}"
        )


def default_placement(moe_layers: Sequence[int], num_experts: int, world_size: int) -> Placement:
    check_world_size(world_size, num_experts)
    blocks = contiguous_blocks(num_experts, world_size)
    return Placement(world_size, num_experts, {l: blocks for l in moe_layers})


def _int(key: Any, what: str, where: str) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        raise ConfigError(f"placement {where}: {what} {key!r} is not an integer") from None


def parse_placement(
    obj: Any, moe_layers: Sequence[int], num_experts: int, world_size: int, *, where: str = "(inline)"
) -> Placement:
    """A `Placement` from the JSON object described in the module docstring; one-line `ConfigError`s."""
    check_world_size(world_size, num_experts)
    if isinstance(obj, Mapping) and "placement" in obj and isinstance(obj["placement"], Mapping):
        obj = obj["placement"]
    if not isinstance(obj, Mapping) or not obj:
        raise ConfigError(f'placement {where} must be a non-empty JSON object {{"layer": {{"expert": [ranks]}}}}')
    default = contiguous_blocks(num_experts, world_size)
    star = obj.get("*")
    named: dict[int, Any] = {}
    for key, per in obj.items():
        if key == "*":
            continue
        l = _int(key, "layer", where)
        if l not in moe_layers:
            raise ConfigError(f"placement {where}: layer {l} is not an MoE layer of this model (MoE layers: {list(moe_layers)})")
        named[l] = per
    out: dict[int, tuple[tuple[int, ...], ...]] = {}
    for l in moe_layers:
        per = named.get(l, star)
        if per is None:
            out[l] = default
            continue
        if not isinstance(per, Mapping):
            raise ConfigError(f'placement {where}: layer {l} must map expert ids to rank lists, e.g. {{"0": [0, 1]}}')
        reps: list[tuple[int, ...] | None] = [None] * num_experts
        for ek, ranks in per.items():
            e = _int(ek, "expert", where)
            if not 0 <= e < num_experts:
                raise ConfigError(f"placement {where}: layer {l} expert {e} is out of range (0..{num_experts - 1})")
            if isinstance(ranks, int):
                ranks = [ranks]
            if not isinstance(ranks, list) or not ranks:
                raise ConfigError(f"placement {where}: layer {l} expert {e} needs a non-empty list of ranks")
            rs = tuple(_int(r, "rank", where) for r in ranks)
            bad = [r for r in rs if not 0 <= r < world_size]
            if bad:
                raise ConfigError(
                    f"placement {where}: layer {l} expert {e} is on rank {bad[0]}, outside world size {world_size} "
                    f"(ranks 0..{world_size - 1}); pass --world-size to match the placement"
                )
            if len(set(rs)) != len(rs):
                raise ConfigError(f"placement {where}: layer {l} expert {e} lists a rank twice ({list(rs)})")
            reps[e] = rs
        missing = [e for e, rs in enumerate(reps) if rs is None]
        if missing:
            raise ConfigError(
                f"placement {where}: layer {l} places no rank for expert(s) {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}; every expert needs at least one rank"
            )
        out[l] = tuple(rs for rs in reps if rs is not None)
    return Placement(world_size, num_experts, out, source=where)


def load_placement(path: str | Path, moe_layers: Sequence[int], num_experts: int, world_size: int) -> Placement:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f'placement file {p} does not exist; pass a JSON file {{"layer": {{"expert": [ranks]}}}}')
    try:
        obj = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"placement file {p} is not valid JSON ({str(e).splitlines()[0]})") from None
    return parse_placement(obj, moe_layers, num_experts, world_size, where=str(p))
