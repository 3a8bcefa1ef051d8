"""GPTQ, the AutoGPTQ / gptqmodel layout (vLLM's gptq.py reads the same):

    <module>.qweight [in/8, out] int32   8 int4 values per word along the input, in order
    <module>.qzeros  [in/G, out/8] int32 zero points packed along the output; the original format
                                         (checkpoint_format "gptq") stores zero - 1, "gptq_v2" the zero
    <module>.scales  [in/G, out] float16
    <module>.g_idx   [in] int32          each input row's group: k // G, or a permutation (desc_act)
    W[n, k] = (q[k, n] - (z[g, n] + offset)) * s[g, n], g = g_idx[k]      (kernels/dequant_torch.py)

Symmetric checkpoints (`sym: true`) store the zero 8 (as 7 in the original format); asymmetric ones any.
With desc_act, a rank of a split input keeps every group's scales and zeros (its rows' g_idx point
anywhere), as vLLM does; without it, only its own groups.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_sdk.errors import CheckpointError
from vlm_sdk.kernels.dequant_torch import dequantize_gptq
from vlm_sdk.layers.quantization.base import PackedTensor, QuantScheme, check_group_index


@dataclass(frozen=True)
class GPTQScheme(QuantScheme):
    group_size: int  # the input rows per group (the whole input for group_size -1 in config.json)
    desc_act: bool
    sym: bool
    zero_offset: int  # 1: checkpoint_format "gptq" (zero - 1 stored); 0: "gptq_v2"
    skip: tuple[str, ...] = ()
    method = "gptq"

    @property
    def description(self) -> str:
        order = ", desc_act" if self.desc_act else ""
        return f"GPTQ int4, group {self.group_size}, {'sym' if self.sym else 'asym'}{order}"

    def tensors(self) -> tuple[PackedTensor, ...]:
        g, whole = self.group_size, self.desc_act
        return (PackedTensor("qweight", torch.int32, 2, out_dim=1, out_div=1, in_dim=0, in_div=8),
                PackedTensor("qzeros", torch.int32, 2, out_dim=1, out_div=8, in_dim=0, in_div=g,
                             whole_on_row_split=whole),
                PackedTensor("scales", torch.float16, 2, out_dim=1, out_div=1, in_dim=0, in_div=g,
                             whole_on_row_split=whole),
                PackedTensor("g_idx", torch.int32, 1, out_dim=None, out_div=1, in_dim=0, in_div=1))

    def dequantize(self, t, out_features, in_features, in_starts):
        # g_idx holds global groups; this rank's scales start at its first group
        return dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"] - in_starts["scales"],
                               self.zero_offset)

    def kernel_matmul(self, x, layer, bias):
        """kernels/int4_gemm.py. Without desc_act a row's group is k // G (as vLLM reads it; `check` makes
        sure g_idx says so): one launch over the fused parts. With it, each part has its own g_idx (made
        local to the rank's scales): one launch per part."""
        from vlm_sdk.kernels.int4_gemm import int4_gemm  # Triton: imported where a kernel runs
        group = self.group_size if self.group_size > 0 else layer.input_size
        if not self.desc_act:
            return int4_gemm(x, layer.qweight, layer.qzeros, layer.scales, awq=False, group=group,
                             zero_offset=self.zero_offset, bias=bias)
        offset = layer.in_starts()["scales"]
        outs, start = [], 0
        for i, part in enumerate(layer.parts):
            t = layer.part_tensors(i)
            g_idx = t["g_idx"] if offset == 0 else t["g_idx"] - offset
            b = None if bias is None else bias[start:start + part.local]
            outs.append(int4_gemm(x, t["qweight"], t["qzeros"], t["scales"], awq=False, group=group, g_idx=g_idx,
                                  zero_offset=self.zero_offset, bias=b))
            start += part.local
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def check(self, name, t, in_starts, shape):
        groups, g_idx, offset = t["scales"].shape[0], t["g_idx"], in_starts["scales"]
        check_group_index(f"{name}.g_idx", g_idx, f"{name}.scales", groups, offset, "desc_act")
        if not self.desc_act:  # each row k in group k // G (the rank's rows start on a group boundary)
            k = torch.arange(g_idx.shape[0], device=g_idx.device)
            g = self.group_size if self.group_size > 0 else g_idx.shape[0]
            if not torch.equal(g_idx.long() - offset, k // g):
                raise CheckpointError(f"tensor {name}.g_idx orders the input rows otherwise than row // group_size "
                                      f"({self.group_size}) while config.json says desc_act false: set desc_act "
                                      f"true in its quantization_config")
