"""What a report's numbers were measured on: code version, libraries, CPU/GPU, load."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from .. import __version__
from ..artifacts import now_iso


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(repo: str | os.PathLike = ".", device: str = "cpu") -> dict[str, Any]:
    """One JSON-able dict: git commit (and whether the tree had changes), versions, CPU, GPU, load."""
    import torch
    import transformers

    repo = Path(repo)
    status = _git(repo, "status", "--porcelain", "--untracked-files=no")
    env: dict[str, Any] = {
        "time": now_iso(),
        # MOEFLOW_GIT_COMMIT: the commit a copied tree was made from (its own .git, if any, may be stale or absent)
        "git_commit": os.environ.get("MOEFLOW_GIT_COMMIT") or _git(repo, "rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "moeflow": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "device": device,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env
