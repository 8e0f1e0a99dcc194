"""MoE-GPS: prediction strategies for expert duplication across GPUs (`predictors`), a prefill
simulator for N GPUs (`simulator`); the strategy guideline behind `moeflow gps` is `moeflow.stages.gps`."""
