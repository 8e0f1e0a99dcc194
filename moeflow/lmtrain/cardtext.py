"""The text of a model card: `render` turns `compute_card`'s dictionary into the README.md of a model folder
(tables of the spec, training, perplexity and routing statistics, with `observations` in plain words)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

CARD_JSON = "card.json"
CURVE_PNG = "training_curve.png"


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
