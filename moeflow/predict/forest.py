"""ExpertFlow's random-forest delta predictor (ExpertFlow 3.2.2-3.2.5): features, fit, predict, save, load.

Samples (3.2.3-3.2.4): one per token record, source layer and step S. The "token sequence" of a
record is the window of its last `window` token ids in its prompt (this one last); records are
grouped by (token sequence, S) as in the paper, each group giving one example per layer. Features
(the paper's three inputs, 3.2.2: the pre-gate output, the token ids, the expert history):

    x = [ mean-pooled fixed random embedding of the token sequence (d, seeded, saved),
          S, target layer rank l,
          prev_act in {0,1}^{L*M}: the experts each MoE layer up to the source chose (later layers 0),
          pregate [M]: the target layer's router applied to the source layer's router input (probabilities;
                       0 without traced hidden states),
          prior [M] + log(1 + n): the target layer's expert frequencies of the current token id over the
                       training tokens (n occurrences; `token-id` baseline's table, global frequency for an
                       unseen id); while fitting, each prompt's own tokens are left out of its rows' prior,
          the same [M+1] for the previous token (its whole-training-set prior) ]

so F = d + 2 + L*M + M + 2(M+1). The label is the target layer's activation vector y in {0,1}^M. ExpertFlow
learns the deviation (Delta) of the truth from the pre-gate estimate: the regressor is trained on
y - pregate_topk (multi-hot of the pre-gate's top-k) and predicts score = pregate_topk + Delta_hat
(+ a 1e-3 * pre-gate probability tie-break). Without traced hidden states (no pre-gate) the base
is 0 and the forest predicts y directly. scikit-learn regression trees (MSE) fit it as `RandomForestRegressor`
would (`forest_arrays.fit_trees`); it is then kept, saved and evaluated as plain arrays (`ArrayForest`,
`forest.npz`): loading runs no code from the file (no pickle), and a legacy `forest.joblib` is refused.

`predict_group(pairs, batch)` serves every (target, S) of a source layer with ONE forest call (the rows
of all pairs stacked), which is what the run-time policy does per layer.

The trees as arrays are `forest_arrays.py`; `AsyncForest`, which runs the forest on a worker thread, is
`forest_async.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import ArtifactError
from ..moe import get_adapter
from .base import PREDICTORS
from .data import RoutingData, SourceBatch, batch_from_rows, target_of
from .forest_arrays import ArrayForest, fit_trees, savez_fast

FOREST_FILE = "forest.npz"
PRIOR_FILE = "prior.npz"  # the token-id prior (arrays)
BASES = ("pregate", "prior", "none")
FEATURES_VERSION = 2  # 1: [e, S, l, prev_act] (older folders are refused with a message)
LEGACY_FILE = "forest.joblib"


def multi_hot(ids: torch.Tensor | np.ndarray, num_experts: int) -> np.ndarray:
    ids = np.asarray(ids)
    out = np.zeros((ids.shape[0], num_experts), dtype=np.float32)
    np.put_along_axis(out, ids, 1.0, axis=1)
    return out


@PREDICTORS.register
class Forest:
    name: ClassVar[str] = "forest"
    needs_hidden: ClassVar[bool] = False  # uses the pre-gate as its base only when hidden states exist

    def __init__(self, model: torch.nn.Module, max_lookahead: int = 4, window: int = 4, dim: int = 16, seed: int = 0):
        self.adapter = get_adapter(model)
        self.spec = self.adapter.spec
        self.max_lookahead = max_lookahead
        self.window = window
        self.dim = dim
        self.table = np.random.default_rng(seed).standard_normal((int(model.config.vocab_size), dim)).astype(np.float32)  # type: ignore[union-attr,arg-type]          # [V,d] fixed random embedding
        self.base_kind = "pregate"  # what the forest learns the delta over: pregate | prior | none
        self.rf: ArrayForest | None = None
        self.fit_seconds = 0.0
        L, E = len(self.spec.moe_layers), self.spec.num_experts
        self.prior_ids = np.zeros(0, np.int64)  # [U] sorted token ids seen in training
        self.prior_counts = np.zeros((L, 0, E), np.float32)  # [L,U,E] expert counts per target rank and id
        self.prior_freq = np.full((L, E), 1.0 / E, np.float32)  # [L,E] global frequency (unseen ids)

    @classmethod
    def create(cls, model: torch.nn.Module, cfg: Any) -> Forest:
        return cls(model, cfg.max_s, cfg.forest_window, cfg.forest_dim, cfg.seed)

    @property
    def n_features(self) -> int:
        L, E = len(self.spec.moe_layers), self.spec.num_experts
        return self.dim + 2 + L * E + E + 2 * (E + 1)

    # -- features --
    def embed(self, ctx: np.ndarray) -> np.ndarray:
        """[T,w] token ids (-1 pad) -> [T,d] mean of the table rows of the valid ids."""
        valid = ctx >= 0
        e = self.table[np.where(valid, ctx, 0)] * valid[..., None]  # [T,w,d]
        return e.sum(1) / np.maximum(valid.sum(1, keepdims=True), 1)

    def prior(self, target: int, tok: np.ndarray, minus: np.ndarray | None = None) -> np.ndarray:
        """[T,M+1]: the target layer's expert frequencies for token ids `tok` [T] and log(1 + count);
        `minus` [T,M] counts to leave out (a training row's own prompt)."""
        r = self.spec.moe_layers.index(target)
        E = self.spec.num_experts
        c = np.zeros((len(tok), E), np.float32)
        if len(self.prior_ids):
            pos = np.clip(np.searchsorted(self.prior_ids, tok), 0, len(self.prior_ids) - 1)
            known = self.prior_ids[pos] == tok
            c[known] = self.prior_counts[r, pos[known]]
        if minus is not None:
            c = np.maximum(c - minus, 0.0)
        n = c.sum(1, keepdims=True) / self.spec.top_k  # occurrences
        p = (c + 0.5 * self.prior_freq[r][None]) / (c.sum(1, keepdims=True) + 0.5)
        return np.concatenate([p, np.log1p(n)], 1).astype(np.float32)

    def prior_all(self, tok: np.ndarray) -> np.ndarray:
        """[L,T,M+1]: `prior(target, tok)` of every target rank at once (the run-time path, `fast.ForestRunner`)."""
        c = np.zeros((self.prior_counts.shape[0], len(tok), self.spec.num_experts), np.float32)  # [L,T,M]
        if len(self.prior_ids):
            pos = np.clip(np.searchsorted(self.prior_ids, tok), 0, len(self.prior_ids) - 1)
            known = self.prior_ids[pos] == tok
            c[:, known] = self.prior_counts[:, pos[known]]
        tot = c.sum(2, keepdims=True)  # [L,T,1]
        p = (c + 0.5 * self.prior_freq[:, None, :]) / (tot + 0.5)
        return np.concatenate([p, np.log1p(tot / self.spec.top_k)], 2).astype(np.float32)

    def features(
        self,
        target: int,
        s: int,
        batch: SourceBatch,
        probs: np.ndarray | None = None,
        minus: np.ndarray | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """[T,F] (see the module docstring); `probs` = the pre-gate probabilities of `target` when known; written
        into `out` [T,F] float32 when given (the fit's pool, without a temporary copy)."""
        ml, E = self.spec.moe_layers, self.spec.num_experts
        t = batch.t
        ctx = batch.token_ctx.numpy() if batch.token_ctx is not None else np.full((t, 1), -1)
        prev = np.zeros((t, len(ml) * E), dtype=np.float32)  # [T,L*M]
        for l, ids in batch.history.items():
            r = ml.index(l)
            prev[:, r * E : (r + 1) * E] = multi_hot(ids, E)
        meta = np.tile(np.array([[s, ml.index(target)]], dtype=np.float32), (t, 1))
        if probs is None:
            probs = self.base(target, batch)[1]
        prev_tok = ctx[:, -2] if ctx.shape[1] > 1 else np.full(t, -1)
        return np.concatenate(
            [self.embed(ctx), meta, prev, probs, self.prior(target, ctx[:, -1], minus), self.prior(target, prev_tok)],
            axis=1,
            out=out,
        )

    @torch.no_grad()
    def base(self, target: int, batch: SourceBatch, minus: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(base [T,E], pre-gate probs [T,E]; 0 without a router input). The base the forest learns the delta
        over: `pregate` the pre-gate's top-k multi-hot (ExpertFlow; 0 without a router input), `prior` k x the
        token-id prior of the current token, `none` 0."""
        E = self.spec.num_experts
        z = np.zeros((batch.t, E), dtype=np.float32)
        probs = z
        if batch.router_input.numel():
            probs = torch.softmax(batch.router_logits(self.adapter, target, batch.router_input).float(), -1).numpy()
        if self.base_kind == "prior":
            tok = batch.token_ctx[:, -1].numpy() if batch.token_ctx is not None else np.full(batch.t, -1)
            return self.spec.top_k * self.prior(target, tok, minus)[:, :E], probs
        if self.base_kind == "pregate" and batch.router_input.numel():
            return multi_hot(np.argsort(-probs, 1, kind="stable")[:, : self.spec.top_k], E), probs
        return z, probs

    def _fit_prior(self, data: RoutingData) -> tuple[np.ndarray, np.ndarray]:
        """Token-id tables from `data`; returns (per-row index of (prompt, token) [N], its counts [G,L,E])
        so a training row's own prompt can be left out of its prior."""
        ml, E = list(self.spec.moe_layers), self.spec.num_experts
        uniq, inv = np.unique(data.token_id, return_inverse=True)
        self.prior_ids = uniq.astype(np.int64)
        self.prior_counts = np.zeros((len(ml), len(uniq), E), np.float32)
        pk, pinv = np.unique(np.stack([data.prompt_id, data.token_id], 1), axis=0, return_inverse=True)
        pinv = pinv.reshape(-1)
        own = np.zeros((len(pk), len(ml), E), np.float32)
        for r, l in enumerate(ml):
            ids = data.layers[l].topk_ids
            k = ids.shape[1]
            np.add.at(self.prior_counts[r], (np.repeat(inv, k), ids.reshape(-1)), 1.0)
            np.add.at(own[:, r], (np.repeat(pinv, k), ids.reshape(-1)), 1.0)
            f = np.bincount(ids.reshape(-1), minlength=E).astype(np.float64) + 1.0
            self.prior_freq[r] = f / f.sum()
        return pinv, own

    # -- fit / predict --
    def fit(self, data: RoutingData, model: torch.nn.Module, cfg: Any, progress: Any = None) -> None:
        import time

        t0 = time.perf_counter()
        self.max_lookahead = cfg.max_s
        self.base_kind = cfg.forest_base if (data.has_hidden or cfg.forest_base != "pregate") else "none"
        ctx = data.context(self.window)
        pinv, own = self._fit_prior(data)
        rng = np.random.default_rng(cfg.seed)
        pairs = data.rank_pairs(cfg.max_s)
        per = max(1, cfg.forest_max_samples // max(1, len(pairs)))
        ml = list(self.spec.moe_layers)
        n = min(data.n, per)  # rows per pair
        X = np.empty((len(pairs) * n, self.n_features), np.float32)  # [pairs*n,F] filled in place (no second copy)
        Y = np.empty((len(pairs) * n, self.spec.num_experts), np.float32)  # [pairs*n,E]
        for j, (src, s) in enumerate(pairs):
            tgt = target_of(data.spec, src, s)
            rows = np.arange(data.n)
            if len(rows) > per:
                rows = np.sort(rng.choice(rows, per, replace=False))
            b = batch_from_rows(data, src, rows, ctx=ctx)
            minus = own[pinv[rows], ml.index(tgt)]  # the row's own prompt, left out of its token prior
            base, probs = self.base(tgt, b if data.has_hidden else _no_router(b), minus)
            self.features(tgt, s, b, probs, minus, out=X[j * n : (j + 1) * n])
            Y[j * n : (j + 1) * n] = multi_hot(data.layers[tgt].topk_ids[rows], self.spec.num_experts) - base
        self.rf = ArrayForest.from_sklearn(fit_trees(X, Y, cfg, self.n_features))  # run-time prediction: compiled walk
        self.fit_seconds = time.perf_counter() - t0

    def delta_hat(self, target: int, s: int, batch: SourceBatch, probs: np.ndarray | None = None) -> np.ndarray:
        assert self.rf is not None, "fit or load first"
        return self.rf.predict(self.features(target, s, batch, probs)).astype(np.float32)  # [T,E]

    def predict_group(
        self, pairs: list[tuple[int, int]], batch: SourceBatch, bases: list[tuple[np.ndarray, np.ndarray]] | None = None
    ) -> list[np.ndarray]:
        """Scores [T,E] for every (target, S) in `pairs` from one source batch, with ONE forest call
        (the feature rows of all pairs stacked). `bases`: their (base, probs) if already computed."""
        assert self.rf is not None, "fit or load first"
        bases = bases if bases is not None else [self.base(t, batch) for t, _ in pairs]
        X = np.concatenate([self.features(t, s, batch, pr) for (t, s), (_, pr) in zip(pairs, bases)])
        d = self.rf.predict(X).astype(np.float32).reshape(len(pairs), batch.t, -1)
        return [np.clip(b + d[i], 0.0, None) + 1e-3 * pr + 1e-6 for i, (b, pr) in enumerate(bases)]

    def predict(self, target_layer: int, lookahead: int, batch: SourceBatch) -> torch.Tensor:
        return torch.from_numpy(self.predict_group([(target_layer, lookahead)], batch)[0])

    def runner(self) -> Any:
        """The run-time path: every (target, S) of a source layer in one call (`fast.ForestRunner`)."""
        from .fast_forest import ForestRunner

        return ForestRunner(self)

    def save(self, folder: Path) -> None:
        assert self.rf is not None, "fit first"
        self.rf.save(folder / FOREST_FILE)
        np.save(folder / "embedding.npy", self.table)
        savez_fast(folder / PRIOR_FILE, {"ids": self.prior_ids, "counts": self.prior_counts, "freq": self.prior_freq})
        (folder / "config.json").write_text(
            json.dumps(
                {
                    "features": FEATURES_VERSION,
                    "max_lookahead": self.max_lookahead,
                    "window": self.window,
                    "dim": self.dim,
                    "base": self.base_kind,
                    "fit_seconds": self.fit_seconds,
                    "n_estimators": self.rf.n_estimators,
                    "max_depth": self.rf.max_depth,
                }
            )
        )

    @classmethod
    def load(cls, folder: Path, model: torch.nn.Module) -> Forest:
        """Read a forest folder; nothing in it is unpickled (a legacy `forest.joblib` is refused)."""
        from .io import artifact_file, read_config

        if not (folder / FOREST_FILE).exists() and (folder / LEGACY_FILE).exists():
            raise ArtifactError(
                f"{folder / LEGACY_FILE} is a pickle, which moeflow no longer loads (it can run "
                f"code); re-run `moeflow train` to save the forest as {FOREST_FILE}"
            )
        c = read_config(folder, "a forest with features", FEATURES_VERSION)
        with artifact_file(folder / "config.json"):
            self = cls(model, int(c["max_lookahead"]), int(c["window"]), int(c["dim"]))
            self.base_kind = str(c["base"])
            if self.base_kind not in BASES:
                raise ValueError(f"base {self.base_kind!r}, expected one of {BASES}")
            self.fit_seconds = float(c.get("fit_seconds", 0.0))
        with artifact_file(folder / "embedding.npy"):
            table = np.load(folder / "embedding.npy", allow_pickle=False)
            if table.shape != self.table.shape or table.dtype != np.float32:
                raise ValueError(f"shape {table.shape} {table.dtype}, expected {self.table.shape} float32")
            self.table = table
        with artifact_file(folder / PRIOR_FILE):
            with np.load(folder / PRIOR_FILE, allow_pickle=False) as z:
                ids, counts, freq = z["ids"], z["counts"], z["freq"]
            L, E = len(self.spec.moe_layers), self.spec.num_experts
            if ids.ndim != 1 or counts.shape != (L, len(ids), E) or freq.shape != (L, E) or (np.diff(ids) <= 0).any():
                raise ValueError(
                    f"token prior shapes {ids.shape} {counts.shape} {freq.shape}, expected [U], [{L},U,{E}], [{L},{E}]"
                )
            self.prior_ids, self.prior_counts, self.prior_freq = (
                ids.astype(np.int64),
                counts.astype(np.float32),
                freq.astype(np.float32),
            )
        with artifact_file(folder / FOREST_FILE):
            self.rf = ArrayForest.load(folder / FOREST_FILE)
            if self.rf.n_features != self.n_features or self.rf.a["value"].shape[1] != self.spec.num_experts:
                raise ValueError(
                    f"{self.rf.n_features} features -> {self.rf.a['value'].shape[1]} experts, "
                    f"this model needs {self.n_features} -> {self.spec.num_experts}"
                )
        return self


def _no_router(batch: SourceBatch) -> SourceBatch:
    return SourceBatch(batch.layer, torch.zeros(0), batch.topk_ids, batch.topk_weights, None, batch.token_ctx, batch.history)
