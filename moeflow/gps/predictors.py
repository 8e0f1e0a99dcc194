"""MoE-GPS prediction strategies (paper §3 and appendix A/B), fitted on traces, scored on held-out prompts.

Distribution-only (appendix A): per MoE layer the multinomial MLE p̂_i = n_i / N over the training rows.
With top-k routing every (token, slot) assignment is one draw, so N = tokens x k and p̂ sums to 1.
Its **error rate** is the paper's |p̂ − p| / (1/K): the mean over experts of |p̂_i − p_i| divided by
1/K (K experts), against the test set's empirical distribution p, averaged over layers. We also give it
against each test batch's own distribution (`batch_error_rate`), which is what a placement made from p̂
meets at run time. **Batch-wise skewness**: rows are packed in trace order into batches of `seq_len`
tokens (batch size 1, as the paper's sequence length 512), skewness = max count / mean count per expert
(`moeflow.trace.summary.skewness`) per batch and layer, averaged.

Token-to-expert (appendix B), each predicting every MoE layer's experts for a token before attention:
- `probability`: the global argmax (the k most frequent experts of the layer, the same for every token);
- `token-id` / `position`: conditional frequency tables n_{k,i} by token id or by absolute position,
  unseen keys fall back to the global frequencies;
- `ffn`: token embedding -> Linear(H,128) -> ReLU -> one Linear(128,K) head per MoE layer;
- `lstm`: token embedding -> Linear(H,128) -> ReLU -> 2-layer LSTM(hidden 64) -> sparse self-attention
  over the LSTM outputs (q = k = v = outputs, causal, each query keeps only its `attn_topk` largest
  scores) + a residual Linear(128,64) of the compressed input -> one Linear(64,K) head per layer.
  Both are trained with cross-entropy (soft target: the routed top-k set, slot j weighted k − j so the
  first choice leads) and Adam.
Inputs are the model's input token embeddings (the paper's "token embeddings"), so no `--record-hidden`
trace is needed. Accuracy: `top1` = argmax equals the router's first choice; `topk` = |predicted top-k ∩
routed top-k| / k (the share of assignments a token-to-expert placement gets right). `ms_per_batch`:
wall time to predict all layers for one batch of `seq_len` tokens on this machine.

Saved without pickle: `tables.npz` (np.load(allow_pickle=False)), `ffn.pt` / `lstm.pt` state dicts
(torch.load(weights_only=True)) and `config.json`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ArtifactError
from ..trace.summary import expert_counts, skewness
from .models import FFNPredictor, LSTMPredictor, TableModel, net_scores, sequences, soft_targets, train_net

TABLES = ("probability", "token-id", "position")
NEURAL = ("ffn", "lstm")
STRATEGIES = TABLES + NEURAL


# ---- distribution-only -------------------------------------------------------------------------


def mle(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Multinomial MLE p̂_i = n_i / N over all (token, slot) assignments [E] (uniform when N = 0)."""
    c = expert_counts(topk_ids, num_experts).astype(np.float64)
    return c / c.sum() if c.sum() > 0 else np.full(num_experts, 1.0 / num_experts)


def error_rate(p_hat: np.ndarray, p: np.ndarray) -> float:
    """MoE-GPS error rate: mean_i |p̂_i − p_i| / (1/K)."""
    p_hat, p = np.asarray(p_hat, np.float64), np.asarray(p, np.float64)
    return float(np.abs(p_hat - p).mean() * p.size)


def batches(n: int, seq_len: int) -> list[slice]:
    """Rows 0..n packed into batches of seq_len (the last, shorter one kept if it is at least half full)."""
    out = [slice(s, min(n, s + seq_len)) for s in range(0, n, seq_len)]
    if len(out) > 1 and out[-1].stop - out[-1].start < seq_len // 2:
        out.pop()
    return out


def batch_skewness(topk_ids: np.ndarray, num_experts: int, seq_len: int) -> float:
    """Mean over batches of seq_len tokens of max / mean expert load."""
    vals = [skewness(expert_counts(topk_ids[b], num_experts)) for b in batches(len(topk_ids), seq_len)]
    vals = [v for v in vals if not math.isnan(v)]
    return float(np.mean(vals)) if vals else float("nan")


def distribution_report(
    train: dict[int, np.ndarray], test: dict[int, np.ndarray], num_experts: int, seq_len: int
) -> dict[str, Any]:
    """Per-layer MLE on `train`, its error rate vs `test` (pooled and per batch), both sets' batch skewness.
    `train` / `test`: layer -> top-k ids [N,k]."""
    layers = []
    for l in sorted(train):
        p_hat = mle(train[l], num_experts)
        te = test[l]
        per_batch = [error_rate(p_hat, mle(te[b], num_experts)) for b in batches(len(te), seq_len)]
        layers.append(
            {
                "layer": l,
                "error_rate": error_rate(p_hat, mle(te, num_experts)),
                "batch_error_rate": float(np.mean(per_batch)) if per_batch else float("nan"),
                "skew_train": batch_skewness(train[l], num_experts, seq_len),
                "skew_test": batch_skewness(te, num_experts, seq_len),
            }
        )
    mean = {k: float(np.mean([L[k] for L in layers])) for k in ("error_rate", "batch_error_rate", "skew_train", "skew_test")}
    return {"seq_len": seq_len, **mean, "layers": layers}


# ---- the suite ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPSFitConfig:
    seq_len: int = 512  # batch (sequence) length for skewness and timing
    width: int = 128
    lstm_hidden: int = 64
    attn_topk: int = 8
    steps: int = 300  # Adam steps per network
    lr: float = 3e-3
    batch: int = 16  # sequences per step
    seed: int = 0


@dataclass
class RoutingRows:
    """What the GPS predictors see: token ids, positions, prompt ids, and per-layer top-k ids."""

    token_id: np.ndarray
    position: np.ndarray
    prompt_id: np.ndarray
    ids: dict[int, np.ndarray]  # layer -> [N,k]

    @classmethod
    def from_data(cls, data: Any, prefill_only: bool = True) -> RoutingRows:
        """From a `RoutingData` (prefill rows only when it has any: MoE-GPS studies prefill)."""
        rows = np.flatnonzero(data.phase == 0) if prefill_only and (data.phase == 0).any() else np.arange(data.n)
        return cls(
            data.token_id[rows],
            data.position[rows],
            data.prompt_id[rows],
            {l: np.asarray(a.topk_ids[rows]).astype(np.int64) for l, a in data.layers.items()},
        )

    @property
    def n(self) -> int:
        return len(self.token_id)


def _topk_acc(scores: np.ndarray, ids: dict[int, np.ndarray], layers: list[int]) -> tuple[float, float, list[dict]]:
    per = []
    for j, l in enumerate(layers):
        y = ids[l]
        k = y.shape[1]
        s = scores[:, j, :]
        top1 = float((s.argmax(-1) == y[:, 0]).mean())
        pred = np.argsort(-s, axis=-1, kind="stable")[:, :k]
        hit = (pred[:, :, None] == y[:, None, :]).any(-1).sum(-1) / k
        per.append({"layer": l, "top1": top1, "topk": float(hit.mean())})
    return float(np.mean([p["top1"] for p in per])), float(np.mean([p["topk"] for p in per])), per


class GPSSuite:
    """Every MoE-GPS predictor of one trace: the MLE distribution, three tables, the FFN and the LSTM."""

    name = "gps"

    def __init__(self, num_experts: int, top_k: int, layers: list[int], hidden: int, cfg: GPSFitConfig):
        self.E, self.k, self.layers, self.hidden, self.cfg = num_experts, top_k, layers, hidden, cfg
        self.p_hat = np.zeros((len(layers), num_experts))
        self.tables: dict[str, TableModel] = {}
        self.nets: dict[str, nn.Module] = {}
        self.report: dict[str, Any] = {}
        self.fit_seconds = 0.0

    def _new_net(self, kind: str) -> nn.Module:
        c = self.cfg
        if kind == "ffn":
            return FFNPredictor(self.hidden, self.E, len(self.layers), c.width)
        return LSTMPredictor(self.hidden, self.E, len(self.layers), c.width, c.lstm_hidden, c.attn_topk)

    def fit(self, train: RoutingRows, emb: torch.Tensor) -> GPSSuite:
        t0 = time.perf_counter()
        self.p_hat = np.stack([mle(train.ids[l], self.E) for l in self.layers])
        for kind in TABLES:
            self.tables[kind] = TableModel(kind, self.E, self.layers).fit(train.token_id, train.position, train.ids)
        seqs = sequences(train.prompt_id, train.position, self.cfg.seq_len)
        targets = soft_targets(train.ids, self.layers, self.E)
        self.report["loss"] = {}
        for i, kind in enumerate(NEURAL):
            torch.manual_seed(self.cfg.seed + i)
            net = self._new_net(kind)
            losses = train_net(
                net,
                emb,
                train.token_id,
                seqs,
                targets,
                steps=self.cfg.steps,
                lr=self.cfg.lr,
                batch=self.cfg.batch,
                seed=self.cfg.seed,
            )
            self.report["loss"][kind] = [round(losses[0], 4), round(losses[-1], 4)]
            self.nets[kind] = net
        self.fit_seconds = time.perf_counter() - t0
        return self

    def scores(self, kind: str, rows: RoutingRows, emb: torch.Tensor) -> np.ndarray:
        if kind in self.tables:
            return self.tables[kind].scores(rows.token_id, rows.position)
        return net_scores(self.nets[kind], emb, rows.token_id, sequences(rows.prompt_id, rows.position, self.cfg.seq_len), rows.n)

    def time_per_batch(self, kind: str, emb: torch.Tensor, reps: int = 5) -> float:
        """Median seconds to predict every layer for one batch of seq_len tokens (this machine)."""
        T = self.cfg.seq_len
        rng = np.random.default_rng(0)
        tok = rng.integers(0, emb.shape[0], T)
        rows = RoutingRows(tok, np.arange(T), np.zeros(T, np.int64), {})
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            s = self.scores(kind, rows, emb)
            np.argsort(-s, axis=-1)[..., : self.k]
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    def evaluate(self, train: RoutingRows | None, test: RoutingRows, emb: torch.Tensor) -> dict[str, Any]:
        """The distribution-only report (against `test`) and every token-to-expert predictor's accuracy on it."""
        if test.n == 0:
            raise ArtifactError("no held-out tokens to evaluate the MoE-GPS predictors on")
        if train is not None:
            dist = distribution_report({l: train.ids[l] for l in self.layers}, test.ids, self.E, self.cfg.seq_len)
        else:
            dist = self._dist_from_p_hat(test)
        t2e = {}
        for kind in STRATEGIES:
            top1, topk, per = _topk_acc(self.scores(kind, test, emb), test.ids, self.layers)
            t2e[kind] = {"top1": top1, "topk": topk, "ms_per_batch": 1e3 * self.time_per_batch(kind, emb), "layers": per}
        return {
            "num_experts": self.E,
            "top_k": self.k,
            "test_tokens": test.n,
            "distribution_only": dist,
            "token_to_expert": t2e,
            "loss": self.report.get("loss", {}),
        }

    def _dist_from_p_hat(self, test: RoutingRows) -> dict[str, Any]:
        """Distribution report when only the saved p̂ is known (moeflow eval on another trace)."""
        layers = []
        for j, l in enumerate(self.layers):
            te = test.ids[l]
            per = [error_rate(self.p_hat[j], mle(te[b], self.E)) for b in batches(len(te), self.cfg.seq_len)]
            layers.append(
                {
                    "layer": l,
                    "error_rate": error_rate(self.p_hat[j], mle(te, self.E)),
                    "batch_error_rate": float(np.mean(per)) if per else float("nan"),
                    "skew_train": skewness(self.p_hat[j]),
                    "skew_test": batch_skewness(te, self.E, self.cfg.seq_len),
                }
            )
        keys = ("error_rate", "batch_error_rate", "skew_train", "skew_test")
        return {"seq_len": self.cfg.seq_len, **{k: float(np.mean([L[k] for L in layers])) for k in keys}, "layers": layers}

    # -- persistence (no pickle) --
    def save(self, folder: Path) -> None:
        arrays: dict[str, np.ndarray] = {"p_hat": self.p_hat}
        for t in self.tables.values():
            arrays.update(t.arrays())
        np.savez(folder / "tables.npz", **arrays)  # type: ignore[arg-type]
        for kind, net in self.nets.items():
            torch.save(net.state_dict(), folder / f"{kind}.pt")
        cfg = {"num_experts": self.E, "top_k": self.k, "layers": self.layers, "hidden": self.hidden, "fit": asdict(self.cfg)}
        (folder / "config.json").write_text(json.dumps({**cfg, "report": self.report}, indent=1))

    @classmethod
    def load(cls, folder: Path, model: Any = None) -> GPSSuite:
        from ..predict.io import artifact_file, load_tensors, read_json_file

        c = read_json_file(folder / "config.json")
        self = cls(
            int(c["num_experts"]), int(c["top_k"]), [int(l) for l in c["layers"]], int(c["hidden"]), GPSFitConfig(**c["fit"])
        )
        self.report = c.get("report", {})
        with artifact_file(folder / "tables.npz"), np.load(folder / "tables.npz", allow_pickle=False) as z:
            self.p_hat = z["p_hat"]
            for kind in TABLES:
                self.tables[kind] = TableModel.from_arrays(kind, z, self.E, self.layers)
        for kind in NEURAL:
            net = self._new_net(kind)
            with artifact_file(folder / f"{kind}.pt"):
                nn.Module.load_state_dict(net, load_tensors(folder / f"{kind}.pt"))
            net.eval()
            self.nets[kind] = net
        return self


def input_embeddings(model: nn.Module) -> torch.Tensor:
    """The model's input token embedding matrix [V,H] (float32, no grad)."""
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    if emb is None or not hasattr(emb, "weight"):
        raise ArtifactError("the model has no input embedding matrix to feed the MoE-GPS predictors")
    return emb.weight.detach().float()


def fit_and_evaluate(
    train_data: Any, held_data: Any, model: nn.Module, cfg: GPSFitConfig | None = None
) -> tuple[GPSSuite, dict[str, Any]]:
    """`moeflow train --only gps`: fit on the training prompts, report on the held-out ones."""
    cfg = cfg or GPSFitConfig()
    spec = train_data.spec
    emb = input_embeddings(model)
    tr, te = RoutingRows.from_data(train_data), RoutingRows.from_data(held_data)
    if tr.n == 0:
        raise ArtifactError("no training tokens for the MoE-GPS predictors")
    suite = GPSSuite(spec.num_experts, spec.top_k, list(spec.moe_layers), emb.shape[1], cfg).fit(tr, emb)
    report = suite.evaluate(tr, te, emb)
    report["fit_seconds"] = round(suite.fit_seconds, 3)
    suite.report["eval"] = {k: v for k, v in report.items() if k != "loss"}
    return suite, report


def render(report: dict[str, Any], console: Any, title: str = "MoE-GPS predictors (held out)") -> None:
    """Tables of a `GPSSuite.evaluate` report (readable at 80 columns: `moeflow.tables.FitTable`)."""
    from ..tables import FitTable

    d = report["distribution_only"]
    t = FitTable(
        f"{title}: distribution-only (multinomial MLE), {report['num_experts']} experts top-{report['top_k']}, "
        f"batches of {d['seq_len']} tokens",
        caption="error rate = mean |p̂ − p| / (1/K) vs the test set's distribution (pooled) and vs each test batch; "
        "skew = max / mean load per batch",
    )
    for c in ("layer", "error rate", "batch error rate", "skew train", "skew test"):
        t.add_column(c)
    for L in [*d["layers"], {"layer": "mean", **d}]:
        t.add_row(
            str(L["layer"]),
            f"{L['error_rate']:.3f}",
            f"{L['batch_error_rate']:.3f}",
            f"{L['skew_train']:.3f}",
            f"{L['skew_test']:.3f}",
        )
    console.print(t)
    t2 = FitTable(f"token-to-expert on {report['test_tokens']} held-out tokens (mean over layers)")
    for c in ("predictor", "top-1 acc", f"top-{report['top_k']} acc", "ms / batch"):
        t2.add_column(c)
    for n, r in report["token_to_expert"].items():
        t2.add_row(n, f"{r['top1']:.3f}", f"{r['topk']:.3f}", f"{r['ms_per_batch']:.2f}")
    console.print(t2)
