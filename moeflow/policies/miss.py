"""Miss policies: what to do with a needed expert that is not resident.

Each returns a `MissAction` (moeflow.policies.base): the engine applies `drop`, `substitute:<e>` and `cpu`
in its router hook, before demand loads (policies with `needs_routing = True` get a `MissInfo`: the
expert's best rank and largest gate weight over the layer's tokens); `fetch` loads as always. The
simulator implements `fetch` only.

| name | action | exact |
|---|---|---|
| fetch | blocking load, then run the expert (SpecMD "Fetch") | yes |
| drop | skip misses of rank >= `min_rank` (3) and weight < `score` (0: any); `renorm` | no |
| substitute | most similar resident expert (router-row cosine), 1 - cos <= `tol` | no |
| cpu | run the missing expert on the host from the store's row; activations move | on CPU |
| auto | per miss: cpu if host time now and at the expected later hits beats a copy's wait + device time | on CPU |
| fetch-lowest-bit | ("fetch", `bits`): the store's lowest-precision copy (default int2; HQQ) | no |
| fetch-priority | misses scoring below the layer's `percentile` (60): ("fetch", b), b from `bits` (8/4/2) by tier | no |
| cascade | ("fetch", `bits`) now (int4), then the full row queued over the slot (prefetch priority) | no |

The mixed-precision three (`precisions` set) are decided by the cache (`ExpertCache.check_misses`, so the
simulator runs them too): the engine makes the store's compact copies at attach, `observe(layer, scores)`
feeds the per-layer gate-score history and `info.score` is the expert's summed gate weight in the call.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from typing import Any, ClassVar

import torch

from .base import CPU, DROP, FETCH, MISS, BindContext, ExpertKey, MissAction, MissInfo, MissPolicy, Position

FULL_BITS = 0  # `moeflow.quant.FULL`: a full-precision (model dtype) copy


@MISS.register
class Fetch(MissPolicy):
    """Load the missing expert and wait for it: the layer's output is exactly the model's."""

    name: ClassVar[str] = "fetch"
    changes_output = False

    def on_miss(self, key: ExpertKey, pos: Position, info: MissInfo | None = None) -> MissAction:
        return FETCH


@MISS.register
class Drop(MissPolicy):
    """Skip missing experts ranked `min_rank` or lower for every token that routes to them (SpecMD "Drop",
    Skliar et al.: models are resilient beyond rank 2) and, when `score` > 0, only those whose largest gate
    weight is below it. Dropped experts get weight 0; `renorm=True` rescales each token's kept weights so
    they sum to the token's original top-k weight sum."""

    name: ClassVar[str] = "drop"
    changes_output = True
    needs_routing: ClassVar[bool] = True

    def __init__(self, min_rank: int = 3, score: float = 0.0, renorm: bool = False):
        if int(min_rank) < 2:
            raise ValueError("min_rank must be >= 2 (a token's top expert is always fetched)")
        self.min_rank, self.score, self.renorm = int(min_rank), float(score), bool(renorm)

    def on_miss(self, key: ExpertKey, pos: Position, info: MissInfo | None = None) -> MissAction:
        if info is None or info.rank < self.min_rank:
            return FETCH
        if self.score > 0 and info.score >= self.score:
            return FETCH
        return DROP


@MISS.register
class Substitute(MissPolicy):
    """Run the most similar resident expert of the same layer instead of a missing one (Zhu et al. 2025):
    similarity = cosine of the two experts' router weight rows (precomputed per layer at `bind`); substitute
    when 1 - cos <= `tol`, else fetch. Only misses of rank >= `min_rank` (default 1: all) are substituted."""

    name: ClassVar[str] = "substitute"
    changes_output = True
    needs_routing: ClassVar[bool] = True
    needs_model: ClassVar[bool] = True  # the router rows' similarities

    def __init__(self, tol: float = 1.0, min_rank: int = 1):
        self.tol, self.min_rank = float(tol), int(min_rank)
        self.sim: dict[int, torch.Tensor] = {}  # layer -> [E,E] cosine similarity

    def bind(self, ctx: BindContext) -> None:
        ad = ctx.adapter
        for l in ad.moe_layers:
            w = ad.router_weight(l).detach().float().cpu()  # [E,H]
            self.sim[l] = similarity(w)

    def on_miss(self, key: ExpertKey, pos: Position, info: MissInfo | None = None) -> MissAction:
        if info is None or info.rank < self.min_rank:
            return FETCH
        l, e = key
        sim = self.sim.get(l)
        if sim is None:
            return FETCH
        best = nearest_resident(sim, l, e, info.resident)
        if best is None or 1.0 - float(sim[e, best]) > self.tol:
            return FETCH
        return f"substitute:{best}"


def similarity(router_weight: torch.Tensor) -> torch.Tensor:
    """Cosine similarity [E,E] of router weight rows [E,H]."""
    w = torch.nn.functional.normalize(router_weight.float(), dim=-1)
    return w @ w.T


def nearest_resident(sim: torch.Tensor, layer: int, expert: int, resident: Any) -> int | None:
    """The resident expert of `layer` (not `expert`) most similar to `expert`, or None (lowest id on ties)."""
    best, best_s = None, -float("inf")
    for j in range(sim.shape[0]):
        if j != expert and resident((layer, j)):
            s = float(sim[expert, j])
            if s > best_s:
                best, best_s = j, s
    return best


@MISS.register
class Cpu(MissPolicy):
    """Compute the missing expert on the host, where its weights live: the rows of its tokens go to the
    host, the same grouped kernels run there, the results come back. Bit-identical on a CPU device (the
    same kernels); on CUDA the host's kernels sum in another order than the device's (`needs_host`: lossy)."""

    name: ClassVar[str] = "cpu"
    changes_output = False  # on its own; `needs_host` makes it lossy on a non-CPU device
    needs_routing: ClassVar[bool] = True
    needs_host: ClassVar[bool] = True

    def on_miss(self, key: ExpertKey, pos: Position, info: MissInfo | None = None) -> MissAction:
        return CPU


@MISS.register
class Auto(MissPolicy):
    """Per miss, `cpu` or `fetch`, whichever costs the layer less over the expert's expected later accesses.

    cpu: the host computes the expert now for the call's tokens, and again at each later access (a cpu
    expert never enters the cache), each time only the part the device's own work does not hide:
    `cost_cpu = (host(tokens) + reuse x host(1)) x slowdown x (1 - hidden)`, host(n) = `host_s` +
    `per_token_s` x (n - 1) (the kernel alone, calibrated or measured at `bind`). fetch: one copy now, after
    which the device computes the expert now and at those later accesses (hits):
    `cost_fetch = wait + device(tokens) + reuse x device(1)`, `wait` = the wait for one demand load.
    device(n) = host(n) x `device_s` / `host_s`: the same kernel at the device's speed, `device_s` = seconds
    of one expert on one token on the device (`moeflow run`: the calibration's `expert_time_s` on a non-CPU
    device). Unset, on a CPU device device(n) = host(n) x slowdown: the same kernels on the same cores under
    the same load, so a fetch there only adds its copy and cpu is chosen at every link speed; elsewhere 0 (a
    GPU's expert compute taken as free against the host's).
    `cpu` when cost_cpu < cost_fetch (a cpu miss now and a fetch at a later access never beats a fetch now).

    The three factors are measured as the engine runs (`measured`: the engine's running totals, fed before
    each layer's misses are decided), each a recent-weighted ratio of sums that start as one observation of
    its prior; each update scales the sums by `decay` and adds (1 - `decay`) of a prior observation, so the
    prior keeps the weight of one observation and an option `auto` has not chosen for a while drifts back to
    its prior (optimistic) and is tried again:
    - `slowdown` = host-path seconds (hand-off to the host worker, compute, result back; on a CPU device at
      several threads, no worker: the compute on the calling thread) / host(tokens) of the experts `auto` sent
      there (prior 1: the kernel alone);
    - `hidden` = 1 - the experts call's wait for those results / their host-path seconds (prior 0);
    - `wait` = seconds the compute waited per demand load or late prefetch (prior: the link's
      estimate of one copy, else one timed row copy), so queueing behind copies in flight and the link's
      real speed are counted.
    `reuse` = the expected later hits of a fetched expert: a fixed value when given, else learned,
    recent-weighted (`decay` per fetch): hits that experts `auto` fetched earned while resident / experts
    `auto` fetched, starting from `prior` (one pseudo-fetch with that many hits). Hits are heard through
    `observe` (every experts call's experts with a slot); a fetched expert stops being followed once it is
    no longer resident. `calibrate=False` keeps the priors (hand-made costs)."""

    name: ClassVar[str] = "auto"
    changes_output = False  # fetch and cpu are both exact on a CPU device; `needs_host`: lossy elsewhere
    needs_routing: ClassVar[bool] = True
    needs_host: ClassVar[bool] = True
    needs_model: ClassVar[bool] = True  # host and copy timings, the model's device

    def __init__(
        self,
        host_s: float | None = None,
        per_token_s: float | None = None,
        copy_s: float | None = None,
        device_s: float | None = None,
        reuse: float | None = None,
        prior: float = 1.0,
        decay: float = 0.98,
        calibrate: bool = True,
    ):
        if not 0.0 < float(decay) <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.host_s, self.per_token_s, self.copy_s = host_s, per_token_s, copy_s
        self.device_s = None if device_s is None else float(device_s)
        if self.device_s is not None and self.device_s < 0:
            raise ValueError("device_s must be >= 0 (seconds of one expert on one token on the device)")
        self.device_is_host = False  # the model on a CPU device (set at `bind`): unset device_s -> host(n) x slowdown
        self._dev_scale = self._dev_flat = 0.0  # device(n) = _dev_scale x host(n) + _dev_flat (set by `_prime`)
        self._dev_host = False  # device(n) = host(n) x slowdown instead (set by `_prime`)
        self.fixed_reuse = None if reuse is None else float(reuse)
        self.decay = float(decay)
        self.calibrate = bool(calibrate)
        self.fetches, self.hits = 1.0, float(prior)  # decayed counts: auto's fetches, the hits they earned
        # decayed sums, each pair starting at one pseudo-observation of its prior (set at `bind` / first use):
        self._est = self._path = self._wait = 0.0  # host(tokens) of auto's host experts, their host path, its wait
        self._stall, self._waited = 0.0, 0.0  # compute's wait for copies, the loads waited for
        self._primed = False
        self._last: tuple[float, float, float, float] | None = None  # the engine's totals at the last `measured`
        self._sent = 0.0  # host(tokens) of the host experts decided since the last `measured`
        self._link: Any = None
        self._nbytes = 0
        self._resident: Any = None  # the cache's `resident(key)` (from `MissInfo`)
        self._followed: dict[int, set[int]] = {}  # layer -> experts auto fetched, still followed for hits
        self._fresh: set[ExpertKey] = set()  # fetched in the layer call now running (not a hit of itself)
        self.decisions = {FETCH: 0, CPU: 0}

    def bind(self, ctx: BindContext) -> None:
        self._link, self._nbytes = ctx.link, ctx.expert_bytes
        param = next(ctx.model.parameters(), None) if ctx.model is not None else None
        self.device_is_host = param is not None and param.device.type == "cpu"
        if self.host_s is None or self.per_token_s is None:
            t1, t8 = ctx.time_host_expert(1), ctx.time_host_expert(8)
            self.host_s = t1 if self.host_s is None else self.host_s
            self.per_token_s = max(0.0, (t8 - t1) / 7) if self.per_token_s is None else self.per_token_s
        if self.copy_s is None:
            est = self._link.transfer_estimate_s(self._nbytes)
            self.copy_s = est if est is not None else ctx.time_row_copy()
        self._primed = False  # the priors from the timings just taken
        self._prime()

    def _prime(self) -> None:
        """Each measured ratio starts at its prior, weighted as one observation (slowdown 1, hidden 0, one copy)."""
        if not self._primed:
            host1, copy = self.estimate(1)
            self._est = self._path = self._wait = host1
            self._stall, self._waited = copy, 1.0
            self._dev_scale, self._dev_flat = 0.0, 0.0
            self._dev_host = self.device_s is None and self.device_is_host  # device(n) = host(n) x slowdown
            if self.device_s is not None and host1 > 0:
                self._dev_scale = self.device_s / host1
            elif self.device_s is not None:  # no host time to scale: the device's one-token time at every row count
                self._dev_flat = self.device_s
            self._primed = True

    @property
    def reuse(self) -> float:
        """Expected later hits of a fetched expert (fixed, or learned: decayed hits / decayed fetches)."""
        return self.fixed_reuse if self.fixed_reuse is not None else self.hits / self.fetches

    @property
    def slowdown(self) -> float:
        """Host-path seconds per second of the kernel model host(tokens), as measured (1 before any)."""
        self._prime()
        return self._path / self._est if self._est > 0 else 1.0

    @property
    def hidden(self) -> float:
        """Share of the host path hidden behind the device's work, as measured (0 before any)."""
        self._prime()
        return min(1.0, max(0.0, 1.0 - self._wait / self._path)) if self._path > 0 else 0.0

    def estimate(self, tokens: int) -> tuple[float, float]:
        """(kernel seconds host(tokens) of one expert, prior seconds of one copy): no overlap, reuse or
        measurement counted."""
        host = float(self.host_s or 0.0) + float(self.per_token_s or 0.0) * max(0, tokens - 1)
        return host, float(self.copy_s or 0.0)

    def device(self, tokens: int) -> float:
        """device(tokens): modelled seconds of one expert on `tokens` rows on the device (see the class docstring)."""
        self._prime()
        scale = self.slowdown if self._dev_host else self._dev_scale
        return scale * self.estimate(tokens)[0] + self._dev_flat

    def costs(self, tokens: int) -> tuple[float, float]:
        """(cost_cpu, cost_fetch) of one miss with `tokens` rows, in seconds (see the class docstring): the
        copy's measured wait is `cost_fetch` less the device's compute."""
        if not self._primed:
            self._prime()
        host1 = float(self.host_s or 0.0)
        host = host1 + float(self.per_token_s or 0.0) * (tokens - 1) if tokens > 1 else host1  # host(tokens)
        reuse = self.fixed_reuse if self.fixed_reuse is not None else self.hits / self.fetches
        cost_fetch = self._stall / self._waited if self._waited > 0 else float(self.copy_s or 0.0)
        ratio = self._wait / self._est if self._est > 0 else 1.0  # slowdown x (1 - hidden)
        work = host + reuse * host1  # host(tokens) + reuse x host(1): the kernel now and at the later accesses
        if self._dev_host:  # a CPU device: the same kernel at the measured slowdown
            scale = self._path / self._est if self._est > 0 else 1.0
        else:
            scale = self._dev_scale
        # device(tokens) + reuse x device(1) = scale x work + (1 + reuse) x _dev_flat
        return work * ratio, cost_fetch + scale * work + (1.0 + reuse) * self._dev_flat

    def measured(self, host_path_s: float, host_wait_s: float, stall_s: float, waited: int) -> None:
        """The engine's running totals, before a layer's misses are decided: host-path seconds of host experts,
        the seconds experts calls waited for them, seconds the compute waited for copies, and the loads it
        waited for (demand loads + late prefetches). Their growth since the last call updates the measured
        ratios; host time is matched with the host experts `auto` sent since then (all joined by now)."""
        now = (float(host_path_s), float(host_wait_s), float(stall_s), float(waited))
        last, self._last = self._last, now
        sent, self._sent = self._sent, 0.0
        if last is None or not self.calibrate:
            return
        if not self._primed:
            self._prime()
        g = self.decay
        q = 1.0 - g
        p = q * float(self.host_s or 0.0)  # each update forgets toward the prior: an option not chosen for a
        #   while looks as it did a priori (slowdown 1, hidden 0, the link's copy time) and is tried again
        d_path = now[0] - last[0]
        if sent and d_path > 0:  # the host experts sent since the last call, all joined by now
            self._est = g * self._est + p + sent
            self._path = g * self._path + p + d_path
            self._wait = g * self._wait + p + (now[1] - last[1])
        else:
            self._est, self._path, self._wait = g * self._est + p, g * self._path + p, g * self._wait + p
        self._stall = g * self._stall + q * float(self.copy_s or 0.0) + (now[2] - last[2])
        self._waited = g * self._waited + q + (now[3] - last[3])

    def on_miss(self, key: ExpertKey, pos: Position, info: MissInfo | None = None) -> MissAction:
        if info is None:
            return self.on_misses(key[0], [key[1]], [(1, 0.0, 1)], pos, self._resident)[0]
        return self.on_misses(key[0], [key[1]], [(info.rank, info.score, info.tokens)], pos, info.resident)[0]

    def on_misses(
        self, layer: int, experts: list[int], infos: list[tuple[int, float, int]], pos: Position, resident: Any
    ) -> list[MissAction]:
        """`on_miss` for every missing expert of one layer call at once (`experts`, their (rank, score, tokens)
        `infos`): the costs are evaluated once per distinct token count with the model as it stood when the
        layer routed (a decode call: once), not once per miss; the same bookkeeping as `on_miss`."""
        self._resident = resident
        cheaper: dict[int, bool] = {}  # tokens -> cpu is cheaper
        out: list[MissAction] = []
        host1, per_token = float(self.host_s or 0.0), float(self.per_token_s or 0.0)
        followed = None
        for e, (_rank, _score, tokens) in zip(experts, infos):
            c = cheaper.get(tokens)
            if c is None:
                cost_cpu, cost_fetch = self.costs(tokens)
                c = cheaper[tokens] = cost_cpu < cost_fetch
            if c:
                self._sent += host1 + per_token * (tokens - 1) if tokens > 1 else host1  # host(tokens)
                out.append(CPU)
                continue
            self.fetches = self.fetches * self.decay + 1.0
            self.hits *= self.decay
            if followed is None:
                followed = self._followed.setdefault(layer, set())
            followed.add(e)
            self._fresh.add((layer, e))
            out.append(FETCH)
        n_cpu = sum(1 for a in out if a == CPU)
        self.decisions[CPU] += n_cpu
        self.decisions[FETCH] += len(out) - n_cpu
        return out

    def observe(self, layer: int, scores: dict[int, float]) -> None:
        """A layer call's experts with a slot (after the call): each followed one not fetched by this very
        call earned a hit; followed experts no longer resident are dropped."""
        followed = self._followed.get(layer)
        if followed:
            resident = self._resident
            for e in list(followed):
                if resident is not None and not resident((layer, e)):
                    followed.discard(e)
                elif e in scores and (layer, e) not in self._fresh:
                    self.hits += 1.0
        self._fresh = {k for k in self._fresh if k[0] != layer}


# ---- mixed precision (SpecMD 3.1.2, HOBBIT) ----------------------------------------------------------


def _bits_list(bits: Any) -> tuple[int, ...]:
    """`8`, `"8/4/2"`, `"8-4"` or a sequence -> (8, 4, 2): the precisions to use, most precise first."""
    from ..quant import BITS

    if isinstance(bits, int):
        out: tuple[int, ...] = (bits,)
    elif isinstance(bits, str):
        out = tuple(int(b) for b in bits.replace("-", "/").replace(":", "/").split("/") if b.strip())
    else:
        out = tuple(int(b) for b in bits)
    bad = [b for b in out if b not in BITS]
    if not out or bad:
        raise ValueError(f"bits must be among {'/'.join(map(str, BITS))}, got {bits!r}")
    return tuple(sorted(set(out), reverse=True))


class _MixedPrecision(MissPolicy):
    """Shared: `precisions` (the store's compact copies to make), HQQ's `optimize`, a no-op `observe`."""

    name: ClassVar[str] = ""
    changes_output = True  # a low-precision copy runs

    def __init__(self, bits: Any, optimize: bool = True):
        self.precisions = _bits_list(bits)
        self.optimize = bool(optimize)


@MISS.register
class FetchLowestBit(_MixedPrecision):
    """On a miss fetch the lowest-precision copy (SpecMD "Fetch-lowest-bit"): fewest bytes, largest error."""

    name: ClassVar[str] = "fetch-lowest-bit"

    def __init__(self, bits: Any = 2, optimize: bool = True):
        super().__init__(bits, optimize)
        self.precisions = (min(self.precisions),)

    def on_miss(self, key: ExpertKey, pos: Position, info: MissInfo | None = None) -> MissAction:
        return (FETCH, self.precisions[0])


@MISS.register
class FetchPriority(_MixedPrecision):
    """SpecMD "Fetch-priority" (int8:4:2): a miss whose gate score ranks below the `percentile` of its layer's
    recent scores (the last `window` needed experts' summed gate weights) is fetched at low precision, the
    band [0, percentile) split evenly into tiers from `bits`, most precise first (60, 8/4/2: 40-60 -> int8,
    20-40 -> int4, 0-20 -> int2); the others, and every miss before `min_history` scores are known, at full
    precision. SpecMD's setting: the bottom 60th percentile degraded."""

    name: ClassVar[str] = "fetch-priority"

    def __init__(
        self, percentile: float = 60.0, bits: Any = "8/4/2", window: int = 4096, min_history: int = 32, optimize: bool = True
    ):
        super().__init__(bits, optimize)
        if not 0 < float(percentile) <= 100:
            raise ValueError("percentile must be in (0, 100]")
        self.percentile, self.window, self.min_history = float(percentile), int(window), int(min_history)
        self._recent: dict[int, deque[float]] = {}
        self._sorted: dict[int, list[float]] = {}
        self.decisions: dict[int, int] = {b: 0 for b in (FULL_BITS, *self.precisions)}

    def observe(self, layer: int, scores: dict[int, float]) -> None:
        recent = self._recent.setdefault(layer, deque())
        srt = self._sorted.setdefault(layer, [])
        for v in scores.values():
            recent.append(v)
            insort(srt, v)
            if len(recent) > self.window:
                old = recent.popleft()
                del srt[bisect_left(srt, old)]

    def rank_pct(self, layer: int, score: float) -> float | None:
        """Percent of the layer's recent scores below `score` (None: too little history)."""
        srt = self._sorted.get(layer, [])
        if len(srt) < self.min_history:
            return None
        return 100.0 * bisect_left(srt, score) / len(srt)

    def on_miss(self, key: ExpertKey, pos: Position, info: MissInfo | None = None) -> MissAction:
        q = self.rank_pct(key[0], info.score) if info is not None else None
        if q is None or q >= self.percentile:
            self.decisions[FULL_BITS] += 1
            return FETCH
        n = len(self.precisions)
        tier = min(n - 1, int((self.percentile - q) / (self.percentile / n)))
        b = self.precisions[tier]
        self.decisions[b] += 1
        return (FETCH, b)


@MISS.register
class Cascade(_MixedPrecision):
    """SpecMD "Fetch with precision cascade" (HOBBIT): fetch the `bits` copy so compute starts sooner, then
    upgrade in the background. Implemented as: low-bit now; when the layer has used it, the full-precision
    row is queued as a prefetch-priority copy that replaces it in the same slot (the cache's `upgrade`).
    Until it lands the slot is in flight, so a later use waits for the exact expert; the layer that missed
    ran on the low-bit copy (lossy). Pair with eviction `lhu`, which evicts low-precision slots first."""

    name: ClassVar[str] = "cascade"
    upgrade: ClassVar[bool] = True

    def __init__(self, bits: Any = 4, optimize: bool = True):
        super().__init__(bits, optimize)
        self.precisions = (min(self.precisions),)

    def on_miss(self, key: ExpertKey, pos: Position, info: MissInfo | None = None) -> MissAction:
        return (FETCH, self.precisions[0])
