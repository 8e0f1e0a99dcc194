"""MoE-GPS prefill simulator for one MoE layer on N GPUs, driven by the measured routing of a trace.

Why not an existing analytic simulator. The paper uses an extended LLMCompass (a block-level
simulator of one accelerator, validated on silicon); its extension for expert duplication and
prediction overhead is not published, and LLMCompass itself models matmuls tile by tile, needs a full
hardware description and takes seconds per operator: too slow for sweeping every batch x layer x
skewness x accuracy of a trace, and its accuracy below the roofline is not what decides the ranking of
strategies here (that is the busiest GPU's load and the all-to-all volume). moeflow's own `moeflow.sim`
is a single-device cache simulator (no GPUs, no collectives). So this is a small analytic model, in the
spirit of LLMCompass's roofline mode, where every term is explicit and unit-tested:

- **attention**: tensor parallel over N GPUs. QKV + output projections and the causal score/value
  products, FLOPs and weight + activation bytes divided by N, time = roofline max(FLOPs / peak,
  bytes / HBM bandwidth) + a kernel launch per kernel; then a **ring all-reduce** of the S x H output,
  2 (N−1)/N x S·H·b / link bandwidth + 2 (N−1) link latencies.
- **FFN**: expert parallel. Each GPU holds `E/N + redundant` expert slots; every expert instance with t
  tokens costs roofline max(2·t·3·H·I / peak, (3·H·I + t·(2H + 2I))·b / HBM) + a launch; the layer waits
  for the busiest GPU.
- **communication**: the paper's model. After the all-reduce the S tokens are scattered (token i is
  owned by GPU ⌊i N / S⌋); **dispatch** sends each (token, expert) assignment from its owner to the GPU
  computing it, **combine** sends the result back. An all-to-all takes max over GPUs of max(bytes sent,
  bytes received) / bandwidth + latency (`all_to_all_time`); links are full duplex, point to point.
- **placement**: no prediction = E/N contiguous experts per GPU, no replicas. Otherwise EPLB-style
  `replicate_and_pack`: give the spare slots one by one to the expert with the highest load per replica,
  then pack replicas heaviest first onto the least-loaded GPU that has a free slot and does not already
  hold that expert. Roofline-aware: a replica is made only while each copy keeps at least the ridge
  point's tokens (peak FLOPs / HBM bandwidth); below it a copy adds a weight read and saves nothing.
- **strategies**. *No prediction*. *Distribution-only*: placement from the MLE p̂ of the training
  prompts, made offline (no overhead); at run time an expert's tokens are split evenly over its replicas.
  *Token-to-expert* at accuracy a (share of assignments predicted right): placement from the batch's
  predicted counts; a correctly predicted assignment is already on its GPU (the all-reduce delivers it
  there: no dispatch and no combine), a mispredicted one is dispatched to a replica of its true expert;
  plus the predictor's overhead from the accuracy -> overhead curve (`OverheadCurve`). The simulated
  predictor keeps each assignment with probability a and otherwise draws a wrong expert from p̂.
- **skewness sweep** (Fig. 2): the real per-token routing is re-routed with a per-expert bias added to
  every token's log router probabilities and top-k taken again: γ = 0 is the trace itself; γ > 0 adds
  γ·log p̄ (p̄ = the layer's measured distribution: popular experts get more popular); γ in [-1, 0) adds
  |γ| x a balancing bias (DeepSeek-V3's auxiliary-loss-free update run to balance on these tokens), which
  flattens. (A negative γ·log p̄ does not flatten: it wakes up near-dead experts and skew rises again.)
  γ is found by bisection for each target skewness (mean over layers and batches of max / mean load).

Model shapes: H, I and the attention heads come from `--model-shape` (or the trace's spec); the number of
experts E and top-k always come from the trace (its routing is real), and a named shape's expert
intermediate size is scaled by E_shape / E_trace so the layer's expert weights keep the named model's
size. Not modelled: moving experts between batches (replicas are assumed resident, as in the paper's
single-batch study), overlap of communication with compute, the gate itself.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..trace.summary import expert_counts, skewness
from .predictors import batches, mle
from .skew import LayerRouting, routed


@dataclass(frozen=True)
class GPU:
    name: str
    flops: float  # peak dense bf16 FLOP/s
    hbm: float  # HBM bytes/s
    launch_s: float = 4e-6  # per kernel


GPUS = {
    "a100": GPU("A100 SXM 80GB", 312e12, 2.039e12),
    "h100": GPU("H100 SXM", 989e12, 3.35e12),
}


@dataclass(frozen=True)
class Interconnect:
    name: str
    bw: float  # bytes/s per GPU per direction
    latency: float  # seconds per collective step


LINKS = {
    "nvlink": Interconnect("NVLink 3 (A100), 300 GB/s per direction", 300e9, 3e-6),
    "pcie": Interconnect("PCIe 4.0 x16, 32 GB/s per direction", 32e9, 10e-6),
}


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    inter: int  # expert intermediate size
    heads: int
    kv_heads: int
    num_experts: int
    top_k: int
    dtype_bytes: int = 2


SHAPES = {
    "mixtral-8x7b": Shape("mixtral-8x7b", 4096, 14336, 32, 8, 8, 2),
    "olmoe-1b-7b": Shape("olmoe-1b-7b", 2048, 1024, 16, 16, 64, 8),
}


def measure_this_machine(seconds: float = 0.5) -> GPU:
    """A 'GPU' from this machine: float32 matmul FLOP/s and copy bandwidth (torch, CPU or current device)."""
    import torch

    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    t0, reps = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds / 2:
        a @ b
        reps += 1
    flops = 2 * n**3 * reps / (time.perf_counter() - t0)
    x = torch.empty(16 * 2**20 // 4)
    y = torch.empty_like(x)
    t0, reps = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds / 2:
        y.copy_(x)
        reps += 1
    bw = 2 * x.numel() * 4 * reps / (time.perf_counter() - t0)
    return GPU("this machine (measured)", flops, bw, 2e-6)


def roofline(flops: float, nbytes: float, gpu: GPU, kernels: int = 1) -> float:
    return max(flops / gpu.flops, nbytes / gpu.hbm) + kernels * gpu.launch_s


def attention_time(S: int, sh: Shape, gpu: GPU, N: int) -> float:
    """Tensor-parallel attention of S prefill tokens on one of N GPUs (projections + causal scores)."""
    H, b = sh.hidden, sh.dtype_bytes
    hkv = H * sh.kv_heads // sh.heads
    w = H * (H + 2 * hkv) + H * H  # QKV + O weights
    flops = 2 * S * w / N + 2 * S * S * H / N  # causal: half of QK^T and AV
    nbytes = (w * b + 4 * S * H * b + 2 * S * hkv * b) / N + S * H * b
    return roofline(flops, nbytes, gpu, kernels=4)


def allreduce_time(nbytes: float, N: int, link: Interconnect) -> float:
    """Ring all-reduce (reduce-scatter + all-gather) of `nbytes` on every GPU."""
    if N == 1:
        return 0.0
    return 2 * (N - 1) / N * nbytes / link.bw + 2 * (N - 1) * link.latency


def all_to_all_time(matrix: np.ndarray, bytes_per_item: float, link: Interconnect) -> float:
    """All-to-all of matrix[src, dst] items (diagonal stays local): max over GPUs of max(sent, received)."""
    m = np.array(matrix, dtype=np.float64)
    np.fill_diagonal(m, 0.0)
    if m.sum() == 0:
        return 0.0
    vol = max(m.sum(1).max(), m.sum(0).max())
    return float(vol * bytes_per_item / link.bw + link.latency)


def expert_time(tokens: np.ndarray, sh: Shape, gpu: GPU) -> float:
    """Sum over expert instances (tokens [n]) of the roofline time of one SwiGLU expert; idle ones cost 0."""
    t = np.asarray(tokens, dtype=np.float64)
    t = t[t > 0]
    H, I, b = sh.hidden, sh.inter, sh.dtype_bytes
    flops = 2 * t * 3 * H * I
    nbytes = 3 * H * I * b + t * (2 * H + 2 * I) * b
    return float(np.maximum(flops / gpu.flops, nbytes / gpu.hbm).sum() + len(t) * 3 * gpu.launch_s)


# ---- placement -------------------------------------------------------------------------------------


def static_placement(E: int, N: int) -> list[list[int]]:
    """No prediction: experts in contiguous blocks of ceil(E/N) per GPU."""
    per = math.ceil(E / N)
    return [list(range(g * per, min(E, (g + 1) * per))) for g in range(N)]


def replicate_and_pack(load: np.ndarray, N: int, slots: int, min_share: float = 0.0) -> list[list[int]]:
    """EPLB-style: spare slots go to the expert with the highest load per replica (at most N replicas each, and
    only while that load per replica stays >= `min_share`), then replicas are packed heaviest first onto the
    least-loaded GPU with a free slot not holding that expert."""
    w = np.asarray(load, dtype=np.float64)
    E = len(w)
    if slots * N < E:
        raise ConfigError(f"{N} GPUs x {slots} slots cannot hold {E} experts")
    reps = np.ones(E, np.int64)
    for _ in range(slots * N - E):
        per = np.where((reps < N) & (w / (reps + 1) >= min_share), w / reps, -1.0)
        if per.max() < 0:
            break
        reps[int(np.argmax(per))] += 1
    items = sorted(((w[e] / reps[e], e) for e in range(E) for _ in range(reps[e])), key=lambda x: (-x[0], x[1]))
    gpus: list[list[int]] = [[] for _ in range(N)]
    gl = np.zeros(N)
    for share, e in items:
        ok = [g for g in range(N) if len(gpus[g]) < slots and e not in gpus[g]]
        if not ok:
            ok = [g for g in range(N) if len(gpus[g]) < slots]
        g = min(ok, key=lambda g: (gl[g], g))
        gpus[g].append(e)
        gl[g] += share
    return gpus


def replica_table(placement: list[list[int]], E: int) -> list[list[int]]:
    """expert -> GPUs holding it."""
    reps: list[list[int]] = [[] for _ in range(E)]
    for g, es in enumerate(placement):
        for e in es:
            reps[e].append(g)
    return reps


def spread(experts: np.ndarray, reps: list[list[int]]) -> np.ndarray:
    """GPU for each assignment [n]: an expert's assignments go round-robin over its replicas, in order."""
    experts = np.asarray(experts, np.int64)
    out = np.zeros(len(experts), np.int64)
    order = np.argsort(experts, kind="stable")
    se = experts[order]
    first = np.searchsorted(se, se)
    rank = np.arange(len(se)) - first
    nrep = np.array([len(r) for r in reps])
    table = np.full((len(reps), max(1, nrep.max())), -1)
    for e, r in enumerate(reps):
        table[e, : len(r)] = r
    if (nrep[se] == 0).any():
        raise ConfigError("an expert has no replica in the placement")
    out[order] = table[se, rank % nrep[se]]
    return out


# ---- prediction overhead ------------------------------------------------------------------------


@dataclass(frozen=True)
class OverheadCurve:
    """Token-to-expert predictor cost by accuracy: t_lo * exp(beta * d), d = (a - a0) / (1 - a0).

    a0 is what the free global-argmax model reaches on the batch (higher at high skew, so the same accuracy
    is cheaper there, as the paper observes); the cost grows exponentially towards perfect prediction
    (paper appendix C). Default: t_lo = a table lookup (10 µs), t_hi = exp(beta) t_lo = an LSTM run over
    the S tokens sequentially (2 layers x S steps x 5 µs). `fit` replaces it by a least-squares fit of
    log time on d through measured predictors (`moeflow train --only gps`)."""

    t_lo: float = 10e-6
    beta: float = math.log(512 * 2 * 5e-6 / 10e-6)
    source: str = "default (lookup 10 µs -> LSTM over S tokens)"

    @classmethod
    def default(cls, S: int) -> OverheadCurve:
        return cls(
            10e-6, math.log(max(S * 2 * 5e-6, 2e-5) / 10e-6), f"default (lookup 10 µs -> LSTM over {S} tokens, 10 µs/token)"
        )

    @classmethod
    def fit(cls, points: list[tuple[float, float]], source: str = "fitted") -> OverheadCurve:
        """points: (d, seconds) of measured predictors."""
        d = np.array([p[0] for p in points], np.float64)
        y = np.log(np.maximum([p[1] for p in points], 1e-9))
        if len(points) < 2 or np.ptp(d) == 0:
            raise ConfigError("fitting the accuracy -> overhead curve needs predictors of at least two accuracies")
        beta, c = np.polyfit(d, y, 1)
        return cls(float(math.exp(c)), float(max(beta, 0.0)), source)

    def __call__(self, acc: float, a0: float) -> float:
        d = 0.0 if a0 >= 1 else float(np.clip((acc - a0) / (1 - a0), 0.0, 1.0))
        return self.t_lo * math.exp(self.beta * d)


# ---- one layer, one batch ------------------------------------------------------------------------


@dataclass
class Breakdown:
    attention: float = 0.0
    ffn: float = 0.0
    comm: float = 0.0
    overhead: float = 0.0
    accuracy: float | None = None

    @property
    def total(self) -> float:
        return self.attention + self.ffn + self.comm + self.overhead

    def add(self, o: Breakdown, w: float = 1.0) -> None:
        self.attention += w * o.attention
        self.ffn += w * o.ffn
        self.comm += w * o.comm
        self.overhead += w * o.overhead

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if v is not None}
        d["total"] = self.total
        return d


@dataclass(frozen=True)
class System:
    gpus: int
    gpu: GPU
    link: Interconnect
    shape: Shape
    redundant: int = 1  # spare expert slots per GPU for replicas


def ep_layer(ids: np.ndarray, gpu_of: np.ndarray, local: np.ndarray, sysm: System) -> tuple[float, float]:
    """(ffn, comm) of one MoE layer: ids [S,k] true experts, gpu_of [S,k] the GPU computing each assignment,
    local [S,k] True where that GPU already holds the token (no dispatch / combine)."""
    N, sh = sysm.gpus, sysm.shape
    S = len(ids)
    cnt = np.zeros((N, sh.num_experts))
    np.add.at(cnt, (gpu_of.reshape(-1), ids.reshape(-1)), 1)
    ffn = max(expert_time(cnt[g], sh, sysm.gpu) for g in range(N))
    owner = np.repeat((np.arange(S) * N // max(S, 1))[:, None], ids.shape[1], 1)
    mv = ~local
    m = np.zeros((N, N))
    np.add.at(m, (owner[mv], gpu_of[mv]), 1)
    tok_bytes = sh.hidden * sh.dtype_bytes
    comm = all_to_all_time(m, tok_bytes, sysm.link) + all_to_all_time(m.T, tok_bytes, sysm.link)
    return ffn, comm


def simulate_predictions(ids: np.ndarray, p_hat: np.ndarray, acc: float, rng: np.random.Generator) -> np.ndarray:
    """Predicted ids [S,k]: each assignment kept with probability acc, else a wrong expert drawn from p_hat."""
    E = len(p_hat)
    pred = ids.copy()
    wrong = rng.random(ids.shape) >= acc
    n = int(wrong.sum())
    if n:
        q = np.maximum(p_hat, 1e-9)
        q = q / q.sum()
        cand = rng.choice(E, size=n, p=q)
        r, c = np.nonzero(wrong)
        for _ in range(4):  # redraw candidates that are one of the token's true experts
            bad = (ids[r] == cand[:, None]).any(1)
            if not bad.any():
                break
            cand[bad] = rng.choice(E, size=int(bad.sum()), p=q)
        pred[r, c] = cand
    return pred


def layer_latency(
    ids: np.ndarray,
    p_hat: np.ndarray,
    sysm: System,
    curve: OverheadCurve,
    accs: list[float] | None,
    rng: np.random.Generator,
) -> dict[str, Breakdown]:
    """Every strategy on one batch of one layer; token-to-expert at its best accuracy of `accs`."""
    N, sh = sysm.gpus, sysm.shape
    S, k = ids.shape
    E = sh.num_experts
    attn = attention_time(S, sh, sysm.gpu, N)
    ar = allreduce_time(S * sh.hidden * sh.dtype_bytes, N, sysm.link)
    base = Breakdown(attention=attn, comm=ar)
    no_local = np.zeros(ids.shape, bool)
    slots = math.ceil(E / N) + sysm.redundant
    # a replica only pays off while each copy still gets enough tokens to be compute bound (roofline ridge);
    # below it, splitting an expert adds a weight read on another GPU and saves no time
    ridge = sysm.gpu.flops / sysm.gpu.hbm * sh.dtype_bytes / 2  # tokens per expert at the ridge point
    out: dict[str, Breakdown] = {}
    # no prediction
    gpu_of = spread(ids.reshape(-1), replica_table(static_placement(E, N), E)).reshape(ids.shape)
    ffn, comm = ep_layer(ids, gpu_of, no_local, sysm)
    out["none"] = replace(base, ffn=ffn, comm=ar + comm)
    # distribution-only: offline placement from p̂
    reps = replica_table(replicate_and_pack(p_hat * ids.size, N, slots, ridge), E)
    gpu_of = spread(ids.reshape(-1), reps).reshape(ids.shape)
    ffn, comm = ep_layer(ids, gpu_of, no_local, sysm)
    out["distribution"] = replace(base, ffn=ffn, comm=ar + comm)
    # token-to-expert at each accuracy; keep the best
    p_batch = expert_counts(ids, E) / ids.size
    a0 = float(np.sort(p_batch)[::-1][:k].sum())  # global argmax (top-k most popular) accuracy
    if accs is None:
        accs = [a0 + d * (1 - a0) for d in (0.0, 0.25, 0.5, 0.7, 0.85, 0.95)]
    best: Breakdown | None = None
    for a in accs:
        pred = simulate_predictions(ids, p_hat, a, rng)
        reps_t = replica_table(replicate_and_pack(expert_counts(pred, E).astype(float), N, slots, ridge), E)
        pred_gpu = spread(pred.reshape(-1), reps_t).reshape(ids.shape)
        # true assignment (i, e): if e is among token i's predicted experts it runs where that prediction went
        match = pred[:, None, :] == ids[:, :, None]  # [S, k_true, k_pred]
        hit = match.any(-1)
        where = np.where(hit, np.take_along_axis(pred_gpu, match.argmax(-1), 1), 0)
        miss_gpu = spread(ids[~hit], reps_t) if (~hit).any() else np.zeros(0, np.int64)
        gpu_of = where.copy()
        gpu_of[~hit] = miss_gpu
        ffn, comm = ep_layer(ids, gpu_of, hit, sysm)
        b = replace(base, ffn=ffn, comm=ar + comm, overhead=curve(a, a0), accuracy=float(hit.mean()))
        if best is None or b.total < best.total:
            best = b
    assert best is not None
    out["token_to_expert"] = best
    return out


@dataclass
class SweepInput:
    layers: list[LayerRouting]
    train_rows: np.ndarray
    test_rows: np.ndarray
    E: int
    k: int
    layer_ids: list[int] = field(default_factory=list)


def evaluate_point(inp: SweepInput, gamma: float, sysm: System, S: int, curve: OverheadCurve, seed: int = 0) -> dict[str, Any]:
    """Mean per-layer latency of each strategy over the test batches at routing bias gamma."""
    rng = np.random.default_rng(seed)
    ids_all = routed(inp.layers, gamma, inp.k)
    tot = {s: Breakdown() for s in ("none", "distribution", "token_to_expert")}
    acc: list[float] = []
    n = 0
    skews, errs = [], []
    for ids in ids_all:
        p_hat = mle(ids[inp.train_rows], inp.E)
        test = ids[inp.test_rows]
        for b in batches(len(test), S):
            res = layer_latency(test[b], p_hat, sysm, curve, None, rng)
            for s, r in res.items():
                tot[s].add(r)
            acc.append(res["token_to_expert"].accuracy or 0.0)
            skews.append(skewness(expert_counts(test[b], inp.E)))
            errs.append(float(np.abs(p_hat - mle(test[b], inp.E)).mean() * inp.E))
            n += 1
    strategies = {}
    for s, tb in tot.items():
        d = Breakdown(tb.attention / n, tb.ffn / n, tb.comm / n, tb.overhead / n).to_dict()
        if s == "token_to_expert":
            d["accuracy"] = float(np.mean(acc))
        strategies[s] = d
    none = strategies["none"]["total"]
    for d in strategies.values():
        d["saving"] = 1 - d["total"] / none
    return {
        "gamma": gamma,
        "skewness": float(np.mean(skews)),
        "distribution_error_rate": float(np.mean(errs)),
        "batches": n,
        "strategies": strategies,
        "best": min(strategies, key=lambda s: strategies[s]["total"]),
    }
