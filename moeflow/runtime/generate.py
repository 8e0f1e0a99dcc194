"""The generate loop: one prompt at a time (batch 1), timed per forward pass, with per-phase cache counters.

`build_engine(model, mode=...)` turns a mode and policy names into an `OffloadEngine` (or None for
`resident`, the stock model); `generate_one(model, input_ids, engine)` runs `model.generate` and
returns the new token ids and a `RunMetrics` for that prompt.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..moe import get_adapter
from ..policies import EVICTION, MISS, PREFETCH, ROUTING, Registry
from .engine import OffloadEngine, PassStats
from .link import Link
from .metrics import RunMetrics


def create_policy(registry: Registry, name: str, opts: dict[str, Any] | None = None) -> Any:
    """`registry.create(name, **opts)` (importing `moeflow.policies` registered every built-in)."""
    try:
        return registry.create(name, **(opts or {}))
    except TypeError as e:
        raise ConfigError(f"{registry.kind} policy {name!r} does not take options {sorted(opts or {})}: {e}") from e


def build_engine(
    model: nn.Module,
    *,
    mode: str,
    link: Link,
    capacity: int = 0,
    eviction: str = "lru",
    prefetch: str = "none",
    miss: str = "fetch",
    routing: str = "standard",
    per_layer: bool = False,
    lookahead: int = 1,
    eviction_opts: dict[str, Any] | None = None,
    prefetch_opts: dict[str, Any] | None = None,
) -> OffloadEngine | None:
    """`resident` -> None (stock model); `on-demand` -> load after routing, keep nothing past the layer;
    `offload` -> C-slot cache with the named policies. The engine is not attached yet (use `with`)."""
    if mode == "resident":
        return None
    spec = get_adapter(model).spec
    if mode == "on-demand":
        return OffloadEngine(
            model,
            capacity=spec.num_experts,
            link=link,
            eviction=None,
            prefetch=None,
            miss=create_policy(MISS, "fetch"),
            routing=None,
            retain=False,
            lookahead=lookahead,
        )
    if mode != "offload":
        raise ConfigError(f"--mode {mode!r} unknown; use offload, resident or on-demand")
    return OffloadEngine(
        model,
        capacity=capacity,
        link=link,
        eviction=create_policy(EVICTION, eviction, eviction_opts),
        prefetch=create_policy(PREFETCH, prefetch, prefetch_opts),
        miss=create_policy(MISS, miss),
        routing=create_policy(ROUTING, routing),
        per_layer=per_layer,
        lookahead=lookahead,
    )


class PassClock:
    """Forward hooks on the model: the wall-clock end of every forward pass."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.ends: list[float] = []
        self._cuda = next(model.parameters()).device.type == "cuda"
        self._h = model.register_forward_hook(self._end)

    def _end(self, module, args, output) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())

    def remove(self) -> None:
        self._h.remove()


def generate_one(
    model: nn.Module,
    input_ids: torch.Tensor,
    engine: OffloadEngine | None,
    *,
    max_new_tokens: int,
    min_new_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    label: str = "",
) -> tuple[torch.Tensor, RunMetrics]:
    """Generate for one prompt `input_ids [1,P]`; return (new token ids [N], metrics of this prompt)."""
    device = next(model.parameters()).device if engine is None else engine.device
    input_ids = input_ids.to(device)
    phases: dict[str, Any] = {"prefill": None, "decode": []}

    def observe(st: PassStats) -> None:
        if phases["prefill"] is None:
            phases["prefill"] = st.counters
        else:
            phases["decode"].append(st.counters)

    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, attention_mask=torch.ones_like(input_ids))
    if temperature > 0:
        kw.update(temperature=temperature, top_k=None, top_p=None)
    if min_new_tokens is not None:
        kw["min_new_tokens"] = min_new_tokens
    pad = pad_token_id if pad_token_id is not None else getattr(model.config, "pad_token_id", None)
    if pad is None:
        pad = eos_token_id if eos_token_id is not None else getattr(model.config, "eos_token_id", None)
    if pad is not None:
        kw["pad_token_id"] = pad
    if eos_token_id is not None:
        kw["eos_token_id"] = eos_token_id
    if device.type == "cuda":
        kw["disable_compile"] = True

    if engine is not None:
        engine.observers.append(observe)
        c0 = engine.cache.counters.copy()
        l0 = (engine.link.busy_s, engine.link.bytes)
    clock = PassClock(model)
    torch.manual_seed(seed)
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        clock.remove()
        if engine is not None:
            engine.observers.remove(observe)
    new = out[0, input_ids.shape[1] :]
    ends = clock.ends
    m = RunMetrics(
        label=label,
        prompts=1,
        prompt_tokens=int(input_ids.shape[1]),
        new_tokens=int(new.numel()),
        decode_tokens=max(0, len(ends) - 1),
        wall_s=wall,
        ttft_s_sum=(ends[0] - t0) if ends else wall,
        decode_s=(ends[-1] - ends[0]) if ends else 0.0,
    )
    if engine is not None:
        m.counters = engine.cache.counters - c0
        for c in phases["decode"]:
            m.decode_counters = m.decode_counters + c
        m.link_busy_s = engine.link.busy_s - l0[0]
        m.link_bytes = engine.link.bytes - l0[1]
        m.expert_bytes = engine.store.expert_bytes
    return new.cpu(), m
