"""Training the project's own small MoE language models (`models/olmoe-mini`, `models/mixtral-mini`).

`tokenizer` (byte-level BPE), `configs` (the model sizes), `losses` (per-layer load balancing and
router z-loss), `loop` (the CPU training loop on a wall-clock budget), `modelcard` (routing
statistics and the README of a saved model). The recipe is `recipes/train_models.py`.
"""
