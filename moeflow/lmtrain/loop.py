"""The CPU training loop: AdamW, linear warmup + cosine decay over a wall-clock (or step) budget.

The schedule's progress is `max(step / max_steps, elapsed / budget)`, so a run with a time budget
finishes its cosine decay exactly when the budget is spent, whatever the machine's speed. The loss
is next-token cross-entropy + `balance_coef` * per-layer balance loss + `z_coef` * router z-loss;
router logits come from `output_router_logits=True` (transformers' own pooled aux loss is computed
by the model but never added: we pass no labels).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .losses import per_layer_balance_loss, router_z_loss


@dataclass(frozen=True)
class LMTrainConfig:
    """Language-model training loop settings (the embedded models; `moeflow train` uses `moeflow.stages.train.TrainConfig`)."""

    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    warmup_steps: int = 30
    minutes: float | None = 25.0  # wall-clock budget of the optimisation loop
    max_steps: int | None = None  # step budget (either or both)
    balance_coef: float = 0.01
    z_coef: float = 1e-3
    grad_clip: float = 1.0
    seed: int = 0
    eval_every_s: float = 180.0  # validation loss every so many seconds
    eval_batches: int = 4


@dataclass
class TrainResult:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)  # one row per step (and eval rows)


def lr_at(cfg: LMTrainConfig, step: int, progress: float) -> float:
    """Linear warmup over `warmup_steps`, then cosine from lr to lr*min_lr_ratio over progress 0..1."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def sample_batch(tokens: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `seq` tokens from a 1-D token stream -> [B,S]."""
    starts = torch.randint(0, tokens.numel() - seq, (batch,), generator=gen)
    return torch.stack([tokens[s : s + seq] for s in starts.tolist()])


def lm_loss(model, ids: torch.Tensor, *, with_router: bool) -> tuple[torch.Tensor, tuple]:
    """Mean next-token cross-entropy of ids [B,S], and the per-layer router logits ([T,E] each)."""
    out = model(input_ids=ids, output_router_logits=with_router, use_cache=False)
    logits = out.logits[:, :-1]  # [B,S-1,V]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
    return loss, (tuple(out.router_logits) if with_router else ())


@torch.no_grad()
def eval_loss(model, windows: torch.Tensor, batch: int = 16) -> float:
    """Token-weighted mean LM loss over windows [N,S]."""
    was = model.training
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]
        loss, _ = lm_loss(model, w, with_router=False)
        tot += loss.item() * w.shape[0]
        n += w.shape[0]
    model.train(was)
    return tot / max(n, 1)


def val_windows(tokens: torch.Tensor, seq: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [N,S] of a 1-D token stream."""
    n = tokens.numel() // seq
    if limit is not None:
        n = min(n, limit)
    return tokens[: n * seq].view(n, seq)


def train(
    model,
    train_tokens: torch.Tensor,
    val_tokens: torch.Tensor | None,
    cfg: LMTrainConfig,
    *,
    top_k: int,
    log_path: str | Path | None = None,
    on_step: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Train `model` in place on random windows of `train_tokens`; log one JSON line per step."""
    if cfg.minutes is None and cfg.max_steps is None:
        raise ValueError("give LMTrainConfig.minutes or max_steps")
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    vw = val_windows(val_tokens, cfg.seq_len, cfg.eval_batches * cfg.batch_size) if val_tokens is not None else None
    log = open(log_path, "a", encoding="utf-8") if log_path else None
    res = TrainResult()
    model.train()
    t0 = time.perf_counter()
    last_eval = t0
    budget_s = cfg.minutes * 60 if cfg.minutes is not None else None

    def emit(row: dict) -> None:
        res.history.append(row)
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()
        if on_step:
            on_step(row)

    if log:
        emit({"event": "config", **asdict(cfg)})
    step = 0
    while True:
        elapsed = time.perf_counter() - t0
        progress = max(step / cfg.max_steps if cfg.max_steps else 0.0, elapsed / budget_s if budget_s else 0.0)
        if progress >= 1.0:
            break
        lr = lr_at(cfg, step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        ids = sample_batch(train_tokens, cfg.batch_size, cfg.seq_len, gen)  # [B,S]
        lm, router_logits = lm_loss(model, ids, with_router=True)
        bal = per_layer_balance_loss(router_logits, top_k)
        z = router_z_loss(router_logits)
        loss = lm + cfg.balance_coef * bal + cfg.z_coef * z
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        opt.step()
        step += 1
        res.tokens += ids.numel()
        now = time.perf_counter()
        emit(
            {
                "step": step,
                "t": round(now - t0, 2),
                "tokens": res.tokens,
                "lr": lr,
                "loss": lm.item(),
                "balance": bal.item(),
                "z": z.item(),
                "grad_norm": gnorm,
            }
        )
        if vw is not None and now - last_eval >= cfg.eval_every_s:
            emit({"step": step, "t": round(now - t0, 2), "tokens": res.tokens, "val_loss": eval_loss(model, vw)})
            last_eval = time.perf_counter()
    res.steps, res.seconds = step, time.perf_counter() - t0
    if vw is not None:
        emit({"step": step, "t": round(res.seconds, 2), "tokens": res.tokens, "val_loss": eval_loss(model, vw)})
    if log:
        log.close()
    model.eval()
    return res
