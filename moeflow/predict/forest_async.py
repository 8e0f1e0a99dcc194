"""`AsyncForest`: the forest of `forest.py` evaluated on CPU in a worker thread, asynchronously to the model:
results land in a prediction cache keyed by (token sequence, target layer, S); a lookup that finds nothing ready
falls back to the pre-gate's top-k (ExpertFlow 3.2.2, "dual mode")."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .data import SourceBatch

if TYPE_CHECKING:
    from .forest import Forest


class AsyncForest:
    """Runs `Forest` predictions in a worker thread; a cache keyed by (token sequence, layer, S).

    `submit_group(pairs, batch, keys, probs)` queues, as ONE forest call for all (target, S) in `pairs`, the rows
    whose keys are not cached or pending (`submit(target, s, ...)`: one pair); `lookup(target, keys, fallback)`
    returns, per row, the ready prediction with the smallest S for that target (any source), else the fallback's
    row (the pre-gate). The caller's thread builds the rows (`fast.ForestRunner.prepare`: the pre-gate
    probabilities from one product with the stacked routers, pass them as `probs` [P,T,E] when already computed,
    and the features, numpy); the worker walks the trees in a compiled kernel that releases the GIL, so it never
    holds the model's thread up. Counters say how often each path was taken; `busy_s` is the worker's time.
    """

    def __init__(self, forest: Forest, *, max_entries: int = 65536, workers: int = 1):
        from .fast_forest import ForestRunner

        self.forest = forest
        self.fast = ForestRunner(forest)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moeflow-forest")
        self.cache: dict[tuple[Hashable, int, int], np.ndarray] = {}
        self.pending: dict[tuple[Hashable, int, int], Future] = {}
        self.lock = threading.Lock()
        self.max_entries = max_entries
        self.hits = 0
        self.fallbacks = 0
        self.busy_s = 0.0
        self.calls = 0  # forest calls (one per submitted source layer)

    def _run(self, pairs: list[tuple[int, int]], keys: list, X: np.ndarray, base: np.ndarray, probs: np.ndarray) -> None:
        import time

        t0 = time.perf_counter()
        scores = self.fast.finish(X, base, probs)  # [P,T,E] one forest call for every (target, S)
        with self.lock:
            for (t, s), sc in zip(pairs, scores):
                for i, q in enumerate(keys):
                    self.cache[(q, t, s)] = sc[i]
                    self.pending.pop((q, t, s), None)
            while len(self.cache) > self.max_entries:
                self.cache.pop(next(iter(self.cache)))
            self.busy_s += time.perf_counter() - t0
            self.calls += 1

    def submit(self, target: int, s: int, batch: SourceBatch, seq_keys: list[Hashable]) -> None:
        self.submit_group([(target, s)], batch, seq_keys)

    def submit_group(
        self, pairs: list[tuple[int, int]], batch: SourceBatch, seq_keys: list[Hashable], probs: np.ndarray | None = None
    ) -> None:
        """Queue ONE forest job for every (target, S) in `pairs`, for the rows with any of them not cached
        or pending. `probs` [P,T,E]: the pairs' pre-gate probabilities (computed here when None)."""
        with self.lock:
            todo = [
                i
                for i, q in enumerate(seq_keys)
                if any((q, t, s) not in self.cache and (q, t, s) not in self.pending for t, s in pairs)
            ]
        if not todo or not pairs:
            return
        probs = self.fast.probs(batch, [t for t, _ in pairs]) if probs is None else probs
        sub = batch
        if len(todo) < batch.t:
            idx = torch.tensor(todo)
            sub = SourceBatch(
                batch.layer,
                batch.router_input[idx] if batch.router_input.numel() else batch.router_input,
                batch.topk_ids[idx],
                batch.topk_weights[idx],
                None,
                None if batch.token_ctx is None else batch.token_ctx[idx],
                {l: h[idx] for l, h in batch.history.items()},
            )
            probs = probs[:, todo]
        sub_keys = [seq_keys[i] for i in todo]
        X, base = self.fast.prepare(list(pairs), sub, probs)  # numpy here; the worker walks the trees without the GIL
        with self.lock:
            fut = self.pool.submit(self._run, list(pairs), sub_keys, X, base, probs)
            for q in sub_keys:
                for t, s in pairs:
                    self.pending[(q, t, s)] = fut

    def lookup(self, target: int, seq_keys: list[Hashable], fallback: Callable[[], Any]) -> np.ndarray:
        """Scores [T,E]: cached forest rows where ready (smallest S first), the fallback's rows elsewhere."""
        out: list[np.ndarray | None] = []
        with self.lock:
            for q in seq_keys:
                got = None
                for s in range(1, self.forest.max_lookahead + 1):
                    got = self.cache.get((q, target, s))
                    if got is not None:
                        break
                out.append(got)
        missing = [i for i, o in enumerate(out) if o is None]
        self.hits += len(out) - len(missing)
        self.fallbacks += len(missing)
        if missing:
            fb = fallback()
            fb = fb.float().numpy() if isinstance(fb, torch.Tensor) else np.asarray(fb, np.float32)
            if len(missing) == len(out):
                return fb
            for i in missing:
                out[i] = fb[i]
        return np.stack(out)  # type: ignore[arg-type]  # every row filled above

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
