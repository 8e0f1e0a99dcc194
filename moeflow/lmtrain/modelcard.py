"""Model card of an embedded model: what it is, how it was trained, and how it routes.

Routing statistics come from router hooks (`moeflow.moe.RouterTap`) over held-out text and a short
decode run, for the trained model AND for the same configuration with random (initial) weights:

- load skewness (max / mean expert count), per-token router entropy / log E, dead experts (< 1% of
  mean load): `moeflow.trace.summary.layer_stats`;
- next-layer pre-gate recall@k: router l+1 applied to layer l's router input, compared with layer
  l+1's actual top-k (and two layers ahead);
- token-id baseline recall@k: the k most frequent experts per (token id, layer), fit on the first half
  of the held-out windows, evaluated on the second half (unseen ids fall back to global popularity);
- same layer, previous token recall@k, and global top-k popularity, as further references.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..artifacts import atomic_write
from ..moe import RouterTap, get_adapter
from ..moe.sets import recall_at_k
from ..trace.summary import layer_stats
from .cardtext import CARD_JSON, CURVE_PNG, render

PROMPTS = ("The old man looked at the", "Question: Tom has 12 apples and buys 5 more. How many apples does he have now?\nAnswer:")


# ---- routing collection ----------------------------------------------------------------------------


@torch.no_grad()
def collect(model, windows: torch.Tensor, batch: int = 20) -> dict[int, dict[str, torch.Tensor]]:
    """Router inputs x [T,H], logits [T,E] and top-k indices [T,k] per MoE layer over windows [N,S].

    Rows are in window-major order, aligned with `windows.reshape(-1)`.
    """
    ad = get_adapter(model)
    out: dict[int, dict[str, list]] = {l: {"x": [], "logits": [], "indices": []} for l in ad.moe_layers}
    tap = RouterTap(ad)
    for i in range(0, windows.shape[0], batch):
        tap.clear()
        with tap.attach():
            model(input_ids=windows[i : i + batch], use_cache=False)
        for l, evs in tap.events.items():
            for ev in evs:
                out[l]["x"].append(ev.x.float())
                out[l]["logits"].append(ev.logits.float())
                out[l]["indices"].append(ev.indices)
    return {l: {k: torch.cat(v) for k, v in d.items()} for l, d in out.items()}


@torch.no_grad()
def collect_decode(
    model, prompts: torch.Tensor, steps: int, repetition_penalty: float = 1.3
) -> dict[int, dict[str, torch.Tensor]]:
    """Like `collect`, for the decode steps only of a greedy generate (prompts [B,P], no padding)."""
    ad = get_adapter(model)
    tap = RouterTap(ad)
    with tap.attach():
        model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            repetition_penalty=repetition_penalty,
            pad_token_id=model.config.pad_token_id,
        )
    return {
        l: {
            k: torch.cat([getattr(ev, k).float() if k != "indices" else ev.indices for ev in evs[1:]])
            for k in ("x", "logits", "indices")
        }
        for l, evs in tap.events.items()
    }


# ---- statistics --------------------------------------------------------------------------------------


def pregate_recall(ad, data: dict, src: int, dst: int) -> float:
    """Router `dst` applied to layer `src`'s router input vs layer `dst`'s actual top-k."""
    x = data[src]["x"].to(ad.router_weight(dst).dtype)  # [T,H]
    with torch.no_grad():
        _, pred = ad.select(dst, ad.router_logits(dst, x))  # [T,k]
    return recall_at_k(pred.numpy(), data[dst]["indices"].numpy())


def token_id_recall(token_ids: np.ndarray, indices: np.ndarray, num_experts: int, vocab: int) -> float:
    """Most frequent k experts per token id, fit on the first half of the rows, scored on the second."""
    n = len(token_ids) // 2
    k = indices.shape[1]
    counts = np.zeros((vocab, num_experts), np.int64)  # [V,E]
    np.add.at(counts, (np.repeat(token_ids[:n], k), indices[:n].reshape(-1)), 1)
    glob = np.argsort(-counts.sum(0), kind="stable")[:k]  # [k]
    table = np.argsort(-counts, axis=1, kind="stable")[:, :k]  # [V,k]
    seen = counts.sum(1) > 0  # [V]
    pred = np.where(seen[token_ids[n:], None], table[token_ids[n:]], glob[None, :])  # [N-n,k]
    return recall_at_k(pred, indices[n:])


def popularity_recall(indices: np.ndarray, num_experts: int) -> float:
    """The globally most frequent k experts of the first half, scored on the second half."""
    n = len(indices) // 2
    k = indices.shape[1]
    glob = np.argsort(-np.bincount(indices[:n].reshape(-1), minlength=num_experts), kind="stable")[:k]
    return recall_at_k(np.broadcast_to(glob, indices[n:].shape), indices[n:])


def prev_token_recall(indices: np.ndarray, seq: int) -> float:
    """Same layer, previous token (within each window of `seq` rows)."""
    idx = indices.reshape(-1, seq, indices.shape[1])  # [N,S,k]
    return recall_at_k(idx[:, :-1].reshape(-1, idx.shape[2]), idx[:, 1:].reshape(-1, idx.shape[2]))


def routing_stats(
    model, windows: torch.Tensor, *, decode_prompts: torch.Tensor | None = None, decode_steps: int = 32
) -> dict[str, Any]:
    """All per-layer statistics of `model` over held-out windows [N,S] (and a decode run)."""
    ad = get_adapter(model)
    spec = ad.spec
    E, L = spec.num_experts, list(spec.moe_layers)
    data = collect(model, windows)
    ids = windows.reshape(-1).numpy()
    res: dict[str, Any] = {"layers": L, "tokens": int(windows.numel()), "prefill": {}, "decode": {}}
    per = []
    for l in L:
        idx = data[l]["indices"].numpy()
        probs = torch.softmax(data[l]["logits"], -1).numpy()
        s = layer_stats(idx, probs, E, layer=l)
        per.append(
            {
                "layer": l,
                "skewness": s.skewness,
                "router_entropy": s.router_entropy,
                "load_entropy": s.load_entropy,
                "dead": s.dead,
                "token_id_recall": token_id_recall(ids, idx, E, model.config.vocab_size),
                "prev_token_recall": prev_token_recall(idx, windows.shape[1]),
                "popularity_recall": popularity_recall(idx, E),
            }
        )
    res["prefill"]["per_layer"] = per
    res["prefill"]["pregate_next"] = [pregate_recall(ad, data, a, b) for a, b in zip(L, L[1:])]
    res["prefill"]["pregate_two_ahead"] = [pregate_recall(ad, data, a, b) for a, b in zip(L, L[2:])]
    if decode_prompts is not None:
        dd = collect_decode(model, decode_prompts, decode_steps)
        res["decode"] = {
            "prompts": int(decode_prompts.shape[0]),
            "steps": decode_steps,
            "per_layer": [
                {
                    "layer": l,
                    **{
                        k: v
                        for k, v in layer_stats(dd[l]["indices"].numpy(), torch.softmax(dd[l]["logits"], -1).numpy(), E, layer=l)
                        .to_dict()
                        .items()
                        if k in ("skewness", "router_entropy", "dead")
                    },
                }
                for l in L
            ],
            "pregate_next": [pregate_recall(ad, dd, a, b) for a, b in zip(L, L[1:])],
        }
    return res


# ---- perplexity, samples, curve -----------------------------------------------------------------------


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch: int = 16) -> tuple[float, int]:
    """exp(mean next-token loss) over windows [N,S], and the number of predicted tokens."""
    from .loop import eval_loss

    return math.exp(eval_loss(model, windows, batch)), int(windows.shape[0] * (windows.shape[1] - 1))


def _loops(ids: list[int], n: int = 4) -> bool:
    """True when some n-gram occurs three times or more (greedy repetition)."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return any(grams.count(g) >= 3 for g in set(grams))


@torch.no_grad()
def samples(model, tok, max_new_tokens: int = 48) -> list[dict[str, Any]]:
    out = []
    for p in PROMPTS:
        enc = tok(p, return_tensors="pt", add_special_tokens=False)
        ids = torch.cat([torch.tensor([[tok.bos_token_id]]), enc.input_ids], 1)
        row: dict[str, Any] = {"prompt": p}
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        new = g[0, ids.shape[1] :].tolist()
        row["greedy"] = tok.decode(new, skip_special_tokens=True)
        row["greedy_loops"] = _loops(new)
        if row["greedy_loops"]:
            g = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, repetition_penalty=1.3
            )
            row["greedy_rep_penalty_1.3"] = tok.decode(g[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
        out.append(row)
    return out


def read_log(folder: Path) -> list[dict]:
    from .files import TRAIN_LOG

    p = Path(folder) / TRAIN_LOG
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.is_file() else []


def plot_curve(history: list[dict], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [r for r in history if "loss" in r]
    va = [r for r in history if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    if tr:
        x = np.array([r["tokens"] for r in tr]) / 1e6
        y = np.array([r["loss"] for r in tr])
        w = max(1, len(y) // 50)
        ax.plot(x, y, color="0.75", lw=0.8, label="train LM loss")
        if len(y) >= w:
            ax.plot(x[w - 1 :], np.convolve(y, np.ones(w) / w, "valid"), color="C0", lw=1.5, label=f"train (mean of {w})")
    if va:
        ax.plot(
            [r["tokens"] / 1e6 for r in va],
            [r["val_loss"] for r in va],
            "o-",
            color="C3",
            ms=4,
            label="held-out loss (first held-out windows)",
        )
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


# ---- the card ------------------------------------------------------------------------------------------


def param_counts(model) -> dict[str, int]:
    """Total parameters, and parameters active per token (routed experts counted k of E)."""
    ad = get_adapter(model)
    spec = ad.spec
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for l in spec.moe_layers for p in ad.per_expert_params(l).values())
    active = total - experts + experts * spec.top_k // spec.num_experts
    emb = model.get_input_embeddings().weight.numel() + model.get_output_embeddings().weight.numel()
    return {"total": total, "active": active, "experts": experts, "embeddings": emb}


def compute_card(
    folder: Path,
    val_tokens: torch.Tensor,
    *,
    seed: int = 0,
    n_windows: int = 200,
    seq: int = 128,
    ppl_seq: int = 256,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every number of the card of the saved model in `folder` (held-out token stream `val_tokens`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .files import TRAINING_JSON
    from .loop import val_windows

    folder = Path(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    meta = json.loads((folder / TRAINING_JSON).read_text()) if (folder / TRAINING_JSON).is_file() else {}
    spec = get_adapter(model).spec
    windows = val_windows(val_tokens, seq, n_windows)  # [N,S]
    dec_prompts = windows[-8:, :32].clone()  # [8,32]
    log(f"[card {folder.name}] perplexity over the held-out text")
    ppl, n_tok = perplexity(model, val_windows(val_tokens, ppl_seq))
    log(f"[card {folder.name}] routing statistics, trained ({windows.shape[0]} x {seq} tokens + decode)")
    trained = routing_stats(model, windows, decode_prompts=dec_prompts)
    torch.manual_seed(seed)
    rnd_model = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    log(f"[card {folder.name}] routing statistics, random init")
    random = routing_stats(rnd_model, windows, decode_prompts=dec_prompts)
    rnd_ppl, _ = perplexity(rnd_model, val_windows(val_tokens, ppl_seq, 32))
    disk = sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and f.name.endswith(".safetensors"))
    return {
        "name": folder.name,
        "spec": spec.to_dict(),
        "vocab_size": int(model.config.vocab_size),
        "params": param_counts(model),
        "training": meta,
        "safetensors_bytes": disk,
        "val_perplexity": ppl,
        "val_tokens_scored": n_tok,
        "random_init_val_perplexity_32_windows": rnd_ppl,
        "samples": samples(model, tok),
        "routing": {"trained": trained, "random_init": random, "windows": int(windows.shape[0]), "seq": seq, "seed": seed},
    }


def write_card(
    folder: str | Path, val_tokens: torch.Tensor, *, seed: int = 0, log: Callable[[str], None] = print, **kw: Any
) -> dict[str, Any]:
    """Compute the card of the saved model in `folder`; write README.md, card.json, the curve PNG."""
    folder = Path(folder)
    card = compute_card(folder, val_tokens, seed=seed, log=log, **kw)
    history = read_log(folder)
    png = folder / CURVE_PNG
    tmp_png = folder / f".{CURVE_PNG}.tmp.png"
    plot_curve(history, tmp_png, f"{folder.name}: LM loss")
    os.chmod(tmp_png, 0o644)
    os.replace(tmp_png, png)
    with atomic_write(folder / CARD_JSON) as f:
        f.write(json.dumps(card, indent=1, default=float))
    with atomic_write(folder / "README.md") as f:
        f.write(render(card))
    return card
