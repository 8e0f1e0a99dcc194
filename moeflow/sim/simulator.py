"""Trace-driven cache simulator: THE runtime cache (`moeflow.runtime.cache.ExpertCache`, tensor-free) and the
same policy objects, driven in the engine's access order through a link model.

Per forward pass (`begin_pass`) and MoE layer, exactly the engine's sequence of cache calls
(`moeflow.runtime.cache`, "One access order"):
1. `begin_layer`; the layer's unique routed experts sorted by id, with their gate weight summed over the
   pass's tokens (`needed_experts`, float32 like the engine);
2. `route`: when they fit one wave (`wave_capacity`), the miss policy ('fetch') and `demand` (hits pinned
   first, then misses in id order, each miss evicting the eviction policy's victim);
3. the prefetch policy's proposals (`LayerContext`, router input from the trace) -> `prefetch` (priority
   order; resident or in-flight experts get `on_predicted`; a proposal finding no victim is dropped);
4. the layer's compute: `wait` for its slots, the link's clock advances by `layer_time_s`, `release`; a
   layer needing more experts than a wave holds (a long prefill) runs in waves (`plan_waves`: resident
   experts first; `demand_wave`, compute, `release` per wave).

Links (`moeflow.sim.link`): `InstantLink` (copies complete at once: `DirectLink`'s behaviour) or
`ModelledLink(gbps, latency)` (`EmulatedLink`'s FIFO schedule on a virtual clock; no threads, no sleeping).

Time: the link's clock advances per MoE layer by the engine's calibrated host time (`moeflow.sim.timemodel.TimeModel`).

Every pass of the access trace is replayed in order (prefill passes too: the cache carries over, as in
`moeflow run`); `decode_counters` are the `CacheCounters` of decode passes, `counters` of all passes, and
the `SimStats` headline fields count the passes of `count_phase` (None: all).

`belady(...)`: Belady's MIN for demand paging (`moeflow.sim.belady.Belady`: evict the resident expert whose next
use is farthest in the future), through the same cache: the best hit count any eviction policy can reach without prefetching.

Compiled replay: when the cache runs its compiled core (an eviction policy with a `kernel`: lru, lfu,
least-stale, belady-approx, next-use, belady; the instant link), the miss policy is `fetch` and the prefetch policy's
proposals depend on the trace alone (`none`, `pregate`, `all-next-layer`: `moeflow.sim.stream`, computed once
per trace), the whole trace is replayed in ONE kernel call (`ExpertCache.replay`) through the same kernels the
cache runs per call, in the order above. Otherwise (`compiled=False`, a modelled link, another policy) this
loop drives the cache call by call; a prefetch policy with `propose_at(pos, resident)` (tune's `TablePrefetch`,
which reads nothing else of the context) is asked through it, without a `LayerContext` per step.
`SimStats.seconds` is the replay's wall time, `prepare_s` the one-time preparation (stream, proposals: cached on
the trace; the kernels: loaded once per process), `engine` which replay ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import numpy as np
import torch

from ..errors import ConfigError
from ..policies import EVICTION, MISS, PREFETCH, ExpertKey
from ..policies.base import PrefetchPolicy
from ..policies.miss import Cpu, Fetch
from ..runtime.cache import CacheCounters, ExpertCache, needed_experts, wave_capacity
from ..runtime.cachecore import warm
from ..runtime.corecache import ReplayResult, counters_of
from .access import AccessTrace
from .belady import Belady
from .link import make_sim_link
from .stream import layer_context, precomputable, proposals, stream
from .timemodel import TimeModel


@dataclass
class SimStats:
    capacity: int
    eviction: str
    prefetch: str
    passes: int = 0  # passes counted (of `count_phase`)
    tokens: int = 0
    accesses: int = 0
    hits: int = 0
    misses: int = 0
    collisions: int = 0  # misses on an expert evicted earlier in the same pass (CacheCounters.collision_misses)
    demand_loads: int = 0
    prefetch_loads: int = 0  # CacheCounters.prefetch_issued
    prefetch_used: int = 0  # prefetched experts accessed before their eviction
    prefetch_used_prior: int = 0  # of those, issued before their generation (phase, with `count_phase`) began
    prefetch_hits: int = 0  # hits on a prefetched expert not used before (= prefetch_used with the shared cache)
    proposed_accesses: int = 0  # accesses whose expert the prefetcher proposed earlier in the pass
    proposals: int = 0
    evictions: int = 0
    late: int = 0  # hits whose copy was still in flight (modelled link)
    host_misses: int = 0  # experts computed on the host instead (miss policy `cpu`; not cache accesses)
    stall_s: float = 0.0  # virtual seconds waited for copies (modelled link)
    max_resident: int = 0
    collisions_per_layer: dict[int, int] = field(default_factory=dict)
    hits_per_layer: dict[int, int] = field(default_factory=dict)
    accesses_per_layer: dict[int, int] = field(default_factory=dict)
    counters: CacheCounters = field(default_factory=CacheCounters)  # every replayed pass
    decode_counters: CacheCounters = field(default_factory=CacheCounters)  # decode passes (as `moeflow run`)
    replayed_accesses: int = 0  # accesses of every replayed pass
    seconds: float = 0.0  # wall time of the replay (cache, policies, link model)
    cpu_s: float = 0.0  # CPU time of the replay (this process; a steadier figure on a shared machine)
    prepare_s: float = 0.0  # one-time preparation of the compiled replay (stream, proposals; cached per trace)
    engine: str = "python"  # compiled: one kernel call over the trace; python: the cache call by call
    link: str = "instant"
    time_s: float = 0.0  # modelled seconds of the counted passes (each from the end of the previous pass)

    @property
    def pass_s(self) -> float | None:
        """Modelled seconds per counted pass: the predicted TPOT when decode passes are counted."""
        return self.time_s / self.passes if self.passes else None

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
    def prefetch_precision(self) -> float | None:
        """Prefetched copies used / prefetched copies; None when nothing was prefetched (as `RunMetrics`)."""
        return (self.prefetch_used - self.prefetch_used_prior) / self.prefetch_loads if self.prefetch_loads else None

    @property
    def prefetch_recall(self) -> float:
        return self.proposed_accesses / self.accesses if self.accesses else 0.0

    @property
    def accesses_per_s(self) -> float:
        return self.replayed_accesses / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in (
            "loads",
            "hit_rate",
            "collision_rate",
            "loads_per_token",
            "prefetch_precision",
            "prefetch_recall",
            "accesses_per_s",
            "pass_s",
        ):
            d[k] = getattr(self, k)
        return d


# ---- the access trace in the engine's order, computed once per trace ----------------------------------


@dataclass
class _Compiled:
    """Per pass: (phase, tokens, [(layer, rank, experts sorted by id, {expert: summed gate weight}, step)])."""

    passes: list[tuple[int, int, list[tuple[int, int, list[int], dict[int, float], Any]]]]


def _compile(acc: AccessTrace) -> _Compiled:
    key = (id(acc.passes), len(acc.passes))
    cached = getattr(acc, "_compiled", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    rank_of = {l: r for r, l in enumerate(acc.moe_layers)}
    passes = []
    for p in acc.passes:
        steps = []
        for s in p.steps:
            idx = s.indices
            w = np.ones(idx.shape, dtype=np.float32) if s.weights is None else s.weights
            if idx.shape[0] == 1:  # one token: k distinct experts, the engine's no-sum path
                ids = idx[0].tolist()
                ws = w[0].astype(np.float32, copy=False).tolist()
                order = sorted(range(len(ids)), key=ids.__getitem__)
                experts = [ids[i] for i in order]
                scores = {ids[i]: ws[i] for i in order}
                if len(scores) != len(ids):  # a repeated id: sum as the engine does
                    experts, scores = _needed(idx, w)
            else:
                experts, scores = _needed(idx, w)
            steps.append((s.layer, rank_of[s.layer], experts, scores, s))
        passes.append((p.phase, p.tokens, steps))
    out = _Compiled(passes)
    acc._compiled = (key, out)  # type: ignore[attr-defined]
    return out


def _needed(idx: np.ndarray, w: np.ndarray) -> tuple[list[int], dict[int, float]]:
    flat = torch.from_numpy(np.ascontiguousarray(idx.reshape(-1)).astype(np.int64))
    return needed_experts(flat, torch.from_numpy(np.ascontiguousarray(w.reshape(-1), dtype=np.float32)))


# ---- replay ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """What ExpertCache needs of a MoESpec (the access trace's shape)."""

    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    expert_bytes: int

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def total_experts(self) -> int:
        return len(self.moe_layers) * self.num_experts


def _resolve(registry, spec: Any, what: str) -> tuple[Any, str, bool]:
    """(policy, label, built here: a fresh object)."""
    if isinstance(spec, str):
        return registry.create(spec), spec, True
    if isinstance(spec, tuple):  # (name, {options})
        name, opts = spec
        label = name + ("(" + ",".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "")
        return registry.create(name, **opts), label, True
    return spec, str(spec.name), False


EXACT_MISSES = ("fetch", "cpu")  # the miss policies replayed here that are exact on a CPU device (tune and simulate's)


def replayable(name: str) -> bool:
    """Whether the simulator can replay prefetch policy `name`: not one that needs the running model (a learned
    prefetcher reads the post-attention residual and binds to the model; only `moeflow run` has them)."""
    cls = PREFETCH.get(name)
    return cls is None or not (cls.needs_model or cls.needs_residual)


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
    link: Any = None,
    layer_time_s: float = 0.0,
    per_layer: bool = False,
    count_phase: int | None = None,
    compiled: bool | None = None,
    timing: TimeModel | None = None,
) -> SimStats:
    """Replay `acc` through a tensor-free `ExpertCache` of `capacity` experts (policies: names, (name, options)
    or objects; `link`: None/'instant', 'emulated:GBPS[,LATENCY_US]' or a sim link object). `compiled`: None
    replays in one kernel call where possible (see "Compiled replay"), False drives the cache call by call
    with the Python mechanism (the reference), True requires the compiled replay. `timing`: the host times the
    clock advances by (`TimeModel`; its `submit_s` / `wake_s` apply to a link given as a string); None:
    `TimeModel.layer_time(layer_time_s)`."""
    if capacity < 1:
        raise ConfigError(f"capacity must be >= 1 expert, got {capacity}")
    if timing is not None and layer_time_s:
        raise ConfigError("give the simulator either layer_time_s or a time model, not both")
    tm = timing if timing is not None else TimeModel.layer_time(layer_time_s)
    if isinstance(eviction, Belady):
        ev, ev_name = eviction, "belady"
    else:
        ev, ev_name, _ = _resolve(EVICTION, eviction, "eviction")
    pf, pf_name, pf_fresh = _resolve(PREFETCH, prefetch, "prefetch")
    ms, _, _ = _resolve(MISS, miss, "miss")
    host = type(ms) is Cpu  # every miss computed on the host: the router hook's filter, replayed below
    if ms.needs_routing and not host:  # asked info-less by the cache, it would answer fetch: a row that only looks like it
        cache_level = ", ".join([*(n for n in MISS if not MISS[n].needs_routing), "cpu"])
        raise ConfigError(
            f"miss policy {ms.name!r} acts in the engine's router hook, which a replay without the model does not run; "
            f"the simulator replays {cache_level}: measure {ms.name!r} with moeflow run or moeflow quality"
        )
    if type(ms) is Fetch or host:
        ms = None  # fetch: the built-in exact policy (what the cache does without one); cpu: never reaches the cache
    prefetching = pf.proposes
    spec = _Spec(tuple(acc.moe_layers), acc.num_experts, acc.top_k, int(acc.expert_bytes or 1))
    lk = make_sim_link(link, submit_s=tm.submit_s, wake_s=tm.wake_s, prefetch_submit_s=tm.prefetch_copy_s)
    timed = timing is not None or layer_time_s > 0 or not getattr(lk, "instant", False)
    if host and tm.host_miss_s is None and timed:  # a clock that would leave the host's experts out
        raise ConfigError(
            "miss policy cpu needs the host seconds per host-computed expert (link_timing host_miss_s) to advance the "
            "clock: `moeflow simulate --calibrated-time` with a calibration `moeflow calibrate --link-gbps X` made on "
            "a CPU device (an older one: re-run it), or replay fetch"
        )
    gate = pf.gate if prefetching else None  # the prefetch policy's admission (PrefetchGate)
    cache = ExpertCache(
        None, capacity, link=lk, eviction=ev, per_layer=per_layer, spec=spec, gate=gate, compiled=None if compiled else compiled
    )
    wcap = wave_capacity(cache.part_capacity, cache.expert_bytes)
    st = SimStats(capacity=capacity, eviction=ev_name, prefetch=pf_name, link=lk.describe())
    whole = cache.core is not None and ms is None and not host and (not prefetching or precomputable(pf))
    if compiled and not whole:
        raise ValueError(
            f"no compiled replay for eviction {ev_name!r}, prefetch {pf_name!r}, "
            f"miss {'cpu' if host else 'fetch' if ms is None else type(ms).__name__} on link {lk.describe()!r}"
        )
    if whole:
        t0 = time.perf_counter()
        strm = stream(acc)
        props = proposals(acc, pf, lookahead, predict_logits, cache=pf_fresh) if prefetching else None
        left = -1
        if gate is not None:  # the gate's quota per call (an instant link: no admission reads the link)
            gate.begin(lk, cache.expert_bytes, 0, 0)
            left = cast(int, gate.quota())
        warm()  # the kernels loaded (numba's cache) or compiled: preparation, not replay time
        t1, c1 = time.perf_counter(), time.process_time()
        res = cache.replay(strm, props, wave_cap=wcap, count_phase=count_phase, left=left)
        st.seconds, st.cpu_s = time.perf_counter() - t1, time.process_time() - c1
        st.prepare_s, st.engine = t1 - t0, "compiled"
        if gate is not None:
            gate.count(int(res.out[5]), int(res.out[6]))
        _fill_compiled(st, res, cache, count_phase)
        # an instant link never stalls: every pass takes the time model's seconds (every MoE layer runs once)
        each = tm.pass_s(len(acc.moe_layers), prefetching, _ahead(pf, lookahead))
        cast(Any, lk).advance(each * len(acc.passes))  # the simulator's links (sim/link.py) advance
        st.time_s = each * st.passes
    else:
        _replay(st, acc, cache, pf, ms, lookahead, predict_logits, check, lk, tm, wcap, count_phase, host)
    if check and cache.num_resident() > capacity:
        raise RuntimeError("cache over capacity")
    return st


def _replay(st, acc, cache, pf, ms, lookahead, predict_logits, check, lk, tm, wcap, count_phase, host=False) -> None:
    """The cache call by call, in the engine's order, the link's clock advanced by the time model `tm`. `host`
    (miss policy `cpu`): as the engine's router hook (`moeflow.runtime.step.apply_miss`), a layer's experts
    without a slot leave its needed list before `route` (the host computes them; the cache never sees them), and
    each adds `tm.host_miss_s`, and a call that also has experts in slots `tm.host_split_s`, after the layer's wait
    less what that wait stalled (the engine hands the host worker its job before it waits for its slots; without a
    worker, `tm.host_beside` False, nothing is hidden)."""
    prefetching = pf.proposes
    pre_s, pred_s, disp_s, post_s = tm.per_layer(len(acc.moe_layers), _ahead(pf, lookahead))
    miss_s = tm.miss_host_s
    host_s, split_s = tm.host_miss_s or 0.0, tm.host_split_s
    resident = cache.resident
    clock = lk.clock_s
    last_end = clock()  # the end of the previous pass on the link's clock
    comp = _compile(acc)
    moe = tuple(acc.moe_layers)
    c = cache.counters
    L = len(moe)
    hits_l, acc_l, col_l = [0] * L, [0] * L, [0] * L
    phase_sums: dict[int, CacheCounters] = {}
    seg_phase, seg0 = None, c.copy()
    route, prefetch_, wait, release, advance = cache.route, cache.prefetch, cache.wait, cache.release, cast(Any, lk).advance
    begin_layer = cache.begin_layer
    propose_at = pf.propose_at if pf.reads_position_only else None  # reads only the position and residency: no LayerContext
    proposed: set[ExpertKey] = set()
    t0, c0 = time.perf_counter(), time.process_time()
    for pass_id, (phase, tokens, steps) in enumerate(comp.passes):
        if phase == 0:  # a new generation: `moeflow run` drains the link between generations (untimed)
            lk.drain()
            last_end = clock()
        if phase == 0 or phase != seg_phase:  # as `generate_batch`: a prefill begins a generation, decode a phase
            cache.mark_phase(new_generation=phase == 0)
        if phase != seg_phase:
            if seg_phase is not None:
                phase_sums[seg_phase] = phase_sums.get(seg_phase, CacheCounters()) + (cache.counters - seg0)
            seg_phase, seg0 = phase, cache.counters.copy()
        counted = count_phase is None or phase == count_phase
        if counted:
            st.passes += 1
            st.tokens += tokens
        cache.begin_pass(pass_id)
        if prefetching:
            proposed.clear()
        for layer, rank, experts, scores, step in steps:
            c = cache.counters
            if counted:
                h0, a0, k0 = c.hits, c.accesses, c.collision_misses
            begin_layer(layer)
            d0 = c.demand_loads
            host_cost = 0.0
            if host:  # the router hook: experts without a slot go to the host (`apply_miss`)
                kept = [e for e in experts if resident((layer, e))]
                n_host = len(experts) - len(kept)
                if n_host:
                    host_cost = host_s * n_host + (split_s if kept else 0.0)  # a split call: slots beside the host's
                    experts, scores = kept, {e: scores[e] for e in kept}
                    if counted:
                        st.host_misses += n_host
            advance(pre_s[rank])  # attention, router, the router hook up to the demand copies
            slots = route(layer, experts, scores, wcap, ms)
            if counted:
                hits_l[rank] += c.hits - h0
                acc_l[rank] += c.accesses - a0
                col_l[rank] += c.collision_misses - k0
                if proposed and slots is not None:  # in waves: counted per wave below
                    st.proposed_accesses += sum(1 for e in experts if (layer, e) in proposed)
            if prefetching:
                if propose_at is not None:
                    reqs = propose_at(cache.position(layer), cache.resident)
                else:
                    ctx = layer_context(acc, step, cache.position(layer), moe, lookahead, predict_logits, cache.resident)
                    reqs = pf.propose(ctx)
                advance(pred_s[rank])  # the proposal, before its copies are submitted
                if reqs:
                    if counted:
                        st.proposals += len(reqs)
                    proposed.update(r.key for r in reqs)
                    prefetch_(reqs, layer)
            advance(disp_s[rank])  # the experts call up to its wait: overlaps the copies in flight
            if slots is not None:
                stalled = wait(slots)  # the host worker's job, handed over before this wait, runs meanwhile
                # the rest of the call, its copies' host cost, what of the host's experts the stall did not hide
                # (without a worker, all of it: they run after the wait)
                hidden = stalled if tm.host_beside else 0.0
                advance(post_s[rank] + miss_s * (c.demand_loads - d0) + max(0.0, host_cost - hidden))
                release(slots)
            else:  # more experts than one wave holds: waves, resident experts first
                waves = cache.plan_waves(layer, experts, wcap)
                for wave in waves:
                    if counted:
                        h0, a0, k0 = c.hits, c.accesses, c.collision_misses
                    d1 = c.demand_loads
                    s = cache.demand_wave(layer, wave, scores, ms)
                    if counted:
                        hits_l[rank] += c.hits - h0
                        acc_l[rank] += c.accesses - a0
                        col_l[rank] += c.collision_misses - k0
                        if proposed:
                            st.proposed_accesses += sum(1 for e in wave if (layer, e) in proposed)
                    advance(post_s[rank] / len(waves) + miss_s * (c.demand_loads - d1))
                    release(s)
                advance(host_cost)
            if check and cache.num_resident() > cache.capacity:
                raise RuntimeError("cache over capacity")
        advance(tm.token_s)  # final norm, head, generate's loop until the next pass
        end = clock()
        if counted:
            st.time_s += end - last_end
        last_end = end
    st.seconds, st.cpu_s = time.perf_counter() - t0, time.process_time() - c0
    c = cache.counters
    if seg_phase is not None:
        phase_sums[seg_phase] = phase_sums.get(seg_phase, CacheCounters()) + (c - seg0)
    lk.drain()
    _fill(st, cache, phase_sums, count_phase)
    st.hits_per_layer = {l: hits_l[r] for r, l in enumerate(moe) if acc_l[r]}
    st.accesses_per_layer = {l: acc_l[r] for r, l in enumerate(moe) if acc_l[r]}
    st.collisions_per_layer = {l: col_l[r] for r, l in enumerate(moe) if col_l[r]}


def _ahead(pf: PrefetchPolicy | None, lookahead: int) -> int:
    """The MoE layers a proposal predicts: the policy's own `lookahead=` option (declared on every prefetch policy),
    else the engine's S."""
    own = pf.lookahead if pf is not None else None
    return int(own) if isinstance(own, int) and own >= 1 else int(lookahead)


def _fill_compiled(st: SimStats, res: ReplayResult, cache: ExpertCache, count_phase: int | None) -> None:
    passes, tokens, proposed, props = (int(v) for v in res.out[1:5])
    st.passes, st.tokens, st.proposed_accesses, st.proposals = passes, tokens, proposed, props
    sums = {ph: counters_of(res.sums[ph]) for ph in (0, 1) if res.sums[ph].any()}
    _fill(st, cache, sums, count_phase)
    hits, accs, cols = (row.tolist() for row in res.per_layer)
    moe = cache.spec.moe_layers
    st.hits_per_layer = {l: hits[r] for r, l in enumerate(moe) if accs[r]}
    st.accesses_per_layer = {l: accs[r] for r, l in enumerate(moe) if accs[r]}
    st.collisions_per_layer = {l: cols[r] for r, l in enumerate(moe) if cols[r]}


def _fill(st: SimStats, cache: ExpertCache, phase_sums: dict[int, CacheCounters], count_phase: int | None) -> None:
    """The headline fields from the cache's counters (all passes) and those of each phase."""
    c = cache.counters
    st.counters = c.copy()
    st.decode_counters = phase_sums.get(1, CacheCounters())
    st.replayed_accesses = c.accesses
    h = c if count_phase is None else phase_sums.get(count_phase, CacheCounters())
    st.accesses, st.hits, st.misses, st.collisions = h.accesses, h.hits, h.misses, h.collision_misses
    st.demand_loads, st.prefetch_loads, st.prefetch_used = h.demand_loads, h.prefetch_issued, h.prefetch_used
    st.prefetch_used_prior = h.prefetch_used_prior_generation if count_phase is None else h.prefetch_used_prior_phase
    st.prefetch_hits, st.evictions, st.late, st.stall_s = h.prefetch_used, h.evictions, h.late, h.stall_s
    st.max_resident = cache.num_resident()  # residency never shrinks with retained slots


def belady(acc: AccessTrace, capacity: int, **kw: Any) -> SimStats:
    """Belady's MIN on `acc` at `capacity` (demand paging, no prefetch)."""
    return simulate(acc, capacity, Belady(acc), "none", **kw)
