"""Benchmarks, each runnable by anyone and printing a ratio against a peer measured in the same run:
`vlm-sdk bench` (engine.py: our engine vs transformers generate), `vlm-sdk bench --gpu` (gpu.py, gpu_parts.py:
the Qwen2.5-VL-3B figures against their floors) and `vlm-sdk bench-serve` (serve.py: a server over HTTP)."""
