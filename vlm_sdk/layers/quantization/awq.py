"""AWQ, GEMM version (AutoAWQ's `WQLinear_GEMM`, what Qwen's and OpenGVLab's -AWQ checkpoints hold):

    <module>.qweight [in, out/8] int32   8 int4 values per word in AWQ's interleaved order
    <module>.qzeros  [in/G, out/8] int32 the groups' zero points, same packing
    <module>.scales  [in/G, out] float16
    W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]          (kernels/dequant_torch.py)

config.json: `"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true,
"version": "gemm", "modules_to_not_convert": ["visual"]}` (vLLM's awq.py reads the same keys).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_sdk.kernels.dequant_torch import dequantize_awq
from vlm_sdk.layers.quantization.base import PackedTensor, QuantScheme

@dataclass(frozen=True)
class AWQScheme(QuantScheme):
    group_size: int
    skip: tuple[str, ...] = ()
    method = "awq"

    @property
    def description(self) -> str:
        return f"AWQ int4, group {self.group_size}"

    def tensors(self) -> tuple[PackedTensor, ...]:
        g = self.group_size
        return (PackedTensor("qweight", torch.int32, 2, out_dim=1, out_div=8, in_dim=0, in_div=1),
                PackedTensor("qzeros", torch.int32, 2, out_dim=1, out_div=8, in_dim=0, in_div=g),
                PackedTensor("scales", torch.float16, 2, out_dim=1, out_div=1, in_dim=0, in_div=g))

    def dequantize(self, t, out_features, in_features, in_starts):
        return dequantize_awq(t["qweight"], t["qzeros"], t["scales"])

    def kernel_matmul(self, x, layer, bias):
        """kernels/int4_gemm.py over the rank's whole tensors (fused parts side by side: one launch). A
        rank's groups start on a group boundary, so its row k is in its group k // G."""
        from vlm_sdk.kernels.int4_gemm import int4_gemm  # Triton: imported where a kernel runs
        group = self.group_size if self.group_size > 0 else layer.input_size
        return int4_gemm(x, layer.qweight, layer.qzeros, layer.scales, awq=True, group=group, bias=bias)
