"""An access trace as flat arrays for the compiled replay (`ExpertCache.replay`), and the prefetch proposals
of its every layer step, computed once per trace.

`Stream` (`stream(acc)`): per pass its phase, tokens and steps; per step (one MoE layer of one pass) its layer
rank and its unique routed experts, ascending (the order of the cache's accesses, `needed_experts`).

`Proposals` (`proposals(...)`): per step, the keys (`rank * E + expert`) its prefetch policy proposes, in the
order the cache issues them (priority, highest first; ties in proposal order). Precomputed for policies whose
proposals depend on the trace alone, never on the cache (`precomputable`):
- `pregate` (overfetch or mass selection): for each source layer and each later layer within S, ONE router
  call over every recorded router input of the source layer (a batched matmul), then per step the union of
  its tokens' selections with the best probability per expert (`PreGatePrefetch.propose`'s arithmetic; the
  logits equal the per-step ones up to float rounding, as any batched matmul);
- `pregate` with `percentile` (its threshold follows a history of every call) and `all-next-layer`: the
  policy's own `propose`, step by step in replay order.
Both are cached on the access trace (per policy options, S and predictor). Both are built with numpy over the
trace's distinct pass objects (a trace whose passes repeat, as a benchmark's copies do, is prepared once per
distinct pass, then gathered into the full order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..policies import LayerContext, Position
from ..policies.prefetch import AllNextLayer, PreGatePrefetch
from ..runtime.cachecore import pack_stream
from .access import AccessTrace

ROWS = 1 << 16  # router inputs per batched router call (bounds the [rows, E] probabilities in memory)


@dataclass
class Stream:
    phase: np.ndarray  # [P] 0 prefill, 1 decode
    tokens: np.ndarray  # [P]
    pass_off: np.ndarray  # [P+1] steps of pass p: pass_off[p]..pass_off[p+1]
    step_rank: np.ndarray  # [S] MoE layer rank of each step
    exp_off: np.ndarray  # [S+1] experts of step j: experts[exp_off[j]:exp_off[j+1]]
    experts: np.ndarray  # [A] ascending within a step
    _packed: Any = field(default=None, repr=False, compare=False)  # (proposals id, packed array, proposals)

    @property
    def accesses(self) -> int:
        return len(self.experts)

    def step_keys(self, num_experts: int) -> np.ndarray:
        """[A] key (`rank * E + expert`) of every access."""
        return np.repeat(self.step_rank, np.diff(self.exp_off)) * num_experts + self.experts

    def packed(self, proposals: Proposals | None) -> np.ndarray:
        """The stream and its proposals as the replay kernel reads them (`cachecore.pack_stream`; the latest
        packing is kept, a replay per policy of the same trace packs once)."""
        key = None if proposals is None else id(proposals)
        if self._packed is None or self._packed[0] != key:
            args = (proposals.off, proposals.keys) if proposals is not None else ()
            R = pack_stream(self.phase, self.tokens, self.pass_off, self.step_rank, self.exp_off, self.experts, *args)
            self._packed = (key, R, proposals)
        return self._packed[1]

    def repeat(self, n: int) -> Stream:
        """The stream `n` times over (benchmarks: a longer replay of the same passes)."""
        P, S, A = len(self.phase), len(self.step_rank), len(self.experts)
        return (
            Stream(
                np.tile(self.phase, n),
                np.tile(self.tokens, n),
                np.concatenate([self.pass_off[:-1] + i * S for i in range(n)] + [np.array([n * S])]),
                np.tile(self.step_rank, n),
                np.concatenate([self.exp_off[:-1] + i * A for i in range(n)] + [np.array([n * A])]),
                np.tile(self.experts, n),
            )
            if P
            else self
        )


@dataclass
class Proposals:
    off: np.ndarray  # [S+1] keys of step j: keys[off[j]:off[j+1]]
    keys: np.ndarray  # [Q] rank * E + expert, in issue order; -1: not a key of the trace's layers

    def repeat(self, n: int) -> Proposals:
        Q = len(self.keys)
        return Proposals(np.concatenate([self.off[:-1] + i * Q for i in range(n)] + [np.array([n * Q])]), np.tile(self.keys, n))


def _distinct(acc: AccessTrace) -> tuple[list[Any], np.ndarray]:
    """The trace's distinct pass objects in order of first appearance, and each pass's index among them [P]
    (a trace that repeats its passes, as a benchmark's copies do, is prepared once per distinct pass)."""
    index: dict[int, int] = {}
    uniq: list[Any] = []
    seq = np.empty(len(acc.passes), dtype=np.int64)
    for i, p in enumerate(acc.passes):
        u = index.get(id(p))
        if u is None:
            u = index[id(p)] = len(uniq)
            uniq.append(p)
        seq[i] = u
    return uniq, seq


def _ranges(off: np.ndarray, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows `off[w]..off[w+1]` for each w of `which`, concatenated: (their indices, the new offsets [n+1])."""
    n = np.diff(off)[which]  # [n]
    new_off = np.zeros(len(which) + 1, dtype=np.int64)
    np.cumsum(n, out=new_off[1:])
    rows = np.arange(new_off[-1], dtype=np.int64) + np.repeat(off[which] - new_off[:-1], n)
    return rows, new_off


def stream(acc: AccessTrace) -> Stream:
    """The access trace's stream (cached on it while its passes are unchanged)."""
    key = (id(acc.passes), len(acc.passes))
    cached = getattr(acc, "_stream", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    E = acc.num_experts
    rank_of = {l: r for r, l in enumerate(acc.moe_layers)}
    uniq, seq = _distinct(acc)
    steps = [s for p in uniq for s in p.steps]  # the distinct passes' steps
    S = len(steps)
    u_pass_off = np.zeros(len(uniq) + 1, dtype=np.int64)
    np.cumsum([len(p.steps) for p in uniq], out=u_pass_off[1:])
    rows = [np.asarray(s.indices) for s in steps]  # each [T, k]
    counts = np.fromiter((r.size for r in rows), dtype=np.int64, count=S)
    try:
        flat = np.concatenate(rows).reshape(-1).astype(np.int64) if rows else np.zeros(0, np.int64)
    except ValueError:  # steps of different widths
        flat = np.concatenate([r.reshape(-1) for r in rows]).astype(np.int64)
    codes = np.sort(np.repeat(np.arange(S, dtype=np.int64), counts) * E + flat)  # by step, then expert
    if len(codes):
        codes = codes[np.concatenate([[True], codes[1:] != codes[:-1]])]  # unique
    u_rank = np.fromiter((rank_of[s.layer] for s in steps), dtype=np.int64, count=S)
    u_exp_off = np.searchsorted(codes // E, np.arange(S + 1)).astype(np.int64)
    step_rows, pass_off = _ranges(u_pass_off, seq)  # every pass's steps, as rows of the distinct steps
    exp_rows, exp_off = _ranges(u_exp_off, step_rows)
    out = Stream(
        phase=np.fromiter((p.phase for p in uniq), dtype=np.int64, count=len(uniq))[seq],
        tokens=np.fromiter((p.tokens for p in uniq), dtype=np.int64, count=len(uniq))[seq],
        pass_off=pass_off,
        step_rank=u_rank[step_rows],
        exp_off=exp_off,
        experts=(codes % E)[exp_rows],
    )
    acc._stream = (key, out, step_rows)  # type: ignore[attr-defined]
    return out


def precomputable(policy: Any) -> bool:
    """Whether `proposals` can compute this prefetch policy's proposals once per trace (they never read the cache)."""
    return type(policy) in (PreGatePrefetch, AllNextLayer)


def proposals(
    acc: AccessTrace,
    policy: Any,
    lookahead: int,
    predict_logits: Callable[[int, torch.Tensor], torch.Tensor] | None,
    *,
    cache: bool = True,
) -> Proposals:
    """Every step's proposals of a `precomputable` policy (`cache`: keep them on `acc` for the next call with
    the same options, for a policy object that starts fresh, as a policy built by name does)."""
    opts = tuple(sorted((k, repr(v)) for k, v in vars(policy).items() if not k.startswith("_") and k != "gate"))
    key = (type(policy).__name__, opts, lookahead, id(predict_logits), id(acc.passes), len(acc.passes))
    store = acc.__dict__.setdefault("_proposals", {})
    if cache and key in store:
        return store[key][0]
    if type(policy) is PreGatePrefetch and policy.percentile is None:
        out = _pregate(acc, policy, lookahead, predict_logits)
    else:
        out = _sequential(acc, policy, lookahead, predict_logits)
    if cache:
        store[key] = (out, predict_logits)  # the predictor is kept alive: its id stays its own
    return out


def _no_router(layer: int, x: torch.Tensor) -> torch.Tensor:
    raise ConfigError(
        "this prefetch policy needs the model's routers: pass predict_logits "
        "(e.g. get_adapter(model).router_logits) and an access trace with router inputs"
    )


def _pregate(acc: AccessTrace, pf: PreGatePrefetch, lookahead: int, predict_logits: Any) -> Proposals:
    """`PreGatePrefetch.propose` for every step: one batched router call per (source layer, target layer)."""
    if predict_logits is None or not acc.has_router_input:
        _no_router(acc.moe_layers[0], torch.zeros(0))
    stream(acc)
    step_rows = acc._stream[2]  # type: ignore[attr-defined]  # [S] each step's row among the distinct steps
    E, k, moe = acc.num_experts, acc.top_k, acc.moe_layers
    L = len(moe)
    S_ahead = pf.lookahead if pf.lookahead is not None else lookahead
    uniq, _ = _distinct(acc)
    steps = [s for p in uniq for s in p.steps]  # proposals depend on a step's router input alone
    rank_of = {l: r for r, l in enumerate(moe)}
    rank = np.fromiter((rank_of[s.layer] for s in steps), dtype=np.int64, count=len(steps))
    parts_j: list[np.ndarray] = []  # per (source rank, target): step, priority, offset s, key
    parts_p: list[np.ndarray] = []
    parts_s: list[np.ndarray] = []
    parts_k: list[np.ndarray] = []
    for r in range(L - 1):
        js = np.flatnonzero(rank == r)  # [n] the steps of source layer r
        if not len(js):
            continue
        xs = [steps[j].router_input for j in js.tolist()]  # each [T_j, H]
        T = torch.tensor([x.shape[0] for x in xs])
        row_step = torch.repeat_interleave(torch.arange(len(js)), T)  # [N] local step of each row
        X = torch.cat(xs)  # [N, H]
        targets = moe[r + 1 : r + 1 + S_ahead]
        for s, t in enumerate(targets):
            best = torch.full((len(js), E), -1.0)  # [n, E] best selected probability per step
            for a in range(0, X.shape[0], ROWS):
                with torch.no_grad():
                    probs = predict_logits(t, X[a : a + ROWS]).float().softmax(-1)  # [rows, E]
                mask = pf._select(t, probs, k)  # [rows, E] row-wise (overfetch / mass)
                idx = row_step[a : a + ROWS].unsqueeze(1).expand(-1, E)  # [rows, E]
                best.scatter_reduce_(0, idx, probs.masked_fill(~mask, -1.0), "amax")
            bj, be = (best >= 0).nonzero(as_tuple=True)  # proposed (step, expert), by step then expert
            b = best[bj, be].double().numpy()
            parts_j.append(js[bj.numpy()])
            parts_p.append(float(len(targets) - s) + b)
            parts_s.append(np.full(len(b), s))
            parts_k.append((r + 1 + s) * E + be.numpy())
    u = _ordered(len(rank), parts_j, parts_p, parts_s, parts_k)
    rows, off = _ranges(u.off, step_rows)
    return Proposals(off, u.keys[rows])


def _ordered(n_steps: int, js: list, prio: list, ss: list, keys: list) -> Proposals:
    """Per step, keys by priority (highest first), ties in proposal order (offset s, then expert)."""
    if not js:
        return Proposals(np.zeros(n_steps + 1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    j, p, s, k = (np.concatenate(x) for x in (js, prio, ss, keys))
    order = np.lexsort((k, s, -p, j))
    j = j[order]
    return Proposals(np.searchsorted(j, np.arange(n_steps + 1)).astype(np.int64), k[order].astype(np.int64))


def _sequential(acc: AccessTrace, pf: Any, lookahead: int, predict_logits: Any) -> Proposals:
    """The policy's own `propose` at every step, in replay order (its position as the cache would give it)."""
    st = stream(acc)
    E, moe = acc.num_experts, tuple(acc.moe_layers)
    rank_of = {l: r for r, l in enumerate(moe)}
    off = np.zeros(len(st.step_rank) + 1, dtype=np.int64)
    keys: list[int] = []
    j = time = 0
    for pass_id, p in enumerate(acc.passes):
        for step in p.steps:
            time += int(st.exp_off[j + 1] - st.exp_off[j])
            r = rank_of[step.layer]
            ctx = layer_context(acc, step, Position(pass_id, step.layer, r, time), moe, lookahead, predict_logits, _unknown)
            for req in sorted(pf.propose(ctx), key=lambda q: -q.priority):
                rl = rank_of.get(int(req.key[0]))
                e = int(req.key[1])
                keys.append(rl * E + e if rl is not None and 0 <= e < E else -1)
            j += 1
            off[j] = len(keys)
    return Proposals(off, np.asarray(keys, dtype=np.int64))


def _unknown(key: Any) -> bool:
    raise RuntimeError("a precomputed prefetch policy asked the cache's residency")


def layer_context(
    acc: AccessTrace, step: Any, pos: Position, moe: tuple[int, ...], lookahead: int, predict_logits: Any, resident: Any
) -> LayerContext:
    """What a prefetch policy sees after `step` routed: the recorded router input and routing."""
    x = step.router_input
    idx = torch.as_tensor(step.indices)  # [T,k]
    w = torch.as_tensor(step.weights) if step.weights is not None else torch.ones(idx.shape)
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
        predict_logits=predict_logits or _no_router,
        lookahead=lookahead,
        resident=resident,
    )
