"""`next-use`: evict the resident expert whose next use is expected farthest away, from calibrated probabilities.

Like `belady-approx` it ranks candidates by the expected time to their next use in MoE layer steps,

    E[T] = d + (1 - p1) * L / f

(d: steps until the candidate's layer runs next, 1..L; p1: the probability that it is used at that run;
f: its long-run share of passes that use it), but p1 and f are estimated differently, and every estimate
is calibrated online on what the run itself routed:
- f, per (layer, expert): passes that used it / passes its layer ran (both decayed by `decay` per pass, default
  0.9 so the share follows the prompt; 1.0 = the whole run, LFU-like), shrunk towards the mean share of its layer
  with weight `shrink` passes;
- p1, for a layer still ahead in this pass that the prefetch policy predicted (its proposals reach the policy
  for resident experts as `on_predicted` or a prefetched insert, whether or not the gate loads anything): the
  observed fraction of proposed experts used, or of not-proposed resident experts of a predicted layer used;
- p1 otherwise: a table, learned online, of the next-run use rate by (bucket of f, used at the layer's last
  run), so a recently used expert is kept for as long as recency actually predicts reuse in this run.

Ties by least-recent use, then key. With prefetch `none` it ranks by calibrated frequency, recency and layer
distance. This class is the reference (and the mechanism on a link with copies in flight): `expected_next_use`
scores every tracked expert at once with numpy; a victim among the cache's candidates orders the resident
experts in one compiled call (`_victim_order`: the same operations in the same order, so the same floats). Its
compiled twin (`kernel`, `moeflow.runtime.cachecore_nu`) makes the same decisions with the same floats in the
compiled cache core, which runs it with an instant link.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..numba_cache import file_digest, njit_cached, stamped_locators
from .base import EVICTION, Candidates, ExpertKey, Position
from .eviction import _Base
from .next_use_sums import BUCKETS as _BUCKETS
from .next_use_sums import bucket as _bucket1
from .next_use_sums import row_sum as _row_sum

_THIS = Path(__file__).resolve()
_SOURCES = (_THIS, _THIS.with_name("next_use_sums.py"))  # what `_victim_order` compiles: its own and the shared sums
_STAMP: list[str] = []


def _stamp() -> str:
    """A digest of this file and of the shared float routines it inlines (computed once per process)."""
    if not _STAMP:
        _STAMP.append(file_digest(_SOURCES))
    return _STAMP[0]


_CACHE = bool(stamped_locators(lambda p: p == _THIS, _stamp))  # unstamped, a stale function could survive an edit


def _compiled(fn):  # compiled once per machine (numba's on-disk cache, stamped with both sources), else per process
    return njit_cached(fn, _CACHE, nogil=True, error_model="numpy", _nrt=False)


@_compiled
def _victim_order(
    uses, passes, used_pass, prop_pass, rank, resident, tick, ne, r0, L, pass_id, shrink, rec, recency, cov, pp, keys, out
):
    """The tracked keys (`resident`) into `keys` [n] by the largest E[T], then least recent (`tick`), then key, and
    their E[T] into `out` [n]; returns n. E[T] as the numpy `expected_next_use`: the same operations on the same
    values (a layer's mean share summed in numpy's pairwise order), so the same floats. Arrays flat, keys l * NE + e:
    uses, used_pass, prop_pass, resident, tick [NL*NE]; rec: (rec_used, rec_seen) [2, 2 * buckets]; cov: (covered
    this pass, source rank, steps) of the proposals, cov[0] == 0: none; pp: (prop_used, prop_seen) [2, 2]."""
    width = float(ne if ne > 1 else 1)
    Lf = float(L)
    n_keys = 0
    q_at = -1
    d, sm, den, last, covered, seen = 0.0, 0.0, 1.0, 0, False, False
    for i in range(resident.shape[0]):
        if not resident[i]:
            continue
        q = i // ne
        if q != q_at:  # the layer's terms, once per layer
            q_at = q
            rq = rank[q]
            seen = rq >= 0
            d = float((rq - r0 - 1) % L + 1) if seen else Lf
            if seen:
                n = passes[q] if passes[q] > 1e-9 else 1e-9
                mean = _row_sum(uses, q * ne, ne) / n / width
                sm, den = shrink * mean, n + shrink
            ahead = rq > r0
            last = pass_id - 1 if ahead else pass_id
            steps = rq - cov[1]
            covered = cov[0] != 0 and steps > 0 and steps <= cov[2] and ahead
        f = (uses[i] + sm) / den if seen else 0.0
        f = f if f > 1e-3 else 1e-3
        if covered:
            j = 1 if prop_pass[i] == pass_id else 0
            p1 = pp[0, j] / pp[1, j]
        elif recency:
            j = 2 * _bucket1(f) + (1 if used_pass[i] == last else 0)
            p1 = rec[0, j] / rec[1, j]
        else:
            p1 = f
        x = d + (1.0 - p1) * Lf / f
        # insertion: after every key with a larger E[T], or an equal one and an older tick (keys ascend)
        m = n_keys
        while m > 0 and (out[m - 1] < x or (out[m - 1] == x and tick[keys[m - 1]] > tick[i])):
            out[m] = out[m - 1]
            keys[m] = keys[m - 1]
            m -= 1
        out[m] = x
        keys[m] = i
        n_keys += 1
    return n_keys


@EVICTION.register
class NextUse(_Base):
    """Evict the resident expert with the largest expected time to next use (calibrated online); see the module."""

    name = "next-use"
    kernel: str | None = (
        "next-use"  # its compiled twin: `moeflow.runtime.cachecore_nu` (the same victims; this class is the reference)
    )

    def __init__(self, decay: float = 0.9, shrink: float = 4.0, recency: bool = True, proposals: bool = True) -> None:
        super().__init__()
        if not 0.0 < decay <= 1.0:
            raise ConfigError(f"next-use decay must be in (0, 1], got {decay}")
        if shrink < 0:
            raise ConfigError(f"next-use shrink must be >= 0, got {shrink}")
        self.decay, self.shrink, self.recency, self.proposals = float(decay), float(shrink), bool(recency), bool(proposals)
        self._n_layers = 0  # rows of the arrays (decoder-layer index + 1)
        self._n_exp = 0  # columns (expert id + 1)
        self.uses = np.zeros((0, 0))  # [NL,NE] decayed passes that used the key
        self.passes = np.zeros(0)  # [NL] decayed passes in which the layer ran
        self.used_pass = np.zeros((0, 0), dtype=np.int64)  # [NL,NE] last pass that used the key (-1: never)
        self.resident = np.zeros((0, 0), dtype=bool)  # [NL,NE] tracked (inserted, not evicted)
        self.tick = np.zeros((0, 0), dtype=np.int64)  # [NL,NE] last touch (LRU tie-break)
        self.prop_pass = np.zeros((0, 0), dtype=np.int64)  # [NL,NE] pass of its last proposal (-1: none)
        self.rank = np.zeros(0, dtype=np.int64)  # [NL] execution rank of a decoder layer (-1: not an MoE layer seen)
        self._layers: list[int] = []  # MoE layers seen, sorted
        self.pass_id = -1
        self._running: int | None = None  # the layer whose run is in progress
        self._run_bucket: np.ndarray | None = None  # [NE] its keys' f bucket at its start
        self._run_recent: np.ndarray | None = None  # [NE] used at its previous run
        self._run_covered = False  # the prefetch policy predicted it in this pass
        self._run_prop: np.ndarray | None = None  # [NE] proposed (with `_run_covered`)
        self._run_res: np.ndarray | None = None  # [NE] resident at its start
        self._cover_pass = -1  # pass of the latest proposal
        self._cover_src = -1  # rank of its source layer
        self._cover_steps = 0  # the largest distance proposals were seen at
        # calibration counts (Laplace-smoothed): the recency table [bucket, recent] and proposals [proposed]
        # used and seen share one array each, as `_victim_order` reads them (views, updated in place only)
        self._rec = np.stack((np.ones((_BUCKETS, 2)), np.full((_BUCKETS, 2), 2.0)))  # [2, buckets, 2]
        self.rec_used, self.rec_seen = self._rec[0], self._rec[1]
        self._pp = np.array([[1.0, 1.0], [8.0, 2.0]])  # [used, seen] x [not proposed, proposed]
        self.prop_used, self.prop_seen = self._pp[0], self._pp[1]
        self._order_buf = (np.zeros(0, dtype=np.int64), np.zeros(0))  # `_victim_order`'s keys and E[T] [NL*NE]

    # -- arrays --
    def _grow(self, layer: int, expert: int) -> None:
        nl, ne = max(self._n_layers, layer + 1), max(self._n_exp, expert + 1)
        if (nl, ne) == (self._n_layers, self._n_exp):
            return

        def pad(a: np.ndarray, fill) -> np.ndarray:
            out = np.full((nl, ne) if a.ndim == 2 else (nl,), fill, dtype=a.dtype)
            out[tuple(slice(0, s) for s in a.shape)] = a
            return out

        self.uses, self.used_pass = pad(self.uses, 0.0), pad(self.used_pass, -1)
        self.resident, self.tick, self.prop_pass = pad(self.resident, False), pad(self.tick, 0), pad(self.prop_pass, -1)
        self.passes, self.rank = pad(self.passes, 0.0), pad(self.rank, -1)
        self._n_layers, self._n_exp = nl, ne

    def _see(self, layer: int) -> None:
        if layer >= self._n_layers or self.rank[layer] < 0:
            self._grow(layer, 0)
            import bisect

            bisect.insort(self._layers, layer)
            self.rank[:] = -1
            self.rank[self._layers] = np.arange(len(self._layers))

    def _share(self, rows: int | np.ndarray) -> np.ndarray:
        """f per key of `rows`: decayed use share, shrunk towards its layer's mean share."""
        uses, passes = self.uses[rows], self.passes[rows]
        n = np.maximum(passes, 1e-9)[..., None]
        mean = uses.sum(-1, keepdims=True) / n / max(1, self._n_exp)
        return (uses + self.shrink * mean) / (n + self.shrink)

    @staticmethod
    def _bucket(f: np.ndarray) -> np.ndarray:
        return np.minimum((np.sqrt(np.clip(f, 0.0, 1.0)) * _BUCKETS).astype(np.int64), _BUCKETS - 1)

    # -- events --
    def _touch_key(self, key: ExpertKey) -> None:
        self._touch(key)
        self._grow(*key)
        self.tick[key] = self._tick

    def on_insert(self, key: ExpertKey, pos: Position, *, prefetched: bool) -> None:
        self._see(key[0])
        self._touch_key(key)
        self.resident[key] = True
        if prefetched:
            self._proposed(key, pos)

    def on_predicted(self, key: ExpertKey, pos: Position) -> None:
        if key in self._last:
            self._proposed(key, pos)

    def _proposed(self, key: ExpertKey, pos: Position) -> None:
        if not self.proposals:
            return
        self._see(key[0])
        self._see(pos.layer)
        self.prop_pass[key] = pos.pass_id
        src, dist = int(self.rank[pos.layer]), int(self.rank[key[0]] - self.rank[pos.layer])
        self._cover_pass, self._cover_src = pos.pass_id, src
        self._cover_steps = max(self._cover_steps, dist)

    def on_access(self, key: ExpertKey, pos: Position, *, score: float) -> None:
        self._see(key[0])
        self._touch_key(key)
        self.resident[key] = True
        if self.used_pass[key] != pos.pass_id:
            self.used_pass[key] = pos.pass_id
            self.uses[key] += 1.0

    def on_evict(self, key: ExpertKey) -> None:
        super().on_evict(key)
        if key[0] < self._n_layers and key[1] < self._n_exp:
            self.resident[key] = False

    def on_pass_start(self, pos: Position) -> None:
        self._end_run()
        if self.decay < 1.0:
            self.uses *= self.decay
            self.passes *= self.decay
        self.pass_id = pos.pass_id

    def on_layer_start(self, pos: Position) -> None:
        self._end_run()
        self.pass_id = pos.pass_id
        l = pos.layer
        self._see(l)
        self.passes[l] += 1.0
        self._running = l
        self._run_bucket = self._bucket(self._share(l))
        self._run_recent = self.used_pass[l] == pos.pass_id - 1  # used at the layer's previous run
        self._run_covered = self._covered(l, pos.pass_id)
        self._run_prop = self.prop_pass[l] == pos.pass_id
        self._run_res = self.resident[l].copy()

    def _end_run(self) -> None:
        """Score the predictions made for the run that just ended (its layer's keys: used or not)."""
        l = self._running
        if l is None or self._run_bucket is None or self._run_recent is None:
            return
        self._running = None
        b, r = self._run_bucket, self._run_recent.astype(np.int64)
        used = self.used_pass[l, : len(b)] == self.pass_id  # [NE] (experts first seen during the run left out)
        cell = 2 * b + r  # [NE] of the table [bucket, recent]: counts of 1.0 (integers: exact in any order)
        self.rec_seen += np.bincount(cell, minlength=2 * _BUCKETS).reshape(_BUCKETS, 2)
        self.rec_used += np.bincount(cell, weights=used.astype(float), minlength=2 * _BUCKETS).reshape(_BUCKETS, 2)
        if self._run_covered and self._run_prop is not None and self._run_res is not None:
            res, prop = self._run_res, self._run_prop
            for j, m in ((0, res & ~prop), (1, res & prop)):
                self.prop_seen[j] += m.sum()
                self.prop_used[j] += (m & used).sum()

    def _covered(self, layer: int, pass_id: int) -> bool:
        if not self.proposals or self._cover_pass != pass_id:
            return False
        d = int(self.rank[layer]) - self._cover_src
        return 0 < d <= self._cover_steps

    # -- the prediction --
    def expected_next_use(self, pos: Position) -> np.ndarray:
        """E[T] in MoE layer steps from `pos` for every (layer, expert) [NL,NE] (larger = evicted first)."""
        self._see(pos.layer)
        L = len(self._layers)
        r0 = int(self.rank[pos.layer])
        seen = self.rank >= 0
        d = np.where(seen, (self.rank - r0 - 1) % L + 1, L)[:, None]  # [NL,1] steps until the layer runs next
        f = np.zeros((self._n_layers, self._n_exp))
        f[seen] = self._share(seen)
        f = np.maximum(f, 1e-3)
        ahead = (self.rank > r0)[:, None]  # [NL,1] the layer runs later in this pass (else it ran: next pass)
        last = np.where(ahead, self.pass_id - 1, self.pass_id)  # pass of the layer's last run
        recent = self.used_pass == last
        rec = self.rec_used / self.rec_seen
        p1 = rec[self._bucket(f), recent.astype(np.int64)] if self.recency else f
        if self.proposals and self._cover_pass == self.pass_id:
            steps = self.rank - self._cover_src
            cov = ((steps > 0) & (steps <= self._cover_steps) & (self.rank > r0))[:, None]
            pp = self.prop_used / self.prop_seen
            prop = self.prop_pass == self.pass_id
            p1 = np.where(cov, np.where(prop, pp[1], pp[0]), p1)
        return d + (1.0 - p1) * L / f

    def victim(self, candidates: Sequence[ExpertKey], pos: Position) -> ExpertKey:
        if not candidates:
            raise RuntimeError("next-use: asked for a victim among no candidates")
        if type(candidates) is Candidates:
            if type(self).expected_next_use is NextUse.expected_next_use:
                keys = self._victim_order(pos)[0]  # [n] in the victim order
            else:  # a subclass's own E[T]
                keys = np.flatnonzero(self.resident)  # [n]
                far_keys = self.expected_next_use(pos).ravel()[keys]
                keys = keys[np.lexsort((keys, self.tick.ravel()[keys], -far_keys))]  # farthest, least recent, key
            ne = self._n_exp
            for i in keys.tolist():
                k = divmod(i, ne)
                if k in candidates:
                    return k
        for k in candidates:
            self._grow(*k)
        far = self.expected_next_use(pos)  # [NL,NE]
        return max(candidates, key=lambda k: (far[k], -self.tick[k], -k[0], -k[1]))

    def _victim_order(self, pos: Position) -> tuple[np.ndarray, np.ndarray]:
        """The tracked keys (flat l * NE + e) [n] by the largest `expected_next_use`, then least recent, then key,
        and their E[T] [n]: one compiled call (`_victim_order`)."""
        self._see(pos.layer)
        size = self.resident.size
        if self._order_buf[0].size != size:
            self._order_buf = (np.empty(size, dtype=np.int64), np.empty(size))
        keys, out = self._order_buf  # [NL*NE] each
        cov = (int(self.proposals and self._cover_pass == self.pass_id), self._cover_src, self._cover_steps)
        n = _victim_order(
            self.uses.ravel(),
            self.passes,
            self.used_pass.ravel(),
            self.prop_pass.ravel(),
            self.rank,
            self.resident.ravel(),
            self.tick.ravel(),
            self._n_exp,
            int(self.rank[pos.layer]),
            len(self._layers),
            self.pass_id,
            self.shrink,
            self._rec.reshape(2, -1),  # (rec_used, rec_seen) [2, 2 * buckets], no copy
            self.recency,
            cov,
            self._pp,  # (prop_used, prop_seen) [2, 2]
            keys,
            out,
        )
        return keys[:n], out[:n]

    def reuse_steps(self, key: ExpertKey, pos: Position, p: float | None = None) -> float | None:
        """`expected_next_use` of `key`; with `p`, p1 = `p` (a proposal's confidence for its layer's next run)."""
        self._see(key[0])
        self._grow(*key)
        if p is None:
            return float(self.expected_next_use(pos)[key])
        self._see(pos.layer)
        L = len(self._layers)
        d = (int(self.rank[key[0]]) - int(self.rank[pos.layer]) - 1) % L + 1
        f = max(float(self._share(key[0])[key[1]]), 1e-3)
        return d + (1.0 - min(1.0, max(0.0, p))) * L / f
