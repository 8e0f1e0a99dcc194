"""Approximate Belady's MIN eviction: the resident expert whose next use is predicted farthest away."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError
from .base import EVICTION, ExpertKey, Position
from .eviction import _Base


@EVICTION.register
class BeladyApprox(_Base):
    """Approximate Belady's MIN: evict the resident expert whose next use is predicted farthest away.

    Time is counted in MoE layer steps. For a candidate (l, e) seen from the running layer (rank r of L
    MoE layers, L learned from the layers seen), its layer next runs d = ((rank(l) - r - 1) mod L) + 1
    steps ahead (the running layer's own experts, if not pinned, next run in the next pass: d = L), as
    in `fld`. The expected time to its next use is

        E[T] = d + (1 - p1) * L * I

    with p1 the probability that it is used at that next run and I the expected passes between its uses
    after that (a geometric reuse model: used with probability 1/I per pass):
    - I, per (layer, expert): an EMA of its inter-access intervals in passes, raised to the passes since
      it was last used or loaded when that is longer (an expert unused for long is not "due"); a key
      never reused takes the mean interval over all keys;
    - p1, when the prefetch policy proposed the key in this pass for its coming run (the cache reports
      it with `on_insert(prefetched=True)` or `on_predicted`, in the runtime and in the simulator):
      the predictor's layer-ahead probability, calibrated online - the fraction of past proposals made
      the same number of layers ahead that were then used (starting at `prior`); otherwise 1 / I.
    Without proposals (prefetch none) this ranks by reuse frequency, recency and layer distance.
    Ties by least-recent use, then key.
    """

    name = "belady-approx"
    kernel = "belady-approx"

    def __init__(self, ema: float = 0.3, prior: float = 0.5) -> None:
        super().__init__()
        if not 0.0 < ema <= 1.0:
            raise ConfigError(f"belady-approx ema must be in (0, 1], got {ema}")
        if not 0.0 < prior <= 1.0:
            raise ConfigError(f"belady-approx prior must be in (0, 1], got {prior}")
        self.ema, self.prior = ema, prior
        self._layers: list[int] = []  # MoE layers seen, sorted: rank = index (execution order)
        self._rank_of: dict[int, int] = {}
        self.last_use: dict[ExpertKey, int] = {}  # pass of the last access (survives eviction)
        self._ref: dict[ExpertKey, int] = {}  # pass of the last access or load
        self.interval: dict[ExpertKey, float] = {}  # EMA of passes between accesses (survives eviction)
        self.mean_interval = 1.0
        self._intervals_seen = 0
        self.pred: dict[ExpertKey, tuple[int, int]] = {}  # proposed key -> (pass, layers ahead)
        self.p_ahead: dict[int, float] = {}  # layers ahead -> calibrated P(used | proposed)

    # -- layers --
    def _see(self, layer: int) -> None:
        if layer not in self._rank_of:
            import bisect

            bisect.insort(self._layers, layer)
            self._rank_of = {l: i for i, l in enumerate(self._layers)}

    def _ahead(self, layer: int, pos: Position) -> int:
        """MoE layer steps until `layer` runs next, seen from the running layer: 1..L."""
        self._see(layer)
        self._see(pos.layer)
        L = len(self._layers)
        return (self._rank_of[layer] - self._rank_of[pos.layer] - 1) % L + 1

    # -- events --
    def on_insert(self, key: ExpertKey, pos: Position, *, prefetched: bool) -> None:
        super().on_insert(key, pos, prefetched=prefetched)
        self._ref[key] = pos.pass_id
        if prefetched:
            self._predict(key, pos)

    def on_predicted(self, key: ExpertKey, pos: Position) -> None:
        self._predict(key, pos)

    def _predict(self, key: ExpertKey, pos: Position) -> None:
        if key not in self.pred or self.pred[key][0] != pos.pass_id:
            self.pred[key] = (pos.pass_id, self._ahead(key[0], pos))

    def on_access(self, key: ExpertKey, pos: Position, *, score: float) -> None:
        super().on_access(key, pos, score=score)
        self._see(key[0])
        p = pos.pass_id
        last = self.last_use.get(key)
        if last is not None and p > last:
            gap = float(p - last)
            old = self.interval.get(key)
            self.interval[key] = gap if old is None else (1 - self.ema) * old + self.ema * gap
            self._intervals_seen += 1
            self.mean_interval += (gap - self.mean_interval) / min(self._intervals_seen, 1000)
        self.last_use[key] = p
        self._ref[key] = p
        pr = self.pred.pop(key, None)
        if pr is not None and pr[0] == p:
            self._outcome(pr[1], True)

    def on_layer_start(self, pos: Position) -> None:
        self._see(pos.layer)
        r = self._rank_of[pos.layer]
        done = [k for k, (p, _) in self.pred.items() if p < pos.pass_id or (p == pos.pass_id and self._rank_of.get(k[0], r) < r)]
        for k in done:  # its layer ran without using it: a wasted proposal
            self._outcome(self.pred.pop(k)[1], False)

    def on_pass_start(self, pos: Position) -> None:
        for k in [k for k, (p, _) in self.pred.items() if p < pos.pass_id]:
            self._outcome(self.pred.pop(k)[1], False)

    def on_evict(self, key: ExpertKey) -> None:
        super().on_evict(key)
        self._ref.pop(key, None)

    def _outcome(self, ahead: int, used: bool) -> None:
        old = self.p_ahead.get(ahead, self.prior)
        self.p_ahead[ahead] = (1 - self.ema) * old + self.ema * (1.0 if used else 0.0)

    # -- the prediction --
    def expected_next_use(self, key: ExpertKey, pos: Position) -> float:
        """E[T] in MoE layer steps from `pos` (larger = evicted first)."""
        d = self._ahead(key[0], pos)
        L = len(self._layers)
        age = pos.pass_id - self._ref.get(key, pos.pass_id)
        I = max(self.interval.get(key, self.mean_interval), float(age), 1.0)
        pr = self.pred.get(key)
        if pr is not None and pr[0] == pos.pass_id and d < L:
            p1 = self.p_ahead.get(pr[1], self.prior)
        else:
            p1 = 1.0 / I
        return d + (1.0 - p1) * L * I

    def victim(self, candidates: Sequence[ExpertKey], pos: Position) -> ExpertKey:
        if not candidates:
            raise RuntimeError("belady-approx: asked for a victim among no candidates")
        rank = self._rank_of
        if pos.layer not in rank or any(k[0] not in rank for k in candidates):  # a new layer changes L midway
            far = {k: self.expected_next_use(k, pos) for k in candidates}
            top = max(far.values())
            return min((k for k in candidates if far[k] >= top - 1e-9), key=self._age)
        # `expected_next_use` inlined (the same arithmetic, so the same floats) for every candidate
        L, p = len(self._layers), pos.pass_id
        r0 = rank[pos.layer]
        ref, interval, mean, pred = self._ref, self.interval, self.mean_interval, self.pred
        p_ahead, prior = self.p_ahead, self.prior
        far = {}
        for k in candidates:
            d = (rank[k[0]] - r0 - 1) % L + 1
            I = max(interval.get(k, mean), float(p - ref.get(k, p)), 1.0)
            pr = pred.get(k)
            if pr is not None and pr[0] == p and d < L:
                p1 = p_ahead.get(pr[1], prior)
            else:
                p1 = 1.0 / I
            far[k] = d + (1.0 - p1) * L * I
        top = max(far.values())
        return min((k for k in candidates if far[k] >= top - 1e-9), key=self._age)

    def reuse_steps(self, key: ExpertKey, pos: Position, p: float | None = None) -> float | None:
        """`expected_next_use`, with p1 = `p` when given (a proposal's confidence for its layer's next run)."""
        if p is None:
            return self.expected_next_use(key, pos)
        d = self._ahead(key[0], pos)
        age = pos.pass_id - self._ref.get(key, pos.pass_id)
        I = max(self.interval.get(key, self.mean_interval), float(age), 1.0)
        return d + (1.0 - min(1.0, max(0.0, p))) * len(self._layers) * I
