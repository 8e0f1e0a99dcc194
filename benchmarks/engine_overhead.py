"""Engine overhead: offload-engine TPOT with every expert cached ÷ resident TPOT, side by side in one run.

The engine runs with capacity = all routed experts, warmed up (every expert copied into a slot first),
no prefetch, lru: no miss can happen, so what remains is the cost of the mechanism itself. The
resident model is a second copy of the same checkpoint with transformers' `grouped_mm` experts (the
engine's exactness reference). One untimed warm-up generation of each comes first; then `--rounds`
rounds alternate the order (resident, engine / engine, resident) so machine load hits both alike, and
the ratio is of the medians. torch.profiler then counts, per MoE layer per decode step (inside the MoE
block's forward), kernel launches (CUDA) or top-level aten ops (CPU, the proxy) and host
synchronizations (CUDA: stream/device/event synchronize calls; CPU: the engine's own device->host
reads, `engine.host_syncs`, over decode passes), all with `benchmarks/_profile.py`.

    python benchmarks/engine_overhead.py --model models/olmoe-mini --threads 1
    python benchmarks/engine_overhead.py --make-model olmoe-1b-7b-shape /tmp/olmoe-7b   # then:
    python benchmarks/engine_overhead.py --model /tmp/olmoe-7b --device cuda
    python benchmarks/engine_overhead.py --shape olmoe-1b-7b-shape --device cuda   # the same, built in memory

Off the CPU, transformers' generate decodes a `grouped_mm` model with `batched_mm` (it switches for the decode
stage): the JSON's `resident_decode_impl` says which implementation the resident decode steps ran.
`--host-profile N` prints, to stderr, the N functions with the most own host time (cProfile) in one
generation of each: on a GPU both decodes are bound by the host (launches and Python), so this is where
the ratio comes from.

Targets: <= 1.10x resident on the GPU shape, <= 1.05x on CPU. Prints a rich table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from _profile import host_profile, profile_counts  # benchmarks/_profile.py (shared with offload.py)

SHAPES = {  # OlmoeConfig kwargs
    "olmoe-1b-7b-shape": dict(
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_experts=64,
        num_experts_per_tok=8,
        num_attention_heads=16,
        vocab_size=8192,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_experts=16,
        num_experts_per_tok=2,
        num_attention_heads=4,
        vocab_size=1024,
    ),
}


def make_model(shape: str, out: Path) -> None:
    """Random-weight OLMoE checkpoint of a named shape, bf16, `save_pretrained` into `out`."""
    from transformers import AutoModelForCausalLM, OlmoeConfig

    cfg = OlmoeConfig(**SHAPES[shape], dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"made": str(out), "shape": shape, "parameters": n}))


def shape_model(shape: str, device: str, dtype: str):
    """A random-weight OLMoE model of a named shape built directly on `device` (no checkpoint), in eval mode
    with the stock `grouped_mm` experts; `dtype` auto: bf16 on CUDA, fp32 on CPU. Deterministic (seed 0)."""
    from transformers import AutoModelForCausalLM, OlmoeConfig

    from moeflow.models import resolve_dtype

    dt = resolve_dtype(dtype, device)
    dt = torch.bfloat16 if dt == "auto" else dt  # "auto" is a checkpoint's own dtype: this shape's is bf16
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(OlmoeConfig(**SHAPES[shape]), dtype=dt)
    model = model.to(device).eval()  # a no-op where the factory honoured the device context
    model.set_experts_implementation("grouped_mm")
    return model


def model_and_tokenizer(model_dir: str | None, shape: str | None, tokenizer: str, device: str, dtype: str):
    """(model, tokenizer, name): `shape`'s random-weight model (`shape_model`) with the tokenizer folder `tokenizer`,
    or else the checkpoint `model_dir` with its own (grouped_mm experts); name is what a report calls it. For the
    benchmarks that take `--model DIR` or `--shape NAME` (offload.py, decode_new_lengths.py)."""
    if shape:
        from transformers import AutoTokenizer

        return shape_model(shape, device, dtype), AutoTokenizer.from_pretrained(tokenizer), f"random {shape}"
    from moeflow.models import load_model

    model, tok = load_model(model_dir, dtype=dtype, device=device, experts_implementation="grouped_mm")
    return model, tok, model_dir


def decode_impl(model, adapter, ids) -> str:
    """The experts implementation the stock model's decode steps run: transformers' generate may switch
    `grouped_mm` to `batched_mm` for decoding off the CPU (the resident reference is then `batched_mm`)."""
    seen: list[str] = []
    experts = adapter.experts(adapter.moe_layers[0])

    def hook(module, args):
        if args[0].shape[0] == 1:  # one row: a decode step
            seen.append(str(module.config._experts_implementation))

    h = experts.register_forward_pre_hook(hook)
    try:
        _tpot(model, ids, None, 2)
    finally:
        h.remove()
    return seen[-1] if seen else "?"


def host_profiles(resident, offloaded, ids, engine, new: int, top: int) -> None:
    """cProfile of one generation of `new` tokens of each model: the `top` functions by own time, to stderr."""
    for name, model, eng in (("resident", resident, None), ("engine", offloaded, engine)):
        host_profile(f"{name}, {new} new tokens", lambda m=model, e=eng: _tpot(m, ids, e, new), top)


def _tpot(model, ids, engine, new: int) -> float:
    from moeflow.runtime.generate import generate_one

    _, m = generate_one(model, ids, engine, max_new_tokens=new, min_new_tokens=new)
    return m.tpot_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: models/olmoe-deep, or $MOEFLOW_MODEL)")
    ap.add_argument(
        "--make-model",
        nargs=2,
        metavar=("SHAPE", "DIR"),
        default=None,
        help=f"build a random-weight checkpoint ({', '.join(SHAPES)}) into DIR and exit",
    )
    ap.add_argument(
        "--shape",
        default=None,
        choices=tuple(SHAPES),
        help="instead of --model: a random-weight OLMoE of this shape built in memory on --device (no download)",
    )
    ap.add_argument("--device", default="cpu", help="torch device: cpu or cuda (default %(default)s)")
    ap.add_argument("--dtype", default="auto", help="auto (default): bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="random prompt length (tokens; default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=32, help="new tokens per timed generation (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds, alternating order (default %(default)s)")
    ap.add_argument("--profile-tokens", type=int, default=6, help="new tokens in the profiled generation (default %(default)s)")
    ap.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="print the N functions with the most own host time (cProfile) of one generation of each (default: off)",
    )
    a = ap.parse_args()
    if a.make_model:
        make_model(a.make_model[0], Path(a.make_model[1]))
        return

    from rich.console import Console

    from moeflow.models import default_model_path, load_model
    from moeflow.moe import get_adapter
    from moeflow.runtime.generate import build_engine
    from moeflow.runtime.link import make_link
    from moeflow.tables import FitTable

    if a.threads:
        torch.set_num_threads(a.threads)
    console = Console(stderr=True)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if a.shape and a.model:
        ap.error("give --model or --shape, not both")
    if a.shape:
        path = f"random {a.shape}"
        resident, offloaded = shape_model(a.shape, a.device, a.dtype), shape_model(a.shape, a.device, a.dtype)
    else:
        path = a.model or default_model_path()
        resident, _ = load_model(path, dtype=a.dtype, device=a.device, experts_implementation="grouped_mm")
        offloaded, _ = load_model(path, dtype=a.dtype, device=a.device, experts_implementation="grouped_mm")
    adapter, adapter_off = get_adapter(resident), get_adapter(offloaded)
    spec = adapter.spec
    vocab = resident.config.vocab_size
    ids = torch.randint(3, vocab, (1, a.prompt_tokens), generator=torch.Generator().manual_seed(0))  # [1,P]
    engine = build_engine(
        offloaded, mode="offload", link=make_link("auto", device), capacity=spec.total_experts, eviction="lru", prefetch="none"
    )
    tpot: dict[str, list[float]] = {"resident": [], "engine": []}
    with engine:
        engine.warm()
        _tpot(resident, ids, None, a.new_tokens)  # untimed warm-up of both
        resident_decode = decode_impl(resident, adapter, ids)
        _tpot(offloaded, ids, engine, a.new_tokens)
        for r in range(a.rounds):
            order = ("resident", "engine") if r % 2 == 0 else ("engine", "resident")
            for mode in order:
                if mode == "resident":
                    tpot[mode].append(_tpot(resident, ids, None, a.new_tokens))
                else:
                    tpot[mode].append(_tpot(offloaded, ids, engine, a.new_tokens))
        counts = {
            "resident": profile_counts(resident, adapter, ids, None, a.profile_tokens, cuda),
            "engine": profile_counts(offloaded, adapter_off, ids, engine, a.profile_tokens, cuda),
        }
        misses = engine.cache.counters.misses
        if a.host_profile:
            host_profiles(resident, offloaded, ids, engine, a.new_tokens, a.host_profile)

    med = {m: statistics.median(v) for m, v in tpot.items()}
    ratio = med["engine"] / med["resident"]
    ratio_min = min(tpot["engine"]) / min(tpot["resident"])  # least disturbed by shared cores
    paired = statistics.median(e / r for e, r in zip(tpot["engine"], tpot["resident"]))  # same round
    unit = "kernel launches" if cuda else "aten ops"
    key = "kernel_launches" if cuda else "aten_ops"
    t = FitTable(
        title=f"engine overhead: {Path(path).name} on {a.device} "
        f"({spec.num_moe_layers} MoE layers x {spec.num_experts} experts, top-{spec.top_k}), "
        f"C = all {spec.total_experts} experts"
    )
    for col in ("mode", "TPOT ms (median)", "min", "max", f"{unit} / MoE layer / step", "host syncs / MoE layer / step"):
        t.add_column(col, justify="right" if col != "mode" else "left")
    for m in ("resident", "engine"):
        t.add_row(
            m,
            f"{med[m] * 1e3:.2f}",
            f"{min(tpot[m]) * 1e3:.2f}",
            f"{max(tpot[m]) * 1e3:.2f}",
            f"{counts[m][key]:.1f}",
            f"{counts[m]['host_syncs']:.2f}",
        )
    console.print(t)
    target = 1.10 if cuda else 1.05
    console.print(
        f"engine / resident TPOT = {ratio:.3f} (medians; of minima {ratio_min:.3f}, per-round median "
        f"{paired:.3f}; target <= {target}); misses after warm-up: {misses}; the resident model decodes with "
        f"{resident_decode}"
    )
    print(
        json.dumps(
            {
                "model": str(path),
                "device": a.device,
                "threads": a.threads if not cuda else None,
                "prompt_tokens": a.prompt_tokens,
                "new_tokens": a.new_tokens,
                "rounds": a.rounds,
                "tpot_ms": {m: [round(x * 1e3, 3) for x in v] for m, v in tpot.items()},
                "tpot_ms_median": {m: round(v * 1e3, 3) for m, v in med.items()},
                "ratio": round(ratio, 4),
                "ratio_of_minima": round(ratio_min, 4),
                "ratio_paired_median": round(paired, 4),
                "target": target,
                "misses": misses,
                "resident_decode_impl": resident_decode,
                "per_moe_layer_per_decode_step": counts,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
        )
    )


if __name__ == "__main__":
    main()
