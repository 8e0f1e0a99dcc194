"""MoE-GPS: prediction strategies for expert duplication across GPUs (`predictors`), a prefill
simulator for N GPUs (`simulator`) and the strategy guideline behind `moeflow gps` (`guide`)."""
