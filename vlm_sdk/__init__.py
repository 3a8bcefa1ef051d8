"""vlm_sdk: vision-language models on a paged KV cache with continuous batching.

The public names load lazily, so `import vlm_sdk.errors` (say, in a client) does not load the engine.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "vlm_sdk.llm",
    "AsyncLLM": "vlm_sdk.async_llm",
    "SamplingParams": "vlm_sdk.sampling_params",
    "RequestOutput": "vlm_sdk.outputs",
    "RequestMetrics": "vlm_sdk.outputs",
    "TokenLogprob": "vlm_sdk.outputs",
    "EngineArgs": "vlm_sdk.config",
    "TextPrompt": "vlm_sdk.multimodal.prompts",
    "TokensPrompt": "vlm_sdk.multimodal.prompts",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'vlm_sdk' has no attribute {name!r}")
