"""Run metrics: one dataclass per generation (a prompt, or a whole run), a dict for JSON, a rich table.

Definitions (docs/architecture.md, "Metrics vocabulary"):
- TTFT: wall time from the start of `generate` to the end of the prefill pass (the first token).
- TPOT: mean wall time per decode pass after the first token (one token per prompt of the batch; at
  batch size 1, per decode token).
- throughput (decode tok/s): tokens the decode passes generated for all prompts of a batch / decode wall
  time (= B / TPOT while no prompt of the batch has stopped); tok/s: all new tokens / whole wall time.
- stall: seconds the compute thread waited for an expert copy; stall share = stall / wall.
- hit rate: needed experts already in a slot (ready, or a prefetch still in flight: `late`) when the layer
  routed / needed experts; the same definition as the simulator's. Late hits cost stall, not a transfer.
- prefetch precision: prefetch copies issued in a window that were used before eviction / prefetch copies
  issued in it (0..1). The windows are a generation (its prefill and decode) and its decode passes: a copy
  issued during prefill and first used while decoding counts for the generation, not for the decode passes
  (`CacheCounters.prefetch_used_prior_phase`, `ExpertCache.mark_phase`).
- prefetch recall: needed experts that were resident thanks to a prefetch (whenever issued) / needed experts.
- collision misses: needed experts evicted earlier in the same forward pass.
- effective bandwidth: bytes moved / busy link seconds.
- host time: seconds the host worker ran missed experts (`cpu` / `auto`); host wait: seconds the experts
  calls waited for it; host hidden share = 1 - host wait / host time (host time hidden behind the device).
- TTFT bound: max(resident prefill time, link seconds of the experts the prefill routes that were not resident
  when it began (`runtime/prefill.py`)); the resident prefill time is the resident run's TTFT of the same
  prompts when one ran (`ttft_bound_source` "resident"), else the engine's own prefill compute ("compute").
  ttft_bound_ratio = TTFT / bound (1 = nothing left to gain from overlap).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .cache import CacheCounters


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


@dataclass
class RunMetrics:
    label: str = ""  # e.g. "offload C=25% lru+pregate"
    prompts: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    decode_tokens: int = 0  # decode passes (new tokens after the first; one per prompt of a batch)
    decode_row_tokens: int = 0  # tokens the decode passes generated, all prompts of the batch (throughput)
    batch_size: int = 1  # prompts decoded together
    experts_impl: str | None = None  # resident: the stock experts implementation measured fastest
    wall_s: float = 0.0
    ttft_s_sum: float = 0.0  # summed over prompts (mean = ttft_s)
    decode_s: float = 0.0  # wall time of all decode steps
    counters: CacheCounters = field(default_factory=CacheCounters)
    decode_counters: CacheCounters = field(default_factory=CacheCounters)
    link_busy_s: float = 0.0
    link_bytes: int = 0
    expert_bytes: int = 0
    s_history: list[int] = field(default_factory=list)  # step size S used at each decode pass (adaptive S)
    lossy: bool = False  # a lossy miss / routing policy (or --speculative): outputs may differ from the model's
    host_s: float = 0.0  # host worker busy seconds (missed experts computed on the host)
    host_wait_s: float = 0.0  # seconds the experts calls waited for the host worker
    prefill_needed: int = 0  # routed experts of the prefills not resident when each began (copies no schedule avoids)
    prefill_xfer_s_sum: float = 0.0  # link seconds of those copies, x prompts of the batch (mean: prefill_xfer_s)
    prefill_compute_s_sum: float = 0.0  # the engine's prefill compute (waits excluded), x prompts of the batch
    ttft_bound_s_sum: float = 0.0  # TTFT bound x prompts of the batch (`set_ttft_bound`; 0: unknown)
    ttft_bound_source: str | None = None  # "resident" (the resident run's TTFT) or "compute" (the engine's own)

    # ---- derived ----------------------------------------------------------------------------------
    @property
    def ttft_s(self) -> float | None:
        return _ratio(self.ttft_s_sum, self.prompts)

    @property
    def ttft_bound_s(self) -> float | None:
        return _ratio(self.ttft_bound_s_sum, self.prompts) if self.ttft_bound_s_sum > 0 else None

    @property
    def ttft_bound_ratio(self) -> float | None:
        return _ratio(self.ttft_s_sum, self.ttft_bound_s_sum) if self.ttft_bound_s_sum > 0 else None

    def set_ttft_bound(self, resident_ttft_s: float | None) -> None:
        """The bound of this batch's prefill: max(resident prefill time, its copies' link seconds); without a
        resident TTFT (`None`) the engine's own prefill compute stands in for the resident prefill time."""
        n = max(1, self.prompts)
        res = resident_ttft_s if resident_ttft_s is not None else self.prefill_compute_s_sum / n
        self.ttft_bound_s_sum = max(res, self.prefill_xfer_s_sum / n) * n
        self.ttft_bound_source = "resident" if resident_ttft_s is not None else "compute"

    @property
    def tpot_s(self) -> float | None:
        return _ratio(self.decode_s, self.decode_tokens)

    @property
    def tokens_per_s(self) -> float | None:
        return _ratio(self.new_tokens, self.wall_s)

    @property
    def throughput_tok_s(self) -> float | None:
        return _ratio(self.decode_row_tokens, self.decode_s)

    @property
    def stall_share(self) -> float | None:
        return _ratio(self.counters.stall_s, self.wall_s)

    @property
    def hit_rate(self) -> float | None:
        return _ratio(self.counters.hits, self.counters.accesses)

    @property
    def decode_hit_rate(self) -> float | None:
        return _ratio(self.decode_counters.hits, self.decode_counters.accesses)

    @property
    def prefetch_precision(self) -> float | None:
        c = self.counters
        return _ratio(c.prefetch_used - c.prefetch_used_prior_generation, c.prefetch_issued)

    @property
    def prefetch_recall(self) -> float | None:
        return _ratio(self.counters.prefetch_used, self.counters.accesses)

    @property
    def decode_prefetch_precision(self) -> float | None:
        c = self.decode_counters
        return _ratio(c.prefetch_used - c.prefetch_used_prior_phase, c.prefetch_issued)

    @property
    def decode_prefetch_recall(self) -> float | None:
        return _ratio(self.decode_counters.prefetch_used, self.decode_counters.accesses)

    @property
    def transfers_per_token(self) -> float | None:
        return _ratio(self.decode_counters.loads, self.decode_tokens)

    @property
    def bytes_per_token(self) -> float | None:
        return _ratio(self.decode_counters.bytes_moved, self.decode_tokens)

    @property
    def host_hidden_share(self) -> float | None:
        if self.host_s <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - self.host_wait_s / self.host_s))

    @property
    def effective_gbps(self) -> float | None:
        r = _ratio(self.link_bytes, self.link_busy_s)
        return r / 1e9 if r is not None else None

    # ---- combine / export ---------------------------------------------------------------------------
    def merge(self, other: RunMetrics) -> RunMetrics:
        out = dataclasses.replace(self)
        for f in (
            "prompts",
            "prompt_tokens",
            "new_tokens",
            "decode_tokens",
            "decode_row_tokens",
            "wall_s",
            "ttft_s_sum",
            "decode_s",
            "link_busy_s",
            "link_bytes",
            "host_s",
            "host_wait_s",
            "prefill_needed",
            "prefill_xfer_s_sum",
            "prefill_compute_s_sum",
            "ttft_bound_s_sum",
        ):
            setattr(out, f, getattr(self, f) + getattr(other, f))
        out.counters = self.counters + other.counters
        out.decode_counters = self.decode_counters + other.decode_counters
        out.expert_bytes = self.expert_bytes or other.expert_bytes
        out.s_history = self.s_history + other.s_history
        out.batch_size = max(self.batch_size, other.batch_size)
        out.experts_impl = self.experts_impl or other.experts_impl
        out.lossy = self.lossy or other.lossy
        srcs = {x.ttft_bound_source for x in (self, other) if x.ttft_bound_s_sum > 0}
        out.ttft_bound_source = srcs.pop() if len(srcs) == 1 else ("mixed" if srcs else None)
        return out

    @classmethod
    def total(cls, items: Iterable[RunMetrics], label: str = "") -> RunMetrics:
        acc = cls(label=label)
        for m in items:
            acc = acc.merge(m)
        acc.label = label
        return acc

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "lossy": self.lossy,
            "prompts": self.prompts,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "batch_size": self.batch_size,
            "experts_impl": self.experts_impl,
            "wall_s": self.wall_s,
            "ttft_s": self.ttft_s,
            "ttft_bound_s": self.ttft_bound_s,
            "ttft_bound_ratio": self.ttft_bound_ratio,
            "ttft_bound_source": self.ttft_bound_source,
            "prefill_needed_experts": self.prefill_needed,
            "prefill_xfer_s": _ratio(self.prefill_xfer_s_sum, self.prompts),
            "prefill_compute_s": _ratio(self.prefill_compute_s_sum, self.prompts),
            "tpot_s": self.tpot_s,
            "decode_passes": self.decode_tokens,
            "decode_tokens": self.decode_row_tokens,
            "throughput_tok_s": self.throughput_tok_s,
            "tokens_per_s": self.tokens_per_s,
            "stall_s": self.counters.stall_s,
            "stall_share": self.stall_share,
            "hit_rate": self.hit_rate,
            "decode_hit_rate": self.decode_hit_rate,
            "late_hits": self.counters.late,
            "prefetch_precision": self.prefetch_precision,
            "prefetch_recall": self.prefetch_recall,
            "decode_prefetch_precision": self.decode_prefetch_precision,
            "decode_prefetch_recall": self.decode_prefetch_recall,
            "collision_misses": self.counters.collision_misses,
            "overfetch": self.counters.prefetch_unused_evicted,
            "bytes_moved": self.counters.bytes_moved,
            "transfers": self.counters.loads,
            "transfers_per_token": self.transfers_per_token,
            "bytes_per_token": self.bytes_per_token,
            "effective_gbps": self.effective_gbps,
            "expert_bytes": self.expert_bytes,
            "host_s": self.host_s,
            "host_wait_s": self.host_wait_s,
            "host_hidden_share": self.host_hidden_share,
            "s_history": list(self.s_history),
            "counters": self.counters.to_dict(),
            "decode_counters": self.decode_counters.to_dict(),
        }


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


COLUMNS = (
    "run",
    "TTFT ms",
    "TTFT/bound",
    "TPOT ms",
    "dec tok/s",
    "tok/s",
    "stall %",
    "dec hit",
    "dec prec",
    "dec recall",
    "collis. misses",
    "xfers /tok",
    "bytes /tok",
    "eff GB/s",
)


def metrics_table(rows: Iterable[RunMetrics], title: str = "moeflow run"):
    """A table with one row per RunMetrics: hit rate, prefetch precision/recall, transfers and bytes over decode
    passes (per decode token); stall share over the whole generation; collisions over all passes. Readable at
    80 columns: the columns that do not fit follow in a second table (`moeflow.tables.FitTable`)."""
    from ..tables import FitTable

    t = FitTable(title)
    for c in COLUMNS:
        t.add_column(c)
    for m in rows:
        t.add_row(
            m.label
            + (f" [{m.experts_impl}]" if m.experts_impl else "")
            + (f" B={m.batch_size}" if m.batch_size > 1 else "")
            + (" LOSSY" if m.lossy and "lossy" not in m.label.lower() else ""),
            _f(m.ttft_s * 1e3 if m.ttft_s is not None else None, ".1f"),
            _f(m.ttft_bound_ratio, ".2f"),
            _f(m.tpot_s * 1e3 if m.tpot_s is not None else None, ".2f"),
            _f(m.throughput_tok_s, ".1f"),
            _f(m.tokens_per_s, ".1f"),
            _f(m.stall_share * 100 if m.stall_share is not None else None, ".1f"),
            _f(m.decode_hit_rate, ".3f"),
            _f(m.decode_prefetch_precision, ".3f"),
            _f(m.decode_prefetch_recall, ".3f"),
            str(m.counters.collision_misses),
            _f(m.transfers_per_token, ".2f"),
            _bytes(m.bytes_per_token),
            _f(m.effective_gbps, ".2f"),
        )
    return t
