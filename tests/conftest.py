"""Shared fixtures: tiny random MoE models from real transformers configs, the shared data dir."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Tiny models decode far faster on one thread (thread-pool wake-ups dominate their small ops).
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
ARCHS = (
    *("olmoe", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "granitemoe", "phimoe"),
    *(
        "deepseek_v2",
        "glm4_moe",
        "glm4_moe_lite",
        "dots1",
        "exaone_moe",
        "solar_open",
        "qwen3_next",
        "qwen3_5_moe_text",
        "ernie4_5_moe",
        "hunyuan_v1_moe",
    ),
)


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


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A saved tiny OLMoE checkpoint (8 experts, top-2) with a trained tokenizer, built once per session: read only."""
    from moeflow.lmtrain.tokenizer import train_tokenizer
    from moeflow.models import tiny_model

    d = tmp_path_factory.mktemp("tiny_ckpt")
    text = ["the king said to the queen that the night was long", "to be or not to be, that is the question"] * 20
    train_tokenizer(text, vocab_size=200).save_pretrained(d)
    tiny_model("olmoe", num_experts=8, top_k=2).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def ckpt_with(tmp_path_factory, tiny_checkpoint):
    """`ckpt_with(name=text, ...)` -> a folder's `model` (a link to `tiny_checkpoint`) with those files beside it."""

    def make(**files: str) -> Path:
        d = tmp_path_factory.mktemp("ckpt")
        model = d / "model"
        model.symlink_to(tiny_checkpoint, target_is_directory=True)
        for name, text in files.items():
            (d / name.replace("_", ".")).write_text(text)
        return model

    return make


@pytest.fixture(autouse=True)
def _unfrozen_heap():
    """A command run in-process freezes the heap (`moeflow.runtime.timing.settle_heap`, as the CLI process would
    once); the suite's process runs many, so each test hands the frozen objects back to the collector."""
    import gc

    yield
    if gc.get_freeze_count():
        gc.unfreeze()
