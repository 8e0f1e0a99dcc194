"""The offload engine's host time at decode, what the simulator's clock needs (`moeflow.sim.timemodel.TimeModel`)
beside the link's (`measure.link_timing`).

`engine_timing` splits the offload engine's decode pass (every expert resident) into per-layer attention, router
hook, prefetch proposal, the experts call before its wait (dispatch) and after it, and the rest of the pass
(`token_s`); `copy_timing` the engine's host time per demand and per prefetch copy it issues on a link, and the
rest of a pass's per demand copy (a small cache against the resident one); on a CPU device `host_timing` how much
longer a pass takes per miss the host computes instead (miss policy `cpu`, the same small cache); `engine_rounds`
times them in interleaved rounds (means over a round's passes, medians over rounds). `_EngineClock` takes the
marks, `split_passes`, `copy_costs`, `host_costs` and `wait_lateness` turn them into those figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..policies.base import CPU
from .measure import prompt_ids

WARMUP_STEPS = 4  # `_time_engine`'s warm-up run: decode steps before the timed run


class _EngineClock:
    """Wall-clock marks of one offload engine's decode passes: pass start and end (model hooks registered after
    the engine's), each router hook's start and end with its prefetch proposal's seconds, each experts call's
    first wait for its slots and its end, and the cache's demand and prefetch copies issued per pass; `waits`:
    (link clock at entry, the copy's due time, link clock at return) of every wait for a copy on a link with a
    schedule (the emulated link). It wraps the engine's `step.route`, `step.prefetch`, `experts_forward`,
    `cache.wait` and `link.wait` on the instances (the runtime is not changed); `remove` restores them."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.step, self.cache = engine, engine.step, engine.cache
        self.passes: list[dict[str, Any]] = []
        self._cur: dict[str, Any] | None = None
        self._pred = 0.0
        self._wait: float | None = None
        self.split_calls = 0  # layer calls with experts in slots and experts the host computes (miss policy cpu)
        route, prefetch, experts, wait = self.step.route, self.step.prefetch, engine.experts_forward, self.cache.wait

        def timed_route(ev: Any) -> Any:
            t0, self._pred = time.perf_counter(), 0.0
            out = route(ev)
            if self._cur is not None:
                self._cur["route"].append((ev.layer, t0, time.perf_counter(), self._pred))
            routed = self.step.pending.get(ev.layer)
            if routed is not None and routed.cpu and routed.experts:
                self.split_calls += 1
            return out

        def timed_prefetch(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return prefetch(*a, **k)
            finally:
                self._pred += time.perf_counter() - t0

        def timed_experts(module: Any, layer: int, *a: Any, **k: Any) -> Any:
            self._wait = None
            out = experts(module, layer, *a, **k)
            if self._cur is not None:
                self._cur["experts"].append((layer, time.perf_counter(), self._wait))
            return out

        def timed_wait(slots: Any) -> Any:
            if self._wait is None:
                self._wait = time.perf_counter()
            return wait(slots)

        self.step.route, self.step.prefetch, engine.experts_forward = timed_route, timed_prefetch, timed_experts
        self.cache.wait = timed_wait
        self.link = engine.link
        self.waits: list[tuple[float, float, float]] = []
        link_wait, clock = self.link.wait, self.link.clock_s

        def timed_link_wait(t: Any) -> Any:
            c0 = clock()
            out = link_wait(t)
            c1 = clock()
            if getattr(t, "due", None) is not None:
                self.waits.append((c0, float(t.due), c1))
            if self._cur is not None:
                self._cur["waited"] = self._cur.get("waited", 0.0) + (c1 - c0)
            return out

        self.link.wait = timed_link_wait
        model = engine.model
        self._hooks = [model.register_forward_pre_hook(self._start), model.register_forward_hook(self._end)]

    def _loads(self) -> tuple[int, int, int, int]:
        c = self.cache.counters
        return c.demand_loads, c.prefetch_issued, self.engine.miss_counts[CPU], self.split_calls

    def _start(self, *a: Any) -> None:
        self._cur = {"start": time.perf_counter(), "route": [], "experts": [], "loads0": self._loads()}

    def _end(self, *a: Any) -> None:
        if self._cur is not None:
            self._cur["end"] = time.perf_counter()
            self._cur["loads1"] = self._loads()
            self.passes.append(self._cur)
        self._cur = None

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        parts = (
            (self.step, "route"),
            (self.step, "prefetch"),
            (self.engine, "experts_forward"),
            (self.cache, "wait"),
            (self.link, "wait"),
        )
        for obj, name in parts:
            obj.__dict__.pop(name, None)


def split_passes(passes: Sequence[dict[str, Any]], moe_layers: Sequence[int]) -> dict[str, Any]:
    """Per MoE layer rank, the means over `passes` (each after a previous one: its period is end to end) of
    attention (previous experts call's end, or the pass start, to the router hook), route (the router hook less
    its proposal), predict (the proposal), dispatch (router hook's end to the experts call's first wait for its
    slots: the MoE block after the router, the rows sorted; 0 for a call that waits for nothing) and experts
    (from that wait, or the router hook's end, to the experts call's end); token: the period less all of them.
    With the passes' counts (`loads0` / `loads1`: demand and prefetch copies issued, host-computed experts and
    split calls at the pass's start and end), `demand_loads`, `prefetch_loads`, `host_misses` and `split_calls` are
    their means per pass. A pass that did not route and call every
    MoE layer once, in order, is skipped. `wait_s`: the mean seconds per pass spent in the link's waits (a pass's
    `waited`, `_EngineClock`; inside `experts_s`). Means, not medians: they add up to the mean period, which is what TPOT
    is (a pass the scheduler preempted counts in a run's TPOT too, and medians per part would drop it)."""
    parts_of = ("attention_s", "route_s", "predict_s", "dispatch_s", "experts_s")
    rows: dict[str, list[list[float]]] = {k: [[] for _ in moe_layers] for k in parts_of}
    tokens, loads, waited = [], [], []
    for prev, p in zip(passes, passes[1:]):
        if [r[0] for r in p["route"]] != list(moe_layers) or [e[0] for e in p["experts"]] != list(moe_layers):
            continue
        mark, used = p["start"], 0.0
        for i, ((_, r0, r1, pred), e) in enumerate(zip(p["route"], p["experts"])):
            e1, w0 = e[1], (e[2] if len(e) > 2 else None)
            w = r1 if w0 is None else w0
            parts = {
                "attention_s": r0 - mark,
                "route_s": r1 - r0 - pred,
                "predict_s": pred,
                "dispatch_s": w - r1,
                "experts_s": e1 - w,
            }
            for k, v in parts.items():
                rows[k][i].append(v)
            used += sum(parts.values())
            mark = e1
        tokens.append(p["end"] - prev["end"] - used)
        waited.append(float(p.get("waited", 0.0)))
        if "loads0" in p and "loads1" in p:
            loads.append([b - a for a, b in zip(p["loads0"], p["loads1"])])
    if not tokens:
        raise RuntimeError("no decode pass routed every MoE layer once; cannot split the engine's time")
    out: dict[str, Any] = {k: [statistics.fmean(v) for v in per] for k, per in rows.items()}
    out["token_s"] = max(0.0, statistics.fmean(tokens))
    out["wait_s"] = statistics.fmean(waited)
    out["passes"] = len(tokens)
    if loads:
        out["demand_loads"] = statistics.fmean(x[0] for x in loads)
        out["prefetch_loads"] = statistics.fmean(x[1] for x in loads)
        if all(len(x) > 3 for x in loads):
            out["host_misses"] = statistics.fmean(x[2] for x in loads)
            out["split_calls"] = statistics.fmean(x[3] for x in loads)
    return out


def wait_lateness(waits: Sequence[tuple[float, float, float]]) -> tuple[float, int]:
    """(mean seconds a wait that slept returned after its copy was due, waits that slept) from `(entry, due, return)`
    triples: everything the engine's waits stalled beyond `max(0, due - entry)` (the sleeping thread's lateness, and
    copies due but not yet copied by the link's worker thread), spread over the waits that slept (due after entry),
    as `moeflow.sim.link.ModelledLink` adds `wake_s` to every wait that stalls."""
    slept = sum(1 for c0, due, _ in waits if due > c0)
    extra = sum(max(0.0, (c1 - c0) - max(0.0, due - c0)) for c0, due, c1 in waits)
    return (extra / slept if slept else 0.0), slept


def _per_copy(extra: float, copies: float) -> float:
    return max(0.0, extra / copies) if copies > 0 else 0.0


def _rest(split: dict[str, Any]) -> float:
    """Host seconds per pass outside the router hook and the proposal, waits for copies left out."""
    parts = sum(sum(split.get(k) or (0.0,)) for k in ("attention_s", "dispatch_s", "experts_s"))
    return parts + float(split.get("token_s", 0.0)) - float(split.get("wait_s", 0.0))


def host_costs(resident: dict[str, Any], alone: dict[str, Any], split: dict[str, Any]) -> dict[str, float]:
    """What the host's experts (miss policy `cpu`) cost a pass, from `split_passes` of the same engine against
    `resident` (every expert resident): a pass's extra host time (the router hook's: the misses found and sent;
    the rest of the pass's: the experts calls, their join; waits for copies and the proposal left out) is
    `host_miss_s` x host-computed experts + `host_split_s` x layer calls that split (some experts in slots, the
    others on the host worker: a hand-off, two threads' kernels beside each other, the join; at several CPU threads
    no worker runs and the host experts follow the slots' compute on the calling thread).
    `alone`: a small cache that nothing fills (no prefetch: every expert computed by the host, no call splits)
    gives `host_miss_s`; `split`: the same cache filled by prefetches gives `host_split_s` from what is left
    once its host experts are counted. Each >= 0; 0 where the run had none."""

    def extra(run: dict[str, Any]) -> float:
        return _rest(run) - _rest(resident) + sum(run["route_s"]) - sum(resident["route_s"])

    per = _per_copy(extra(alone), float(alone.get("host_misses", 0.0)))
    host, calls = float(split.get("host_misses", 0.0)), float(split.get("split_calls", 0.0))
    return {
        "host_miss_s": per,
        "host_split_s": _per_copy(extra(split) - per * host, calls),
        "host_misses": float(alone.get("host_misses", 0.0)),
        "host_split_calls": calls,
    }


def copy_costs(resident: dict[str, Any], loaded: dict[str, Any], prefetch: str) -> dict[str, float]:
    """Host seconds the engine spends per copy it issues, from two `split_passes` of the same engine settings:
    `resident` (every expert resident: no copies) and `loaded` (a small cache on the link: copies every pass).
    `demand_copy_s`: the router hook's extra time per demand copy (the victim, the slot table, the link's submit);
    `prefetch_copy_s`: the proposal's extra time per prefetch copy (`predict_s` of `prefetch`);
    `miss_host_s`: the rest of the pass's extra host time per demand copy, its waits for copies (`wait_s`) left out:
    attention, the experts call before and after its wait, and `token_s` run slower in a pass that copies (the
    experts call's miss path, copied weights not yet in this core's caches, the link's worker thread beside it).
    Each is 0 where the loaded run issued no such copy or spent no more time."""

    route = sum(loaded["route_s"]) - sum(resident["route_s"])
    pred = sum(loaded["predict_s"][prefetch]) - sum(resident["predict_s"][prefetch])
    demand = loaded.get("demand_loads", 0.0)
    out = {"demand_copy_s": _per_copy(route, demand), "prefetch_copy_s": _per_copy(pred, loaded.get("prefetch_loads", 0.0))}
    if "experts_s" in loaded and "experts_s" in resident:
        out["miss_host_s"] = _per_copy(_rest(loaded) - _rest(resident), demand)
    return out


def _time_engine(
    model: Any, adapter: Any, ids: torch.Tensor, steps: int, capacity: int, link: Any, prefetch: str, miss: str = "fetch"
) -> dict[str, Any]:
    """`split_passes` of an offload engine (lru, `prefetch` at S = 1, miss policy `miss`, `capacity` experts on
    `link`) decoding `steps` tokens after `ids` [1,P]: a warm-up run of at most `WARMUP_STEPS` tokens (first calls,
    the cache's steady state), then the timed run. At full capacity every expert is
    loaded first (`warm`); else the runs start from the cache the engine has and copy as they go."""
    from ..policies import EVICTION, MISS, PREFETCH
    from ..runtime.engine import OffloadEngine
    from ..runtime.generate import generate_exactly

    spec = adapter.spec
    engine = OffloadEngine(
        model,
        capacity=capacity,
        link=link,
        eviction=EVICTION.create("lru"),
        prefetch=PREFETCH.create(prefetch),
        lookahead=1,
        miss=None if miss == "fetch" else MISS.create(miss),
    )
    with engine, torch.no_grad():
        if capacity >= spec.total_experts:
            engine.warm()
        clock = _EngineClock(engine)
        try:
            for n in (min(steps, WARMUP_STEPS), steps):  # a short warm-up run, then the timed run (its first pass: the prefill)
                engine.link.drain()
                clock.passes.clear()
                clock.waits.clear()
                generate_exactly(model, ids, n + 1)
        finally:
            clock.remove()
            engine.link.drain()
    out = split_passes(clock.passes, spec.moe_layers)  # pairs: the prefill ends the first period
    out["wake_s"], out["slept_waits"] = wait_lateness(clock.waits)
    return out


def engine_timing(
    model: Any, adapter: Any, steps: int, device: str, prefetches: Sequence[str] = ("pregate",), prompt_len: int = 16
) -> dict[str, Any]:
    """The offload engine's host time at decode with every routed expert resident and ready (link `auto`: a
    direct copy on CPU, so no copy is waited for), split per MoE layer by `split_passes`, one engine per
    prefetch policy of `prefetches` (S = 1). `attention_s`, `route_s`, `dispatch_s`, `experts_s` and `token_s`
    are those of the first policy's engine (a proposing one: the router hook then never takes the deferred path
    that only a layer with all its experts resident and no prefetching takes); `predict_s[policy]` per layer for
    each."""
    from ..runtime.link import make_link

    spec = adapter.spec
    ids = prompt_ids(model, device, prompt_len)
    out: dict[str, Any] = {"predict_s": {}, "prefetches": list(prefetches), "steps": steps}
    for i, name in enumerate(prefetches):
        link = make_link("auto", torch.device(device))
        split = _time_engine(model, adapter, ids, steps, spec.total_experts, link, name)
        out["predict_s"][name] = split["predict_s"]
        if i == 0:
            out.update({k: split[k] for k in ("attention_s", "route_s", "dispatch_s", "experts_s", "token_s", "passes")})
    return out


def copy_timing(
    model: Any, adapter: Any, steps: int, device: str, link: Any, resident: dict[str, Any], prompt_len: int = 16
) -> dict[str, float]:
    """The engine's host seconds per copy it issues on `link` (`copy_costs`): the first prefetch policy of
    `resident` (an `engine_timing` record) decoding with a cache of 10% of the experts (at least top-k), against
    `resident`'s every-expert-resident times. `demand_loads` / `prefetch_loads`: the copies per pass it saw;
    `engine_wake_s`: how late its waits that slept returned after their copies were due (`wait_lateness`, over
    `slept_waits`): the link's lateness where the engine runs (its host work holds the interpreter while the
    link's worker thread has copies to make)."""
    spec = adapter.spec
    name = resident["prefetches"][0]
    capacity = max(spec.top_k, spec.total_experts // 10)
    loaded = _time_engine(model, adapter, prompt_ids(model, device, prompt_len), steps, capacity, link, name)
    loaded["predict_s"] = {name: loaded["predict_s"]}
    out = copy_costs(resident, loaded, name)
    out.update({"demand_loads": loaded.get("demand_loads", 0.0), "prefetch_loads": loaded.get("prefetch_loads", 0.0)})
    out.update({"engine_wake_s": loaded["wake_s"], "slept_waits": loaded["slept_waits"]})
    return out


def host_timing(
    model: Any, adapter: Any, steps: int, device: str, new_link: Callable[[], Any], resident: dict[str, Any], prompt_len: int = 16
) -> dict[str, float]:
    """`host_costs` of miss policy `cpu` (exact on a CPU device): `copy_timing`'s cache of 10% of the experts, its
    misses computed by the host worker instead of copied, without prefetch (`alone`) and with the first prefetch
    policy of `resident` filling it (`split`), each on a fresh link from `new_link`, against `resident`'s times."""
    spec = adapter.spec
    capacity = max(spec.top_k, spec.total_experts // 10)
    ids = prompt_ids(model, device, prompt_len)
    runs = []
    for prefetch in ("none", resident["prefetches"][0]):
        link = new_link()
        try:
            runs.append(_time_engine(model, adapter, ids, steps, capacity, link, prefetch, miss="cpu"))
        finally:
            link.close()
    return host_costs(resident, *runs)


def median_of(recs: Sequence[Any]) -> Any:
    """Element-wise median of records of one shape (dicts, lists, numbers); other values: the first record's."""
    first = recs[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in recs]) if all(k in r for r in recs) else first[k] for k in first}
    if isinstance(first, list) and all(isinstance(r, list) and len(r) == len(first) for r in recs):
        return [median_of([r[i] for r in recs]) for i in range(len(first))]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(float(r) for r in recs)
    return first


def engine_rounds(
    model: Any,
    adapter: Any,
    steps: int,
    device: str,
    new_link: Callable[[], Any] | None = None,
    rounds: int = 3,
    prompt_len: int = 16,
    prefetches: Sequence[str] = ("pregate",),
) -> tuple[dict[str, Any], dict[str, float] | None]:
    """`engine_timing` and (with `new_link`, a fresh link per round: an engine closes its link) `copy_timing`
    `rounds` times, interleaved (resident, then the small cache, then again), each round's copy costs against its
    own resident split, so both see the same minutes of a shared machine: the element-wise median over the rounds
    of each (`median_of`; a round the scheduler preempted does not move it); on a CPU device each round also times
    `host_timing` (miss policy cpu) into the copy record. (engine_time with `rounds` and `prompt_len`, the copy
    record or None)."""
    times, copies = [], []
    for _ in range(max(1, rounds)):
        et = engine_timing(model, adapter, steps, device, prefetches, prompt_len)
        times.append(et)
        if new_link is not None:
            link = new_link()
            try:
                rec = copy_timing(model, adapter, steps, device, link, et, prompt_len)
            finally:
                link.close()
            if torch.device(device).type == "cpu":  # miss policy cpu: exact on a CPU device only
                rec.update(host_timing(model, adapter, steps, device, new_link, et, prompt_len))
            copies.append(rec)
    out = median_of(times)
    out.update(rounds=len(times), prompt_len=prompt_len)
    return out, (median_of(copies) if copies else None)
