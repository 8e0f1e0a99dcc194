"""The stages: each command's orchestration (flags become a frozen config in `moeflow.cli`; `main(cfg)` here loads
what the command needs, calls the libraries and reports), between the CLI and the libraries.

`session` is what `run`, `quality` and `ep` share: the model and tokenizer under the thread rule, the link,
the calibration, the checks made before the first generation, the prompts, the warm-up and the engine.
A library (runtime, policies, predict, plan, gps, calibrate, sim, quant, trace, ...) never imports a stage or
the CLI; the layering is a contract checked by `make lint` (import-linter, `[tool.importlinter]` in pyproject.toml).
"""
