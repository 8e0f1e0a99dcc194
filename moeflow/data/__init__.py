"""Prompt sets for tracing (`prompts.py`) and the LM training corpus (`corpus.py`)."""

from .prompts import PROMPT_SETS, Prompt, data_dir, load_prompts, prompt_id, record_text

__all__ = ["PROMPT_SETS", "Prompt", "data_dir", "load_prompts", "prompt_id", "record_text"]
