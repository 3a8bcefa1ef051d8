"""W8A8 FP8 for compressed-tensors' per-channel format (RedHatAI's *-FP8-dynamic checkpoints: weights e4m3
with one scale per output row, activations quantized per token at run time), through `torch._scaled_mm`.

    x:            [M, K] bfloat16 / float16 / float32
    weight:       [N, K] float8 e4m3
    weight_scale: [N, 1] float32
    y = (x_q * s_x) (weight * weight_scale)^T + b      x_q = e4m3(x / s_x), s_x = max|x row| / 448

One FP8 product on the tensor cores (twice bf16's rate, half its weight bytes), scaled per row and
column in its epilogue. `supported` says where: CUDA compute capability 9.x (torch's row-wise scaled FP8
product is a Hopper CUTLASS kernel: pytorch/pytorch#145728 guards it to sm_90; sm_89 and sm_100+/sm_120
are refused or unsupported by cuBLASLt, pytorch/pytorch#130359, #192707), bfloat16 activations (its
only output dtype) and K, N multiples of 16 (the FP8 layout rules); the quantized layers use the
dequantize path (W8A16) elsewhere.
torch also runs `_scaled_mm` on the CPU, which is how the tests check this op against its reference.
"""
from __future__ import annotations

import torch

from vlm_sdk.kernels.kv_quant import FP8_MAX, KV_FP8

# the smallest activation scale: an all-zero row quantizes to zeros, not NaN
_MIN_SCALE = 1e-12


def supported(device: torch.device, n: int, k: int) -> bool:
    """Whether `fp8_scaled_mm` runs on `device` for an [N, K] weight (CUDA sm_90, K and N multiples of 16)."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            and n % 16 == 0 and k % 16 == 0)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] -> [M, K] e4m3, [M, 1]
    """Each row divided by its max |value| / 448 and rounded to e4m3 (dynamic per-token scales)."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)  # [M, 1]
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(KV_FP8), scale


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or weight.dtype != KV_FP8:
        raise ValueError(f"x must be [M, K] and weight float8_e4m3fn [N, K], got {tuple(x.shape)} and "
                         f"{weight.dtype} {tuple(weight.shape)}")
    n = weight.shape[0]
    if weight_scale.numel() != n or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32 with {n} values (one per output row), got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")


def fp8_scaled_mm(x: torch.Tensor,  # [M, K]
                  weight: torch.Tensor,  # [N, K] float8_e4m3fn
                  weight_scale: torch.Tensor,  # [N, 1] float32
                  bias: torch.Tensor | None = None,  # [N]
                  ) -> torch.Tensor:  # [M, N] x.dtype
    _check(x, weight, weight_scale, bias)
    x_q, x_scale = quantize_per_token(x)
    # the weight's transpose is column-major, as the FP8 product wants its second operand
    return torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.reshape(1, -1).float(),
                            bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)


def fp8_scaled_mm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:  # [M, N]
    """Torch reference: the same quantized activations and the weight, dequantized, multiplied in float32,
    rounded once to x's dtype."""
    _check(x, weight, weight_scale, bias)
    x_q, x_scale = quantize_per_token(x)
    y = (x_q.float() * x_scale) @ (weight.float() * weight_scale.reshape(-1, 1).float()).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
