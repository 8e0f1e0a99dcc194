"""The measurements of `moeflow quality`, each under whatever engine (or none) is attached to the model.

- `stream_nll`: perplexity windows scored token by token, one forward pass per token with the KV cache, as
  decode runs (the expert cache sees the same one-token passes as in generation);
- `dppl_interval`: the 95% interval of a perplexity change against a reference scored on the same tokens
  (paired block bootstrap of the per-token NLL differences); `within_noise` when it contains 0;
- `agreement`: greedy outputs against the reference's (share of matching positions, tokens to the first
  divergence);
- `mmlu_items` / `mmlu_correct`: the answer letter with the highest log-likelihood after "Answer:";
- `gsm8k_items` / `final_number`: exact match of the final number of a greedy answer;
- `above_chance`: a one-sided binomial test (p < 0.05) of k correct of n against the chance rate.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, MoeflowError
from ..models import no_cudnn_attention
from ..moe.tx_compat import kv_cache_kwargs

LETTERS = "ABCDEFGH"


# ---- the perplexity text ---------------------------------------------------------------------------------


def load_text(name: str, data_dir: str | None) -> tuple[str, str]:
    """(text, description): `wikitext2` = the wikitext2 documents the project's models hold out from training
    (moeflow.data.corpus split), `wikitext2-test` = wikitext2/test.txt, else a UTF-8 text file."""
    from ..data.prompts import data_dir as resolve_dir

    if name == "wikitext2":
        from ..data.corpus import load_corpus

        docs = load_corpus(resolve_dir(data_dir), sources=["wikitext2"]).val["wikitext2"]
        return "\n\n".join(docs), "wikitext2 held-out documents (corpus split)"
    path = resolve_dir(data_dir) / "wikitext2" / "test.txt" if name == "wikitext2-test" else Path(name)
    try:
        return path.read_text(encoding="utf-8", errors="replace"), str(path)
    except OSError as e:
        raise MoeflowError(f"cannot read --text {path}: {e.strerror}") from e


def text_windows(tok: Any, text: str, tokens: int, windows: int, max_positions: int | None) -> list[torch.Tensor]:
    """Up to `windows` consecutive non-overlapping windows of `tokens + 1` token ids [1,T+1] from the start of
    `text` (fewer if the text is shorter; the last may be shorter, at least 2 tokens)."""
    if max_positions is not None and tokens + 1 > max_positions:
        raise ConfigError(f"--ppl-tokens {tokens} + 1 is beyond the model's {max_positions} positions; lower --ppl-tokens")
    need = windows * (tokens + 1)
    ids: list[int] = []
    for chunk in range(0, len(text), 3000):  # tokenize only what the windows need
        ids += tok(text[chunk : chunk + 3000], add_special_tokens=False, verbose=False).input_ids  # cut into windows below
        if len(ids) >= need:
            break
    out = [torch.tensor([ids[i : i + tokens + 1]]) for i in range(0, min(need, len(ids)), tokens + 1)]
    out = [w for w in out if w.shape[1] >= 2]
    if windows and not out:
        raise MoeflowError("the perplexity text has fewer than 2 tokens; pass a longer --text")
    return out


@dataclass
class StreamScore:
    nll: float = 0.0  # summed over scored tokens (nats)
    tokens: int = 0
    argmax: list[torch.Tensor] | None = None  # per window: the predicted next token at every position
    token_nll: list[list[float]] = field(default_factory=list)  # per window: each scored token's NLL (nats)

    @property
    def ppl(self) -> float | None:
        return math.exp(self.nll / self.tokens) if self.tokens else None


@torch.no_grad()
def stream_nll(
    model: Any,
    windows: list[torch.Tensor],
    device: torch.device,
    around: Callable[[int], AbstractContextManager[Any]] | None = None,
) -> StreamScore:
    """Feed each window one token per forward pass with the KV cache (a fresh cache per window) and sum the
    negative log-likelihood of every next token; `around(i)` (a CasMoE plan of window i) encloses window i."""
    score = StreamScore(argmax=[])
    for wi, w in enumerate(windows):
        w = w.to(device)
        cache = kv_cache_kwargs(model)  # filled in place by each forward
        preds = []
        nlls: list[float] = []
        with around(wi) if around is not None else nullcontext(), no_cudnn_attention():  # one new length per pass
            for i in range(w.shape[1] - 1):
                out = model(input_ids=w[:, i : i + 1], use_cache=True, **cache)
                logp = torch.log_softmax(out.logits[0, -1].double(), -1)
                nlls.append(-float(logp[w[0, i + 1]]))
                score.nll += nlls[-1]
                preds.append(int(logp.argmax()))
                score.tokens += 1
        score.token_nll.append(nlls)
        assert score.argmax is not None
        score.argmax.append(torch.tensor(preds))
    return score


def tf_agreement(a: StreamScore, ref: StreamScore) -> float | None:
    """Teacher-forced top-1 agreement: share of scored positions whose argmax equals the reference's."""
    if not a.argmax or not ref.argmax:
        return None
    same = sum(int((x == y).sum()) for x, y in zip(a.argmax, ref.argmax))
    return same / max(1, sum(int(y.numel()) for y in ref.argmax))


# ---- the noise of a perplexity change -------------------------------------------------------------------

BOOT_BLOCK = 32  # tokens per bootstrap block: neighbouring tokens share a KV cache and an expert cache
BOOT_RESAMPLES = 1000
BOOT_SEED = 0


def dppl_interval(
    nll: list[list[float]],
    ref: list[list[float]],
    *,
    block: int = BOOT_BLOCK,
    resamples: int = BOOT_RESAMPLES,
    seed: int = BOOT_SEED,
    level: float = 0.95,
) -> tuple[float, float] | None:
    """The `level` interval (percent) of the relative perplexity change exp(mean(nll - ref)) - 1 of a run against
    a reference scored on the same windows and token positions (`StreamScore.token_nll`): a paired bootstrap
    over blocks of `block` consecutive tokens within each window (the last block of a window shorter), blocks
    drawn with replacement, `resamples` times with a fixed seed. None without scored tokens."""
    import numpy as np

    if [len(w) for w in nll] != [len(w) for w in ref]:
        raise ValueError("dppl_interval needs both scores on the same windows and tokens")
    sums, counts = [], []
    for a, b in zip(nll, ref):
        d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)  # [T] per-token NLL change
        for i in range(0, len(d), max(1, block)):
            sums.append(float(d[i : i + block].sum()))
            counts.append(len(d[i : i + block]))
    if not sums:
        return None
    s, n = np.asarray(sums), np.asarray(counts, dtype=np.float64)
    pick = np.random.default_rng(seed).integers(0, len(s), size=(resamples, len(s)))  # [R,blocks]
    rel = np.expm1(s[pick].sum(1) / n[pick].sum(1)) * 100  # [R] percent
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(rel, [tail, 100 - tail])
    return float(lo), float(hi)


def within_noise(ci: tuple[float, float] | list[float] | None) -> bool | None:
    """Whether an interval of a change contains 0 (the change is inside the noise); None without one."""
    return None if ci is None else bool(ci[0] <= 0 <= ci[1])


def dppl_cell(delta: float | None, ci: tuple[float, float] | list[float] | None, fmt: str = "+.2f") -> str:
    """'+1.23 [-0.40, +2.90] within noise': a perplexity change (percent) with its interval, for tables."""
    if delta is None:
        return "-"
    if ci is None:
        return format(delta, fmt)
    return f"{delta:{fmt}} [{ci[0]:{fmt}}, {ci[1]:{fmt}}]" + (" within noise" if within_noise(ci) else "")


# ---- greedy agreement -----------------------------------------------------------------------------------


def agreement(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> tuple[float | None, float | None]:
    """(share of the reference's tokens matched position by position, mean tokens before the first divergence);
    a shorter output counts its missing positions as divergent."""
    match = total = 0
    firsts: list[int] = []
    for ot, rt in zip(outs, refs):
        o, r = ot.reshape(-1).tolist(), rt.reshape(-1).tolist()
        total += len(r)
        match += sum(1 for x, y in zip(o, r) if x == y)
        firsts.append(next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), min(len(o), len(r))))
    if not refs:
        return None, None
    return (match / total if total else 1.0), sum(firsts) / len(firsts)


# ---- tasks ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    prompt: str
    answer: str  # MMLU: the letter; GSM8K: the final number


def _interleave(per_file: list[list[Item]], limit: int) -> list[Item]:
    out: list[Item] = []
    for i in range(max((len(x) for x in per_file), default=0)):
        for rows in per_file:
            if i < len(rows):
                out.append(rows[i])
                if len(out) >= limit:
                    return out
    return out


def mmlu_items(data_dir: str | None, limit: int, split: str = "test") -> list[Item]:
    """MMLU questions (one per subject in turn), as 'question / A. .. / Answer:' with the answer letter."""
    from ..data.prompts import _mmlu_text, resolve_source

    folder = resolve_source("mmlu", data_dir, split)
    assert folder is not None
    per_file = []
    for p in sorted(folder.glob("*.csv")):
        rows = []
        for r in csv.DictReader(io.StringIO(p.read_text(encoding="utf-8-sig"), newline="")):
            ans = (r.get("answer") or "").strip()
            if r.get("question") and ans.isdigit():
                rows.append(Item(_mmlu_text(r) + "\nAnswer:", LETTERS[int(ans)]))
            elif r.get("question") and ans in LETTERS:
                rows.append(Item(_mmlu_text(r) + "\nAnswer:", ans))
        per_file.append(rows)
    items = _interleave(per_file, limit)
    if not items:
        raise MoeflowError(f"no MMLU questions with answers in {folder}")
    return items


def letter_ids(tok: Any, n: int = 4) -> list[int]:
    """The token id of ' A', ' B', ... (the first token of each, or its last where the first is shared: a
    tokenizer that splits off the space); refused if two letters still share it."""
    enc = [tok(" " + c, add_special_tokens=False).input_ids for c in LETTERS[:n]]
    ids = [e[0] for e in enc]
    if len(set(ids)) != n:
        ids = [e[-1] for e in enc]
    if len(set(ids)) != n:
        raise MoeflowError("the tokenizer does not tell the answer letters apart; use --task gsm8k or none")
    return ids


@torch.no_grad()
def mmlu_correct(model: Any, ids: torch.Tensor, answer: str, letters: list[int], device: torch.device) -> bool:
    """One forward pass of the question; the letter with the highest log-likelihood next is the answer."""
    logits = model(input_ids=ids.to(device)).logits[0, -1].float()
    return LETTERS[int(torch.argmax(logits[letters]))] == answer


def gsm8k_items(data_dir: str | None, limit: int, split: str = "test") -> list[Item]:
    import json

    from ..data.prompts import resolve_source

    path = resolve_source("gsm8k", data_dir, split)
    assert path is not None
    items = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            gold = final_number(str(r.get("answer", "")))
            if gold is not None:
                items.append(Item(f"Question: {r['question']}\nAnswer:", gold))
            if len(items) >= limit:
                break
    if not items:
        raise MoeflowError(f"no GSM8K questions with answers in {path}")
    return items


_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The number after '####' if there is one, else the last number of `text` (commas dropped, '.0' trimmed)."""
    part = text.split("####", 1)[1] if "####" in text else text
    nums = _NUM.findall(part if "####" in text else text)
    if not nums:
        return None
    n = (nums[0] if "####" in text else nums[-1]).replace(",", "")
    return n[:-2] if n.endswith(".0") else n


def above_chance(k: int, n: int, chance: float, alpha: float = 0.05) -> bool:
    """One-sided exact binomial test: P(X >= k | n, chance) < alpha (chance 0: any correct answer)."""
    if n == 0:
        return False
    if chance <= 0:
        return k > 0
    p = sum(math.comb(n, i) * chance**i * (1 - chance) ** (n - i) for i in range(k, n + 1))
    return p < alpha
