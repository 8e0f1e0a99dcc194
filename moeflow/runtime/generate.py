"""The generate loop: B prompts at a time (left-padded; B=1 by default), timed per forward pass, with
per-phase cache counters.

`build_engine(model, mode=...)` turns a mode and policy names into an `OffloadEngine` (or None for
`resident`, the stock model); `generate_batch(model, [input_ids...], engine)` runs `model.generate` and
returns each prompt's new token ids and a `RunMetrics` for the batch (`generate_one`: one prompt);
`fastest_experts_impl` picks the resident reference's stock experts implementation by measuring it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from ..errors import ConfigError
from ..models import no_cudnn_attention
from ..moe import get_adapter
from ..policies.base import EVICTION, MISS, PREFETCH, ROUTING  # importing moeflow.policies registers every policy
from ..registry import Registry
from .engine import OffloadEngine, PassStats
from .link import Link
from .metrics import RunMetrics

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel

    class CausalLM(PreTrainedModel, GenerationMixin):
        """What `AutoModelForCausalLM` loads: a transformers model with `generate` (for the type checker only)."""


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
    miss_opts: dict[str, Any] | None = None,
    routing_opts: dict[str, Any] | None = None,
    prefill: str = "staged",
) -> OffloadEngine | None:
    """`resident` -> None (stock model); `on-demand` -> load after routing, keep nothing past the layer;
    `offload` -> C-slot cache with the named policies; `prefill`: staged or serial (`runtime/prefill.py`).
    The engine is not attached yet (use `with`)."""
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
        miss=create_policy(MISS, miss, miss_opts),
        routing=create_policy(ROUTING, routing, routing_opts),
        per_layer=per_layer,
        lookahead=lookahead,
        prefill=prefill,
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


def _generate(model: Any, input_ids: torch.Tensor, **kw: Any) -> torch.Tensor:
    """`model.generate(input_ids, **kw)` without cuDNN's attention (`moeflow.models.no_cudnn_attention`: it plans
    every new sequence length on the host, which tripled a decode step on an H100). `model` is typed Any on
    purpose: transformers annotates `generate`'s `self` with a Protocol whose shape changes between releases, which
    mypy then reports differently per version."""
    with no_cudnn_attention():
        return model.generate(input_ids, **kw)


def generate_exactly(model: Any, ids: torch.Tensor, new_tokens: int, **kw: Any) -> torch.Tensor:
    """`new_tokens` tokens after `ids [1,P]` whatever the model emits (no EOS stop; greedy unless `kw` samples):
    a fixed-length generation for measurements and recordings."""
    kw.setdefault("do_sample", False)
    return _generate(
        model,
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=getattr(model.config, "pad_token_id", None) or 0,
        **kw,
    )


def pad_left(prompts: list[torch.Tensor], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts `[1,P_i]` into `ids [B,P]` and `attention_mask [B,P]` (0 on the padding)."""
    P = max(int(p.shape[-1]) for p in prompts)
    ids = torch.full((len(prompts), P), int(pad_token_id), dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        n = int(p.shape[-1])
        ids[i, P - n :] = p.reshape(-1)
        mask[i, P - n :] = 1
    return ids, mask


def _eos_ids(model: nn.Module, eos_token_id: int | None) -> set[int]:
    eos: Any = eos_token_id
    if eos is None:
        gc = getattr(model, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos is None:
            eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _cut_at_eos(row: torch.Tensor, eos: set[int]) -> torch.Tensor:
    """A batch row's new tokens up to and including its first EOS (what a batch-1 generate returns:
    generate fills a finished row with padding until the whole batch stops)."""
    if not eos:
        return row
    hit = torch.isin(row, torch.tensor(sorted(eos), dtype=row.dtype, device=row.device)).nonzero()
    return row if hit.numel() == 0 else row[: int(hit[0, 0]) + 1]


def generate_batch(
    model: CausalLM,
    prompts: list[torch.Tensor],
    engine: OffloadEngine | None,
    *,
    max_new_tokens: int,
    min_new_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    label: str = "",
) -> tuple[list[torch.Tensor], RunMetrics]:
    """Generate for B prompts `[1,P_i]` together (left-padded, attention mask; B=1: no padding); return
    (each prompt's new token ids [N_i], metrics of the batch). Greedy rows are the tokens a batch-1 run
    gives where the stock model's numerics allow it (`tests/test_runtime_batch.py`); each decode pass
    routes B rows (finished rows keep decoding padding until the batch stops, as in transformers).

    The link is drained after the timed region, so `link_bytes` counts every copy the cache issued for
    this batch, including prefetches still in flight when generation ended (`== counters.bytes_moved`)."""
    device = next(model.parameters()).device if engine is None else engine.device
    B = len(prompts)
    if B < 1:
        raise ValueError("generate_batch needs at least one prompt")
    phases: dict[str, Any] = {"prefill": None, "decode": [], "prefill_stats": None}

    def observe(st: PassStats) -> None:
        if phases["prefill"] is None:
            phases["prefill"] = st.counters
            phases["prefill_stats"] = st
            if engine is not None:
                engine.cache.mark_phase()  # the decode passes begin: their prefetch precision counts their own copies
        else:
            phases["decode"].append(st.counters)

    pad = pad_token_id if pad_token_id is not None else getattr(model.config, "pad_token_id", None)
    if pad is None:
        pad = eos_token_id if eos_token_id is not None else getattr(model.config, "eos_token_id", None)
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    if B == 1:
        input_ids = prompts[0].reshape(1, -1)
        mask = torch.ones_like(input_ids)
    else:
        input_ids, mask = pad_left(prompts, pad if pad is not None else 0)
    input_ids, mask = input_ids.to(device), mask.to(device)
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, attention_mask=mask)
    if temperature > 0:
        kw.update(temperature=temperature, top_k=None, top_p=None)
    if min_new_tokens is not None:
        kw["min_new_tokens"] = min_new_tokens
    if pad is not None:
        kw["pad_token_id"] = pad
    if eos_token_id is not None:
        kw["eos_token_id"] = eos_token_id
    if device.type == "cuda":
        kw["disable_compile"] = True

    if engine is not None:
        engine.observers.append(observe)
        engine.cache.mark_phase(new_generation=True)
        c0 = engine.cache.counters.copy()
        l0 = (engine.link.busy_s, engine.link.bytes)
        h0 = (engine.host_s, engine.host_wait_s)
    clock = PassClock(model)
    torch.manual_seed(seed)
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = _generate(model, input_ids, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        clock.remove()
        if engine is not None:
            engine.observers.remove(observe)
    P = input_ids.shape[1]
    eos = _eos_ids(model, eos_token_id) if B > 1 else set()
    news = [_cut_at_eos(out[i, P:], eos).cpu() for i in range(B)]
    ends = clock.ends
    ttft = (ends[0] - t0) if ends else wall
    m = RunMetrics(
        label=label,
        prompts=B,
        prompt_tokens=sum(int(p.shape[-1]) for p in prompts),
        new_tokens=sum(int(n.numel()) for n in news),
        decode_tokens=max(0, len(ends) - 1),
        decode_row_tokens=sum(max(0, int(n.numel()) - 1) for n in news),
        wall_s=wall,
        ttft_s_sum=ttft * B,
        decode_s=(ends[-1] - ends[0]) if ends else 0.0,
        batch_size=B,
    )
    if engine is not None:
        engine.link.drain()  # untimed: copies still in flight (a last prefetch) complete and are counted
        m.counters = engine.cache.counters - c0
        for c in phases["decode"]:
            m.decode_counters = m.decode_counters + c
        m.link_busy_s = engine.link.busy_s - l0[0]
        m.link_bytes = engine.link.bytes - l0[1]
        m.host_s, m.host_wait_s = engine.host_s - h0[0], engine.host_wait_s - h0[1]
        m.expert_bytes = engine.store.expert_bytes
        m.lossy = engine.lossy
        st0 = phases["prefill_stats"]
        if st0 is not None:  # the TTFT bound's ingredients (`RunMetrics.set_ttft_bound`)
            per = expert_link_s(engine.link, engine.store.expert_bytes)
            m.prefill_needed = st0.needed
            m.prefill_xfer_s_sum = st0.needed * (per or 0.0) * B
            m.prefill_compute_s_sum = st0.compute_s * B
        m.set_ttft_bound(None)
    else:
        m.set_ttft_bound(ttft)  # the resident model is its own bound
    return news, m


def expert_link_s(link: Link, expert_bytes: int) -> float | None:
    """Link seconds of one expert's bytes for the TTFT bound: the link's model (`bulk_s`: emulated, its bandwidth and
    latency per transfer; CUDA, its fitted seconds per byte), else its measured mean (None: no copy yet)."""
    est = link.bulk_s(expert_bytes)
    if est is not None:
        return est
    return expert_bytes * link.busy_s / link.bytes if link.bytes else None


def generate_one(
    model: CausalLM,
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
    news, m = generate_batch(
        model,
        [input_ids],
        engine,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        temperature=temperature,
        seed=seed,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        label=label,
    )
    return news[0], m


# ---- the resident reference: the fastest stock experts implementation ------------------------------------

STOCK_EXPERTS_IMPLS = ("batched_mm", "grouped_mm")


class ImplProbe(NamedTuple):
    """What `fastest_experts_impl` measured: the implementation it kept and, per implementation, the best prefill
    time and mean decode pass time (s)."""

    name: str
    decode_s: dict[str, float]
    prefill_s: dict[str, float]


def fastest_experts_impl(
    model: CausalLM,
    input_ids: torch.Tensor,
    *,
    candidates: tuple[str, ...] = STOCK_EXPERTS_IMPLS,
    steps: int = 4,
    rounds: int = 2,
    new_tokens: int | None = None,
) -> ImplProbe:
    """Time the prefill of `input_ids [B,P]` and `steps` decode passes of a greedy generate with each stock experts
    implementation (after one untimed warm-up generate of each; `rounds` rounds in alternating order, the minimum
    of each phase kept) and switch the model to the one `pick_impl` prefers for a generation of `new_tokens`
    tokens (default: the probe's own, `steps` + 1). Both phases count: on CUDA transformers' generate decodes with
    `batched_mm` whichever is set, so the two decode alike there, while `batched_mm` copies every routed expert's
    weights for every prompt token in the prefill (on an H100 at the OLMoE-1B-7B shape, a 256-token prompt: 305.7 ms
    prefill and 36.6 GiB peak memory against 23.5 ms and 12.7 GiB with `grouped_mm`)."""
    ids = input_ids.to(next(model.parameters()).device)
    kw: dict[str, Any] = dict(
        max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False, attention_mask=torch.ones_like(ids)
    )
    pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "eos_token_id", None)
    if pad is not None:
        kw["pad_token_id"] = pad[0] if isinstance(pad, (list, tuple)) else pad
    if ids.device.type == "cuda":
        kw["disable_compile"] = True
    decode: dict[str, float] = {}
    prefill: dict[str, float] = {}

    def timed(impl: str) -> tuple[float, float]:
        model.set_experts_implementation(impl)
        clock = PassClock(model)
        if ids.device.type == "cuda":
            torch.cuda.synchronize()  # nothing earlier in the prefill's time
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                _generate(model, ids, **kw)
        finally:
            clock.remove()
        e = clock.ends
        return e[0] - t0, (e[-1] - e[0]) / max(1, len(e) - 1)

    for impl in candidates:
        timed(impl)  # warm-up
    for r in range(rounds):
        for impl in candidates if r % 2 == 0 else tuple(reversed(candidates)):
            p, d = timed(impl)
            prefill[impl], decode[impl] = min(prefill.get(impl, p), p), min(decode.get(impl, d), d)
    name = pick_impl(prefill, decode, steps + 1 if new_tokens is None else new_tokens)
    model.set_experts_implementation(name)
    return ImplProbe(name, decode, prefill)


DECODE_TIE = 0.05  # decode pass times within this fraction of the fastest count as equal (timing noise)


def pick_impl(prefill_s: dict[str, float], decode_s: dict[str, float], new_tokens: int, tie: float = DECODE_TIE) -> str:
    """The implementation whose generation of `new_tokens` tokens costs least: its prefill + (new_tokens - 1) decode
    passes, a decode pass within `tie` of the fastest counting as the fastest's. Without the tie a noise-level
    difference times many tokens would outweigh a prefill gap (on CUDA both decode with `batched_mm`, so their
    decode difference is noise, and `batched_mm`'s prefill is 13x `grouped_mm`'s at 256 tokens)."""
    fastest = min(decode_s.values())
    passes = max(0, new_tokens - 1)

    def cost(k: str) -> float:
        d = fastest if decode_s[k] <= fastest * (1 + tie) else decode_s[k]
        return prefill_s[k] + passes * d

    return min(decode_s, key=cost)
