"""Trace-driven cache simulator: the runtime's policies and event protocol, no weights, no clock.

For every pass and MoE layer, in execution order:
1. `on_layer_start`; the layer's needed experts (unique, order of first use) are pinned while it runs;
2. each needed expert: hit (`on_access`) or miss -> the miss policy ('fetch') -> if the cache is
   full, the eviction policy picks a victim among resident, unpinned experts -> `on_evict`,
   `on_insert(prefetched=False)`, `on_access`. If every resident expert is pinned (a layer needs more
   experts than the capacity, e.g. a long prefill), the layer runs in waves: the experts done so far
   are unpinned;
3. after the layer, the prefetch policy proposes experts of later layers (`LayerContext`); resident
   ones get `on_predicted`, others are loaded in priority order, evicting unpinned experts that were
   not loaded by this same proposal (in flight); proposals that find no victim are dropped.

Counted: accesses, hits, misses, loads (demand + prefetch = transfers), collision misses (a miss on an
expert evicted earlier in the same forward pass), prefetch loads / prefetched experts used before
eviction (precision), accesses proposed by the prefetcher earlier in the pass (recall), prefetch hits.
The cache never holds more than `capacity` experts (checked on every insert).

`belady(...)`: Belady's MIN for demand paging (evict the resident expert whose next use is farthest in
the future): the best hit rate any eviction policy can reach without prefetching.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..errors import ConfigError
from ..policies import EVICTION, MISS, PREFETCH, ExpertKey, LayerContext, Position
from .access import AccessTrace


@dataclass
class SimStats:
    capacity: int
    eviction: str
    prefetch: str
    passes: int = 0
    tokens: int = 0
    accesses: int = 0
    hits: int = 0
    misses: int = 0
    collisions: int = 0  # misses on an expert evicted earlier in the same pass
    demand_loads: int = 0
    prefetch_loads: int = 0
    prefetch_used: int = 0  # prefetched experts accessed before their eviction
    prefetch_hits: int = 0  # hits whose expert was brought in by a prefetch and not used yet
    proposed_accesses: int = 0  # accesses whose expert the prefetcher proposed earlier in the pass
    proposals: int = 0
    evictions: int = 0
    max_resident: int = 0
    collisions_per_layer: dict[int, int] = field(default_factory=dict)
    hits_per_layer: dict[int, int] = field(default_factory=dict)
    accesses_per_layer: dict[int, int] = field(default_factory=dict)

    @property
    def loads(self) -> int:
        return self.demand_loads + self.prefetch_loads

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def collision_rate(self) -> float:
        return self.collisions / self.accesses if self.accesses else 0.0

    @property
    def loads_per_token(self) -> float:
        return self.loads / self.tokens if self.tokens else 0.0

    @property
    def prefetch_precision(self) -> float:
        return self.prefetch_used / self.prefetch_loads if self.prefetch_loads else 0.0

    @property
    def prefetch_recall(self) -> float:
        return self.proposed_accesses / self.accesses if self.accesses else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("loads", "hit_rate", "collision_rate", "loads_per_token", "prefetch_precision", "prefetch_recall"):
            d[k] = getattr(self, k)
        return d


class Belady:
    """MIN: the victim is the candidate whose next use (layer step) is farthest away (never = infinity).

    Built from the access trace it will be replayed on; it counts layer steps from `on_layer_start`.
    """

    name = "belady"

    def __init__(self, acc: AccessTrace):
        self._uses: dict[ExpertKey, list[int]] = {}
        step = 0
        for p in acc.passes:
            for s in p.steps:
                for e in s.needed():
                    self._uses.setdefault((s.layer, e), []).append(step)
                step += 1
        self.step = -1

    def on_layer_start(self, pos: Position) -> None:
        self.step += 1

    def next_use(self, key: ExpertKey) -> float:
        u = self._uses.get(key, [])
        i = bisect.bisect_left(u, self.step)
        return u[i] if i < len(u) else float("inf")

    def victim(self, candidates: Sequence[ExpertKey], pos: Position) -> ExpertKey:
        return max(candidates, key=lambda k: (self.next_use(k), k))

    def on_insert(self, key, pos, *, prefetched):
        pass

    def on_access(self, key, pos, *, score):
        pass

    def on_evict(self, key):
        pass

    def on_pass_start(self, pos):
        pass

    def on_predicted(self, key, pos):
        pass


def _resolve(registry, spec: Any, what: str) -> tuple[Any, str]:
    if isinstance(spec, str):
        return registry.create(spec), spec
    if isinstance(spec, tuple):  # (name, {options})
        name, opts = spec
        label = name + ("(" + ",".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "")
        return registry.create(name, **opts), label
    return spec, getattr(spec, "label", None) or getattr(spec, "name", what)


def simulate(
    acc: AccessTrace,
    capacity: int,
    eviction: Any = "lru",
    prefetch: Any = "none",
    *,
    miss: Any = "fetch",
    lookahead: int = 1,
    predict_logits: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    check: bool = False,
) -> SimStats:
    """Replay `acc` through a cache of `capacity` experts. Policies are names, (name, options) or objects."""
    if capacity < 1:
        raise ConfigError(f"capacity must be >= 1 expert, got {capacity}")
    ev, ev_name = (eviction, "belady") if isinstance(eviction, Belady) else _resolve(EVICTION, eviction, "eviction")
    pf, pf_name = _resolve(PREFETCH, prefetch, "prefetch")
    ms, _ = _resolve(MISS, miss, "miss")
    uses_prefetch = pf_name != "none"
    st = SimStats(capacity=capacity, eviction=ev_name, prefetch=pf_name)
    resident: set[ExpertKey] = set()
    fresh_prefetch: set[ExpertKey] = set()  # prefetched, not accessed yet
    time = 0
    moe = tuple(acc.moe_layers)

    def insert(key: ExpertKey, pos: Position, protect: set[ExpertKey], prefetched: bool) -> bool:
        if len(resident) >= capacity:
            cands = sorted(resident - protect)
            if not cands:
                return False
            v = ev.victim(cands, pos)
            if v not in resident or v in protect:
                raise RuntimeError(f"{ev_name} chose {v}, not a candidate")
            resident.discard(v)
            fresh_prefetch.discard(v)
            evicted_this_pass.add(v)
            ev.on_evict(v)
            st.evictions += 1
        resident.add(key)
        evicted_this_pass.discard(key)
        st.max_resident = max(st.max_resident, len(resident))
        if len(resident) > capacity:
            raise RuntimeError("cache over capacity")
        ev.on_insert(key, pos, prefetched=prefetched)
        return True

    for pass_id, p in enumerate(acc.passes):
        evicted_this_pass: set[ExpertKey] = set()
        proposed: set[ExpertKey] = set()
        st.passes += 1
        st.tokens += p.tokens
        for rank, step in enumerate(p.steps):
            l = step.layer
            pos = Position(pass_id, l, rank, time)
            if rank == 0:
                ev.on_pass_start(pos)
            ev.on_layer_start(pos)
            needed = [(l, e) for e in step.needed()]
            scores = step.scores()
            pinned = {k for k in needed if k in resident}
            done: set[ExpertKey] = set()
            for key in needed:
                time += 1
                pos = Position(pass_id, l, rank, time)
                st.accesses += 1
                st.accesses_per_layer[l] = st.accesses_per_layer.get(l, 0) + 1
                if key in proposed:
                    st.proposed_accesses += 1
                if key in resident:
                    st.hits += 1
                    st.hits_per_layer[l] = st.hits_per_layer.get(l, 0) + 1
                    if key in fresh_prefetch:
                        st.prefetch_hits += 1
                else:
                    st.misses += 1
                    if key in evicted_this_pass:
                        st.collisions += 1
                        st.collisions_per_layer[l] = st.collisions_per_layer.get(l, 0) + 1
                    action = ms.on_miss(key, pos)
                    if action != "fetch":
                        raise ConfigError(f"the simulator replays exact policies only; miss action {action!r}")
                    if not insert(key, pos, pinned, prefetched=False):
                        pinned -= done  # wave boundary: experts already run are released
                        if not insert(key, pos, pinned, prefetched=False):
                            raise RuntimeError("no victim even after a wave boundary")
                    st.demand_loads += 1
                    pinned.add(key)
                if key in fresh_prefetch:
                    fresh_prefetch.discard(key)
                    st.prefetch_used += 1
                ev.on_access(key, pos, score=scores[key[1]])
                done.add(key)
            if check:
                assert len(resident) <= capacity
            if not uses_prefetch or rank + 1 >= len(p.steps):
                continue
            ctx = _context(acc, step, pos, moe, lookahead, predict_logits, resident)
            reqs = pf.propose(ctx)
            st.proposals += len(reqs)
            in_flight: set[ExpertKey] = set()
            for r in reqs:
                proposed.add(r.key)
                if r.key in resident:
                    ev.on_predicted(r.key, pos)
                    continue
                if insert(r.key, pos, pinned | in_flight, prefetched=True):
                    in_flight.add(r.key)
                    fresh_prefetch.add(r.key)
                    st.prefetch_loads += 1
    return st


def _context(
    acc: AccessTrace, step, pos: Position, moe: tuple[int, ...], lookahead: int, predict_logits, resident: set[ExpertKey]
) -> LayerContext:
    x = step.router_input
    idx = torch.as_tensor(step.indices)  # [T,k]
    w = torch.as_tensor(step.weights) if step.weights is not None else torch.ones(idx.shape)

    def no_router(layer: int, x: torch.Tensor) -> torch.Tensor:
        raise ConfigError(
            "this prefetch policy needs the model's routers: pass predict_logits "
            "(e.g. get_adapter(model).router_logits) and an access trace with router inputs"
        )

    if x is None:
        x = torch.zeros(idx.shape[0], 0)
    return LayerContext(
        pos=pos,
        layer=step.layer,
        moe_layers=moe,
        num_experts=acc.num_experts,
        top_k=acc.top_k,
        router_input=x,
        logits=torch.zeros(idx.shape[0], acc.num_experts),
        indices=idx,
        weights=w,
        predict_logits=predict_logits or no_router,
        lookahead=lookahead,
        resident=lambda k: k in resident,
    )


def belady(acc: AccessTrace, capacity: int) -> SimStats:
    """Belady's MIN on `acc` at `capacity` (demand paging, no prefetch)."""
    return simulate(acc, capacity, Belady(acc), "none")
