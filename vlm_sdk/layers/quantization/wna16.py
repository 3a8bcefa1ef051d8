"""compressed-tensors W4A16, the `pack-quantized` format (llm-compressor's W4A16 scheme; RedHatAI's / Neural
Magic's *-quantized.w4a16 checkpoints; read from compressed-tensors' pack_quantized compressor and vLLM's
compressed_tensors_wNa16.py):

    <module>.weight_packed     [out, in/8] int32      nibble i of word c = input 8c + i, stored as q + 8
    <module>.weight_scale      [out, in/G] (group) or [out, 1] (channel), the checkpoint's float dtype
    <module>.weight_zero_point [out/8, in/G] int32    asymmetric only: packed along the output, zero + 8
    <module>.weight_shape      [2]                    the unpacked [out, in]
    <module>.weight_g_idx      [in] int32             actorder "group" only: each input column's group
    W[n, k] = (q[n, k] - z[n, g]) * s[n, g], g = g_idx[k] or k // G      (kernels/dequant_torch.py; z = 8
                                                                          without zero points)

config.json: `"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric":
true, "strategy": "group", "group_size": 128, "actorder": null}, "input_activations": null}}, "ignore":
["lm_head", "re:visual.*"]}`. The scales are held in the model's dtype, as vLLM holds them. With actorder
"group" a rank of a split input keeps every group's scales and zeros (its columns' g_idx point anywhere),
as vLLM does (marlin_repeat_scales_on_all_ranks).

On CUDA: kernels/int4_gemm.py's GPTQ path over transposed views (this layout is GPTQ v2's with every tensor
transposed; without zero points the kernel subtracts 8).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_sdk.errors import CheckpointError
from vlm_sdk.kernels.dequant_torch import dequantize_w4a16
from vlm_sdk.layers.quantization.base import PackedTensor, QuantScheme, check_group_index


@dataclass(frozen=True)
class W4A16Scheme(QuantScheme):
    group_size: int  # input columns per scale; -1: strategy "channel" (one group over the whole input)
    symmetric: bool
    actorder: bool  # actorder "group": weight_g_idx orders the columns into groups
    skip: tuple[str, ...] = ()
    method = "compressed-tensors"

    @property
    def description(self) -> str:
        groups = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        order = ", actorder group" if self.actorder else ""
        return f"W4A16 int4 (compressed-tensors pack-quantized), {groups}, {'sym' if self.symmetric else 'asym'}{order}"

    def tensors(self) -> tuple[PackedTensor, ...]:
        g, whole = self.group_size, self.actorder
        out = [PackedTensor("weight_packed", torch.int32, 2, out_dim=0, out_div=1, in_dim=1, in_div=8),
               PackedTensor("weight_scale", None, 2, out_dim=0, out_div=1, in_dim=1, in_div=g,
                            whole_on_row_split=whole),
               PackedTensor("weight_shape", torch.int64, 1, out_dim=None, out_div=1, in_dim=None, in_div=1,
                            extent=2)]
        if not self.symmetric:
            out.append(PackedTensor("weight_zero_point", torch.int32, 2, out_dim=0, out_div=8, in_dim=1, in_div=g,
                                    whole_on_row_split=whole))
        if self.actorder:
            out.append(PackedTensor("weight_g_idx", torch.int32, 1, out_dim=None, out_div=1, in_dim=0, in_div=1))
        return tuple(out)

    def dequantize(self, t, out_features, in_features, in_starts):
        g_idx = t.get("weight_g_idx")
        if g_idx is not None:  # global groups; this rank's scales start at its first group
            g_idx = g_idx - in_starts["weight_scale"]
        return dequantize_w4a16(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), g_idx)

    def check(self, name, t, in_starts, shape):
        recorded = [int(v) for v in t["weight_shape"].tolist()]
        if recorded != list(shape):
            raise CheckpointError(f"tensor {name}.weight_shape says the weight is {recorded}, but config.json makes "
                                  f"this Linear {list(shape)}: the config does not match the weights")
        if self.actorder:
            check_group_index(f"{name}.weight_g_idx", t["weight_g_idx"], f"{name}.weight_scale",
                              t["weight_scale"].shape[1], in_starts["weight_scale"], "actorder")

    def kernel_matmul(self, x, layer, bias):
        """kernels/int4_gemm.py's GPTQ path on transposed views (no copy): weight_packed.t() is GPTQ's
        qweight [K/8, N], weight_scale.t() its scales, weight_zero_point.t() its qzeros (zero_offset 0);
        without zero points, zero_offset 8. One launch over the fused parts, one per part with actorder
        (each part's own g_idx, made local to the rank's scales)."""
        from vlm_sdk.kernels.int4_gemm import int4_gemm  # Triton: imported where a kernel runs
        group = self.group_size if self.group_size > 0 else layer.input_size
        offset = 8 if self.symmetric else 0

        def launch(t, g_idx, b):
            zeros = t.get("weight_zero_point")
            return int4_gemm(x, t["weight_packed"].t(), None if zeros is None else zeros.t(), t["weight_scale"].t(),
                             awq=False, group=group, g_idx=g_idx, zero_offset=offset, bias=b)
        if not self.actorder:
            whole = {"weight_packed": layer.weight_packed, "weight_scale": layer.weight_scale,
                     "weight_zero_point": getattr(layer, "weight_zero_point", None)}
            return launch(whole, None, bias)
        start_group = layer.in_starts()["weight_scale"]
        outs, start = [], 0
        for i, part in enumerate(layer.parts):
            t = layer.part_tensors(i)
            g_idx = t["weight_g_idx"] if start_group == 0 else t["weight_g_idx"] - start_group
            outs.append(launch(t, g_idx, None if bias is None else bias[start:start + part.local]))
            start += part.local
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
