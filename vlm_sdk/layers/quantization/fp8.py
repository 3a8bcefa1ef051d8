"""FP8 (e4m3) weights, two published layouts:

  block-wise, the model makers' (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128, 128]`;
  Qwen3-VL-*-FP8, DeepSeek-V3; vLLM's fp8.py):
    <module>.weight           [out, in] float8_e4m3fn
    <module>.weight_scale_inv [ceil(out/B0), ceil(in/B1)]    W = weight * scale_inv of its block
  per channel, compressed-tensors' float-quantized format (RedHatAI's FP8-dynamic checkpoints: weights
  "strategy": "channel", activations dynamic per token):
    <module>.weight           [out, in] float8_e4m3fn
    <module>.weight_scale     [out, 1]                        W = weight * scale of its row

Activations: both are dynamic W8A8 formats (vLLM quantizes each token's activations to FP8 at run time).
Here: the per-channel format runs W8A8 on CUDA sm_90 (torch._scaled_mm, activations quantized per token);
the block-wise one runs W8A16 on CUDA (kernels/fp8_block_gemm.py: the weight dequantized in registers, the
activations in the model's dtype); the CPU dequantizes the weight and multiplies in the model's dtype
(W8A16). W8A16 is the W8A8 product up to the activations' rounding.
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

    def kernel_matmul(self, x, layer, bias):
        """kernels/fp8_block_gemm.py (W8A16: e4m3 read in registers). Fused parts whose outputs fill whole
        blocks share one launch; a part ending in a partial block starts the next part's scales on a new
        row of blocks, so each part is launched alone. None when B1 is no multiple of 16."""
        from vlm_sdk.kernels.fp8_block_gemm import fp8_block_gemm  # Triton: imported where a kernel runs
        if self.block[1] % 16:
            return None
        if all(p.local % self.block[0] == 0 for p in layer.parts):
            return fp8_block_gemm(x, layer.weight, layer.weight_scale_inv, self.block, bias)
        outs, start = [], 0
        for i, part in enumerate(layer.parts):
            t = layer.part_tensors(i)
            b = None if bias is None else bias[start:start + part.local]
            outs.append(fp8_block_gemm(x, t["weight"], t["weight_scale_inv"], self.block, b))
            start += part.local
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


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

    def kernel_matmul(self, x, layer, bias):
        """W8A8 through torch._scaled_mm (kernels/fp8_scaled_mm.py: activations quantized per token, as the
        format's dynamic activations say) where it runs: CUDA sm_90, bf16 activations, K and N multiples
        of 16; None elsewhere (the layer dequantizes: W8A16)."""
        from vlm_sdk.kernels import fp8_scaled_mm
        n, k = layer.weight.shape
        if x.dtype != torch.bfloat16 or not fp8_scaled_mm.supported(x.device, n, k):
            return None
        return fp8_scaled_mm.fp8_scaled_mm(x, layer.weight, layer.weight_scale, bias)
