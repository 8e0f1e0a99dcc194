"""EAP, CasMoE's parametric Expert Activation Predictor.

A small BERT encoder, mean-pooled, then L MLP heads (Linear(h, m) -> GELU -> Linear(m, K)), one per MoE
layer, predicting the prompt's expert pattern EP [L,K] (normalised per layer to mean 1:
`moeflow.plan.labels.normalize(ep, "mean1")`). Trained end to end (eq. 9): alpha * L_cont + L_hb, with
L_cont SimCSE's unsupervised InfoNCE (eq. 6-7: each prompt encoded twice with dropout on; the two views
are positives, the batch's other prompts negatives, temperature tau) and L_hb the Huber loss (eq. 8,
delta) between predicted and true EP; alpha = 0.05 as in the paper.

Encoder initialisation: the paper uses a 6-layer TinyBERT with hidden 64 and intermediate 128. Here the
encoder is initialised from all-MiniLM-L6-v2 (6 layers, hidden 384, intermediate 1536, 12 heads of 32),
cut to `EAPConfig.layers` layers (the first ones), `hidden` / `intermediate` units and `hidden // 32`
heads by keeping the first rows / columns of every weight (the first heads whole, the first positions
up to `max_len`), as "weight selection" initialises a small model from a larger one. The defaults are
the paper's sizes (6 / 64 / 128); `hidden=384, intermediate=1536` keeps MiniLM whole.

Files (`save(folder)`, the sub-folder `eap/`): `eap.json` (kind, schema, model fingerprint, config,
training report), `eap.pt` (state dict, read with `torch.load(weights_only=True)`), `tokenizer.json`
(MiniLM's WordPiece tokenizer, read by `tokenizers`: JSON, no code).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..artifacts import write_json_atomic
from ..errors import ConfigError

KIND = "eap"
SCHEMA = 1
HEAD_DIM = 32  # MiniLM's attention head size


@dataclass(frozen=True)
class EAPConfig:
    layers: int = 6  # encoder layers (MiniLM's first ones)
    hidden: int = 64  # paper: 64 (MiniLM: 384)
    intermediate: int = 128  # paper: 128 (MiniLM: 1536)
    head_hidden: int = 128  # the MLP heads' hidden width (two-layer MLP)
    max_len: int = 128  # prompt tokens (WordPiece) seen
    dropout: float = 0.1  # SimCSE's dropout noise
    tau: float = 0.05  # InfoNCE temperature (SimCSE)
    alpha: float = 0.05  # weight of L_cont (paper)
    delta: float = 1.0  # Huber delta
    lr: float = 1e-3  # AdamW (the paper's 6e-7 does not move in minutes on CPU)
    weight_decay: float = 0.01
    epochs: int = 30
    batch: int = 32
    seed: int = 0
    init: str = "minilm"  # minilm | random

    def __post_init__(self) -> None:
        if self.layers < 1 or self.hidden < HEAD_DIM or self.hidden % HEAD_DIM or self.intermediate < 1:
            raise ConfigError(f"EAP: layers >= 1, hidden a multiple of {HEAD_DIM}, intermediate >= 1 (got {self})")
        if self.epochs < 1 or self.batch < 2 or self.lr <= 0:
            raise ConfigError("EAP: epochs >= 1, batch >= 2 and lr > 0")
        if self.init not in ("minilm", "random"):
            raise ConfigError(f"EAP init must be minilm or random, got {self.init!r}")


def _bert_config(cfg: EAPConfig, src: dict[str, Any]) -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=int(src.get("vocab_size", 30522)),
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.hidden // HEAD_DIM,
        intermediate_size=cfg.intermediate,
        hidden_act="gelu",
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout,
        max_position_embeddings=cfg.max_len + 2,
        type_vocab_size=int(src.get("type_vocab_size", 2)),
        layer_norm_eps=float(src.get("layer_norm_eps", 1e-12)),
        pad_token_id=int(src.get("pad_token_id", 0)),
    )


class EAPModel(nn.Module):
    """Encoder + L heads: forward(ids, mask) -> (embedding [B,h], EP prediction [B,L,K])."""

    def __init__(self, cfg: EAPConfig, bert_cfg: Any, num_layers: int, num_experts: int):
        super().__init__()
        from transformers import BertModel

        self.encoder = BertModel(bert_cfg, add_pooling_layer=False)
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Linear(cfg.hidden, cfg.head_hidden), nn.GELU(), nn.Linear(cfg.head_hidden, num_experts))
            for _ in range(num_layers)
        )

    def embed(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state  # [B,T,h]
        m = mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp_min(1.0)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed(ids, mask)
        return e, torch.stack([h(e) for h in self.heads], dim=1)


def init_from_minilm(model: EAPModel, src_dir: str) -> int:
    """Copy MiniLM's weights into the (smaller) encoder: the leading slice of every tensor; returns the
    number of tensors copied."""
    from safetensors.torch import load_file

    src = load_file(str(Path(src_dir) / "model.safetensors"))
    src = {k.removeprefix("bert."): v for k, v in src.items()}
    n = 0
    with torch.no_grad():
        for name, p in model.encoder.state_dict().items():
            s = src.get(name)
            if s is None or s.dim() != p.dim() or any(a > b for a, b in zip(p.shape, s.shape)):
                continue
            p.copy_(s[tuple(slice(0, d) for d in p.shape)].to(p.dtype))
            n += 1
    return n


class _Tok:
    """MiniLM's WordPiece tokenizer through `tokenizers` (JSON only)."""

    def __init__(self, path: str | Path, max_len: int):
        from tokenizers import Tokenizer

        self.path = Path(path)
        self.tok = Tokenizer.from_file(str(path))
        self.tok.enable_truncation(max_length=max_len)
        pad = self.tok.token_to_id("[PAD]")
        self.tok.enable_padding(pad_id=0 if pad is None else pad, pad_token="[PAD]")

    def __call__(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tok.encode_batch(list(texts))
        ids = torch.tensor([e.ids for e in enc], dtype=torch.long)
        mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.long)
        return ids, mask


def info_nce(h1: torch.Tensor, h2: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 6-7: mean over i of -log softmax_j(cos(h1_i, h2_j) / tau)[i]."""
    z = F.normalize(h1, dim=-1) @ F.normalize(h2, dim=-1).T / tau
    return F.cross_entropy(z, torch.arange(len(z), device=z.device))


def topk_recall(pred: np.ndarray, true: np.ndarray, k: int) -> np.ndarray:
    """Per-layer mean over prompts of |topk(pred) ∩ topk(true)| / k; pred, true [P,L,K] -> [L]."""
    tp = np.argsort(-pred, axis=-1, kind="stable")[..., :k]
    tt = np.argsort(-true, axis=-1, kind="stable")[..., :k]
    hit = (tp[..., :, None] == tt[..., None, :]).any(-1).sum(-1)  # [P,L]
    return (hit / k).mean(0)


class EAP:
    """A trained EAP: `predict(texts) -> [n,L,K]` (normalised EP scale)."""

    def __init__(self, cfg: EAPConfig, model: EAPModel, tok: _Tok, num_layers: int, num_experts: int):
        self.cfg, self.model, self.tok, self.L, self.K = cfg, model, tok, num_layers, num_experts
        self.report: dict[str, Any] = {}
        self.model.eval()

    @classmethod
    def create(cls, cfg: EAPConfig, num_layers: int, num_experts: int, minilm_dir: str | None = None) -> EAP:
        import json

        from .eam import default_embedder_path

        src_dir = minilm_dir or default_embedder_path()
        cfgfile = Path(src_dir) / "config.json"
        src = json.loads(cfgfile.read_text()) if cfgfile.is_file() else {}
        torch.manual_seed(cfg.seed)
        model = EAPModel(cfg, _bert_config(cfg, src), num_layers, num_experts)
        if cfg.init == "minilm":
            if init_from_minilm(model, src_dir) == 0:
                raise ConfigError(f"EAP: no MiniLM weights matched in {src_dir}")
        return cls(cfg, model, _Tok(Path(src_dir) / "tokenizer.json", cfg.max_len), num_layers, num_experts)

    @torch.no_grad()
    def predict(self, texts: list[str], batch: int = 64) -> np.ndarray:
        self.model.eval()
        out = []
        for i in range(0, len(texts), batch):
            ids, mask = self.tok(texts[i : i + batch])
            out.append(self.model(ids, mask)[1].float().numpy())
        return np.concatenate(out) if out else np.zeros((0, self.L, self.K), dtype=np.float32)

    def fit(
        self,
        texts: list[str],
        targets: np.ndarray,
        *,
        val: tuple[list[str], np.ndarray] | None = None,
        k: int = 1,
        progress: Any = None,
    ) -> dict[str, Any]:
        """Train on (texts, normalised EP [n,L,K]); returns the report (loss per epoch, held-out recall@k)."""
        cfg = self.cfg
        if len(texts) < 2:
            raise ConfigError(f"EAP training needs at least 2 prompts (got {len(texts)})")
        y = torch.from_numpy(np.asarray(targets, dtype=np.float32))
        ids, mask = self.tok(texts)
        with torch.no_grad():  # heads start at the mean training pattern: the encoder learns the deviation
            mean = y.mean(0)  # [L,K]
            for l, h in enumerate(self.model.heads):
                last: Any = h[-1]  # type: ignore[index]
                last.bias.copy_(mean[l])
                last.weight.mul_(0.1)
        g = torch.Generator().manual_seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        steps = cfg.epochs * math.ceil(len(texts) / cfg.batch)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps, pct_start=0.1)
        hist: list[dict[str, float]] = []
        t0 = time.perf_counter()
        for ep in range(cfg.epochs):
            self.model.train()
            perm = torch.randperm(len(texts), generator=g)
            tot = {"loss": 0.0, "cont": 0.0, "huber": 0.0}
            nb = 0
            for i in range(0, len(texts), cfg.batch):
                b = perm[i : i + cfg.batch]
                if len(b) < 2:
                    continue
                L = int(mask[b].sum(1).max())
                bi, bm = ids[b, :L], mask[b, :L]
                h1, p1 = self.model(bi, bm)  # two dropout views of the same prompts (SimCSE positives)
                h2, _ = self.model(bi, bm)
                cont = info_nce(h1, h2, cfg.tau)
                hb = F.huber_loss(p1, y[b], delta=cfg.delta)
                loss = cfg.alpha * cont + hb
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                opt.step()
                sched.step()
                tot["loss"] += loss.item()
                tot["cont"] += cont.item()
                tot["huber"] += hb.item()
                nb += 1
            row = {k_: v / max(nb, 1) for k_, v in tot.items()}
            if val is not None and (ep == cfg.epochs - 1 or ep % 5 == 4):
                row["val_recall"] = float(topk_recall(self.predict(val[0]), np.asarray(val[1]), k).mean())
            hist.append(row)
            if progress is not None:
                progress((ep + 1) / cfg.epochs)
        self.model.eval()
        self.report = {"epochs": hist, "fit_seconds": round(time.perf_counter() - t0, 2), "train_prompts": len(texts)}
        if val is not None:
            self.report["val_recall_per_layer"] = [round(float(x), 4) for x in topk_recall(self.predict(val[0]), val[1], k)]
        return self.report

    # -- files --
    def save(self, folder: str | Path, *, fingerprint: str) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(self.model.state_dict(), folder / "eap.pt")
        shutil.copyfile(self.tok.path, folder / "tokenizer.json")
        write_json_atomic(
            folder / "eap.json",
            {
                "kind": KIND,
                "schema": SCHEMA,
                "model_fingerprint": fingerprint,
                "num_layers": self.L,
                "num_experts": self.K,
                "config": dataclasses.asdict(self.cfg),
                "report": self.report,
            },
        )
        return folder

    @classmethod
    def load(cls, folder: str | Path, *, fingerprint: str | None = None) -> tuple[EAP, dict[str, Any]]:
        from ..predict.io import artifact_file, load_tensors, read_plan_meta

        folder = Path(folder)
        meta = read_plan_meta(folder, KIND, SCHEMA, fingerprint)
        with artifact_file(folder / "eap.json"):
            cfg = EAPConfig(**meta["config"])
            L, K = int(meta["num_layers"]), int(meta["num_experts"])
        state = load_tensors(folder / "eap.pt")
        with artifact_file(folder / "tokenizer.json"):
            tok = _Tok(folder / "tokenizer.json", cfg.max_len)
        with artifact_file(folder / "eap.pt"):
            vocab = int(state["encoder.embeddings.word_embeddings.weight"].shape[0])
            model = EAPModel(cfg, _bert_config(cfg, {"vocab_size": vocab}), L, K)
            model.load_state_dict(state)
        eap = cls(cfg, model, tok, L, K)
        eap.report = meta.get("report", {})
        return eap, meta
