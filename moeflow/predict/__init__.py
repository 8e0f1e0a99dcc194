"""Layer-ahead expert predictors behind one Protocol (fit / predict / save / load), and their evaluation.

Importing the package registers every predictor in `PREDICTORS`: `pregate`, `router-pf`, `estimator`,
`hybrid`, `forest`, and the baselines `frequency` and `token-id`.
"""

from . import baselines, default_vectors, estimator, forest, hybrid, pregate  # noqa: F401  (registration)
from .base import PREDICTORS, Predictor
from .data import RoutingData, SourceBatch, batch_from_rows, from_trace
from .io import load_predictors, save_predictors

__all__ = [
    "PREDICTORS",
    "Predictor",
    "RoutingData",
    "SourceBatch",
    "batch_from_rows",
    "from_trace",
    "load_predictors",
    "save_predictors",
]
