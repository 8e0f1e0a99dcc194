"""`RunConfig`: everything `moeflow run` needs, frozen; the CLI only maps flags to it."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

MODES = ("offload", "resident", "on-demand")

_BYTES = re.compile(r"^(?P<n>[0-9]*\.?[0-9]+)\s*(?P<u>[kKmMgGtT]i?[bB])$")
_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


@dataclass(frozen=True)
class RunConfig:
    model: str
    prompts: str | None = None                    # file, short set name or HF dataset (moeflow.data.load_prompts)
    prompt: tuple[str, ...] = ()                  # literal prompt texts (--prompt, repeatable)
    data_dir: str | None = None
    split: str | None = None                      # split of a prompt set name (e.g. gsm8k: train/test)
    limit: int | None = None                      # at most this many prompts
    max_prompt_tokens: int = 256                  # longer prompts are truncated (first tokens kept)
    max_new_tokens: int = 32
    min_new_tokens: int | None = None             # set to max_new_tokens to ignore EOS (equal-length outputs)
    temperature: float = 0.0                      # 0 = greedy
    seed: int = 0
    modes: tuple[str, ...] = ("offload",)         # offload | resident | on-demand (several with --sweep)
    capacities: tuple[str, ...] = ("25%",)        # N experts, P% of all routed experts, or bytes (64MB)
    per_layer_cache: bool = False
    evictions: tuple[str, ...] = ("lru",)
    prefetches: tuple[str, ...] = ("pregate",)
    eviction_opts: tuple[tuple[str, str], ...] = ()
    prefetch_opts: tuple[tuple[str, str], ...] = ()
    miss: str = "fetch"
    routing: str = "standard"
    link: str = "auto"                            # auto | cuda | direct | emulated:GBPS[,LATENCY_US]
    lookahead: int | None = None                  # step size S; None = calibration's, else 1
    calibration: str | None = None                # calibration JSON; None = calibration/<device>.json
    dtype: str = "auto"
    device: str = "cpu"
    threads: int | None = None                    # torch intra-op threads (None = torch's default)
    out: str | None = None                        # JSONL: one line per prompt and run
    json: bool = False
    sweep: bool = False
    adaptive_s: bool = False                      # ExpertFlow's adaptive step size (stall / overfetch counters)
    speculative: bool = False                     # LOSSY: run the predicted experts instead of the router's

    def __post_init__(self) -> None:
        for m in self.modes:
            if m not in MODES:
                raise ConfigError(f"--mode {m!r} unknown; use one of {', '.join(MODES)}")
        if self.max_new_tokens < 1:
            raise ConfigError("--max-new-tokens must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ConfigError("--limit must be >= 1")
        if self.lookahead is not None and self.lookahead < 1:
            raise ConfigError("--lookahead must be >= 1")
        if self.temperature < 0:
            raise ConfigError("--temperature must be >= 0")
        if not self.sweep and max(len(self.modes), len(self.capacities), len(self.evictions), len(self.prefetches)) > 1:
            raise ConfigError("several modes / capacities / evictions / prefetches need --sweep")
        if not self.prompts and not self.prompt:
            raise ConfigError("give --prompts FILE|NAME or --prompt TEXT")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_capacity(spec: str, *, total_experts: int, expert_bytes: int) -> int:
    """`N` experts, `P%` of all routed experts (rounded), or a byte size (`64MB`, `1.5GiB`) -> experts."""
    s = str(spec).strip()
    try:
        if s.endswith("%"):
            p = float(s[:-1])
            if not 0 < p <= 100:
                raise ConfigError(f"--cache-capacity {spec!r}: a percentage must be in (0, 100]")
            return max(1, round(total_experts * p / 100))
        if s.isdigit():
            return int(s)
        m = _BYTES.match(s)
        if m:
            u = m["u"].lower()
            mult = _UNITS[u[0]] if "i" not in u else 1024 ** ("kmgt".index(u[0]) + 1)
            return int(float(m["n"]) * mult) // expert_bytes
    except ValueError:
        pass
    raise ConfigError(f"--cache-capacity {spec!r} not understood; use experts (48), a percentage (25%) "
                      f"or a size (64MB, 1.5GiB)")


def parse_opts(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    out = []
    for it in items:
        if "=" not in it:
            raise ConfigError(f"option {it!r} must look like key=value")
        k, v = it.split("=", 1)
        out.append((k.strip().replace("-", "_"), v.strip()))
    return tuple(out)


def opts_dict(opts: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """key=value strings -> typed kwargs (int, float, bool, None, else str)."""
    out: dict[str, Any] = {}
    for k, v in opts:
        low = v.lower()
        if low in ("true", "false"):
            out[k] = low == "true"
        elif low in ("none", "null"):
            out[k] = None
        else:
            for cast in (int, float):
                try:
                    out[k] = cast(v)
                    break
                except ValueError:
                    continue
            else:
                out[k] = v
    return out
