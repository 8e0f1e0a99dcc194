"""`moeflow calibrate` stage: measure the link and the compute, compute S, write calibration/<device>.json."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..artifacts import check_out, new_meta
from .config import CalibrateConfig
from .io import KIND, SCHEMA, calibration_path, device_name, write_calibration
from .measure import bandwidth_sweep, decode_timing, expert_timing, fit_latency
from .stepsize import initial_step_size, parse_regime, regime_bandwidth


def _link(cfg: CalibrateConfig) -> Any:
    if cfg.link_gbps is None:
        return None
    from ..runtime.link import EmulatedLink

    return EmulatedLink(cfg.link_gbps, cfg.link_latency_s)


def main(cfg: CalibrateConfig) -> dict[str, Any]:
    """Measure with `cfg.threads` torch threads (compute per layer depends on it: calibrate as you run)."""
    from ..models import torch_threads

    with torch_threads(cfg.threads):
        return _main(cfg)


def _main(cfg: CalibrateConfig) -> dict[str, Any]:
    import torch
    from rich.progress import Progress

    from ..models import load_model
    from ..moe import get_adapter, model_fingerprint

    cfg.preflight()
    model, _ = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    ad = get_adapter(model)
    spec = ad.spec
    dev = device_name(cfg.device, cfg.link_gbps)
    out = Path(cfg.out) if cfg.out else calibration_path(dev)
    if cfg.write:  # before the measurements, not after
        check_out(
            out, kind=KIND, inputs=(cfg.model,), force=cfg.force, file=True, flag="--out" if cfg.out else "the calibration file"
        )
    sizes = sorted({k * 1024 for k in cfg.sizes_kib} | {spec.expert_bytes})
    link = _link(cfg)
    try:
        with Progress(transient=True, disable=not cfg.progress) as prog:
            task = prog.add_task("bandwidth sweep", total=len(sizes) * (2 if link else 1))
            memcpy = bandwidth_sweep(sizes, cfg.device, cfg.repeats, progress=lambda: prog.advance(task))
            emulated = bandwidth_sweep(sizes, cfg.device, cfg.repeats, link, lambda: prog.advance(task)) if link else None
            prog.update(task, description="decode compute")
            comp = decode_timing(model, ad, cfg.decode_steps, cfg.device)
            expert_s = expert_timing(ad, cfg.repeats, cfg.device)
    finally:
        if link is not None:
            link.close()
    sweep = emulated or memcpy
    latency, fitted_bw = fit_latency(sweep)
    at_expert = next(r for r in sweep if r["bytes"] == spec.expert_bytes)
    c_s = spec.expert_bytes / at_expert["seconds"]  # effective bytes/s for one expert, latency included
    n_e = spec.top_k
    s, raw = initial_step_size(n_e, spec.expert_bytes, c_s, comp["layer_time_s"], spec.num_moe_layers)
    bytes_per_token = spec.num_moe_layers * spec.top_k * spec.expert_bytes
    regimes = [
        regime_bandwidth(
            parse_regime(r),
            bytes_per_token=bytes_per_token,
            compute_per_token_s=comp["forward_s"],
            expert_bytes=spec.expert_bytes,
        )
        for r in cfg.regimes
    ]
    rec = new_meta(KIND, SCHEMA, model_fingerprint(model), spec=spec.to_dict(), model=str(cfg.model), config=cfg.to_dict())
    rec.update(
        {
            "device": dev,
            "torch_device": cfg.device,
            "link": ("emulated" if link else ("cuda" if cfg.device.startswith("cuda") else "memcpy")),
            "link_gbps": cfg.link_gbps,
            "bandwidth_bytes_per_s": c_s,  # C_s: one expert's transfer, latency included
            "bandwidth_gbps": c_s / 1e9,
            "fitted_bandwidth_bytes_per_s": fitted_bw,  # slope of t = latency + bytes / bw over the sweep
            "latency_s": latency,
            "sweep": sweep,
            "memcpy_sweep": memcpy if link else None,
            "expert_bytes": spec.expert_bytes,  # E_s
            "experts_per_layer": n_e,  # N_e = top_k (one decode token)
            "layer_time_s": comp["layer_time_s"],  # T_l: mean decoder-layer time at decode, experts resident
            "attention_time_s": comp["attention_time_s"],
            "expert_time_s": expert_s,
            "compute_per_token_s": comp["forward_s"],
            "bytes_per_token_on_demand": bytes_per_token,
            "per_layer": {"layer_s": comp["layer_s"], "moe_block_s": comp["moe_block_s"], "attention_s": comp["attention_s"]},
            "s_formula": raw,
            "initial_s": s,
            "regimes": regimes,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "cpu_threads": torch.get_num_threads(),
        }
    )
    if cfg.write:
        rec["path"] = str(write_calibration(out, rec))
    return rec
