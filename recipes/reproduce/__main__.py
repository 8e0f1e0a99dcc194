"""python -m recipes.reproduce PAPER [--quick] [--device cpu|cuda] [--model DIR] [--data-dir DIR] [--root reports]"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from moeflow.report import Recipe

from . import PAPERS

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipes.reproduce", description=__doc__)
    ap.add_argument("paper", choices=sorted(PAPERS), help="which paper's tables and figures to reproduce")
    ap.add_argument("--quick", action="store_true", help="small prompt sets and few tokens: <= 10 min on 2 CPU cores")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--model", default=os.environ.get("MOEFLOW_MODEL", "models/olmoe-deep"), help="checkpoint folder")
    ap.add_argument("--data-dir", default=None, help="shared data folder (default: $MOEFLOW_DATA or ../shared/data)")
    ap.add_argument("--root", default="reports", help="reports/<paper>/ is written here; reports/_work/ caches artifacts")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per command (1 is fastest for the small models)")
    a = ap.parse_args(argv)
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: DEVICE=cuda but torch sees no CUDA device; use DEVICE=cpu or a CUDA build of torch", file=sys.stderr)
            return 2
    elif a.device != "cpu":
        print(f"error: --device {a.device}: use cpu or cuda", file=sys.stderr)
        return 2
    if not (REPO / a.model).is_dir() and not Path(a.model).is_dir():
        print(f"error: model folder {a.model} does not exist; pass MODEL=DIR (a local Hugging Face checkpoint)", file=sys.stderr)
        return 2
    data_dir = a.data_dir
    if data_dir is not None:
        if not Path(data_dir).is_dir():
            print(f"error: data folder {data_dir} does not exist; pass DATA=DIR (holding sharegpt/, ...)", file=sys.stderr)
            return 2
        if Path.cwd().resolve() != REPO:
            data_dir = os.path.abspath(data_dir)  # the recipe runs from the repository root
    root = Path(a.root) if Path.cwd().resolve() == REPO else Path(os.path.abspath(a.root))
    model = a.model if (REPO / a.model).is_dir() else os.path.abspath(a.model)
    os.chdir(REPO)
    mod = importlib.import_module(PAPERS[a.paper])
    r = Recipe(
        paper=a.paper,
        title=mod.TITLE,
        intro=getattr(mod, "INTRO", ""),
        quick=a.quick,
        device=a.device,
        model=model,
        data_dir=data_dir,
        threads=a.threads,
        root=root,
        repo=REPO,
    )
    try:
        return r.execute(mod.main)
    except KeyboardInterrupt:
        print(f"interrupted: {root / a.paper} was not changed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
