"""Decode host work as on a GPU, counted on the CPU: device ops and CUDA event calls per decode token.

On a GPU the decode of a small batch is bound by the host: each aten op costs tens of microseconds of CPU (its
launch included) against a few of GPU work, so engine ÷ resident TPOT there follows the ops each side issues. This
counts them deterministically without a GPU, for a random tiny OLMoE (every size a flag):
- the resident model decodes as transformers' `generate` does off the CPU (its decode-stage switch from
  `grouped_mm` to `batched_mm` applied here too);
- the engine, every expert cached and warmed, no prefetch, runs over `CudaLink` with CUDA's events and streams
  replaced by counting fakes (copies are CPU copies), its router replay taking the device branch
  (`step.packed_to_host`) and its all-hit decode call mirroring `batched_mm`, as on a GPU;
- per decode token: non-view aten ops (a `TorchDispatchMode`: the ops a GPU would launch; views launch nothing)
  and CUDA event creations / records / stream waits, as the difference of an N-token and a 1-token generation;
- a prefill of `--prefill-tokens` random tokens by a cold engine (lru + pregate: the staged prefill) at 25%, 50% and
  100% capacity: its loads, the link copies that moved them (adjacent rows handed over together go as one copy),
  non-view aten ops and CUDA events, beside the resident prefill's ops.

    .venv/bin/python benchmarks/decode_ops.py                 # 16 MoE layers x 64 experts, top-8
    .venv/bin/python benchmarks/decode_ops.py --experts 8 --top-k 2 --layers 4

Not a timing: the figure to watch is the engine's extra ops per token (`extra_ops_per_token`, `ops_ratio`). Prints a
table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {  # ops that make views or metadata only: nothing launched on a GPU
    *("view", "_reshape_alias", "reshape", "unbind", "select", "slice", "alias", "t", "unsqueeze", "squeeze"),
    *("expand", "transpose", "split", "as_strided", "detach", "_unsafe_view", "permute", "chunk", "split_with_sizes"),
    "narrow",
}


class OpCount(TorchDispatchMode):
    """Non-view aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEWS:
            self.n += 1
        return func(*args, **(kwargs or {}))


CALLS = {"event_new": 0, "event_record": 0, "stream_wait": 0}


class CountingEvent:
    """A CUDA event stand-in that counts its creations and records; complete once recorded."""

    clock = itertools.count()

    def __init__(self, enable_timing: bool = False) -> None:
        CALLS["event_new"] += 1
        self.t: int | None = None

    def record(self, stream: Any = None) -> None:
        CALLS["event_record"] += 1
        self.t = next(CountingEvent.clock)

    def query(self) -> bool:
        return self.t is not None

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: CountingEvent) -> float:
        return float((end.t or 0) - (self.t or 0))


class CountingStream:
    def __init__(self, device: Any = None, priority: int = 0) -> None:
        pass

    def wait_event(self, ev: CountingEvent) -> None:
        CALLS["stream_wait"] += 1


@contextlib.contextmanager
def patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each `(obj, name, value)` set for the block, the previous values restored after."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


@contextlib.contextmanager
def decode_switch_on_cpu() -> Iterator[None]:
    """What transformers' `generate` does off the CPU, on the CPU: a `grouped_mm` model decodes with `batched_mm`
    (its `_optimize_model_for_decode` without the device test), and the engine's experts call mirrors it (its
    decision made as on a GPU). Also `tests/test_decode_ops.py`'s fixture."""
    from transformers.generation.utils import GenerationMixin

    from moeflow.moe import tx_compat
    from moeflow.runtime import experts_call

    @contextlib.contextmanager
    def switch(self):
        impls = self.get_experts_implementation()
        self.set_experts_implementation({k: "batched_mm" if v == "grouped_mm" else v for k, v in impls.items()})
        try:
            yield
        finally:
            self.set_experts_implementation(impls)

    init = experts_call.ExpertsCall.__init__

    def init_as_on_a_gpu(self, **kw):
        init(self, **kw)
        self._batched = tx_compat.decode_batched()

    with patched(
        [(GenerationMixin, "_optimize_model_for_decode", switch), (experts_call.ExpertsCall, "__init__", init_as_on_a_gpu)]
    ):
        yield


@contextlib.contextmanager
def as_on_a_gpu() -> Iterator[None]:
    """CUDA's events and streams faked, transformers' decode-stage switch applied on the CPU, the engine's router
    replay on its device branch and its decode call mirroring `batched_mm` (`decode_switch_on_cpu`); all restored
    after."""
    from moeflow.runtime import step

    def to_host(self, routings):
        self.counts.host_syncs += 1
        return step.packed_to_host(routings)

    fakes = [
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "Event", CountingEvent),
        (torch.cuda, "Stream", CountingStream),
        (torch.cuda, "stream", lambda s: contextlib.nullcontext()),
        (torch.cuda, "current_stream", lambda device=None: CountingStream()),
        (step.RouteStep, "to_host", to_host),
    ]
    with patched(fakes), decode_switch_on_cpu():
        yield


def per_token(model, prompt: torch.Tensor, engine, tokens: int) -> tuple[float, dict[str, float]]:
    """(non-view aten ops, CUDA calls) per decode token: an N-token generation minus a 1-token one, / (N - 1)."""
    from moeflow.runtime.generate import generate_one

    def run(n: int) -> tuple[int, dict[str, int]]:
        for k in CALLS:
            CALLS[k] = 0
        with OpCount() as ops:
            generate_one(model, prompt, engine, max_new_tokens=n, min_new_tokens=n)
        return ops.n, dict(CALLS)

    (many, c_many), (one, c_one) = run(tokens), run(1)
    return (many - one) / (tokens - 1), {k: (c_many[k] - c_one[k]) / (tokens - 1) for k in CALLS}


def prefill_counts(model, prompt: torch.Tensor, capacity: int) -> dict[str, Any]:
    """A cold engine's prefill (a 1-token generation) over the faked `CudaLink` at `capacity`, lru + pregate (the
    staged prefill): the loads, the link copies that moved them (adjacent rows handed over together: one copy),
    non-view aten ops and CUDA event creations."""
    from moeflow.runtime.generate import build_engine, generate_one
    from moeflow.runtime.link import CudaLink

    link = CudaLink(torch.device("cpu"))
    copies = [0]
    issue = link._issue_run

    def counted(ts, *args, **kw):
        copies[0] += 1
        return issue(ts, *args, **kw)

    link._issue_run = counted  # type: ignore[method-assign]
    engine = build_engine(model, mode="offload", link=link, capacity=capacity, eviction="lru", prefetch="pregate")
    with engine:
        for k in CALLS:
            CALLS[k] = 0
        with OpCount() as ops:
            generate_one(model, prompt, engine, max_new_tokens=1, min_new_tokens=1)
        link.drain()
        loads = engine.cache.counters.loads
    return {"capacity": capacity, "loads": loads, "copies": copies[0], "ops": ops.n, "cuda_events": CALLS["event_new"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64, help="routed experts per MoE layer (default %(default)s)")
    ap.add_argument("--top-k", type=int, default=8, help="experts per token (default %(default)s)")
    ap.add_argument("--layers", type=int, default=16, help="MoE layers (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=9, help="tokens generated, the first being the prefill's (default %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="random prompt length (default %(default)s)")
    ap.add_argument(
        "--prefill-tokens", type=int, default=128, help="random prompt length of the prefill rows (default %(default)s)"
    )
    a = ap.parse_args()
    if a.tokens < 2:
        ap.error("--tokens must be at least 2 (one decode step after the prefill's token)")

    from rich.console import Console

    from moeflow.models import tiny_model
    from moeflow.moe import get_adapter
    from moeflow.runtime.generate import build_engine, generate_one
    from moeflow.runtime.link import CudaLink
    from moeflow.tables import FitTable

    torch.set_num_threads(1)
    model = tiny_model("olmoe", num_experts=a.experts, top_k=a.top_k, num_hidden_layers=a.layers)
    model.set_experts_implementation("grouped_mm")
    spec = get_adapter(model).spec
    prompt = torch.randint(3, 250, (1, a.prompt_tokens), generator=torch.Generator().manual_seed(0))  # [1,P]
    with as_on_a_gpu():
        resident, res_calls = per_token(model, prompt, None, a.tokens)
        link = CudaLink(torch.device("cpu"))
        engine = build_engine(model, mode="offload", link=link, capacity=spec.total_experts, eviction="lru", prefetch="none")
        with engine:
            engine.warm()
            link.drain()
            offload, eng_calls = per_token(model, prompt, engine, a.tokens)
            misses = engine.cache.counters.misses
        long = torch.randint(3, 250, (1, a.prefill_tokens), generator=torch.Generator().manual_seed(1))  # [1,P]
        with OpCount() as res_prefill:
            generate_one(model, long, None, max_new_tokens=1, min_new_tokens=1)
        E = spec.total_experts
        prefill = [prefill_counts(model, long, c) for c in (E // 4, E // 2, E)]
    L = spec.num_moe_layers
    t = FitTable(
        title=f"decode ops as on a GPU: tiny olmoe, {L} MoE layers x {a.experts} experts, top-{a.top_k}, every expert cached"
    )
    for col in ("mode", "aten ops / token", "/ MoE layer", "CUDA events / token", "stream waits / token"):
        t.add_column(col, justify="right" if col != "mode" else "left")
    for name, ops, calls in (("resident", resident, res_calls), ("engine", offload, eng_calls)):
        t.add_row(name, f"{ops:.1f}", f"{ops / L:.2f}", f"{calls['event_new']:.1f}", f"{calls['stream_wait']:.1f}")
    console = Console(stderr=True)
    console.print(t)
    console.print(f"engine - resident = {offload - resident:.1f} ops per token ({(offload - resident) / L:.2f} per MoE layer)")
    t = FitTable(title=f"prefill of {a.prefill_tokens} tokens, cold engine, lru + pregate (resident: {res_prefill.n} ops)")
    for col in ("capacity", "loads", "link copies", "aten ops", "CUDA events"):
        t.add_column(col, justify="right")
    for r in prefill:
        t.add_row(
            f"{r['capacity']} ({r['capacity'] / E:.0%})", str(r["loads"]), str(r["copies"]), str(r["ops"]), str(r["cuda_events"])
        )
    console.print(t)
    print(
        json.dumps(
            {
                "benchmark": "decode_ops",
                "experts": a.experts,
                "top_k": a.top_k,
                "layers": L,
                "tokens": a.tokens,
                "resident_ops_per_token": resident,
                "engine_ops_per_token": offload,
                "extra_ops_per_token": offload - resident,
                "ops_ratio": offload / resident,
                "engine_cuda_calls_per_token": eng_calls,
                "misses": misses,
                "prefill_tokens": a.prefill_tokens,
                "prefill_resident_ops": res_prefill.n,
                "prefill": prefill,
            }
        )
    )


if __name__ == "__main__":
    main()
