"""Build one embedded model end to end: corpus -> tokenizer -> training -> saved folder -> card."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..artifacts import atomic_dir, now_iso, write_json_atomic
from ..data.corpus import load_corpus
from .configs import model_config
from .files import TRAIN_LOG, TRAINING_JSON
from .loop import LMTrainConfig, train
from .tokenizer import encode_docs, train_tokenizer

MAX_FOLDER_BYTES = 25 * 2**20


@dataclass(frozen=True)
class BuildConfig:
    name: str  # olmoe-mini | mixtral-mini
    data_dir: str
    out: str  # parent folder: the model goes to out/name
    log_dir: str
    train: LMTrainConfig = field(default_factory=LMTrainConfig)
    vocab_size: int = 8192
    val_fraction: float = 0.02
    threads: int = 1
    tiny: bool = False
    card: bool = True


def tokens_of(tok, docs: list[str]) -> torch.Tensor:
    return torch.tensor(encode_docs(tok, docs), dtype=torch.long)


def save_model(model, tok, folder: Path) -> str:
    """save_pretrained in fp32, or bf16 when the fp32 weights would exceed the size limit."""
    from transformers import GenerationConfig

    n_bytes = sum(p.numel() for p in model.parameters()) * 4
    dtype = "float32" if n_bytes <= MAX_FOLDER_BYTES - 2 * 2**20 else "bfloat16"
    model = model.to(getattr(torch, dtype))
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False
    )
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return dtype


def build(cfg: BuildConfig, log=print) -> Path:
    """Train model `cfg.name` and write `cfg.out/cfg.name` (atomically), then its model card."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    corpus = load_corpus(cfg.data_dir, val_fraction=cfg.val_fraction)
    train_docs, val_docs = corpus.train_docs(), corpus.val_docs()
    if cfg.tiny:
        train_docs, val_docs = train_docs[::40], val_docs[::4]
    tok = train_tokenizer(train_docs, vocab_size=512 if cfg.tiny else cfg.vocab_size)
    train_tok, val_tok = tokens_of(tok, train_docs), tokens_of(tok, val_docs)
    n_chars = sum(map(len, train_docs))
    log(
        f"[{cfg.name}] corpus {n_chars / 1e6:.2f}M chars, {train_tok.numel() / 1e6:.2f}M train tokens, "
        f"{val_tok.numel() / 1e3:.1f}k val tokens, {n_chars / train_tok.numel():.2f} chars/token"
    )

    mcfg = model_config(cfg.name, tiny=cfg.tiny, vocab_size=len(tok))
    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_config(mcfg, dtype=torch.float32)
    top_k = mcfg.num_experts_per_tok
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"[{cfg.name}] {n_params / 1e6:.2f}M parameters; training for "
        f"{cfg.train.minutes if cfg.train.minutes is not None else '-'} min / {cfg.train.max_steps or '-'} steps"
    )

    Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
    log_path = Path(cfg.log_dir) / f"{cfg.name}{'-tiny' if cfg.tiny else ''}.train_log.jsonl"
    log_path.unlink(missing_ok=True)

    def on_step(row: dict) -> None:
        if "val_loss" in row:
            log(f"[{cfg.name}] step {row['step']} t={row['t']:.0f}s val_loss {row['val_loss']:.3f}")
        elif "step" in row and row["step"] % 25 == 0:
            log(
                f"[{cfg.name}] step {row['step']} t={row['t']:.0f}s loss {row['loss']:.3f} "
                f"bal {row['balance']:.3f} z {row['z']:.2f} lr {row['lr']:.2e}"
            )

    res = train(model, train_tok, val_tok, cfg.train, top_k=top_k, log_path=log_path, on_step=on_step)
    log(f"[{cfg.name}] trained {res.steps} steps, {res.tokens / 1e6:.2f}M tokens in {res.seconds / 60:.1f} min")

    final = Path(cfg.out) / cfg.name
    with atomic_dir(final, versioned=False) as d:  # a real folder: models/ is tracked by git
        dtype = save_model(model, tok, d)
        shutil.copy(log_path, d / TRAIN_LOG)
        write_json_atomic(
            d / TRAINING_JSON,
            {
                "name": cfg.name,
                "created_at": now_iso(),
                "saved_dtype": dtype,
                "parameters": n_params,
                "steps": res.steps,
                "train_tokens_seen": res.tokens,
                "train_seconds": round(res.seconds, 1),
                "wall_seconds_total": round(time.perf_counter() - t_start, 1),
                "threads": cfg.threads,
                "corpus_sources": sorted(corpus.train),
                "corpus_train_chars": n_chars,
                "corpus_train_tokens": train_tok.numel(),
                "corpus_val_tokens": val_tok.numel(),
                "val_fraction": cfg.val_fraction,
                "tiny": cfg.tiny,
                "train_config": asdict(cfg.train),
                "final_val_loss_train_windows": next((r["val_loss"] for r in reversed(res.history) if "val_loss" in r), None),
            },
        )
    log(f"[{cfg.name}] saved {final} ({folder_bytes(final) / 2**20:.1f} MiB, {dtype})")
    if cfg.card:
        from .modelcard import write_card

        write_card(final, val_tok, seed=cfg.train.seed, log=log)
        log(f"[{cfg.name}] model card written: {final / 'README.md'} ({folder_bytes(final) / 2**20:.1f} MiB)")
    return final


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def val_tokens_for(folder: Path, data_dir: str, val_fraction: float = 0.02) -> torch.Tensor:
    """The held-out token stream of a saved model, rebuilt from the corpus with its own tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    meta = json.loads((Path(folder) / TRAINING_JSON).read_text())
    docs = load_corpus(data_dir, val_fraction=meta.get("val_fraction", val_fraction)).val_docs()
    if meta.get("tiny"):
        docs = docs[::4]
    return tokens_of(tok, docs)
