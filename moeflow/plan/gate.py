"""CasMoE's cascade planner: EAM when its best cosine similarity is >= eps, else EAP.

`CascadePlanner.plan(texts)` -> one `Plan` per prompt: the pattern EP [L,K] (normalised scale), which path
served it (`eam` / `eap`), the best similarity and the planner's time for that prompt (embedding,
retrieval and, on the EAP path, the EAP forward). A plan is turned into experts per layer by top-k
(`Plan.topk(k)`) or by cumulative mass (`Plan.mass_set(m)`).

With only one of the two fitted, that one serves every prompt. `fit_planner` builds both from a
`RoutingData` (labels: `moeflow.plan.labels`), `evaluate_plans` scores plans against the true EPs:
per-layer recall@k (overlap of top-k sets), precision / recall / size of the mass set, and the EAM /
EAP split. Files: `<predictors>/eam/`, `<predictors>/eap/` (see `eam.py`, `eap.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArtifactError, ConfigError
from .eam import EAM, Embedder
from .eap import EAP, EAPConfig, topk_recall
from .labels import normalize

DEFAULT_EPS = 0.3


@dataclass
class Plan:
    ep: np.ndarray  # [L,K]
    path: str  # "eam" | "eap"
    best_sim: float
    ms: float  # planner time for this prompt

    def topk(self, k: int) -> np.ndarray:
        """[L,k] expert ids, highest predicted pattern first."""
        return np.argsort(-self.ep, axis=-1, kind="stable")[:, :k]

    def mass_set(self, mass: float) -> list[np.ndarray]:
        """Per layer the experts in descending score up to cumulative share `mass` of the layer's pattern."""
        out = []
        for row in np.maximum(self.ep, 0):
            order = np.argsort(-row, kind="stable")
            c = np.cumsum(row[order]) / max(float(row.sum()), 1e-12)
            out.append(order[: int(np.searchsorted(c, mass - 1e-9)) + 1])
        return out


@dataclass
class CascadePlanner:
    eam: EAM | None
    eap: EAP | None
    embedder: Embedder | None
    eps: float = DEFAULT_EPS
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.eam is None and self.eap is None:
            raise ConfigError("the CasMoE planner needs an EAM or an EAP (`moeflow train --only eam --only eap`)")
        if self.eam is not None and self.embedder is None:
            raise ConfigError("the EAM needs its sentence-transformers embedder")

    def plan(self, texts: list[str]) -> list[Plan]:
        out = []
        for t in texts:  # one prompt at a time: what the planner costs a request
            t0 = time.perf_counter()
            sim, ep, path = -1.0, None, "eap"
            if self.eam is not None and self.embedder is not None:
                m = self.eam.query(self.embedder.encode([t]))[0]
                sim = m.best_sim
                if sim >= self.eps or self.eap is None:
                    ep, path = m.ep, "eam"
            if ep is None:
                assert self.eap is not None
                ep = self.eap.predict([t])[0]
            out.append(Plan(ep, path, sim, (time.perf_counter() - t0) * 1e3))
        return out

    def observe(self, text: str, ep: np.ndarray) -> bool:
        """Feed an observed (prompt, raw EP) pair to the EAM's buffer; True when the buffer was flushed."""
        if self.eam is None or self.embedder is None:
            return False
        return self.eam.add(self.embedder.encode([text]), normalize(ep, "mean1"))

    @classmethod
    def load(
        cls, folder: str | Path, *, fingerprint: str | None, eps: float = DEFAULT_EPS, embedder: Embedder | None = None
    ) -> CascadePlanner:
        """The planner in a predictor folder (`eam/`, `eap/`, whichever exist)."""
        folder = Path(folder)
        eam = eap = None
        info: dict[str, Any] = {}
        if (folder / "eam").exists():
            eam, info["eam"] = EAM.load(folder / "eam", fingerprint=fingerprint)
            if embedder is None:
                p = info["eam"].get("embedder_path")
                embedder = Embedder(p if p and Path(p).is_dir() else None)
            if embedder.dim != eam.dim:
                raise ArtifactError(f"{folder}/eam holds {eam.dim}-d keys but the embedder gives {embedder.dim}-d embeddings")
        if (folder / "eap").exists():
            eap, info["eap"] = EAP.load(folder / "eap", fingerprint=fingerprint)
        if eam is None and eap is None:
            raise ArtifactError(f"{folder} holds no CasMoE planner (no eam/ or eap/); run `moeflow train --only eam --only eap`")
        return cls(eam, eap, embedder, eps, info)


def fit_eam(
    texts: list[str], ep: np.ndarray, embedder: Embedder, *, k_prime: int = 3, weighted: bool = False, buffer_size: int = 30
) -> EAM:
    """An EAM over (texts, raw EP [n,L,K]); values are stored normalised (mean 1 per layer)."""
    _, L, K = ep.shape
    eam = EAM(embedder.dim, L, K, k_prime=k_prime, weighted=weighted, buffer_size=buffer_size)
    return eam.build(embedder.encode(texts), normalize(ep, "mean1"))


def fit_eap(
    texts: list[str],
    ep: np.ndarray,
    cfg: EAPConfig,
    *,
    k: int,
    val: tuple[list[str], np.ndarray] | None = None,
    minilm_dir: str | None = None,
    progress: Any = None,
) -> EAP:
    _, L, K = ep.shape
    eap = EAP.create(cfg, L, K, minilm_dir)
    v = None if val is None else (val[0], normalize(val[1], "mean1"))
    eap.fit(texts, normalize(ep, "mean1"), val=v, k=k, progress=progress)
    return eap


def evaluate_plans(
    plans: list[Plan], true_ep: np.ndarray, *, k: int, mass: float = 0.8, baseline: np.ndarray | None = None
) -> dict:
    """Per-layer recall@k (top-k overlap / k; precision@k is the same number, both sets have k members),
    precision / recall / size of the predicted mass-`mass` set against the true one, the EAM / EAP split
    and planner ms; `baseline` [L,K] (e.g. the training prompts' mean pattern) is scored too."""
    if not plans:
        return {}
    pred = np.stack([p.ep for p in plans])
    true = np.asarray(true_ep, dtype=np.float64)
    rep: dict[str, Any] = {"k": k, "mass": mass, "prompts": len(plans)}
    rep["recall_at_k"] = [round(float(x), 4) for x in topk_recall(pred, true, k)]
    L = true.shape[1]
    prec, rec, size = np.zeros(L), np.zeros(L), np.zeros(L)
    for p, t in zip(plans, true):
        ts = Plan(t.astype(np.float32), "", 0.0, 0.0).mass_set(mass)
        for l, (a, b) in enumerate(zip(p.mass_set(mass), ts)):
            inter = len(np.intersect1d(a, b))
            prec[l] += inter / max(len(a), 1)
            rec[l] += inter / max(len(b), 1)
            size[l] += len(a)
    n = len(plans)
    rep["mass_precision"] = [round(float(x / n), 4) for x in prec]
    rep["mass_recall"] = [round(float(x / n), 4) for x in rec]
    rep["mass_set_size"] = [round(float(x / n), 2) for x in size]
    paths = [p.path for p in plans]
    rep["split"] = {"eam": paths.count("eam"), "eap": paths.count("eap")}
    for path in ("eam", "eap"):
        sel = [i for i, p in enumerate(paths) if p == path]
        if sel:
            rep[f"recall_at_k_{path}"] = [round(float(x), 4) for x in topk_recall(pred[sel], true[sel], k)]
    ms = np.array([p.ms for p in plans])
    rep["ms_per_prompt"] = {"mean": round(float(ms.mean()), 3), "p50": round(float(np.median(ms)), 3)}
    for path in ("eam", "eap"):
        ms_path = [p.ms for p in plans if p.path == path]
        if ms_path:
            rep["ms_per_prompt"][path] = round(float(np.mean(ms_path)), 3)
    if baseline is not None:
        b = np.broadcast_to(np.asarray(baseline, dtype=np.float64), true.shape)
        rep["baseline_recall_at_k"] = [round(float(x), 4) for x in topk_recall(b, true, k)]
    rep["chance_recall_at_k"] = round(k / true.shape[-1], 4)
    return rep
