"""What `moeflow tune` hands the simulator so that one trace replays fast at every step size S, fixed or adaptive.

- `PregateTable`: `pregate`'s proposals for every layer step and every offset up to the largest S the search
  tries, from ONE batched router call per (source layer, target layer) (the policy's own selection rule,
  `PreGatePrefetch._select`, on the recorded router inputs), kept as (offset, key, best probability, confidence).
- `TablePrefetch`: a prefetch policy that proposes, at each step, the table's requests within the current S,
  with `pregate`'s priorities (nearer layers first, then probability) and confidences (`topk_confidence`), and
  the gate of a freshly built `pregate` of the same options. Replayed by the simulator's call-by-call loop on
  a modelled link, it proposes what `pregate` proposes there, without a router call per step; it reads only the
  position and the cache's residency (`propose_at`), so the loop builds no `LayerContext` for it.
- `AdaptiveS`: the runtime's `StepSizeController` (ExpertFlow's adaptive S) fed per replayed pass with the
  `PassStats` fields it reads (the pass's cache counters, the modelled link's clock, bytes and busy time, the
  layers run and the experts proposed), so an adaptive-S candidate is replayed with the controller `moeflow run
  --adaptive-s` attaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from ..policies import ExpertKey, LayerContext, Position, PrefetchPolicy, PrefetchRequest
from ..policies.prefetch import PreGatePrefetch
from ..runtime.adaptive_s import StepSizeController
from ..runtime.cache import CacheCounters
from ..runtime.passstats import PassStats
from ..sim.access import AccessTrace

ROWS = 1 << 16  # router inputs per batched router call (bounds the [rows, E] probabilities in memory)


@dataclass
class PregateTable:
    """Per layer step j (passes in order, layers in order): rows[j] = [(offset s, key, best prob, confidence)],
    sorted in `pregate`'s issue order (priority n - s + prob, highest first; ties by offset then expert); the
    key is (the MoE layer s + 1 after the step's, expert), the confidence `topk_confidence(prob, top_k)`."""

    rows: list[list[tuple[int, ExpertKey, float, float]]]
    step_of: dict[tuple[int, int], int]  # (pass index, MoE layer rank) -> step
    max_s: int
    top_k: int
    moe: tuple[int, ...] = ()  # the MoE layers

    @classmethod
    def build(cls, acc: AccessTrace, policy: PreGatePrefetch, max_s: int, predict_logits: Any) -> PregateTable:
        """The table of `policy` (overfetch or mass; not percentile, whose threshold follows its history) up to `max_s`."""
        E, k, moe = acc.num_experts, acc.top_k, tuple(acc.moe_layers)
        L = len(moe)
        steps = [s for p in acc.passes for s in p.steps]
        rank_of = {l: r for r, l in enumerate(moe)}
        ranks = np.fromiter((rank_of[s.layer] for s in steps), dtype=np.int64, count=len(steps))
        rows: list[list[tuple[int, ExpertKey, float, float]]] = [[] for _ in steps]
        for r in range(L - 1):
            js = np.flatnonzero(ranks == r)  # [n] the steps of source layer r
            if not len(js):
                continue
            xs = [steps[j].router_input for j in js.tolist()]  # each [T_j, H]
            T = torch.tensor([x.shape[0] for x in xs])  # type: ignore[union-attr]
            row_step = torch.repeat_interleave(torch.arange(len(js)), T)  # [N] local step of each row
            X = torch.cat(xs)  # type: ignore[arg-type]  # [N, H]
            for s, t in enumerate(moe[r + 1 : r + 1 + max_s]):
                best = torch.full((len(js), E), -1.0)  # [n, E] best selected probability per step
                for a in range(0, X.shape[0], ROWS):
                    with torch.no_grad():
                        probs = predict_logits(t, X[a : a + ROWS]).float().softmax(-1)  # [rows, E]
                    mask = policy._select(t, probs, k)  # [rows, E]
                    idx = row_step[a : a + ROWS].unsqueeze(1).expand(-1, E)  # [rows, E]
                    best.scatter_reduce_(0, idx, probs.masked_fill(~mask, -1.0), "amax")
                bj, be = (best >= 0).nonzero(as_tuple=True)  # by step, then expert
                b = best[bj, be].double()  # [m] as Python floats: `topk_confidence`'s arithmetic below
                conf = (b * k).clamp(0.0, 1.0)  # [m] topk_confidence(b, k)
                for j, e, p, q in zip(js[bj.numpy()].tolist(), be.tolist(), b.tolist(), conf.tolist()):
                    rows[j].append((s, (t, e), p, q))
        for row in rows:
            row.sort(key=lambda x: (x[0] - x[2], x[0], x[1][1]))  # priority n - s + b, highest first, stable order
        step_of = {}
        j = 0
        for pi, p in enumerate(acc.passes):
            for st in p.steps:
                step_of[(pi, rank_of[st.layer])] = j
                j += 1
        return cls(rows, step_of, max_s, k, moe)

    def requests(self, j: int, rank: int, s_now: int) -> list[PrefetchRequest]:
        """Step j's requests within S = s_now (at most the table's S), as `pregate` makes them."""
        n = len(self.moe[rank + 1 : rank + 1 + s_now])
        return [_request(key, float(n - s) + b, conf) for s, key, b, conf in self.rows[j] if s < s_now]


_new = object.__new__


def _request(key: ExpertKey, priority: float, confidence: float) -> PrefetchRequest:
    """`PrefetchRequest(key, priority, confidence)` without the frozen dataclass's per-field `object.__setattr__`."""
    r = _new(PrefetchRequest)
    d = r.__dict__
    d["key"], d["priority"], d["confidence"] = key, priority, confidence
    return r


class TablePrefetch(PrefetchPolicy):
    """`pregate` replayed from a `PregateTable` at S = `s()` (a fixed S or an `AdaptiveS`)."""

    name: ClassVar[str] = "pregate"
    changes_output = False
    proposes: ClassVar[bool] = True
    needs_router_input: ClassVar[bool] = False  # the table holds what the routers said
    needs_residual: ClassVar[bool] = False
    needs_model: ClassVar[bool] = False
    speculates: ClassVar[bool] = False
    lookahead: int | None = None
    horizon: int | None = None
    reads_position_only: ClassVar[bool] = True

    def __init__(self, table: PregateTable, gate: Any, s: Any, adaptive: AdaptiveS | None = None) -> None:
        self.table, self.gate, self.s, self.adaptive = table, gate, s, adaptive

    def bind(self, ctx: Any) -> Any:
        return lambda: None

    def propose(self, ctx: LayerContext) -> list[PrefetchRequest]:
        return self.propose_at(ctx.pos, ctx.resident)

    def propose_at(self, pos: Position, resident: Any) -> list[PrefetchRequest]:
        """`propose` from what it reads of the context (the simulator's loop then builds none): the position and
        the cache's residency test."""
        if self.adaptive is not None:
            self.adaptive.step(pos, resident)
        s_now = min(int(self.s()), self.table.max_s)
        reqs = self.table.requests(self.table.step_of[(pos.pass_id, pos.layer_rank)], pos.layer_rank, s_now)
        if self.adaptive is not None:
            self.adaptive.proposed(resident, reqs)
        return reqs


class AdaptiveS:
    """The runtime's adaptive-S controller, fed one `PassStats` per replayed pass (decode passes: the virtual time
    of the pass on the modelled link). Driven from the prefetch policy's calls: a call in a new pass closes the
    previous one. `s()` is the S in use."""

    def __init__(self, ctrl: StepSizeController, link: Any, layer_time_s: float, phases: list[int], tokens: list[int]) -> None:
        self.ctrl, self.link, self.layer_time_s = ctrl, link, layer_time_s
        self.phases, self.tokens = phases, tokens
        self.pass_id = -1
        self._cache: Any = None
        self._c0 = CacheCounters()
        self._t0 = self._b0 = self._busy0 = 0.0
        self._layers = 0
        self._seen: set[tuple[int, int]] = set()
        self._new = 0
        self.history: list[int] = []  # S of each decode pass

    def __call__(self) -> int:
        return self.ctrl.s

    def step(self, pos: Position, resident: Any) -> None:
        if pos.pass_id != self.pass_id:
            if self.pass_id >= 0:
                self._close()
            self._open(pos, resident)
        self._layers += 1

    def proposed(self, resident: Any, reqs: list[PrefetchRequest]) -> None:
        seen = self._seen
        for r in reqs:
            if r.key not in seen:
                seen.add(r.key)
                if not resident(r.key):
                    self._new += 1

    def _open(self, pos: Position, resident: Any) -> None:
        # the simulator hands prefetch policies the cache's own residency test: its cache, and so its counters
        self._cache = getattr(resident, "__self__", None)
        self.pass_id = pos.pass_id
        self._c0 = self._counters().copy()
        self._t0, self._b0, self._busy0 = self.link.clock_s(), self.link.bytes, self.link.busy_s
        self._layers, self._new = 0, 0
        self._seen = set()
        if self.phases[self.pass_id] == 1:
            self.history.append(self.ctrl.s)

    def _counters(self) -> CacheCounters:
        return self._cache.counters if self._cache is not None else CacheCounters()

    def _close(self) -> None:
        decode = self.phases[self.pass_id] == 1
        st = PassStats(
            pass_id=self.pass_id,
            tokens=self.tokens[self.pass_id],
            wall_s=self.link.clock_s() - self._t0,
            stall_s=0.0,
            counters=self._counters() - self._c0,
            transfer_s=self.link.busy_s - self._busy0,
            transfer_bytes=int(self.link.bytes - self._b0),
            lookahead=self.ctrl.s,
            decode=decode,
            compute_s=self.layer_time_s * self._layers,
            moe_layers_run=self._layers,
            predicted=len(self._seen),
            predicted_new=self._new,
        )
        self.ctrl.on_pass(st)
