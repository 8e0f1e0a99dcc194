"""A byte-level BPE tokenizer trained on the corpus, wrapped as a transformers fast tokenizer."""

from __future__ import annotations

from collections.abc import Iterable

SPECIAL = {"pad": "<|pad|>", "bos": "<|bos|>", "eos": "<|eos|>"}


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192):
    """Train byte-level BPE; returns a `PreTrainedTokenizerFast` with pad=0, bos=1, eos=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[SPECIAL["pad"], SPECIAL["bos"], SPECIAL["eos"]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_first(tok)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"], pad_token=SPECIAL["pad"], model_max_length=1024
    )
    assert (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id) == (0, 1, 2)
    return fast


def bos_first(tok) -> None:
    """Make `tokenizer(text)` start with <bos>, as every training document does (a `tokenizers.Tokenizer`)."""
    from tokenizers import processors

    bos = SPECIAL["bos"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )


def encode_docs(tok, docs: Iterable[str]) -> list[int]:
    """One token stream: every document as `<bos> text <eos>`."""
    out: list[int] = []
    docs = list(docs)
    for enc in tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False):  # no length warnings
        out.append(tok.bos_token_id)
        out.extend(enc.ids)
        out.append(tok.eos_token_id)
    return out
