"""`moeflow calibrate` stage: measure the link and the compute, compute S, write calibration/<device>.json.

`CalibrateConfig`: everything `moeflow calibrate` needs, as one frozen dataclass (the CLI builds it)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..artifacts import new_meta
from ..calibrate.engine_time import engine_rounds
from ..calibrate.io import KIND, SCHEMA, calibration_path, device_name, write_calibration
from ..calibrate.measure import (
    bandwidth_sweep,
    expert_timing,
    fit_latency,
    link_timing,
    thread_counts,
    thread_sweep,
)
from ..calibrate.stepsize import initial_step_size, parse_regime, regime_bandwidth
from ..errors import ConfigError
from ..outputs import check_out

DEFAULT_SIZES_KIB = (64, 256, 1024, 4096, 16384)


@dataclass(frozen=True)
class CalibrateConfig:
    model: str  # local checkpoint folder
    device: str = "cpu"
    dtype: str = "auto"
    link_gbps: float | None = None  # calibrate an EmulatedLink of this bandwidth (GB/s = 1e9 B/s)
    link_latency_s: float = 0.0  # its per-transfer latency
    sizes_kib: tuple[int, ...] = DEFAULT_SIZES_KIB  # transfer sizes for the bandwidth sweep (the expert size is added)
    repeats: int = 5  # timed repeats per size / per module (median)
    decode_steps: int = 8  # decode steps timed for per-layer compute
    prompt_tokens: int = 16  # prompt length before the engine's timed decode steps (KV length at the first step)
    engine_rounds: int = 3  # interleaved timed rounds of the engine, resident and with a small cache (medians)
    regimes: tuple[str, ...] = ()  # e.g. ("copy-share=0.85", "specmd")
    out: str | None = None  # file; default calibration/<device>.json
    write: bool = True
    force: bool = False  # replace an existing calibration file at `out`
    wait: bool = False  # wait for another writer of `out` instead of refusing (moeflow.locks.out_lock)
    progress: bool = True
    threads: int | None = None  # time decode at this count only (None: at 1, 2, 4, ... up to the usable CPUs)

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1 (got {self.threads})")
        if self.link_gbps is not None and self.link_gbps <= 0:
            raise ConfigError(f"--link-gbps must be > 0 (got {self.link_gbps})")
        if self.link_latency_s < 0:
            raise ConfigError(f"--link-latency-us must be >= 0 (got {self.link_latency_s * 1e6})")
        if self.link_gbps is not None and not self.device.startswith("cpu"):
            raise ConfigError("--link-gbps emulates a link on CPU; drop it or use --device cpu")
        for flag, v in (("--repeats", self.repeats), ("--decode-steps", self.decode_steps),
                        ("--prompt-tokens", self.prompt_tokens), ("--engine-rounds", self.engine_rounds)):  # fmt: skip
            if v < 1:
                raise ConfigError(f"{flag} must be >= 1 (got {v})")
        if self.link_latency_s and self.link_gbps is None:
            raise ConfigError("--link-latency-us is the emulated link's: give --link-gbps too, or drop it")
        if not self.sizes_kib or min(self.sizes_kib) < 1:
            raise ConfigError("--sizes must be positive KiB values")
        from ..calibrate.stepsize import parse_regime

        for r in self.regimes:
            parse_regime(r)

    @staticmethod
    def parse_sizes(text: str) -> tuple[int, ...]:
        """`--sizes 64,256,1024` -> (64, 256, 1024) KiB."""
        try:
            return tuple(int(s) for s in text.split(",") if s.strip())
        except ValueError:
            raise ConfigError(f"--sizes must be comma-separated KiB integers, got {text!r}") from None

    def preflight(self) -> None:
        """What depends on this machine, checked before anything loads: the device (`--out` is checked by
        the stage with `moeflow.outputs.check_out` before the model loads)."""
        from ..checks import check_device

        check_device(self.device)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sizes_kib"] = list(self.sizes_kib)
        d["regimes"] = list(self.regimes)
        return d


def _link(cfg: CalibrateConfig) -> Any:
    if cfg.link_gbps is None:
        return None
    from ..runtime.link import EmulatedLink

    return EmulatedLink(cfg.link_gbps, cfg.link_latency_s)


def main(cfg: CalibrateConfig) -> dict[str, Any]:
    """Measure; decode compute at 1, 2, 4, ... up to the usable CPUs (or only at `--threads` / the environment's
    count, `moeflow.threads`), recording the fastest as `best_threads` and the other times at that count.

    The device and the file to write are checked first; the file's lock is held from then until it is written."""
    from ..locks import out_lock
    from ..models import torch_threads

    cfg.preflight()
    out = _checked_out(cfg)
    flag = "--out" if cfg.out else "the calibration file"
    with (
        out_lock(out, wait=cfg.wait, command="moeflow calibrate", flag=flag, check=lambda: _checked_out(cfg)),
        torch_threads(cfg.threads),
    ):
        return _main(cfg)


def _checked_out(cfg: CalibrateConfig) -> Path | None:
    """The calibration file to write (None with --no-write), checked before any work (`outputs.check_out`)."""
    if not cfg.write:
        return None
    out = Path(cfg.out) if cfg.out else calibration_path(device_name(cfg.device, cfg.link_gbps))
    flag = "--out" if cfg.out else "the calibration file"
    return check_out(out, kind=KIND, inputs=(cfg.model,), force=cfg.force, file=True, flag=flag)


def _main(cfg: CalibrateConfig) -> dict[str, Any]:
    import torch

    from ..models import load_model
    from ..moe import get_adapter, model_fingerprint
    from ..progress import progress
    from ..threads import ENV_VARS, resolve_threads, usable_cores

    model, _ = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    ad = get_adapter(model)
    spec = ad.spec
    dev = device_name(cfg.device, cfg.link_gbps)
    out = Path(cfg.out) if cfg.out else calibration_path(dev)
    sizes = sorted({k * 1024 for k in cfg.sizes_kib} | {spec.expert_bytes})
    link = _link(cfg)
    pinned = resolve_threads(cfg.threads, None, spec)  # --threads or the environment: time that count only
    counts = [pinned.n] if pinned.source in ("--threads", *ENV_VARS) else thread_counts(usable_cores())
    try:
        with progress("calibrate", enabled=cfg.progress) as prog:
            total = len(sizes) * (2 if link else 1) + len(counts) + 2 + (1 if link else 0)
            task = prog.add_task("bandwidth sweep", total=total, unit="measurements")
            memcpy = bandwidth_sweep(sizes, cfg.device, cfg.repeats, progress=lambda: prog.advance(task))
            emulated = bandwidth_sweep(sizes, cfg.device, cfg.repeats, link, lambda: prog.advance(task)) if link else None
            link_host = None
            if link is not None:  # the emulated link's host terms for the simulator's modelled link
                link_host = link_timing(link, spec.expert_bytes, max(10, 2 * cfg.repeats), burst=spec.top_k)
                prog.advance(task)
            prog.update(task, description="decode compute")
            best, by_threads, comp = thread_sweep(
                model, ad, counts, cfg.decode_steps, cfg.device, lambda n: prog.update(task, advance=1)
            )
            expert_s = expert_timing(ad, cfg.repeats, cfg.device)
            prog.advance(task)
            prog.update(task, description="engine time")
            engine_time, copies = engine_rounds(  # with a link: the engine's host seconds per copy on it too
                model,
                ad,
                cfg.decode_steps,
                cfg.device,
                (lambda: _link(cfg)) if link else None,
                cfg.engine_rounds,
                cfg.prompt_tokens,
            )
            if link_host is not None and copies is not None:
                link_host.update(copies)
            prog.advance(task)
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
            "engine_time": engine_time,  # the offload engine's decode pass split per MoE layer (simulate --calibrated-time)
            "link_timing": link_host,  # emulated link: submit, wake lateness, engine seconds per copy (None: no --link-gbps)
            "s_formula": raw,
            "initial_s": s,
            "regimes": regimes,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "cpu_threads": torch.get_num_threads(),  # the count the compute times above were measured at
            "best_threads": best,  # what commands use without --threads or an environment count (moeflow.threads)
            "thread_sweep": by_threads,  # decode time per token at each count timed
            "threads": best,
            "threads_source": pinned.source if pinned.source in ("--threads", *ENV_VARS) else "measured",
        }
    )
    if cfg.write:
        rec["path"] = str(write_calibration(out, rec))
    return rec
