"""Trivial baselines every learned predictor must beat (fitted on the training split, saved like predictors).

- `frequency`: global expert frequency of the target layer (the same scores for every token).
- `token-id`: the most frequent experts per (token id, target layer); unseen ids fall back to `frequency`.
Neither looks at the source layer, so their recall does not depend on S.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from .base import PREDICTORS
from .data import RoutingData, SourceBatch


def _counts(ids: np.ndarray, E: int) -> np.ndarray:
    return np.bincount(ids.reshape(-1), minlength=E).astype(np.float64)


@PREDICTORS.register
class Frequency:
    name: ClassVar[str] = "frequency"
    needs_hidden: ClassVar[bool] = False

    def __init__(self, model: torch.nn.Module | None = None, max_lookahead: int = 4):
        self.max_lookahead = max_lookahead
        self.freq: dict[int, np.ndarray] = {}  # layer -> [E] probabilities

    @classmethod
    def create(cls, model, cfg: Any) -> Frequency:
        return cls(model, cfg.max_s)

    def fit(self, data: RoutingData, model, cfg: Any) -> None:
        E = data.spec.num_experts
        for l, a in data.layers.items():
            c = _counts(a.topk_ids, E) + 1e-3
            self.freq[l] = (c / c.sum()).astype(np.float32)

    def predict(self, target_layer: int, lookahead: int, batch: SourceBatch) -> torch.Tensor:
        return torch.from_numpy(np.tile(self.freq[target_layer], (batch.t, 1)))

    def save(self, folder: Path) -> None:
        # numpy's stub types **kwds next to `allow_pickle: bool`, and mypy checks an unpacked dict against both
        np.savez(folder / "frequency.npz", **{str(l): v for l, v in self.freq.items()})  # type: ignore[arg-type]
        (folder / "config.json").write_text(json.dumps({"max_lookahead": self.max_lookahead}))

    @classmethod
    def load(cls, folder: Path, model) -> Frequency:
        self = cls(model, json.loads((folder / "config.json").read_text())["max_lookahead"])
        with np.load(folder / "frequency.npz") as z:
            self.freq = {int(l): z[l] for l in z.files}
        return self


@PREDICTORS.register
class TokenId:
    name: ClassVar[str] = "token-id"
    needs_hidden: ClassVar[bool] = False

    def __init__(self, model: torch.nn.Module | None = None, max_lookahead: int = 4):
        self.max_lookahead = max_lookahead
        self.freq = Frequency(model, max_lookahead)
        self.table: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layer -> (sorted token ids [U], probs [U,E])

    @classmethod
    def create(cls, model, cfg: Any) -> TokenId:
        return cls(model, cfg.max_s)

    def fit(self, data: RoutingData, model, cfg: Any) -> None:
        self.freq.fit(data, model, cfg)
        E = data.spec.num_experts
        uniq, inv = np.unique(data.token_id, return_inverse=True)
        for l, a in data.layers.items():
            c = np.zeros((len(uniq), E), dtype=np.float64)
            np.add.at(c, (np.repeat(inv, a.topk_ids.shape[1]), a.topk_ids.reshape(-1)), 1.0)
            c += 1e-3 * self.freq.freq[l][None]  # ties and sparse rows follow global frequency
            self.table[l] = (uniq, (c / c.sum(1, keepdims=True)).astype(np.float32))

    def predict(self, target_layer: int, lookahead: int, batch: SourceBatch) -> torch.Tensor:
        uniq, probs = self.table[target_layer]
        if batch.token_ctx is None:  # no token ids (a run-time batch without them): global frequency
            return self.freq.predict(target_layer, lookahead, batch)
        tok = batch.token_ctx[:, -1].numpy()
        pos = np.clip(np.searchsorted(uniq, tok), 0, len(uniq) - 1)
        known = uniq[pos] == tok
        out = np.where(known[:, None], probs[pos], self.freq.freq[target_layer][None])
        return torch.from_numpy(out.astype(np.float32))

    def save(self, folder: Path) -> None:
        self.freq.save(folder)
        arrays = {
            **{f"ids_{l}": u for l, (u, _) in self.table.items()},
            **{f"p_{l}": p for l, (_, p) in self.table.items()},
        }
        np.savez(folder / "token_id.npz", **arrays)  # type: ignore[arg-type]  # numpy stub: see Frequency.save

    @classmethod
    def load(cls, folder: Path, model) -> TokenId:
        self = cls(model)
        self.freq = Frequency.load(folder, model)
        self.max_lookahead = self.freq.max_lookahead
        with np.load(folder / "token_id.npz") as z:
            layers = {int(n.split("_")[1]) for n in z.files}
            self.table = {l: (z[f"ids_{l}"], z[f"p_{l}"]) for l in layers}
        return self
