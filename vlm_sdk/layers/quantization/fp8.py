"""FP8 (e4m3) weights, two published layouts:

  block-wise, the model makers' (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128, 128]`;
  Qwen3-VL-*-FP8, DeepSeek-V3; vLLM's fp8.py):
    <module>.weight           [out, in] float8_e4m3fn
    <module>.weight_scale_inv [ceil(out/B0), ceil(in/B1)]    W = weight * scale_inv of its block
  per channel, compressed-tensors' float-quantized format (RedHatAI's FP8-dynamic checkpoints: weights
  "strategy": "channel", activations dynamic per token):
    <module>.weight           [out, in] float8_e4m3fn
    <module>.weight_scale     [out, 1]                        W = weight * scale of its row

Activations: both are dynamic W8A8 formats (vLLM quantizes each token's activations to FP8 at run time);
the CPU path here dequantizes the weight and multiplies in the model's dtype (W8A16), which is the same
product up to the activations' rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_sdk.kernels.dequant_torch import dequantize_fp8_block, dequantize_fp8_channel
from vlm_sdk.layers.quantization.base import PackedTensor, QuantScheme


@dataclass(frozen=True)
class FP8BlockScheme(QuantScheme):
    block: tuple[int, int]  # (output rows, input columns) per scale
    skip: tuple[str, ...] = ()
    method = "fp8"

    @property
    def description(self) -> str:
        return f"FP8 e4m3, {self.block[0]}x{self.block[1]} blocks"

    def tensors(self) -> tuple[PackedTensor, ...]:
        b0, b1 = self.block
        return (PackedTensor("weight", torch.float8_e4m3fn, 2, out_dim=0, out_div=1, in_dim=1, in_div=1),
                PackedTensor("weight_scale_inv", torch.float32, 2, out_dim=0, out_div=b0, in_dim=1, in_div=b1,
                             ceil=True))

    def dequantize(self, t, out_features, in_features, in_starts):
        return dequantize_fp8_block(t["weight"], t["weight_scale_inv"], self.block)


@dataclass(frozen=True)
class FP8ChannelScheme(QuantScheme):
    skip: tuple[str, ...] = ()
    method = "compressed-tensors"

    @property
    def description(self) -> str:
        return "FP8 e4m3, per-channel scales (compressed-tensors)"

    def tensors(self) -> tuple[PackedTensor, ...]:
        return (PackedTensor("weight", torch.float8_e4m3fn, 2, out_dim=0, out_div=1, in_dim=1, in_div=1),
                PackedTensor("weight_scale", torch.float32, 2, out_dim=0, out_div=1, in_dim=None, in_div=1))

    def dequantize(self, t, out_features, in_features, in_starts):
        return dequantize_fp8_channel(t["weight"], t["weight_scale"])
