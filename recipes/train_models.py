"""Train the project's embedded MoE language models on CPU: models/olmoe-deep, models/olmoe-mini and models/mixtral-mini.

    .venv/bin/python recipes/train_models.py --data-dir ../shared/data --out models
    .venv/bin/python recipes/train_models.py --only olmoe-mini --minutes 25 --threads 1
    .venv/bin/python recipes/train_models.py --tiny --out /tmp/models          # seconds-long smoke run
    .venv/bin/python recipes/train_models.py --card-only                         # rewrite the model cards

Without --only, every model trains at the same time, each in a process of its own (each with --threads threads).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NAMES = ("olmoe-mini", "olmoe-deep", "mixtral-mini")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data-dir",
        default=str(REPO.parent / "shared" / "data"),
        help="shared data folder (default: ../shared/data beside the repo)",
    )
    p.add_argument("--out", default=str(REPO / "models"), help="parent folder of the model folders (default: models)")
    p.add_argument("--only", choices=NAMES, help="train one model only (default: all of them, concurrently)")
    p.add_argument(
        "--minutes",
        type=float,
        default=25.0,
        help="wall-clock training budget per model, minutes (default 25; 0 = none, give --steps)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="step budget instead of / besides --minutes (with --minutes 0 the run is step-deterministic)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per model (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of init, data order and card statistics (default 0)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--lr", type=float, default=2.5e-3, help="peak learning rate (default 2.5e-3)")
    p.add_argument("--balance-coef", type=float, default=0.01, help="per-layer balance loss weight (default 0.01)")
    p.add_argument("--z-coef", type=float, default=1e-3, help="router z-loss weight (default 1e-3)")
    p.add_argument("--tiny", action="store_true", help="tiny smoke configuration (2 layers, vocab 512, 20 steps)")
    p.add_argument("--log-dir", default=str(REPO / ".work" / "lmtrain"), help="where training logs go")
    p.add_argument("--card-only", action="store_true", help="only (re)write README.md of already saved models")
    p.add_argument("--no-card", action="store_true", help="skip the model card after training")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def child_argv(a: argparse.Namespace, name: str) -> list[str]:
    argv = [
        sys.executable,
        __file__,
        "--only",
        name,
        "--data-dir",
        a.data_dir,
        "--out",
        a.out,
        "--minutes",
        str(a.minutes),
        "--threads",
        str(a.threads),
        "--seed",
        str(a.seed),
        "--batch-size",
        str(a.batch_size),
        "--seq-len",
        str(a.seq_len),
        "--lr",
        str(a.lr),
        "--balance-coef",
        str(a.balance_coef),
        "--z-coef",
        str(a.z_coef),
        "--log-dir",
        a.log_dir,
    ]
    if a.steps is not None:
        argv += ["--steps", str(a.steps)]
    return argv + (["--tiny"] if a.tiny else []) + (["--no-card"] if a.no_card else [])


def main(argv=None) -> int:
    a = parse(argv)
    names = [a.only] if a.only else list(NAMES)
    if a.card_only:
        import torch

        from moeflow.lmtrain.build import val_tokens_for
        from moeflow.lmtrain.modelcard import write_card

        torch.set_num_threads(a.threads)
        for name in names:
            folder = Path(a.out) / name
            write_card(folder, val_tokens_for(folder, a.data_dir), seed=a.seed, log=log)
            log(f"wrote {folder / 'README.md'}")
        return 0
    if len(names) > 1:
        procs = [subprocess.Popen(child_argv(a, n)) for n in names]
        return max(p.wait() for p in procs)

    from moeflow.lmtrain.build import BuildConfig, build

    if a.minutes <= 0 and not a.steps and not a.tiny:
        print("error: --minutes 0 needs --steps N", file=sys.stderr)
        return 2
    from moeflow.lmtrain.loop import LMTrainConfig

    tiny = a.tiny
    tc = LMTrainConfig(
        seq_len=64 if tiny else a.seq_len,
        batch_size=4 if tiny else a.batch_size,
        lr=a.lr,
        warmup_steps=5 if tiny else 30,
        minutes=None if tiny or a.minutes <= 0 else a.minutes,
        max_steps=(a.steps or 20) if tiny else a.steps,
        balance_coef=a.balance_coef,
        z_coef=a.z_coef,
        seed=a.seed,
        eval_every_s=1e9 if tiny else 300.0,
    )
    build(
        BuildConfig(
            name=names[0],
            data_dir=a.data_dir,
            out=a.out,
            log_dir=a.log_dir,
            train=tc,
            threads=a.threads,
            tiny=tiny,
            card=not a.no_card,
        ),
        log=log,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
