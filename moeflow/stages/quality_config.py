"""`QualityConfig`: a `RunConfig` (the configurations to compare, checked by RunConfig itself) plus what
`moeflow quality` measures. Miss and routing policies may be swept here (`name[:key=value,...]` each); every
one is checked through `RunConfig` and its registry before anything loads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..policies.lossy import Lossy
from ..policies.parse import parse_policy
from .run_config import RunConfig

TASKS = ("mmlu", "gsm8k", "none")
TEXTS = ("wikitext2", "wikitext2-test")  # named text sets; anything else is a text file


def build_named(kind: str, text: str) -> Any:
    """The miss / routing policy `text` (`name[:key=value,...]`) from its registry (one line if it is refused)."""
    from ..policies import MISS, ROUTING

    name, opts = parse_policy(text)
    return (MISS if kind == "miss" else ROUTING).create(name, **opts)


def is_lossy(run: RunConfig, miss: str, routing: str, device_type: str, r: dict[str, Any] | None = None) -> Lossy:
    """Whether the configuration (`run` with this miss / routing policy; `r`: one run of its sweep) can change
    the model's output on a `device_type` device: `RunConfig.lossy`, the one answer `moeflow run` gives too."""
    return run_config_for(run, miss, routing).lossy(device_type, r)


def run_config_for(run: RunConfig, miss: str, routing: str) -> RunConfig:
    """`run` with this miss / routing policy; its inline options join RunConfig's `miss_opts` / `routing_opts`
    (`--miss-opt` / `--routing-opt`), winning over them as in `moeflow run`."""
    kw: dict[str, Any] = {}
    for key, text, given in (("miss", miss, run.miss_opts), ("routing", routing, run.routing_opts)):
        name, opts = parse_policy(text)
        kw[key] = name
        kw[f"{key}_opts"] = tuple({**dict(given), **{k: str(v) for k, v in opts.items()}}.items())
    return dataclasses.replace(run, **kw)


@dataclass(frozen=True)
class QualityConfig:
    run: RunConfig  # prompts, modes / capacities / policies (sweep), link, device, ... (resident is implicit)
    misses: tuple[str, ...] = ("fetch",)  # miss policies to compare (name[:k=v,...]); several with --sweep
    routings: tuple[str, ...] = ("standard",)  # routing policies to compare (name[:k=v,...]); several with --sweep
    text: str = "wikitext2"  # perplexity text: wikitext2 (held-out docs), wikitext2-test, or a text file
    ppl_tokens: int = 256  # scored tokens per window (one forward per token, KV cache kept within a window)
    ppl_windows: int = 4
    task: str = "mmlu"  # mmlu | gsm8k | none
    task_limit: int = 40  # questions
    task_new_tokens: int = 96  # gsm8k: greedy tokens per answer

    def __post_init__(self) -> None:
        if self.ppl_tokens < 1 or self.ppl_windows < 0:
            raise ConfigError(f"--ppl-tokens must be >= 1 and --ppl-windows >= 0 (got {self.ppl_tokens}, {self.ppl_windows})")
        if self.task not in TASKS:
            raise ConfigError(f"--task {self.task!r} unknown; use one of {', '.join(TASKS)}")
        if self.task_limit < 1 or self.task_new_tokens < 1:
            raise ConfigError(f"--task-limit and --task-new-tokens must be >= 1 (got {self.task_limit}, {self.task_new_tokens})")
        if not self.misses or not self.routings:
            raise ConfigError("--miss and --routing need at least one value each")
        if not self.run.sweep and (len(self.misses) > 1 or len(self.routings) > 1):
            raise ConfigError("several miss / routing policies need --sweep")
        spec = self.run.plan_spec()  # RunConfig checked --plan / --plan-opt
        if spec is not None and spec.update:
            raise ConfigError("--plan-opt update=true changes the EAM while it is measured; it is `moeflow run`'s")
        if not self.text:
            raise ConfigError("--text needs a set name (wikitext2, wikitext2-test) or a text file")
        for m in self.misses:
            for r in self.routings:
                run_config_for(self.run, m, r)  # RunConfig's checks (names, speculative's needs)
                build_named("miss", m)  # the options too
                build_named("routing", r)

    def preflight(self) -> None:
        from pathlib import Path

        self.run.preflight()
        if self.text not in TEXTS and not Path(self.text).is_file():
            raise ConfigError(f"--text {self.text!r} is neither {' nor '.join(TEXTS)} nor a text file")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
