"""TraceConfig: everything `moeflow trace` needs, as one frozen dataclass (the CLI builds it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError


@dataclass(frozen=True)
class TraceConfig:
    model: str  # local checkpoint folder
    prompts: str  # file path, short set name or HF dataset name
    out: str  # trace folder (created, or appended to)
    max_new_tokens: int = 32  # decode steps per prompt
    limit: int | None = None  # at most this many prompts (after deduplication)
    record_hidden: bool = False  # also store router input and post-attention residual
    hidden_dtype: str = "float16"  # storage of the hidden states: float16, or float32 (exact for fp32/bf16 models)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0  # per-prompt seed = seed + hash(prompt) (sampling only)
    max_prompt_tokens: int = 256  # longer prompts are truncated (keep the beginning)
    data_dir: str | None = None
    split: str | None = None  # split of a short set name or HF dataset
    column: str | None = None  # prompt field of csv/tsv/json/jsonl records (None: detected)
    dtype: str = "auto"
    device: str = "cpu"
    shard_size: int | None = None  # token records per Arrow shard (None: about 256 MiB); closes at a prompt boundary
    threads: int | None = None  # torch intra-op threads (None: the rule of moeflow.threads)
    progress: bool = True
    wait: bool = False  # wait for another writer of `out` instead of refusing (moeflow.locks.out_lock)

    def __post_init__(self) -> None:
        if not self.prompts or not self.out:
            raise ConfigError(
                "moeflow trace needs --prompts and --out; see `moeflow trace --help` (`moeflow inspect DIR` summarises a trace)"
            )
        if self.hidden_dtype not in ("float16", "float32"):
            raise ConfigError(f"--hidden-dtype must be float16 or float32 (got {self.hidden_dtype!r})")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1 (got {self.max_new_tokens})")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1 (got {self.limit})")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0 = greedy; got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"--repetition-penalty must be > 0 (got {self.repetition_penalty})")
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"--max-prompt-tokens must be >= 1 (got {self.max_prompt_tokens})")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1 (got {self.threads})")
        if self.shard_size is not None and self.shard_size < 1:
            raise ConfigError(f"--shard-size must be >= 1 record (got {self.shard_size})")

    def preflight(self) -> None:
        """What depends on this machine, checked before anything loads: the device."""
        from ..checks import check_device

        check_device(self.device)

    def generation(self) -> dict[str, Any]:
        """The settings that shape the generated tokens (stored in meta.json)."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "max_prompt_tokens": self.max_prompt_tokens,
            "do_sample": self.temperature > 0,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TraceConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
