"""Quantized weight formats (AWQ, GPTQ, FP8, compressed-tensors W4A16): each a `QuantScheme` naming its
checkpoint tensors and their dequantization; `quant_scheme(hf_config)` reads config.json's
`quantization_config`."""
from vlm_sdk.layers.quantization.base import PackedTensor, QuantScheme
from vlm_sdk.layers.quantization.config import QUANT_METHODS, quant_scheme

__all__ = ["PackedTensor", "QuantScheme", "QUANT_METHODS", "quant_scheme"]
