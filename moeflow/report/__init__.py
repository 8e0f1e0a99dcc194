"""Reproduction reports: the mechanism behind `make reproduce-<paper>` (recipes/reproduce/).

- `Recipe` runs the project's own commands (`moeflow ...`, `python benchmarks/...`) as subprocesses,
  records each exact command, keeps its raw output and JSON, reuses shared artifacts (trace, predictors,
  calibration) between recipes, and never turns a failed or missing step into a number;
- `Table` lays a paper's table out with the paper's published numbers beside ours;
- `environment()` records what the numbers were measured on;
- `Recipe.publish()` writes `reports/<paper>/` (README.md, PNGs, raw/, commands.sh, environment.json,
  results.json) in one atomic step.
"""

from .env import environment
from .recipe import Recipe, StepFailed
from .table import Table, fmt

__all__ = ["Recipe", "StepFailed", "Table", "environment", "fmt"]
