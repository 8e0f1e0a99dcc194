"""The space `moeflow tune` searches, the predicted TPOT of one candidate, and the search (successive halving).

A candidate is one `moeflow run` configuration at a fixed cache capacity: eviction x prefetch x step size S
(fixed, or adaptive: the runtime's controller) x miss policy. Only exact policies are searched
(`moeflow.policies.lossy`), and only what the simulator replays: prefetch `none`, `pregate` (overfetch / mass
variants) and `all-next-layer` (the learned prefetchers need the running model), miss `fetch` and, for a CPU
device whose calibration measured the host's time per host-computed expert (`host_miss_s`), `cpu` (exact there;
`auto` sends every miss to the host on a CPU device, so `cpu` is its row).

Predicted TPOT of a candidate (`CostModel`): every pass of the trace is replayed through the runtime's cache on
the modelled link (`moeflow.sim.link.ModelledLink`: the calibration's bandwidth and latency, or `--link`), whose
clock advances by the simulator's time model (`moeflow.sim.timemodel.TimeModel`): the calibration's `engine_time`
and `link_timing` (`TimeModel.from_calibration`, what `moeflow simulate --calibrated-time` uses, so both predict
the same TPOT for the same configuration), or, for a calibration without them, the calibrated compute per MoE
layer (`layer_time_s`) with the rest of the compute per token once per pass (`TimeModel.from_compute`). The
predicted TPOT is the simulator's `pass_s` over the decode passes (the link's clock per decode pass: compute,
stalls, copy submissions).

Bound: no configuration at this capacity moves fewer bytes than Belady's MIN with demand paging (prefetching
can move bytes earlier, never fewer), and none runs a pass faster than the time model's pass that waits for
nothing, so TPOT >= max(that pass, MIN's copies per token x one copy's link time).

Search (`search`): successive halving over prompt prefixes of the trace: every candidate is replayed on the first
few prompts, the best 1/`eta` go on to a `eta` times longer prefix, and so on until the last round replays the
whole trace; `exhaustive=True` replays every candidate on the whole trace.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..policies import EVICTION, MISS, PREFETCH, ROUTING
from ..policies.lossy import lossy
from ..policies.parse import build_policy, policy_args
from ..sim.access import AccessTrace
from ..sim.link import ModelledLink
from ..sim.simulator import EXACT_MISSES, belady, replayable, simulate
from ..sim.timemodel import TimeModel
from .replay import AdaptiveS, PregateTable, TablePrefetch

# the default space (each dimension can be given instead: `moeflow tune -e/-f/-S`)
EVICTIONS = ("next-use", "lru", "lfu", "least-stale")  # lru2, fld, score, belady-approx on request
PREFETCHES = ("none", "pregate")  # pregate:overfetch=X | mass=P and all-next-layer on request
MISSES = ("fetch",)  # the default miss dimension; + cpu for a CPU device with host_miss_s (`moeflow tune`)
HOST_MISS = "cpu"  # the miss policy that computes a miss on the host (exact on a CPU device)
S_VALUES = (1, 2, 4, 8)  # fixed S tried (those below the MoE layers), plus the calibration's


@dataclass(frozen=True)
class Candidate:
    eviction: str
    prefetch: str  # policy text, `name[:k=v,...]`
    s: int | None = None  # fixed step size S; None: S is not used (no prefetch, own lookahead) or adaptive
    adaptive: bool = False  # the runtime's adaptive S (`moeflow run --adaptive-s`)
    miss: str = "fetch"

    @property
    def label(self) -> str:
        s = " S=adaptive" if self.adaptive else (f" S={self.s}" if self.s is not None else "")
        return f"{self.eviction}+{self.prefetch}{s}" + (f" miss={self.miss}" if self.miss != "fetch" else "")

    def run_options(self) -> dict[str, Any]:
        """The `moeflow run` options of this candidate (the keys of a run configuration file)."""
        return {
            "eviction": self.eviction,
            "prefetch": self.prefetch,
            "lookahead": self.s,
            "adaptive_s": self.adaptive,
            "miss": self.miss,
        }


def uses_s(prefetch: str) -> bool:
    """Whether prefetch policy `prefetch` follows the engine's S (`pregate` does; `all-next-layer` has its own lookahead)."""
    pol = build_policy(PREFETCH, prefetch)
    return bool(pol.proposes) and pol.lookahead is None


def refuse_unreplayable(text: str) -> None:
    """ConfigError for a prefetch policy `text` (`name[:k=v,...]`) tune cannot replay: a learned one (it needs the
    running model) or pre-gate with a percentile threshold (it follows its own history)."""
    name, opts = policy_args(text)
    if not replayable(name):
        raise ConfigError(
            f"tune cannot replay prefetch policy {text!r} (it needs the running model; measure it with "
            f"`moeflow run -f {name}:predictors=DIR`); use none, pregate[:overfetch=X|mass=P] or all-next-layer"
        )
    if name == "pregate" and "percentile" in opts:
        raise ConfigError(
            f"tune cannot replay {text!r} (its threshold follows its own history); use pregate:overfetch=X or mass=P"
        )


def space(
    num_moe_layers: int,
    *,
    evictions: Sequence[str] = EVICTIONS,
    prefetches: Sequence[str] = PREFETCHES,
    s_values: Sequence[int] = S_VALUES,
    calibration_s: int | None = None,
    adaptive: bool = True,
    misses: Sequence[str] = MISSES,
    device_type: str = "cpu",
) -> list[Candidate]:
    """Every candidate: eviction x prefetch x (S in `s_values` and the calibration's, within 1..MoE layers - 1,
    and adaptive, for a prefetch policy that follows S) x miss. Refuses a policy lossy on a `device_type` device
    or one the simulator does not replay."""
    hi = max(1, num_moe_layers - 1)
    ss = sorted({s for s in (*s_values, *((calibration_s,) if calibration_s else ())) if 1 <= s <= hi})
    for text in evictions:
        build_policy(EVICTION, text)
    for text in prefetches:
        refuse_unreplayable(text)
    for text in misses:
        if policy_args(text)[0] not in EXACT_MISSES:
            raise ConfigError(
                f"tune replays miss policies {' and '.join(EXACT_MISSES)} only (got {text!r}); the simulator does not "
                "model the others"
            )
    out: list[Candidate] = []
    for miss in misses:
        for ev in evictions:
            for pf in prefetches:
                if not uses_s(pf):
                    out.append(Candidate(ev, pf, None, False, miss))
                    continue
                out += [Candidate(ev, pf, s, False, miss) for s in ss]
                if adaptive:
                    out.append(Candidate(ev, pf, None, True, miss))
    for c in out:
        ans = lossy(
            device_type=device_type,
            eviction=[build_policy(EVICTION, c.eviction)],
            prefetch=[build_policy(PREFETCH, c.prefetch)],
            miss=build_policy(MISS, c.miss),
            routing=ROUTING.create("standard"),
        )
        if ans.lossy:
            raise ConfigError(f"tune searches exact configurations only; {c.label} is lossy ({ans.reasons[0]})")
    return out


def sig3(x: float) -> str:
    """`x` to 3 significant figures, without an exponent or trailing zeros: 0.0599731 -> 0.06, 124.528 -> 125,
    12345 -> 12300."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    r = float(f"{x:.3g}")
    text = f"{r:.{max(0, 2 - math.floor(math.log10(abs(r))))}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


@dataclass(frozen=True)
class CostModel:
    """Time and link of the predicted TPOT (from a calibration, the link possibly from `--link`)."""

    gbps: float  # link bandwidth, GB/s (1e9 bytes/s)
    latency_s: float  # per copy
    expert_bytes: int
    layer_time_s: float  # one MoE layer's compute (calibration `layer_time_s`: the adaptive-S controller's)
    num_moe_layers: int
    calibration: dict[str, Any] = field(default_factory=dict)  # engine_time, link_timing (else the compute fields)

    @property
    def engine_time(self) -> bool:
        """Whether the calibration has the per-layer host times (`engine_time`)."""
        return isinstance(self.calibration.get("engine_time"), dict)

    def time_model(self, prefetch: str = "none") -> TimeModel:
        """The simulator's time model for prefetch policy `prefetch` (name or `name:options`): the calibration's
        `engine_time` and `link_timing` as `moeflow simulate --calibrated-time` reads them, else its compute."""
        name = policy_args(prefetch)[0]
        if self.engine_time:
            return TimeModel.from_calibration(self.calibration, name)
        return TimeModel.from_compute(float(self.calibration["compute_per_token_s"]), self.layer_time_s, self.num_moe_layers)

    @property
    def copy_s(self) -> float:
        """Link seconds of one expert's copy."""
        return self.latency_s + self.expert_bytes / (self.gbps * 1e9)

    def link(self, timing: TimeModel | None = None) -> ModelledLink:
        """The modelled link (with the time model's host seconds per copy submitted and per stalled wait)."""
        tm = timing or self.time_model()
        return ModelledLink(
            self.gbps, self.latency_s, submit_s=tm.submit_s, wake_s=tm.wake_s, prefetch_submit_s=tm.prefetch_copy_s
        )

    def describe(self) -> str:
        link = f"modelled {sig3(self.gbps)} GB/s, {sig3(self.latency_s * 1e6)} us"
        if self.engine_time:
            return f"{link}; time model: calibration engine_time"
        return f"{link}; compute {float(self.calibration['compute_per_token_s']) * 1e3:.2f} ms/token (no engine_time)"


@dataclass
class Evaluator:
    """Replays candidates on (prefixes of) one access trace at one capacity."""

    acc: AccessTrace
    capacity: int
    cost: CostModel
    predict_logits: Any = None  # the model's routers (pregate)
    calibration: dict[str, Any] | None = None  # starts the adaptive-S controller
    num_layers: int = 0
    tables: dict[str, PregateTable] = field(default_factory=dict)
    max_s: int = 1  # the largest S of the model (MoE layers - 1)
    table_s: int = 0  # pregate tables are built up to this S (0: max_s); the largest S searched
    prompt_ends: list[int] = field(default_factory=list)  # passes[:prompt_ends[i]] = the first i + 1 prompts
    prefixes: dict[int, AccessTrace] = field(default_factory=dict)  # prompts -> that prefix of the trace

    def __post_init__(self) -> None:
        ends: list[int] = []
        for i, p in enumerate(self.acc.passes):
            if i and p.prompt_id != self.acc.passes[i - 1].prompt_id:
                ends.append(i)
        self.prompt_ends = [*ends, len(self.acc.passes)] if self.acc.passes else []
        self.max_s = max(1, len(self.acc.moe_layers) - 1)

    @property
    def prompts(self) -> int:
        return len(self.prompt_ends)

    def prefix(self, prompts: int) -> AccessTrace:
        """The first `prompts` prompts (one object per length: the simulator's per-trace preparation is kept on it)."""
        if prompts >= self.prompts:
            return self.acc
        got = self.prefixes.get(prompts)
        if got is None:
            end = self.prompt_ends[prompts - 1]
            a = self.acc
            got = self.prefixes[prompts] = AccessTrace(a.moe_layers, a.num_experts, a.top_k, a.passes[:end], a.expert_bytes)
        return got

    def table(self, prefetch: str, s_max: int) -> PregateTable:
        t = self.tables.get(prefetch)
        if t is None or t.max_s < s_max:
            if self.predict_logits is None:
                raise ConfigError("pregate needs the model's routers: pass --model (the traced model)")
            t = self.tables[prefetch] = PregateTable.build(self.acc, build_policy(PREFETCH, prefetch), s_max, self.predict_logits)
        return t

    def controller(self) -> Any:
        from ..runtime.adaptive_s import StepSizeController

        if self.calibration:
            ctrl = StepSizeController.from_calibration(self.calibration, max_s=self.max_s, num_layers=self.num_layers)
        else:
            ctrl = StepSizeController(initial_s=1, max_s=self.max_s, num_layers=self.num_layers)
        ctrl.capacity = self.capacity
        return ctrl

    def run(self, c: Candidate, prompts: int | None = None) -> dict[str, Any]:
        """Replay candidate `c` on the first `prompts` prompts (None: all); its predicted decode metrics."""
        acc = self.prefix(prompts or self.prompts)
        timing = self.cost.time_model(c.prefetch)
        link = self.cost.link(timing)
        name, opts = policy_args(c.prefetch)
        adaptive = None
        pf: Any = (name, opts)
        if name == "pregate" and uses_s(c.prefetch):
            gate = build_policy(PREFETCH, c.prefetch).gate  # a fresh gate of these options
            table = self.table(c.prefetch, max(self.table_s or self.max_s, self.max_s if c.adaptive else int(c.s or 1)))
            if c.adaptive:
                phases = [p.phase for p in acc.passes]
                tokens = [p.tokens for p in acc.passes]
                adaptive = AdaptiveS(self.controller(), link, self.cost.layer_time_s, phases, tokens)
                pf = TablePrefetch(table, gate, adaptive, adaptive)
            else:
                s = int(c.s or 1)
                pf = TablePrefetch(table, gate, lambda: s)
        t0 = time.perf_counter()
        st = simulate(
            acc,
            self.capacity,
            policy_args(c.eviction),
            pf,
            miss=c.miss,
            lookahead=int(c.s or 1),
            predict_logits=self.predict_logits,  # a pregate with its own lookahead replays by its routers
            link=link,
            timing=timing,
            count_phase=1,
        )
        n = max(1, st.tokens)  # decode tokens
        row: dict[str, Any] = {
            **c.run_options(),
            "label": c.label,
            "predicted_tpot_s": st.pass_s or 0.0,  # the link's clock per decode pass (`simulate`'s predicted_tpot_s)
            "stall_per_token_s": st.stall_s / n,
            "hit_rate": st.hit_rate,
            "bytes_per_token": st.loads * self.cost.expert_bytes / n,
            "loads_per_token": st.loads_per_token,
            "prefetch_precision": st.prefetch_precision,
            "prefetch_recall": st.prefetch_recall,
            "late": st.late,
            "host_misses_per_token": st.host_misses / n,  # miss cpu: experts the host computed (not cache accesses)
            "decode_tokens": st.tokens,
            "prompts": prompts or self.prompts,
            "replay_s": time.perf_counter() - t0,
        }
        if adaptive is not None and adaptive.history:
            h = adaptive.history
            row["s_adaptive"] = {"min": min(h), "max": max(h), "mean": sum(h) / len(h)}
        return row

    def bound(self) -> dict[str, Any]:
        """Belady's MIN (demand paging) on the whole trace: the fewest copies per decode token at this capacity,
        and the TPOT bound max(a pass that waits for nothing, those copies' link time)."""
        st = belady(self.acc, self.capacity, count_phase=1)
        loads = st.loads / max(1, st.tokens)
        compute = self.cost.time_model().pass_s(len(self.acc.moe_layers), False)
        return {
            "belady_hit_rate": st.hit_rate,
            "belady_loads_per_token": loads,
            "bound_tpot_s": max(compute, loads * self.cost.copy_s),
        }


def rounds(candidates: int, prompts: int, eta: int = 4, final: int = 2, min_prompts: int = 3) -> list[tuple[int, int]]:
    """(prompts replayed, candidates replayed) per round of successive halving: the last round replays every prompt,
    each earlier one 1/eta of the next one's prompts (the first at least `min_prompts`); each round keeps the best
    1/eta of the candidates of the one before, at least `final` (one round when there are no more than that)."""
    r = 1
    while candidates > final and math.ceil(prompts / eta**r) >= min_prompts:
        r += 1
    out = []
    n = candidates
    for i in range(r):
        out.append((math.ceil(prompts / eta ** (r - 1 - i)), n))
        n = max(min(final, n), math.ceil(n / eta))
    return out


def rank_key(row: dict[str, Any]) -> tuple[float, float, str]:
    """Best first: predicted TPOT, then bytes per token, then the label (a stable order)."""
    return (row["predicted_tpot_s"], row["bytes_per_token"], row["label"])


def search(
    ev: Evaluator,
    candidates: Sequence[Candidate],
    *,
    exhaustive: bool = False,
    eta: int = 4,
    on_replay: Callable[[], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[tuple[int, int]]]:
    """(ranked: the candidates replayed on the whole trace, best first; pruned: the others, each with the round it
    left in and its figures on that round's prefix; the rounds as (prompts, candidates))."""
    plan = [(ev.prompts, len(candidates))] if exhaustive else rounds(len(candidates), ev.prompts, eta)
    alive = list(candidates)
    pruned: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for i, (prompts, _) in enumerate(plan):
        rows = []
        for c in alive:
            rows.append({**ev.run(c, prompts), "round": i + 1})
            if on_replay is not None:
                on_replay()
        rows.sort(key=rank_key)
        if i + 1 < len(plan):
            keep = plan[i + 1][1]
            pruned += rows[keep:]
            by_label = {c.label: c for c in alive}
            alive = [by_label[r["label"]] for r in rows[:keep]]
    pruned.sort(key=lambda r: (-r["round"], *rank_key(r)))
    return rows, pruned, plan
