"""Misses the cache decides: the fetch actions, full precision or a compact low-precision copy.

A miss action `("fetch", bits)` (`moeflow.policies.base.miss_action`) loads the host store's compact copy at
`bits` (int8/4/2, HQQ; `moeflow.quant`) into the slot's first bytes; the slot records its precision
(`Slot.bits`, 0 = full) and the copy is dequantized into the model-dtype row on the device as soon as it is
known complete (`ExpertCache._ready`), before any compute reads it. Every load counts its own transfer's
bytes (`bytes_at(bits)`) in `bytes_moved`; without a store the compact size is estimated
(`compact_bytes_estimate`). A hit on a low-precision slot counts `lowbit_hits`. With a miss policy whose
`upgrade` is True (`cascade`) each low-precision slot gets, when the layer releases it, a full-precision copy
queued as a prefetch-priority transfer into the same slot (`upgrades`); until it lands the slot is in flight,
so a later use waits for the exact expert. Drop / substitute / cpu are the engine's (`needs_routing`
policies, asked in its router hook: `moeflow.runtime.step`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ConfigError
from ..policies.base import FETCH, ExpertKey, MissInfo, MissPolicy, Position, miss_action
from ..quant import FULL


def fetch_bits(
    miss: MissPolicy,
    layer: int,
    experts: Sequence[int],
    scores: dict[int, float] | None,
    slot_of: dict[ExpertKey, int],
    position: Callable[[int], Position],
    resident: Callable[[ExpertKey], bool],
    store: Any = None,
) -> dict[int, int]:
    """Ask the miss policy about every needed expert without a slot (not in `slot_of`); returns {expert: bits}
    of the misses to load as a low-precision copy (the others load at full precision).

    A policy with `precisions` (the mixed-precision ones) first sees every needed expert's summed gate
    weight (`observe(layer, scores)`) and is asked with `info=MissInfo(rank=0, score, tokens=0)` (rank and
    tokens unknown here); another is asked info-less. Only fetch actions are implemented here (another is a
    `ConfigError`, so is a `bits` the `store` does not hold)."""
    mixed = bool(miss.precisions)
    if mixed:
        scores = scores or {}
        miss.observe(layer, {e: scores.get(e, 0.0) for e in experts})
    out: dict[int, int] = {}
    for e in experts:
        if (layer, e) not in slot_of:
            key, pos = (layer, e), position(layer)
            if mixed:
                action = miss.on_miss(key, pos, MissInfo(0, float(scores.get(e, 0.0)) if scores else 0.0, 0, resident))
            else:
                action = miss.on_miss(key, pos)
            try:
                kind, arg = miss_action(action)
            except ValueError as err:
                raise ConfigError(f"miss policy {miss.name!r}: {err}") from None
            if kind != FETCH:
                raise ConfigError(
                    f"miss policy {miss.name!r} asked for {action!r}; the cache implements only fetch actions "
                    "(drop / substitute / cpu are applied by the engine's router hook: set needs_routing)"
                )
            if arg is not None and arg != FULL:
                if store is not None and arg not in store.compact:
                    raise ConfigError(
                        f"miss policy {miss.name!r} asked for an int{arg} copy; the store holds "
                        f"{', '.join(f'int{b}' for b in store.precisions) or 'none'} (list it in its `precisions`)"
                    )
                out[e] = int(arg)
    return out
