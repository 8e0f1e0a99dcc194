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

CARD_JSON = "card.json"
CURVE_PNG = "training_curve.png"
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
    x = data[src]["x"].to(ad.router(dst).weight.dtype)  # [T,H]
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


def _row(vals, fmt="{:.2f}") -> str:
    return " / ".join("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v) for v in vals)


def render(card: dict[str, Any]) -> str:
    c, s, p, t = card, card["spec"], card["params"], card["training"]
    tr, rn = c["routing"]["trained"], c["routing"]["random_init"]
    L = s["moe_layers"]
    nxt = ", ".join(f"L{a}->{b}" for a, b in zip(L, L[1:]))
    two = ", ".join(f"L{a}->{b}" for a, b in zip(L, L[2:]))
    lays = "/".join(map(str, L))
    k = s["top_k"]

    def per(res, key, phase="prefill", fmt="{:.2f}"):
        return _row([r[key] for r in res[phase]["per_layer"]], fmt)

    def dead(res, phase="prefill"):
        return " / ".join(str(len(r["dead"])) for r in res[phase]["per_layer"])

    rows = [
        (f"load skew (max / mean count), layers {lays}", per(tr, "skewness"), per(rn, "skewness")),
        (f"router entropy / log E, layers {lays}", per(tr, "router_entropy"), per(rn, "router_entropy")),
        (f"dead experts (< 1% of mean load), layers {lays}", dead(tr), dead(rn)),
        (f"next-layer pre-gate recall@{k} ({nxt})", _row(tr["prefill"]["pregate_next"]), _row(rn["prefill"]["pregate_next"])),
        *(
            [(f"two layers ahead ({two})", _row(tr["prefill"]["pregate_two_ahead"]), _row(rn["prefill"]["pregate_two_ahead"]))]
            if len(L) > 2
            else []
        ),
        (f"token-id baseline recall@{k}, layers {lays}", per(tr, "token_id_recall"), per(rn, "token_id_recall")),
        (f"same layer, previous token recall@{k}", per(tr, "prev_token_recall"), per(rn, "prev_token_recall")),
        (f"global top-{k} popularity recall@{k}", per(tr, "popularity_recall"), per(rn, "popularity_recall")),
    ]
    drows = []
    if tr.get("decode"):
        drows = [
            ("load skew (max / mean count)", per(tr, "skewness", "decode"), per(rn, "skewness", "decode")),
            ("router entropy / log E", per(tr, "router_entropy", "decode"), per(rn, "router_entropy", "decode")),
            (f"next-layer pre-gate recall@{k} ({nxt})", _row(tr["decode"]["pregate_next"]), _row(rn["decode"]["pregate_next"])),
        ]
    chance = k / s["num_experts"]
    arch_name = {"olmoe": "OLMoE (`OlmoeForCausalLM`)", "mixtral": "Mixtral (`MixtralForCausalLM`)"}.get(s["arch"], s["arch"])
    cfg = t.get("train_config", {})
    lines = [
        f"# {c['name']}",
        "",
        f"A small {arch_name} mixture-of-experts language model trained from scratch on CPU by "
        "`recipes/train_models.py`, embedded in moeflow as a real (trained, not random) model for tracing, "
        "predictor training and offloading experiments. It is a research fixture: it writes locally plausible "
        "English with little meaning. Not for any downstream use.",
        "",
        "Load it with `AutoModelForCausalLM.from_pretrained(path)` and `AutoTokenizer.from_pretrained(path)`.",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | {arch_name} |",
        f"| decoder layers (all MoE) | {s['num_layers']} |",
        f"| routed experts per layer, top-k | {s['num_experts']}, top-{k} |",
        f"| hidden size / expert intermediate size | {s['hidden_size']} / {s['expert_intermediate_size']} |",
        f"| vocabulary | {c['vocab_size']:,} byte-level BPE tokens (pad 0, bos 1, eos 2) |",
        f"| parameters, total | {p['total']:,} ({p['total'] / 1e6:.2f}M; routed experts {p['experts'] / 1e6:.2f}M, "
        f"embeddings + LM head {p['embeddings'] / 1e6:.2f}M) |",
        f"| parameters active per token | {p['active']:,} ({p['active'] / 1e6:.2f}M) |",
        f"| stored as | {t.get('saved_dtype', s['dtype'])} safetensors, {c['safetensors_bytes'] / 2**20:.1f} MiB |",
        "",
        "## Training",
        "",
        f"- Corpus: {', '.join(t.get('corpus_sources', []))} from `shared/data` "
        f"({t.get('corpus_train_chars', 0) / 1e6:.1f}M characters, {t.get('corpus_train_tokens', 0) / 1e6:.2f}M tokens; "
        f"{t.get('val_fraction', 0.02):.0%} of each source held out, {t.get('corpus_val_tokens', 0):,} tokens). "
        "Alpaca and ShareGPT are excluded: they are the workloads.",
        f"- {t.get('steps', 0)} steps of {cfg.get('batch_size')} x {cfg.get('seq_len')} tokens = "
        f"{t.get('train_tokens_seen', 0) / 1e6:.2f}M tokens seen "
        f"(about {t.get('train_tokens_seen', 0) / max(1, t.get('corpus_train_tokens', 1)):.2f} epochs) "
        f"in {t.get('train_seconds', 0) / 60:.1f} minutes on {t.get('threads', 1)} CPU thread(s) of a shared 2-core machine.",
        f"- AdamW (betas 0.9/0.95, weight decay {cfg.get('weight_decay')}), peak lr {cfg.get('lr')}, "
        f"{cfg.get('warmup_steps')} warmup steps, cosine decay to {cfg.get('min_lr_ratio')} x peak over the wall-clock budget; "
        f"seed {cfg.get('seed')}.",
        f"- Loss: next-token cross-entropy + {cfg.get('balance_coef')} x per-layer load-balancing loss "
        f"(Switch-style, computed for each layer from its own router logits and averaged, "
        f"`moeflow.lmtrain.losses.per_layer_balance_loss`; transformers' pooled loss lets single layers collapse) "
        f"+ {cfg.get('z_coef')} x router z-loss.",
        "",
        f"![training curve]({CURVE_PNG})",
        "",
        f"Red points: loss on the first {cfg.get('eval_batches', 4) * cfg.get('batch_size', 16)} held-out windows of "
        f"{cfg.get('seq_len')} tokens (the held-out stream starts with War and Peace), measured during training. "
        "The perplexity below covers all held-out text.",
        "",
        f"**Held-out perplexity: {c['val_perplexity']:.1f}** ({c['val_tokens_scored']:,} predicted tokens, "
        f"windows of 256, fp32 compute on the stored weights). The same configuration with random weights: "
        f"{c['random_init_val_perplexity_32_windows']:.0f}.",
        "",
        "## Samples (greedy, 48 new tokens)",
        "",
    ]
    for smp in c["samples"]:
        lines += [f"Prompt: `{smp['prompt']!r}`", "", "```", smp["greedy"].strip(), "```", ""]
        if smp.get("greedy_loops"):
            lines += [
                "Greedy decoding repeats itself here; with `repetition_penalty=1.3` (still greedy):",
                "",
                "```",
                smp["greedy_rep_penalty_1.3"].strip(),
                "```",
                "",
            ]
    r = c["routing"]
    lines += [
        "## Routing",
        "",
        f"Router hooks (`moeflow.moe.RouterTap`) over {r['windows']} held-out windows of {r['seq']} tokens "
        f"({r['windows'] * r['seq']:,} tokens), for the trained model and for the same configuration with random "
        f"initial weights (seed {r['seed']}). Recall@{k} = overlap of a predicted expert set with the actual top-{k}, "
        f"divided by {k}; chance is {chance:.3f}. Pre-gate: router l+1 applied to layer l's router input. Token-id "
        "baseline: the most frequent experts per token id and layer, fit on the first half of the windows, scored "
        "on the second half.",
        "",
        "| measure | trained | random init |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c_} |" for a, b, c_ in rows],
        "",
    ]
    if drows:
        lines += [
            f"Decode: {tr['decode']['prompts']} prompts of 32 held-out tokens, {tr['decode']['steps']} greedy "
            "steps with repetition_penalty 1.3 (decode steps only):",
            "",
            "| measure | trained | random init |",
            "|---|---|---|",
            *[f"| {a} | {b} | {c_} |" for a, b, c_ in drows],
            "",
        ]
    lines += [
        "### What the numbers show",
        "",
        *observations(card),
        "",
        f"All numbers: `{CARD_JSON}`. Regenerate: `.venv/bin/python recipes/train_models.py --card-only --only {c['name']}`.",
        "",
    ]
    return "\n".join(lines)


def observations(card: dict[str, Any]) -> list[str]:
    """Plain statements derived from the numbers (no hand-written claims)."""
    tr, rn = card["routing"]["trained"]["prefill"], card["routing"]["random_init"]["prefill"]
    k, E = card["spec"]["top_k"], card["spec"]["num_experts"]
    out = []
    dead = [len(r["dead"]) for r in tr["per_layer"]]
    out.append(f"- Dead experts in the trained model: {sum(dead)} of {E * len(dead)} ({', '.join(map(str, dead))} per layer).")
    sk_t = np.mean([r["skewness"] for r in tr["per_layer"]])
    sk_r = np.mean([r["skewness"] for r in rn["per_layer"]])
    en_t = np.mean([r["router_entropy"] for r in tr["per_layer"]])
    en_r = np.mean([r["router_entropy"] for r in rn["per_layer"]])
    verdict = (
        "the trained routers are more decided than random ones"
        if en_t < en_r - 0.02
        else "the trained routers are about as undecided as random ones"
    )
    out.append(
        f"- Mean load skew {sk_t:.2f} trained vs {sk_r:.2f} random; mean router entropy {en_t:.2f} vs "
        f"{en_r:.2f} of the maximum: {verdict}" + (", and still spread probability widely." if en_t > 0.7 else ".")
    )
    if tr["pregate_next"]:
        pg_t, pg_r = np.mean(tr["pregate_next"]), np.mean(rn["pregate_next"])
        out.append(f"- Next-layer pre-gate recall@{k} averages {pg_t:.2f} trained vs {pg_r:.2f} random (chance {k / E:.2f}).")
        L = card["spec"]["moe_layers"]
        cmp = [(L[i + 1], pg, tr["per_layer"][i + 1]["token_id_recall"]) for i, pg in enumerate(tr["pregate_next"])]
        wins = [f"L{l} ({pg:.2f} vs {tid:.2f})" for l, pg, tid in cmp if pg > tid]
        loses = [f"L{l} ({pg:.2f} vs {tid:.2f})" for l, pg, tid in cmp if pg <= tid]
        out.append(
            "- Pre-gate vs the token-id baseline, per predicted layer (trained): "
            + (f"the pre-gate is better for {', '.join(wins)}" if wins else "the pre-gate is never better")
            + (f"; the token-id baseline is as good or better for {', '.join(loses)}." if loses else ".")
            + " A learned predictor has to beat both."
        )
    out.append(
        "- A random model is a weak 'no structure' control: its residual stream is dominated by the token "
        "embedding, so token-id and previous-token recall are not at chance."
    )
    return out


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
