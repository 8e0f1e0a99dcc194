"""The random forest of `forest.py` as plain arrays: `fit_trees` fits scikit-learn regression trees as
`RandomForestRegressor` would, `ArrayForest` holds them as stacked node arrays, predicts exactly like it (a
compiled walk, `kernels.forest_walk`) and saves / loads them as an `.npz` of numeric arrays (`savez_fast`; no
pickle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

MIN_SPLIT_FEATURES = 32  # features tried per split at least (all if fewer): 32 of 500 within 0.5 recall points of 50, 25 lost 2


def savez_fast(path: Path, arrays: dict[str, Any]) -> None:
    """The file `np.savez_compressed(path, **arrays)` writes (an .npz of deflated .npy members, read back by
    `np.load`), deflated at zlib level 1 instead of numpy's 6: the quickstart forest's arrays (54k nodes, 27k
    leaves x 32 experts) take about a third of the time (0.12-0.15 s against 0.44 s) for 1.3 MB against 1.0."""
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name, a in arrays.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(a), allow_pickle=False)


class ArrayForest:
    """A fitted regression forest as plain arrays; predicts exactly like `RandomForestRegressor.predict`.

    All trees' nodes are stacked (node ids offset per tree): `left`/`right` children (-1 at a leaf),
    split `feature` and `threshold`, `nan_left` (where a NaN goes), `leaf` (row of `value` at a leaf,
    -1 inside) and `value` [n_leaves, E] (float64 leaf means); `roots` [n_trees] holds each tree's root.
    """

    FIELDS = ("left", "right", "feature", "threshold", "nan_left", "leaf", "value", "roots")

    def __init__(self, arrays: dict[str, np.ndarray], n_features: int, max_depth: int | None):
        self.a = arrays
        self.n_features = n_features
        self.max_depth = max_depth
        self.n_estimators = len(arrays["roots"])
        a = arrays  # [N,6] one float64 row per node for the compiled walk (`kernels.forest_walk`)
        cols = ("left", "right", "feature", "leaf", "nan_left", "threshold")
        self.nodes = np.stack([a[k].astype(np.float64) for k in cols], 1)

    @classmethod
    def from_sklearn(cls, rf: Any) -> ArrayForest:
        parts: dict[str, list[np.ndarray]] = {k: [] for k in cls.FIELDS}
        off = n_leaves = 0
        for est in rf.estimators_:
            t = est.tree_
            left, right = t.children_left.astype(np.int64), t.children_right.astype(np.int64)
            is_leaf = left == -1
            parts["left"].append(np.where(is_leaf, -1, left + off))
            parts["right"].append(np.where(is_leaf, -1, right + off))
            parts["feature"].append(np.where(is_leaf, 0, t.feature).astype(np.int64))
            parts["threshold"].append(t.threshold.astype(np.float64))
            mgl = getattr(t, "missing_go_to_left", None)
            parts["nan_left"].append(np.zeros(t.node_count, bool) if mgl is None else np.asarray(mgl, bool))
            leaf = np.full(t.node_count, -1, np.int64)
            leaf[is_leaf] = n_leaves + np.arange(int(is_leaf.sum()))
            parts["leaf"].append(leaf)
            parts["value"].append(t.value[is_leaf, :, 0].astype(np.float64))  # [leaves,E]
            parts["roots"].append(np.array([off], np.int64))
            off += t.node_count
            n_leaves += int(is_leaf.sum())
        return cls({k: np.concatenate(v) for k, v in parts.items()}, int(rf.n_features_in_), rf.max_depth)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """[T,F] -> [T,E] float64: the mean over trees of the leaf each row reaches (`kernels.forest_walk`, compiled;
        features compared as float32, as scikit-learn does)."""
        from .kernels import forest_walk

        a = self.a
        X = np.ascontiguousarray(X, dtype=np.float32)
        return forest_walk(X, self.nodes, a["value"], a["roots"])

    def save(self, path: Path) -> None:
        arrays = {
            **self.a,
            "n_features": np.int64(self.n_features),
            "max_depth": np.int64(-1 if self.max_depth is None else self.max_depth),
        }
        savez_fast(path, arrays)

    @classmethod
    def load(cls, path: Path) -> ArrayForest:
        """Read `forest.npz` (numeric arrays only, no pickle) and check it is a well-formed forest."""
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in (*cls.FIELDS, "n_features", "max_depth") if k not in z.files]
            if missing:
                raise ValueError(f"no {missing[0]} array")
            a = {k: z[k] for k in cls.FIELDS}
            n_features, depth = int(z["n_features"]), int(z["max_depth"])
        n, n_leaves = len(a["left"]), len(a["value"])
        ok = (
            all(len(a[k]) == n for k in ("right", "feature", "threshold", "nan_left", "leaf"))
            and a["value"].ndim == 2
            and len(a["roots"]) > 0
            and all(a[k].dtype.kind == "i" for k in ("left", "right", "feature", "leaf", "roots"))
            and ((a["left"] >= -1) & (a["left"] < n) & (a["right"] >= -1) & (a["right"] < n)).all()
            and ((a["roots"] >= 0) & (a["roots"] < n)).all()
            and ((a["feature"] >= 0) & (a["feature"] < n_features)).all()
            and ((a["left"] >= 0) == (a["right"] >= 0)).all()
            and ((a["left"] >= 0) | ((a["leaf"] >= 0) & (a["leaf"] < n_leaves))).all()
            and ((a["left"] < 0) | (a["left"] > np.arange(n))).all()  # children after parents: no loops
            and ((a["right"] < 0) | (a["right"] > np.arange(n))).all()
        )
        if not ok:
            raise ValueError("inconsistent tree arrays")
        return cls(a, n_features, None if depth < 0 else depth)


class _Trees:
    """What `ArrayForest.from_sklearn` reads of a fitted forest: its trees, feature count and depth limit."""

    def __init__(self, trees: list[Any], n_features: int, max_depth: int | None):
        self.estimators_, self.n_features_in_, self.max_depth = trees, n_features, max_depth


def fit_trees(X: np.ndarray, Y: np.ndarray, cfg: Any, n_features: int) -> _Trees:
    """A random forest of `cfg.forest_trees` scikit-learn regression trees (MSE) on X [n,F] float32 -> Y [n,E], as
    `RandomForestRegressor(max_samples=...)` fits it: each tree on a bootstrap draw of `cfg.forest_tree_samples`
    rows of the pool (all n when fewer), the rows drawn more than once weighted by their count, a random subset of
    the features tried per split. Each tree gets its draw as a compact copy X[rows] [<=draw,F] instead of weights
    over the whole pool: the splitter then reads rows of a 24 MB copy instead of rows scattered over the pool
    (n x F x 4 bytes, 240 MB by default): about a fifth less CPU time for the trees on the quickstart trace.
    `cfg.threads` trees fit at once (the splitter releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    from sklearn.tree import DecisionTreeRegressor

    n = len(X)
    draw = min(cfg.forest_tree_samples, n)
    rng = np.random.default_rng(cfg.seed)
    seeds = rng.integers(0, 2**31 - 1, cfg.forest_trees)
    max_features = min(n_features, max(MIN_SPLIT_FEATURES, round(cfg.forest_max_features * n_features)))

    def one(t: int) -> Any:
        r = np.random.default_rng(int(seeds[t]))
        rows, counts = np.unique(r.integers(0, n, draw), return_counts=True)  # [u] the bootstrap draw, with repeats
        tree = DecisionTreeRegressor(
            max_depth=cfg.forest_depth or None,
            min_samples_leaf=cfg.forest_min_leaf,
            max_features=max_features,
            random_state=int(seeds[t]),
        )
        return tree.fit(X[rows], Y[rows], sample_weight=counts.astype(np.float64))  # X[rows]: [u,F] contiguous

    workers = max(1, int(cfg.threads or 1))
    if workers == 1:
        trees = [one(t) for t in range(cfg.forest_trees)]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            trees = list(pool.map(one, range(cfg.forest_trees)))
    return _Trees(trees, n_features, cfg.forest_depth or None)
