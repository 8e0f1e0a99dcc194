"""Shared fixtures: tiny random MoE models from real transformers configs, the shared data dir."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Tiny models decode far faster on one thread (thread-pool wake-ups dominate their small ops).
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
ARCHS = ("olmoe", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "granitemoe", "phimoe")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not beside the checkout")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_models():
    """arch -> tiny random model (built once per session)."""
    from moeflow.models import tiny_model

    cache: dict[str, torch.nn.Module] = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = tiny_model(arch)
        return cache[arch]

    return get
