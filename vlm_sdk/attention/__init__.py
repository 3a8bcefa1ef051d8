"""Attention: the per-step metadata type (`metadata.AttentionMetadata`) and the backends that run
attention over the paged KV cache and within vision segments (`selector.make_backend`: torch | triton).
Imports only `vlm_sdk.kernels` below it."""
