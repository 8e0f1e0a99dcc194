"""The neural estimator (Speculating Experts, section 6.1 + appendix A): fit, predict, save, load. Its network and
input features are in `estimator_net.py`; Hybrid-PF (section 6.3), which serves it on some (layer, S) pairs, is in
`hybrid.py`.

Estimator: features x -> standardise -> linear projection A (F->m) + a learned embedding of the
(source layer, S) pair (the paper's "positional embedding" of layer l; with S > 1 one embedding per
pair) -> `blocks` x [z + C(SiLU(B z))] (B: m->n, C: n->m, residual) -> LayerNorm(m) -> head (m->E)
= router logits of the target layer; in the residual form (`residual`, the default) the target layer's
router applied to q_S is added, so the network learns the correction to Router-PF's logits (held out on
olmoe-deep, 50 ShareGPT prompts: 3 epochs of it match 8 of the plain form within 0.4 recall points at
every S, higher at S = 1, 2). The paper feeds q
alone; here x also carries what is known at the source layer and what the token-id baseline shows to be
predictive at every S:

    x = [ q_S       [H]  the quasi-hidden state chained S steps (`default_vectors.QuasiHidden`; S=1: q_l),
          u_l       [H]  the source layer's router input (its normed hidden state),
          e_t, e_t-1 [cH] the model's own input embeddings of the last `context` tokens (0 = none),
          g         [L*E] the gate weights of the experts each MoE layer up to the source chose
                          (scattered per layer; later layers 0) ]

so F = (2 + context) H + L E (`feature_dim`). Trained by distillation, KL(router probs ||
softmax(logits)) on the traced router probabilities of the target layer, plus `bce` x a multi-label
binary cross-entropy against the routed top-k set (what recall@k scores), AdamW with a one-cycle
learning-rate schedule, early stopping on the recall of a validation part of the training prompts.
Each step takes a set of rows with all their (layer, S) pairs, so the first layer runs once per distinct
input part (q per pair, [u | g] per source layer, the token embeddings per row; `_logits_parts`).
The standardisation (mean / std per feature of the training set) is part of the saved network.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ArtifactError, ConfigError
from .base import PREDICTORS
from .data import RoutingData, SourceBatch, batch_from_rows, iter_chunks, split_rows, target_of
from .default_vectors import QuasiHidden, compute_default_vectors, load_dvec, save_dvec
from .estimator_net import EstimatorFeatures, EstimatorNet

STD_SAMPLES = 20_000  # (pair, row) samples the feature standardisation is measured on
STD_CHUNK = 1024  # of them assembled at a time (`Estimator._moments`)
EST_DTYPES = ("auto", "bfloat16", "float32")  # `est_dtype`: what training multiplies in (auto: `native_bf16`)
FEATURES_VERSION = 2  # config.json "features": 1 = q only (older folders, refused with a message)


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (x86's `avx512_bf16` or `amx_bf16` flag in Linux's
    /proc/cpuinfo, or `cpuinfo`'s text) and torch has oneDNN to use it: with `TrainConfig.est_dtype` "auto" the
    estimator's training steps then run in bfloat16 autocast. Elsewhere bfloat16 products are emulated and no
    faster, so it trains in float32."""
    if not torch.backends.mkldnn.is_available():
        return False
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return bool({"avx512_bf16", "amx_bf16"} & set(line.split(":", 1)[-1].split()))
    return False


def _hidden(data: RoutingData, layer: int) -> np.ndarray:
    h = data.layers[layer].hidden_in
    if h is None:
        raise ArtifactError("the estimator needs traced router inputs; re-run `moeflow trace --record-hidden`")
    return h


@PREDICTORS.register
class Estimator:
    name: ClassVar[str] = "estimator"
    needs_hidden: ClassVar[bool] = True

    def __init__(
        self,
        model: torch.nn.Module,
        max_lookahead: int = 4,
        m: int = 128,
        n: int = 256,
        blocks: int = 1,
        context: int = 2,
        residual: bool = True,
    ):
        self.model = model
        self.max_lookahead = max_lookahead
        self.m, self.n, self.blocks, self.context = m, n, blocks, context
        self.residual = residual  # logits = the network's + the target router's of q (Router-PF's)
        self.qh: QuasiHidden | None = None
        self.feat: EstimatorFeatures | None = None
        self.pairs: list[tuple[int, int]] = []  # (source layer, S) -> embedding row
        self.net: EstimatorNet | None = None
        self.history: list[dict[str, float]] = []
        self.fit_seconds = 0.0
        self.bf16 = False  # trained with its products in bfloat16 autocast (TrainConfig.est_dtype, `native_bf16`)
        self.val_recall: dict[tuple[int, int], float] | None = None  # (source layer, S) -> validation recall@k
        self.val_prompts: np.ndarray | None = None  # prompt ids of that validation part

    @classmethod
    def create(cls, model: torch.nn.Module, cfg: Any) -> Estimator:
        return cls(
            model, cfg.max_s, cfg.est_latent, cfg.est_hidden, cfg.est_blocks, cfg.est_context, getattr(cfg, "est_residual", True)
        )

    def _pair(self, source: int, s: int) -> int:
        return self.pairs.index((source, s))

    @torch.no_grad()
    def _parts(self, data: RoutingData, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """The inputs of every (pair, row) for `rows`, kept per part so that a mini-batch of rows x all pairs
        runs the first layer once per distinct input (`_logits_parts`): q per pair and row, [u | g] per
        source rank and row, the token embeddings per row; and the targets of each pair."""
        assert self.qh is not None and self.feat is not None
        spec = data.spec
        ml = list(spec.moe_layers)
        n = len(rows)
        srcs = sorted({ml.index(l) for l, _ in self.pairs})  # source ranks in use
        by_src: dict[int, list[torch.Tensor]] = {}
        by_src_rl: dict[int, list[torch.Tensor]] = {}
        for src in ml:
            smax = max([s for (l, s) in self.pairs if l == src], default=0)
            if smax == 0:
                continue
            parts: list[list[torch.Tensor]] = [[] for _ in range(smax)]
            rls: list[list[torch.Tensor]] = [[] for _ in range(smax)]
            for sl in iter_chunks(n, 4096):
                b = batch_from_rows(data, src, rows[sl])
                for j, q in enumerate(self.qh.chain(b, smax)):
                    parts[j].append(q.half())
                    if self.residual:  # the target router's logits of q: Router-PF's
                        rls[j].append(b.router_logits(self.qh.adapter, target_of(spec, src, j + 1), q).float())
            by_src[src] = [torch.cat(p) for p in parts]
            by_src_rl[src] = [torch.cat(r) if r else torch.zeros(n, spec.num_experts) for r in rls]
        ids = torch.stack([torch.from_numpy(data.layers[l].topk_ids[rows]) for l in ml], 1)  # [N,L,k]
        w = torch.stack([torch.from_numpy(data.layers[l].topk_weights[rows]) for l in ml], 1).float()  # [N,L,k]
        ug = []
        for r in srcs:  # the history weighs earlier layers' chosen experts 1, the source's its gate weights
            wr = torch.ones_like(w)
            wr[:, r] = w[:, r]
            g = self.feat.gates(ids, wr, torch.full((n,), r))  # [N,L*E]
            ug.append(torch.cat([torch.from_numpy(_hidden(data, ml[r])[rows]).float(), g], 1).half())
        tgt = torch.tensor([ml.index(target_of(spec, l, s)) for l, s in self.pairs])  # [P]
        ctx = torch.from_numpy(data.context(max(1, self.context), rows))
        return {
            "q": torch.stack([by_src[src][s - 1] for src, s in self.pairs]),  # [P,N,H] f16
            "ug": torch.stack(ug),  # [R,N,H+L*E] f16: router input and gate history per source rank
            "tok": self.feat.tokens(ctx, n).half(),  # [N,cH]
            "pair_src": torch.tensor([srcs.index(ml.index(l)) for l, _ in self.pairs]),  # [P] row of ug
            "truth": ids[:, tgt].permute(1, 0, 2).contiguous(),  # [P,N,k] routed experts of each pair's target
            "probs": torch.stack([torch.from_numpy(data.layers[ml[t]].probs[rows]) for t in tgt.tolist()]),  # [P,N,E] f16
            "rl": torch.stack([by_src_rl[src][s - 1] for src, s in self.pairs]),  # [P,N,E] Router-PF's logits
        }

    def _features_parts(self, c: dict[str, torch.Tensor], p: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        """The full features [B,F] of samples (pair p [B], row i [B]) from `_parts` (the standardisation's sample)."""
        H = self.feat.spec.hidden_size if self.feat is not None else 0
        ug = c["ug"][c["pair_src"][p], i].float()  # [B,H+L*E]
        return EstimatorFeatures.assemble(c["q"][p, i], ug[:, :H], c["tok"][i].float(), ug[:, H:])

    @torch.no_grad()
    def _moments(self, c: dict[str, torch.Tensor], p: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean [F], standard deviation [F], unbiased) of the full features of samples (pair p [B], row i [B]),
        assembled STD_CHUNK samples at a time and summed in float64 (two passes: the mean, then the squared
        deviations from it), so that the sample never exists whole: [B,F] floats are gigabytes for a wide model
        (B = 20,000 and F = 43,520 for DeepSeek-V3's 7,168-wide hidden state and 58 x 256 gate columns: 3.5 GB,
        about twice that with the parts cast on the way)."""
        assert self.feat is not None
        chunks = list(iter_chunks(len(p), STD_CHUNK))
        total = torch.zeros(self.feat.dim, dtype=torch.float64)
        for sl in chunks:
            total += self._features_parts(c, p[sl], i[sl]).sum(0, dtype=torch.float64)
        mu = (total / max(1, len(p))).float()
        sq = torch.zeros_like(total)
        for sl in chunks:
            sq += (self._features_parts(c, p[sl], i[sl]) - mu).square().sum(0, dtype=torch.float64)
        return mu, (sq / max(1, len(p) - 1)).sqrt().float()

    def _logits_parts(self, c: dict[str, torch.Tensor], i: torch.Tensor) -> torch.Tensor:
        """Logits [P,B,E] of every pair for rows i [B]: `EstimatorNet.forward` on `_features_parts`, with the
        first layer applied per part (q: [P,B], u and g: [R,B], tokens: [B]) and summed."""
        assert self.net is not None and self.feat is not None
        net, H = self.net, self.feat.spec.hidden_size
        cH = self.context * H
        # index_select, not c[...][:, i]: the same rows, several times faster on CPU (the f16 q: 0.04 ms against 0.3)
        ug = c["ug"].index_select(1, i).float()  # [R,B,H+L*E]
        z = net.project(c["q"].index_select(1, i), slice(0, H))  # [P,B,m]
        zs = net.project(ug[..., :H], slice(H, 2 * H)) + net.project(ug[..., H:], slice(2 * H + cH, None))  # [R,B,m]
        z = z + zs.index_select(0, c["pair_src"]) + net.A.bias + net.pos.weight[:, None, :]
        if cH:
            z = z + net.project(c["tok"].index_select(0, i), slice(2 * H, 2 * H + cH))  # [B,m] broadcast over pairs
        out = net.trunk(z)  # [P,B,E]
        return out + c["rl"].index_select(1, i) if self.residual else out

    @torch.no_grad()
    def _val_recall(self, c: dict[str, torch.Tensor], rows_per_step: int) -> torch.Tensor:
        """[P] recall@k of each pair on the rows of `c`."""
        assert self.net is not None
        P, N, k = c["truth"].shape
        hits = torch.zeros(P)
        for sl in iter_chunks(N, max(1, 4 * rows_per_step)):
            top = torch.topk(self._logits_parts(c, torch.arange(sl.start, sl.stop)), k, -1).indices  # [P,B,k]
            hits += (top[..., :, None] == c["truth"][:, sl, None, :]).any(-1).sum((1, 2)).float()
        return hits / max(1, N * k)

    def fit(
        self,
        data: RoutingData,
        model: torch.nn.Module,
        cfg: Any,
        dvec: dict[int, torch.Tensor] | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        """Train on the prompts of `data` minus a validation part (`cfg.hybrid_val` of them, split with seed
        `cfg.seed + 1`, the split `Hybrid` picks its pairs on): up to `cfg.est_epochs` epochs (more on a small
        trace, to make `cfg.est_min_steps` steps), stopping once validation recall@k has not improved for
        `cfg.est_patience` epochs (never before `cfg.est_min_steps` steps), keeping the best epoch's weights.
        Each step takes `cfg.est_batch` // P rows with all P (layer, S) pairs. `val_recall` / `val_prompts`
        record the validation result for `Hybrid`."""
        t0 = time.perf_counter()
        want = getattr(cfg, "est_dtype", "auto")
        if want not in EST_DTYPES:
            raise ConfigError(f"est_dtype must be one of {', '.join(EST_DTYPES)} (got {want!r})")
        self.bf16 = native_bf16() if want == "auto" else want == "bfloat16"
        dvec = dvec if dvec is not None else compute_default_vectors(model, data, max_tokens=cfg.dv_max_tokens)
        self.qh = QuasiHidden(model, dvec)
        self.feat = EstimatorFeatures(model, data.spec, self.context)
        self.max_lookahead = cfg.max_s
        self.pairs = data.rank_pairs(cfg.max_s)
        spec = data.spec
        P = len(self.pairs)
        # the rows of the fitting part and of the validation prompts (`data`'s rows: no copies of its arrays)
        fit_rows: np.ndarray = np.arange(data.n)
        val_rows: np.ndarray | None = None
        if len(np.unique(data.prompt_id)) >= 2:
            fit_rows, val_rows = split_rows(data.prompt_id, cfg.hybrid_val, cfg.seed + 1)
        rng = np.random.default_rng(cfg.seed)
        rows = np.arange(len(fit_rows))
        per_row = max(1, cfg.est_max_samples // max(1, P))  # samples = rows x pairs
        if len(rows) > min(cfg.est_max_tokens, per_row):
            rows = np.sort(rng.choice(rows, min(cfg.est_max_tokens, per_row), replace=False))
        c = self._parts(data, fit_rows[rows])
        cv = None
        if val_rows is not None:
            vrows = np.arange(len(val_rows))
            if len(vrows) > per_row:
                vrows = np.sort(rng.choice(vrows, per_row, replace=False))
            cv = self._parts(data, val_rows[vrows])
        N = len(rows)
        torch.manual_seed(cfg.seed)
        self.net = EstimatorNet(self.feat.dim, spec.num_experts, P, self.m, self.n, self.blocks)
        idx = torch.randperm(P * N)[:STD_SAMPLES]  # feature standardisation from a sample of the training set
        mu, sd = self._moments(c, idx // N, idx % N)
        self.net.mu.copy_(mu)
        self.net.sd.copy_(sd.clamp(min=1e-3))
        y = c["probs"].float().clamp(min=1e-6)
        y = y / y.sum(-1, keepdim=True)  # [P,N,E] KL targets
        opt = torch.optim.AdamW(self.net.parameters(), lr=cfg.est_lr, weight_decay=cfg.est_weight_decay, fused=True)
        rows_per_step = max(1, cfg.est_batch // P)
        per_epoch = -(-N // rows_per_step)
        epochs = max(cfg.est_epochs, -(-cfg.est_min_steps // per_epoch))  # small traces: at least est_min_steps
        steps = epochs * per_epoch
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.est_lr, total_steps=max(1, steps), pct_start=0.1)
        k, E = spec.top_k, spec.num_experts
        best: tuple[float, dict[str, torch.Tensor] | None, torch.Tensor | None, int] = (-1.0, None, None, -1)
        done = 0
        for ep in range(epochs):
            self.net.train()
            perm = torch.randperm(N)
            tot = 0.0
            for j in range(0, N, rows_per_step):
                i = perm[j : j + rows_per_step]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):  # the products; the loss in float32
                    logits = self._logits_parts(c, i).flatten(0, 1).float()  # [P*B,E]
                loss = F.kl_div(F.log_softmax(logits, -1), y.index_select(1, i).flatten(0, 1), reduction="batchmean")
                if cfg.est_bce > 0:
                    hot = torch.zeros_like(logits).scatter(-1, c["truth"][:, i].flatten(0, 1), 1.0)
                    loss = loss + cfg.est_bce * F.binary_cross_entropy_with_logits(logits, hot) * E / k
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                tot += float(loss.detach()) * len(i)
                done += 1
                if progress is not None:
                    progress(done / max(1, steps))
            self.net.eval()
            rec = {"epoch": ep + 1, "loss": tot / N}
            if cv is not None:
                vr = self._val_recall(cv, rows_per_step)
                rec["val_recall"] = float(vr.mean())
                if rec["val_recall"] > best[0] + 1e-4:
                    best = (rec["val_recall"], {n: t.clone() for n, t in self.net.state_dict().items()}, vr, ep)
            self.history.append(rec)
            if cv is not None and ep - best[3] >= cfg.est_patience and done >= cfg.est_min_steps:
                break
        if best[1] is not None:
            self.net.load_state_dict(best[1])
        self.val_recall = None if best[2] is None else {pr: float(v) for pr, v in zip(self.pairs, best[2])}
        self.val_prompts = None if val_rows is None else np.unique(data.prompt_id[val_rows])
        self.net.eval()
        if progress is not None:
            progress(1.0)
        self.fit_seconds = time.perf_counter() - t0

    def features(self, lookahead: int, batch: SourceBatch) -> torch.Tensor:
        """The estimator's input x [T, feature_dim] for `batch` and step `lookahead`."""
        assert self.qh is not None and self.feat is not None, "fit or load first"
        q = self.qh.chain(batch, lookahead)[-1].float()  # [T,H]
        return self.feat.of_batch(q, batch)

    @property
    def feature_dim(self) -> int:
        assert self.feat is not None, "fit or load first"
        return self.feat.dim

    @torch.no_grad()
    def predict(self, target_layer: int, lookahead: int, batch: SourceBatch) -> torch.Tensor:
        assert self.net is not None and self.qh is not None and self.feat is not None, "fit or load first"
        q = self.qh.chain(batch, lookahead)[-1]  # [T,H]
        x = self.feat.of_batch(q.float(), batch)
        pair = torch.full((len(x),), self._pair(batch.layer, lookahead), dtype=torch.long)
        logits = self.net(x, pair)  # [T,E]
        if self.residual:
            logits = logits + batch.router_logits(self.qh.adapter, target_layer, q).float()  # Router-PF's logits
        return torch.softmax(logits, -1)  # [T,E]

    def runner(self) -> Any:
        """The run-time path: every S of a source layer in one pass through the network (`fast.EstimatorRunner`)."""
        from .fast_estimator import EstimatorRunner

        return EstimatorRunner(self)

    def save(self, folder: Path) -> None:
        assert self.net is not None and self.qh is not None, "fit first"
        save_dvec(folder, self.qh.dvec)
        torch.save(self.net.state_dict(), folder / "estimator.pt")
        params = sum(int(p.numel()) for p in self.net.parameters())
        (folder / "config.json").write_text(
            json.dumps(
                {
                    "features": FEATURES_VERSION,
                    "max_lookahead": self.max_lookahead,
                    "m": self.m,
                    "n": self.n,
                    "blocks": self.blocks,
                    "context": self.context,
                    "residual": self.residual,
                    "pairs": self.pairs,
                    "history": self.history,
                    "params": params,
                    "train_bf16": self.bf16,
                    "fit_seconds": self.fit_seconds,
                }
            )
        )

    @classmethod
    def load(cls, folder: Path, model: torch.nn.Module) -> Estimator:
        from .io import artifact_file, load_tensors, read_config

        c = read_config(folder, "an estimator with input features", FEATURES_VERSION)
        with artifact_file(folder / "config.json"):
            self = cls(model, int(c["max_lookahead"]), int(c["m"]), int(c["n"]), int(c["blocks"]), int(c["context"]))
            self.residual = bool(c.get("residual", False))  # folders written before the residual form: plain logits
            self.pairs = [(int(l), int(s)) for l, s in c["pairs"]]
            self.history = list(c.get("history", []))
            self.fit_seconds = float(c.get("fit_seconds", 0.0))
            self.bf16 = bool(c.get("train_bf16", False))
        self.qh = QuasiHidden(model, load_dvec(folder, model))
        spec = self.qh.spec
        self.feat = EstimatorFeatures(model, spec, self.context)
        self.net = EstimatorNet(self.feat.dim, spec.num_experts, len(self.pairs), self.m, self.n, self.blocks)
        state = load_tensors(folder / "estimator.pt")
        with artifact_file(folder / "estimator.pt"):
            self.net.load_state_dict(state)  # a wrong key or shape is refused too
        self.net.eval()
        return self
