"""Policy Protocols and registries: the contract between the cache (mechanism) and policies (decisions).

The device expert cache owns slots, copies and counters. It never decides anything itself:
- an `EvictionPolicy` picks the victim when a slot is needed and tracks whatever state it needs
  from the events the cache reports (insert, access, evict, forward-pass and layer boundaries);
- a `PrefetchPolicy` proposes experts of later layers to load after a layer has routed;
- a `MissPolicy` says what to do with a needed expert that is not resident;
- a `RoutingPolicy` may bias router selection scores (cache-aware routing); `standard` does not.

Experts are named by `ExpertKey = (layer, expert)` with `layer` a decoder-layer index.
"Time" is a monotone access counter the cache increments on every access (not wall clock), so
policies behave identically in the runtime and in the trace-driven simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from ..registry import Registry

ExpertKey = tuple[int, int]  # (decoder layer, expert id)


@dataclass(frozen=True)
class Position:
    """Where execution is: forward pass number (one per generate step) and the MoE layer running."""

    pass_id: int  # increments at the start of each model forward (prefill = pass 0)
    layer: int  # decoder-layer index currently executing
    layer_rank: int  # position of `layer` in spec.moe_layers (0 = first MoE layer)
    time: int  # cache access counter at this moment


class Candidates(Sequence[ExpertKey]):
    """The cache's eviction candidates as a view: `key in view` is O(1), iteration (materialised once, on first
    use) gives the slots' keys in slot order, as the list the cache used to build.

    Every key in it is resident, so a policy that tracks every inserted and not yet evicted key (from the
    cache's events) may walk its own order and return the first key `in` the view instead of scanning all
    candidates; a plain sequence (tests, other callers) may hold any keys and gets the policy's full scan.
    Without `keys` (the common case: every slot of the single part is ready, nothing is protected) the
    candidates are the unpinned slots of `slots`; with `keys` exactly those keys.
    """

    __slots__ = ("_keys", "_set", "_slot_of", "_slots")

    def __init__(self, slot_of: dict[ExpertKey, int], slots: Sequence[Any], keys: list[ExpertKey] | None = None):
        self._slot_of, self._slots, self._keys = slot_of, slots, keys
        self._set: set[ExpertKey] | None = None

    def __contains__(self, key: object) -> bool:
        if self._keys is None:
            s = self._slot_of.get(key)  # type: ignore[call-overload]
            return s is not None and not self._slots[s].pinned
        if self._set is None:
            self._set = set(self._keys)
        return key in self._set

    def _list(self) -> list[ExpertKey]:
        if self._keys is None:
            self._keys = [sl.key for sl in self._slots if not sl.pinned]
        return self._keys

    def __iter__(self) -> Iterator[ExpertKey]:
        return iter(self._list())

    def __len__(self) -> int:
        return len(self._list())

    def __bool__(self) -> bool:
        if self._keys is None:
            for sl in self._slots:
                if not sl.pinned:
                    return True
            return False
        return bool(self._keys)

    def __getitem__(self, i):
        return self._list()[i]


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses victims. Receives every cache event so it can keep its own bookkeeping."""

    name: ClassVar[str]

    def on_insert(self, key: ExpertKey, pos: Position, *, prefetched: bool) -> None: ...
    def on_access(self, key: ExpertKey, pos: Position, *, score: float) -> None: ...
    def on_evict(self, key: ExpertKey) -> None: ...
    def on_pass_start(self, pos: Position) -> None: ...
    def on_layer_start(self, pos: Position) -> None: ...
    def on_predicted(self, key: ExpertKey, pos: Position) -> None:
        """A prefetch policy proposed `key` in this pass and it is already resident (the cache skips
        the load). Least-Stale uses it to mark the expert current again; most policies ignore it."""
        ...

    def victim(self, candidates: Sequence[ExpertKey], pos: Position) -> ExpertKey:
        """One of `candidates` (resident, not pinned by the running layer, not in flight)."""
        ...


@dataclass
class LayerContext:
    """What a prefetch policy may look at after MoE layer `layer` has routed (one forward pass).

    `router_input` is the router's input (the post-attention-norm hidden state) and
    `residual` the post-attention residual when the engine captured it (None otherwise).
    `predict_logits(target_layer, x)` applies layer `target_layer`'s own router to x [T,H].
    """

    pos: Position
    layer: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    router_input: torch.Tensor  # [T,H]
    logits: torch.Tensor  # [T,E] this layer's router logits
    indices: torch.Tensor  # [T,k] experts this layer chose
    weights: torch.Tensor  # [T,k]
    predict_logits: Callable[[int, torch.Tensor], torch.Tensor]
    token_ids: torch.Tensor | None = None  # [T] input ids of this forward pass, when known
    residual: torch.Tensor | None = None  # [T,H]
    lookahead: int = 1  # step size S: how many MoE layers ahead to prefetch
    resident: Callable[[ExpertKey], bool] = field(default=lambda k: False)

    def next_layers(self, steps: int | None = None) -> list[int]:
        """The next `steps` (default: lookahead) MoE layers after this one, in the same pass."""
        steps = self.lookahead if steps is None else steps
        r = self.moe_layers.index(self.layer)
        return list(self.moe_layers[r + 1 : r + 1 + steps])


@dataclass(frozen=True)
class PrefetchRequest:
    key: ExpertKey
    priority: float = 0.0  # higher is sooner; the cache issues requests in priority order
    confidence: float = 1.0  # the predictor's probability that `key` is routed when its layer runs (the gate's p)


@runtime_checkable
class PrefetchPolicy(Protocol):
    name: ClassVar[str]

    def propose(self, ctx: LayerContext) -> list[PrefetchRequest]:
        """Experts of later layers to load now (resident ones are skipped by the cache)."""
        ...


# ---- miss actions ----------------------------------------------------------------------------------
# What `MissPolicy.on_miss` returns for a needed expert that is not resident:
#   "fetch"              blocking load, then run it (exact)
#   ("fetch", bits)      load a low-precision copy of `bits` bits (the store's quantized copies; lossy)
#   "drop"               skip it: its gate weight becomes 0 (optionally the token's others renormalized)
#   "substitute:<e>"     run resident expert <e> of the same layer in its place, with its gate weight
#   "cpu"                run it on the host from the host store's row; only activations move (exact in fp32
#                        on CPU: the same grouped kernels)
MissAction = str | tuple[str, int]
FETCH, DROP, CPU, SUBSTITUTE = "fetch", "drop", "cpu", "substitute"


def miss_action(action: MissAction) -> tuple[str, int | None]:
    """An action -> (kind, argument): "fetch" -> ("fetch", None), ("fetch", 4) -> ("fetch", 4),
    "substitute:5" -> ("substitute", 5), "drop" / "cpu" -> (kind, None). ValueError for anything else."""
    if isinstance(action, tuple):
        if len(action) == 2 and action[0] == FETCH:
            return FETCH, int(action[1])
    elif action in (FETCH, DROP, CPU):
        return action, None
    elif isinstance(action, str) and action.startswith(SUBSTITUTE + ":"):
        return SUBSTITUTE, int(action.split(":", 1)[1])
    raise ValueError(f"unknown miss action {action!r}")


@dataclass(frozen=True)
class MissInfo:
    """What the router hook knows about one missing expert of the running layer (all its tokens)."""

    rank: int  # best 1-based rank among the tokens routed to it, by gate weight (1 = a token's top choice)
    score: float  # the largest gate weight it got
    tokens: int  # tokens routed to it in this call
    resident: Callable[[ExpertKey], bool] = field(default=lambda k: False)  # the cache's residency now


@runtime_checkable
class MissPolicy(Protocol):
    """`on_miss(key, pos)` -> a `MissAction`. A policy with `needs_routing = True` is asked in the engine's
    router hook with `info=MissInfo(...)` and may return any action (the engine applies drop / substitute /
    cpu there, before demand loads); other policies are asked by the cache (`check_misses`), info-less."""

    name: ClassVar[str]
    exact: ClassVar[bool]  # True if the layer's output is unchanged (the expert is loaded and run)

    def on_miss(self, key: ExpertKey, pos: Position) -> MissAction:
        """'fetch' (blocking load, exact) or another `MissAction` (lossy ones: see above)."""
        ...


@runtime_checkable
class RoutingPolicy(Protocol):
    name: ClassVar[str]
    exact: ClassVar[bool]

    def bias(self, layer: int, num_experts: int, resident: Callable[[ExpertKey], bool]) -> torch.Tensor | None:
        """An additive bias [E] on the selection scores of `layer`, or None for the router's own choice.

        A policy may instead define `select_logits(layer, logits [T,E], resident, top_k) -> z' | None`
        (dual-logit routing: z' selects the experts, the original logits weight them; `cache-aware`).
        `reroutes = False` tells the engine the policy never changes routing (`hit-first`), and
        `hit_first = True` makes the experts call compute resident experts before waiting for misses."""
        ...


# ---- registries (one per kind; `moeflow.registry.Registry`) ---------------------------------------

EVICTION = Registry("eviction")
PREFETCH = Registry("prefetch")
MISS = Registry("miss")
ROUTING = Registry("routing")
