"""`moeflow quality`: what a configuration costs in quality against `resident`, beside what it gains in speed.

`moeflow.stages.quality.main(QualityConfig)` runs the reference (`resident`, the stock model) and every
configuration of a sweep on
the same inputs and reports, per configuration: held-out perplexity scored token by token under the engine
(as decode passes, so the expert cache behaves as in generation) and its change vs resident, greedy token
agreement with resident's output (share of tokens, tokens to the first divergence), accuracy on a prompt set
with answers (MMLU, GSM8K) where the model scores above chance, and TPOT / bytes per token of the same run.
Every configuration is labelled lossy or exact by `moeflow.policies.lossy` (the policies' declared capabilities,
`--speculative`, a restricted plan, the device type), the answer `moeflow run` gives too.

This package is the measurement library (`measure`: perplexity windows, agreement, task scoring, intervals).
"""
