"""Sampling, on the logits' device (vLLM's v1/sample): the `Sampler` (greedy, temperature, top-k / top-p,
seeded draws, logprobs), per-row edits (`penalties`: presence / frequency / repetition, logit_bias,
min_tokens), top-k / top-p among the most likely tokens (`top_k_top_p`), structured-output masks
(`token_mask`), the step's tokens kept on the device (`sampled_tokens`), and small per-row lists uploaded
without a host sync (`device_lists`). Only the worker's model runner (and its memory profile) samples."""
