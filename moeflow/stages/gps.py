"""`moeflow gps`: the MoE-GPS guideline (paper Fig. 1-3) for a trace on N GPUs.

`main(GPSConfig)` reads the trace's prefill routing, holds out 20% of its prompts (the distribution-only
MLE is fitted on the rest), and runs `moeflow.gps.simulator` on the held-out batches of `seq_len` tokens:
at the trace's own skewness (the recommendation) and over a skewness sweep (Fig. 2's x axis). Per
strategy: mean per-MoE-layer latency split into attention, FFN, communication and overhead, the saving
over no prediction, and the best strategy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.markup import escape

from ..artifacts import PLOT_METADATA, atomic_write
from ..errors import ArtifactError, ConfigError
from ..gps.simulator import (
    GPUS,
    LINKS,
    SHAPES,
    Interconnect,
    OverheadCurve,
    Shape,
    SweepInput,
    System,
    evaluate_point,
    measure_this_machine,
)
from ..gps.skew import LayerRouting, find_gamma

STRATEGY_NAMES = {"none": "no prediction", "distribution": "distribution-only", "token_to_expert": "token-to-expert"}


@dataclass(frozen=True)
class GPSConfig:
    trace: str
    gpus: int = 4
    interconnect: str = "nvlink"  # nvlink | pcie
    link_gbps: float | None = None  # overrides the preset's bandwidth (GB/s per GPU per direction)
    link_latency_us: float | None = None
    seq_len: int = 512
    model_shape: str = "mixtral-8x7b"  # a SHAPES name or "trace"
    gpu: str = "a100"  # a GPUS name or "this" (measured here)
    redundant: int = 1  # spare expert slots per GPU
    skews: tuple[float, ...] = (1.5, 1.7, 2.0, 2.5, 3.5, 4.5)
    holdout: float = 0.2
    seed: int = 0
    max_batches: int = 12  # held-out batches simulated per layer and point
    predictors: str | None = None  # a predictor folder with gps/: fit the overhead curve on its predictors
    plot: str | None = None

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ConfigError(f"--gpus must be >= 1 (got {self.gpus})")
        if self.interconnect not in LINKS:
            raise ConfigError(f"--interconnect must be one of {', '.join(LINKS)} (got {self.interconnect!r})")
        if self.model_shape not in (*SHAPES, "trace"):
            raise ConfigError(f"--model-shape must be one of {', '.join((*SHAPES, 'trace'))} (got {self.model_shape!r})")
        if self.gpu not in (*GPUS, "this"):
            raise ConfigError(f"--gpu must be one of {', '.join((*GPUS, 'this'))} (got {self.gpu!r})")
        for flag, v, least in (("--seq-len", self.seq_len, 1), ("--max-batches", self.max_batches, 1),
                               ("--redundant", self.redundant, 0)):  # fmt: skip
            if v < least:
                raise ConfigError(f"{flag} must be >= {least} (got {v})")
        if self.link_gbps is not None and not self.link_gbps > 0:
            raise ConfigError(f"--link-gbps must be > 0 (got {self.link_gbps})")
        if self.link_latency_us is not None and self.link_latency_us < 0:
            raise ConfigError(f"--link-latency-us must be >= 0 (got {self.link_latency_us})")
        if not 0.0 < self.holdout < 1.0:
            raise ConfigError(f"--holdout must be in (0, 1), got {self.holdout}")
        if self.plot is not None and not self.plot.lower().endswith(".png"):
            raise ConfigError(f"--plot must name a .png file (got {self.plot})")


def _link(cfg: GPSConfig) -> Interconnect:
    base = LINKS[cfg.interconnect]
    bw = cfg.link_gbps * 1e9 if cfg.link_gbps is not None else base.bw
    lat = cfg.link_latency_us * 1e-6 if cfg.link_latency_us is not None else base.latency
    name = base.name if cfg.link_gbps is None else f"{cfg.interconnect} at {cfg.link_gbps:g} GB/s per direction"
    return Interconnect(name, bw, lat)


def _shape(cfg: GPSConfig, spec: Any) -> Shape:
    E, k = spec.num_experts, spec.top_k
    if cfg.model_shape == "trace":
        H = spec.hidden_size
        heads = max(1, H // 64)
        return Shape(f"trace ({spec.arch})", H, spec.expert_intermediate_size, heads, heads, E, k, 2)
    s = SHAPES[cfg.model_shape]
    inter = max(1, round(s.inter * s.num_experts / E))  # keep the named model's expert weights per layer
    return dataclasses.replace(s, inter=inter, num_experts=E, top_k=k)


def overhead_curve(cfg: GPSConfig) -> OverheadCurve:
    if cfg.predictors is None:
        return OverheadCurve.default(cfg.seq_len)
    from ..predict.io import read_json_file

    f = Path(cfg.predictors) / "gps" / "config.json"
    if not f.is_file():
        raise ArtifactError(f"{cfg.predictors} has no MoE-GPS predictors ({f} missing); run `moeflow train --only gps`")
    ev = read_json_file(f).get("report", {}).get("eval", {}).get("token_to_expert", {})
    if "probability" not in ev:
        raise ArtifactError(f"{f} holds no evaluation; re-run `moeflow train --only gps`")
    a0 = ev["probability"]["topk"]
    pts = [((r["topk"] - a0) / max(1e-9, 1 - a0), r["ms_per_batch"] / 1e3) for r in ev.values()]
    return OverheadCurve.fit(pts, f"fitted on {cfg.predictors}/gps (this machine's predictor times)")


def load_input(cfg: GPSConfig) -> tuple[SweepInput, Any]:
    from ..trace import Trace

    if not Path(cfg.trace).is_dir():
        raise ArtifactError(f"trace folder {cfg.trace} does not exist; run `moeflow trace --out {cfg.trace}`")
    tr = Trace(cfg.trace)
    spec = tr.spec
    rows = np.flatnonzero(tr.mask("prefill"))
    if len(rows) == 0:
        raise ArtifactError(f"trace {cfg.trace} has no prefill tokens")
    pid = tr.tokens()["prompt_id"][rows]
    prompts = np.unique(pid)
    if len(prompts) < 2:
        raise ArtifactError(f"trace {cfg.trace} has {len(prompts)} prompt(s); the held-out split needs at least 2")
    rng = np.random.default_rng(cfg.seed)
    n_out = min(len(prompts) - 1, max(1, round(cfg.holdout * len(prompts))))
    held = np.isin(pid, rng.choice(prompts, size=n_out, replace=False))
    test = np.flatnonzero(held)[: cfg.max_batches * cfg.seq_len]
    train = np.flatnonzero(~held)
    use = np.concatenate([train, test])
    layers = []
    for l in spec.moe_layers:
        d = tr.layer(l, ("topk_ids", "probs"))
        p = np.asarray(d["probs"][rows][use], np.float32)
        ids = np.asarray(d["topk_ids"][rows][use]).astype(np.int64)
        cnt = np.bincount(ids.reshape(-1), minlength=spec.num_experts).astype(np.float64) + 1.0
        layers.append(LayerRouting(np.log(np.maximum(p, 1e-8)), ids, np.log(cnt / cnt.sum())))
    inp = SweepInput(
        layers, np.arange(len(train)), np.arange(len(train), len(use)), spec.num_experts, spec.top_k, list(spec.moe_layers)
    )
    return inp, tr


def main(cfg: GPSConfig) -> dict[str, Any]:
    if cfg.plot:  # before any work: a moeflow plot there is replaced; anything else, a folder or an input is not
        from ..outputs import check_out

        check_out(cfg.plot, kind="plot", inputs=(cfg.trace, cfg.predictors), force=True, file=True, flag="--plot")
    inp, tr = load_input(cfg)
    spec = tr.spec
    gpu = measure_this_machine() if cfg.gpu == "this" else GPUS[cfg.gpu]
    sysm = System(cfg.gpus, gpu, _link(cfg), _shape(cfg, spec), cfg.redundant)
    curve = overhead_curve(cfg)
    S = cfg.seq_len
    measured = evaluate_point(inp, 0.0, sysm, S, curve, cfg.seed)
    top = spec.num_experts / spec.top_k  # the largest possible skewness
    sweep: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for target in sorted(set(cfg.skews)):
        if target >= 0.95 * top or target < 1.0:
            skipped.append({"target": target, "reason": f"outside 1..{0.95 * top:.2f} (this routing's possible skewness)"})
            continue
        g = find_gamma(inp.layers, target, spec.num_experts, spec.top_k, S) if inp.test_rows.size else 0.0
        same = next((p for p in [measured, *sweep] if abs(p["gamma"] - g) < 1e-9), None)  # same routing: same point
        point = same if same is not None else {**evaluate_point(inp, g, sysm, S, curve, cfg.seed), "target": target}
        dup = same or duplicate_of(point, [measured, *sweep])
        if dup is not None:
            skipped.append(
                {
                    "target": target,
                    "skewness": point["skewness"],
                    "reason": f"lands on the point at skewness {dup['skewness']:.2f}"
                    + (" (the trace's own)" if dup is measured else ", the nearest the re-routing reaches"),
                }
            )
            continue
        sweep.append(point)
    st = measured["strategies"]
    best = measured["best"]
    res: dict[str, Any] = {
        "trace": str(cfg.trace),
        "arch": spec.arch,
        "num_experts": spec.num_experts,
        "top_k": spec.top_k,
        "moe_layers": len(spec.moe_layers),
        "system": {
            "gpus": cfg.gpus,
            "gpu": dataclasses.asdict(gpu),
            "link": dataclasses.asdict(sysm.link),
            "shape": dataclasses.asdict(sysm.shape),
            "redundant_slots_per_gpu": cfg.redundant,
            "seq_len": S,
        },
        "overhead_curve": dataclasses.asdict(curve),
        "measured": measured,
        "recommended": best,
        "recommendation": _why(best, measured, sysm),
        "savings": {s: st[s]["saving"] for s in st},
        "sweep": sweep,
        "sweep_skipped": skipped,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
    }
    if cfg.plot:
        plot(res, cfg.plot)
        res["plot"] = cfg.plot
    return res


SKEW_DIGITS = 2  # skewness as the tables and the plot print it


def duplicate_of(point: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The point among `others` that `point` repeats (its skewness prints the same), else None: a sweep target
    the re-routing cannot reach lands on a routing another point already shows."""
    key = round(point["skewness"], SKEW_DIGITS)
    return next((o for o in others if o is not point and round(o["skewness"], SKEW_DIGITS) == key), None)


def _why(best: str, point: dict[str, Any], sysm: System) -> str:
    st = point["strategies"]
    comm_share = st["none"]["comm"] / st["none"]["total"]
    ahead = {s: st[s]["total"] for s in st if s != best}
    margin = min(ahead.values()) / st[best]["total"] - 1 if ahead else 0.0
    return (
        f"{STRATEGY_NAMES[best]} ({margin:.1%} ahead of the next) at skewness {point['skewness']:.2f}; communication is "
        f"{comm_share:.0%} of the unpredicted layer on {sysm.link.name}"
    )


def plot(res: dict[str, Any], path: str) -> None:
    """Fig. 2's kind: stacked latency components per strategy vs skewness, with total-latency lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted([res["measured"], *res["sweep"]], key=lambda p: p["skewness"])
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.8))
    names = list(STRATEGY_NAMES)
    comps = ("attention", "ffn", "comm", "overhead")
    colors = {"attention": "#4c72b0", "ffn": "#55a868", "comm": "#c44e52", "overhead": "#8172b2"}
    w = 0.27
    x = np.arange(len(pts))
    for j, s in enumerate(names):
        bottom = np.zeros(len(pts))
        for c in comps:
            v = np.array([p["strategies"][s][c] for p in pts]) * 1e6
            ax[0].bar(
                x + (j - 1) * w, v, w, bottom=bottom, color=colors[c], edgecolor="k", linewidth=0.3, label=c if j == 0 else None
            )
            bottom += v
    ax[0].set_xticks(x, [f"{p['skewness']:.2f}{'*' if p is res['measured'] else ''}" for p in pts])
    ax[0].set_xlabel("skewness (* = the trace's own); bars: none | distribution-only | token-to-expert")
    ax[0].set_ylabel("latency per MoE layer (µs)")
    ax[0].legend(fontsize=8)
    for s in names:
        ax[1].plot([p["skewness"] for p in pts], [p["strategies"][s]["total"] * 1e6 for p in pts], "o-", label=STRATEGY_NAMES[s])
    ax[1].set_xlabel("skewness (max / mean expert load per batch)")
    ax[1].set_ylabel("total latency per MoE layer (µs)")
    ax[1].legend(fontsize=8)
    sy = res["system"]
    fig.suptitle(
        f"MoE-GPS prefill, {sy['shape']['name']} shape, {sy['gpus']} x {sy['gpu']['name']}, {sy['link']['name']}, "
        f"seq {sy['seq_len']}; routing from {Path(res['trace']).name}",
        fontsize=9,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=110, metadata=PLOT_METADATA)  # marks it moeflow's (`artifact_kind`)
    plt.close(fig)


# strategy names in table cells (80 columns): the caption spells out "t2e"
SHORT_NAMES = {"none": "no prediction", "distribution": "distribution", "token_to_expert": "token-to-expert"}


def render(res: dict[str, Any], console: Any) -> None:
    from ..tables import FitTable

    sy = res["system"]
    m = res["measured"]
    t = FitTable(
        f"{res['trace']}: {res['arch']} routing ({res['num_experts']} experts top-{res['top_k']}), "
        f"{sy['shape']['name']} shape, {sy['gpus']} x {sy['gpu']['name']}, {sy['link']['name']}, seq {sy['seq_len']}; "
        f"skewness {m['skewness']:.2f}, distribution-only error rate {m['distribution_error_rate']:.3f} "
        f"({m['batches']} held-out batch x layer)",
        caption="µs per MoE layer (mean over layers and held-out batches): attention, FFN, communication, prediction "
        "overhead; * recommended; token-to-expert at its best simulated accuracy (acc); "
        f"overhead curve: {res['overhead_curve']['source']}",
    )
    for c in ("strategy", "attn", "FFN", "comm", "overhead", "total", "saving", "acc"):
        t.add_column(c)
    for s, r in m["strategies"].items():
        t.add_row(
            SHORT_NAMES[s] + (" *" if s == res["recommended"] else ""),
            f"{r['attention'] * 1e6:.1f}",
            f"{r['ffn'] * 1e6:.1f}",
            f"{r['comm'] * 1e6:.1f}",
            f"{r['overhead'] * 1e6:.1f}",
            f"{r['total'] * 1e6:.1f}",
            f"{r['saving']:+.1%}",
            f"{r['accuracy']:.2f}" if "accuracy" in r else "",
        )
    console.print(t)
    if res["sweep"]:
        t2 = FitTable(
            "skewness sweep (routing re-ranked with a bias: γ>0 γ·log p̄, γ<0 |γ|·balancing bias; γ=0 is the trace)",
            caption="µs per MoE layer (saving vs no prediction); t2e: token-to-expert, acc its simulated accuracy"
            + "".join(f"; skewness {x['target']:g}: {x['reason']}" for x in res.get("sweep_skipped", [])),
        )
        for c in ("skew", "γ", "none", "distribution", "t2e", "t2e acc", "best"):
            t2.add_column(c)
        for p in res["sweep"]:
            s = p["strategies"]
            t2.add_row(
                f"{p['skewness']:.2f}",
                f"{p['gamma']:+.2f}",
                f"{s['none']['total'] * 1e6:.1f}",
                f"{s['distribution']['total'] * 1e6:.1f} ({s['distribution']['saving']:+.0%})",
                f"{s['token_to_expert']['total'] * 1e6:.1f} ({s['token_to_expert']['saving']:+.0%})",
                f"{s['token_to_expert']['accuracy']:.2f}",
                "t2e" if p["best"] == "token_to_expert" else SHORT_NAMES[p["best"]],
            )
        console.print(t2)
    console.print(f"recommended: [bold]{STRATEGY_NAMES[res['recommended']]}[/] — {res['recommendation']}")
    if "plot" in res:
        console.print(f"wrote {escape(str(res['plot']))}")  # a path is text, not markup


__all__ = ["GPSConfig", "main", "plot", "render"]
