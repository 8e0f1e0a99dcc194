"""Policy Protocols and registries: the contract between the cache (mechanism) and policies (decisions).

The device expert cache owns slots, copies and counters. It never decides anything itself:
- an `EvictionPolicy` picks the victim when a slot is needed and tracks whatever state it needs
  from the events the cache reports (insert, access, evict, forward-pass and layer boundaries);
- a `PrefetchPolicy` proposes experts of later layers to load after a layer has routed;
- a `MissPolicy` says what to do with a needed expert that is not resident;
- a `RoutingPolicy` may bias router selection scores (cache-aware routing); `standard` does not.

Every policy class subclasses its kind's Protocol (the registries refuse one that does not) and inherits
the declared capabilities' safe defaults (`changes_output`, `needs_routing`, `needs_host`, `needs_model`,
...: see "declared capabilities" below); `moeflow.policies.lossy` turns them into one lossy answer.

Experts are named by `ExpertKey = (layer, expert)` with `layer` a decoder-layer index.
"Time" is a monotone access counter the cache increments on every access (not wall clock), so
policies behave identically in the runtime and in the trace-driven simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from ..registry import P, Registry

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
    use) gives the slots' keys in slot order.

    Every key in it is resident, so a policy that tracks every inserted and not yet evicted key (from the
    cache's events) may walk its own order and return the first key `in` the view instead of scanning all
    candidates; a plain sequence (tests, other callers) may hold any keys and gets the policy's full scan.
    Without `keys` (the common case: every slot of the single part holds a key) the candidates are the
    unpinned slots of `slots` not in `exclude` (slot indices: copies in flight, slots a prefetch call just
    filled); with `keys` exactly those keys.
    """

    __slots__ = ("_exclude", "_keys", "_set", "_slot_of", "_slots")

    def __init__(
        self,
        slot_of: dict[ExpertKey, int],
        slots: Sequence[Any],
        keys: list[ExpertKey] | None = None,
        exclude: Any = (),
    ):
        self._slot_of, self._slots, self._keys, self._exclude = slot_of, slots, keys, exclude
        self._set: set[ExpertKey] | None = None

    def __contains__(self, key: object) -> bool:
        if self._keys is None:
            s = self._slot_of.get(key)  # type: ignore[call-overload]
            return s is not None and not self._slots[s].pinned and s not in self._exclude
        if self._set is None:
            self._set = set(self._keys)
        return key in self._set

    def _list(self) -> list[ExpertKey]:
        if self._keys is None:
            ex = self._exclude
            self._keys = [sl.key for s, sl in enumerate(self._slots) if not sl.pinned and s not in ex]
        return self._keys

    def __iter__(self) -> Iterator[ExpertKey]:
        return iter(self._list())

    def __len__(self) -> int:
        return len(self._list())

    def __bool__(self) -> bool:
        if self._keys is None:
            ex = self._exclude
            for s, sl in enumerate(self._slots):
                if not sl.pinned and s not in ex:
                    return True
            return False
        return bool(self._keys)

    def __getitem__(self, i):
        return self._list()[i]


# ---- declared capabilities ---------------------------------------------------------------------------
# Every policy class subclasses its kind's Protocol below and so inherits each capability's safe default;
# a class (or, where an option decides it, an instance) sets what differs. The engine, the cache, the
# simulator and `moeflow.policies.lossy` read these attributes; nothing probes a policy for what it can do.
# `changes_output` (every kind): the policy may change the model's output on every device (lossy). Safe
# defaults: eviction and prefetch policies only move bytes (False); a miss or routing policy is lossy
# unless it says otherwise (True).


@dataclass(frozen=True)
class BindContext:
    """What a policy with `needs_model` is given when the engine attaches (`bind(ctx)`): the running model and
    what it may measure. Prefetch policies are bound before the experts leave the device, miss policies after."""

    model: Any  # the running transformers model
    adapter: Any  # its `moeflow.moe.Adapter`
    link: Any  # the transfer link (`transfer_estimate_s(nbytes)`)
    expert_bytes: int  # one routed expert's full-precision row
    time_host_expert: Callable[[int], float]  # fastest seconds to run one expert on N rows on the host
    time_row_copy: Callable[[], float]  # fastest seconds of one plain host -> device copy of one expert row
    host_hidden: Callable[[], float | None] | None = None  # share of host expert time hidden so far (`auto`)


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses victims. Receives every cache event so it can keep its own bookkeeping."""

    name: ClassVar[str]
    changes_output: bool = False  # evictions only decide what stays: never
    hears_precision: ClassVar[bool] = False  # `on_precision(key, bits)` on every slot precision change (`lhu`)
    kernel: str | None = None  # its bookkeeping compiled in `moeflow.runtime.cachecore` (lru, lfu, least-stale,
    #   belady-approx, belady): with an instant link the cache (runtime and simulator) runs that kernel and
    #   never calls the events below; a subclass that changes an event sets None

    def __init__(self) -> None:  # a policy without options (`Registry.create` reads the signature)
        return None

    def on_insert(self, key: ExpertKey, pos: Position, *, prefetched: bool) -> None: ...
    def on_access(self, key: ExpertKey, pos: Position, *, score: float) -> None: ...
    def on_evict(self, key: ExpertKey) -> None: ...
    def on_pass_start(self, pos: Position) -> None:
        return None

    def on_layer_start(self, pos: Position) -> None:
        return None

    def on_predicted(self, key: ExpertKey, pos: Position) -> None:
        """A prefetch policy proposed `key` in this pass and it is already resident (the cache skips
        the load). Least-Stale uses it to mark the expert current again; most policies ignore it."""
        return None

    def on_precision(self, key: ExpertKey, bits: int) -> None:
        """`key`'s slot now holds a copy at `bits` (0: full precision); called only with `hears_precision`."""
        return None

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
    changes_output: bool = False  # prefetches only move bytes: never
    proposes: ClassVar[bool] = True  # False: never proposes (`none`; the engine skips the prefetch step)
    needs_router_input: ClassVar[bool] = False  # reads `LayerContext.router_input` through later layers' routers
    #   (`predict_logits`): the simulator needs a trace with router inputs and the model
    needs_residual: ClassVar[bool] = False  # reads `LayerContext.residual` (the engine captures it)
    needs_model: ClassVar[bool] = False  # `bind(ctx)` loads what it needs from the running model (runtime only)
    speculates: ClassVar[bool] = False  # its predictor can replace the routing (`--speculative`)
    gate: Any = None  # the admission of its proposals (`moeflow.policies.prefetch.PrefetchGate`); None: admit all
    pred: Any = None  # the predictor a `needs_model` policy bound (`speculates`: the one that routes)
    lookahead: int | None = None  # its own step size S (option `lookahead=`), used instead of the engine's
    reads_position_only: ClassVar[bool] = False  # True: `propose_at(pos, resident)` does what `propose` does, so a
    #   replay loop need not build a `LayerContext` per step (tune's table of pre-gate proposals)

    def __init__(self) -> None:  # a policy without options (`Registry.create` reads the signature)
        return None

    @property
    def horizon(self) -> int | None:
        """The largest S it can predict (a learned predictor's trained S, once bound); None: any."""
        return None

    def bind(self, ctx: BindContext) -> Callable[[], None]:
        """Called with `needs_model` before the engine offloads the experts; returns the release function."""
        return _nothing

    def propose(self, ctx: LayerContext) -> list[PrefetchRequest]:
        """Experts of later layers to load now (resident ones are skipped by the cache)."""
        ...

    def propose_at(self, pos: Position, resident: Any) -> list[PrefetchRequest]:
        """`propose` from the position and the cache's residency test alone (only where `reads_position_only`)."""
        raise NotImplementedError(f"{self.name} reads the whole LayerContext: call propose")


def _nothing() -> None:
    return None


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
    cpu there, before demand loads); other policies are asked by the cache (`check_misses`), info-less, or
    with `precisions` with a `MissInfo` of the summed gate weight after `observe`."""

    name: ClassVar[str]
    changes_output: bool = True  # safe default: lossy unless the policy says it loads and runs the expert
    needs_routing: ClassVar[bool] = False  # asked in the engine's router hook (drop / substitute / cpu; runtime only)
    needs_host: ClassVar[bool] = False  # may run experts on the host: bit-identical only on a CPU device
    needs_model: ClassVar[bool] = False  # `bind(ctx)` when the engine attaches (router rows, timings)
    upgrade: ClassVar[bool] = False  # the cache queues the full-precision row over each low-precision slot
    precisions: tuple[int, ...] = ()  # low precisions (bits) the store must hold; non-empty: asked after `observe`
    optimize: bool = True  # HQQ's zero optimisation for those copies
    renorm: bool = False  # `drop`: rescale a token's kept gate weights to their original sum

    def __init__(self) -> None:  # a policy without options (`Registry.create` reads the signature)
        return None

    def bind(self, ctx: BindContext) -> None:
        """Called with `needs_model` when the engine attaches, after the experts are in the host store."""
        return None

    def observe(self, layer: int, scores: dict[int, float]) -> None:
        """With `precisions`: every needed expert of a layer call with its summed gate weight (hits included)."""
        return None

    def measured(self, host_path_s: float, host_wait_s: float, stall_s: float, waited: int) -> None:
        """With `needs_routing`, before each layer's misses are decided: the engine's running totals (seconds of
        the host path of host experts, seconds experts calls waited for them, seconds the compute waited for
        copies, loads it waited for). `auto` calibrates its costs on them."""
        return None

    def on_miss(self, key: ExpertKey, pos: Position, info: MissInfo | None = None) -> MissAction:
        """'fetch' (blocking load, exact) or another `MissAction` (lossy ones: see above)."""
        ...

    def on_misses(
        self,
        layer: int,
        experts: list[int],
        infos: list[tuple[int, float, int]],
        pos: Position,
        resident: Callable[[ExpertKey], bool],
    ) -> list[MissAction]:
        """With `needs_routing`: the actions for every missing expert of one layer call (`infos`: each one's
        (rank, score, tokens)), in order. By default `on_miss` per expert; `auto` decides them at once."""
        return [self.on_miss((layer, e), pos, MissInfo(*i, resident)) for e, i in zip(experts, infos)]


@runtime_checkable
class RoutingPolicy(Protocol):
    """Changes which experts a layer selects (`reroutes`), or the order the experts call computes them in."""

    name: ClassVar[str]
    changes_output: bool = True  # safe default: lossy unless the policy keeps the router's choice
    reroutes: ClassVar[bool] = True  # the engine re-selects in its router hook (`bias` or `select_logits`)
    dual_logits: ClassVar[bool] = False  # re-selects through `select_logits` (z' selects; else `bias`)
    hit_first: ClassVar[bool] = False  # the experts call computes ready experts before waiting for the others
    renorm: bool = False  # with `dual_logits`: z' selects and weights (else the original logits weight)

    def __init__(self) -> None:  # a policy without options (`Registry.create` reads the signature)
        return None

    def bias(self, layer: int, num_experts: int, resident: Callable[[ExpertKey], bool]) -> torch.Tensor | None:
        """An additive bias [E] on the selection scores of `layer`, or None for the router's own choice."""
        return None

    def select_logits(
        self, layer: int, logits: torch.Tensor, resident: Callable[[ExpertKey], bool], top_k: int
    ) -> torch.Tensor | None:
        """With `dual_logits`: z' [T,E] that selects the experts (the original logits weight them, unless
        `renorm`), or None for the router's own choice."""
        return None


KINDS: dict[str, type] = {"eviction": EvictionPolicy, "prefetch": PrefetchPolicy, "miss": MissPolicy, "routing": RoutingPolicy}


class PolicyRegistry(Registry):
    """A `Registry` that accepts only classes subclassing the kind's Protocol (so every capability is declared)."""

    def register(self, cls: type[P]) -> type[P]:
        proto = KINDS[self.kind]
        if proto not in cls.__mro__:
            raise TypeError(f"{cls.__name__} must subclass {proto.__name__} to be registered as a {self.what}")
        return super().register(cls)


# ---- registries (one per kind; `moeflow.registry.Registry`) ---------------------------------------

EVICTION = PolicyRegistry("eviction")
PREFETCH = PolicyRegistry("prefetch")
MISS = PolicyRegistry("miss")
ROUTING = PolicyRegistry("routing")
