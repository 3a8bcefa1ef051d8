"""A reference quantizer for tests and benchmarks: a float checkpoint directory -> the same model in a
published quantized layout (AWQ GEMM, GPTQ v1/v2 with or without desc_act, block-wise FP8,
compressed-tensors FP8 and W4A16 pack-quantized), plus its dequantized twin (the same directory with every
quantized Linear's weight replaced by exactly what the quantized tensors decode to), which transformers loads
as the oracle.

Only the LLM's decoder Linears are quantized (`layers.N.self_attn.{q,k,v,o}_proj`, `layers.N.mlp.{gate,up,
down}_proj`, and a mixture-of-experts layer's per-expert `layers.N.mlp.experts.E.{gate,up,down}_proj`, as
the Qwen3-VL-MoE FP8 repos store them; never its router `mlp.gate`), as the published checkpoints do; the vision tower, embeddings and LM head stay as they are,
and `modules_to_not_convert` / `ignore` say so. Group scales are rounded to their stored dtype before the
weights are rounded against them, so the dequantized twin is exact.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from vlm_sdk.kernels.dequant_torch import (awq_pack, dequantize_awq, dequantize_fp8_block, dequantize_fp8_channel,
                                           dequantize_gptq, dequantize_w4a16, pack_int4)
from vlm_sdk.model_loader import iter_safetensors

_LINEAR = re.compile(r"^(?P<base>.*\blayers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj))"
                     r"\.weight$")
_NOT_LLM = ("visual", "vision", "mlp1", "multi_modal_projector")
_SKIP = ["lm_head", "visual", "vision_tower", "vision_model", "mlp1", "multi_modal_projector"]
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def _group_reduce(w: torch.Tensor, groups: torch.Tensor, num_groups: int, op: str) -> torch.Tensor:
    """`op` ("amin" / "amax") of w [out, in] over each group's input columns -> [groups, out]."""
    return torch.stack([getattr(w[:, groups == g], op)(dim=1) for g in range(num_groups)])


def _minmax_int4(w: torch.Tensor, groups: torch.Tensor, num_groups: int, zero_min: int = 0,
                 dtype: torch.dtype = torch.float16):
    """Asymmetric int4 of w [out, in] with groups of input columns: (q [out, in], zeros [groups, out],
    scales [groups, out] in `dtype`)."""
    lo, hi = _group_reduce(w, groups, num_groups, "amin"), _group_reduce(w, groups, num_groups, "amax")
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-4).to(dtype)
    zeros = (-lo / scales.float()).round().clamp(zero_min, 15)
    q = (w / scales.float()[groups].t() + zeros[groups].t()).round().clamp(0, 15)
    return q.to(torch.int32), zeros.to(torch.int32), scales


def quantize_awq(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """w [out, in] -> AWQ GEMM tensors (qweight, qzeros, scales)."""
    in_f = w.shape[1]
    g = group_size if group_size > 0 else in_f
    q, z, s = _minmax_int4(w.float(), torch.arange(in_f) // g, in_f // g)
    return {"qweight": awq_pack(q.t()), "qzeros": awq_pack(z), "scales": s}


def _group_index(in_f: int, g: int, shuffled: bool, seed: int) -> torch.Tensor:
    """[in] int32: each input column's group, k // g, or (`shuffled`, GPTQ's activation order) the columns
    given to the groups in a random order."""
    order = torch.randperm(in_f, generator=torch.Generator().manual_seed(seed)) if shuffled else torch.arange(in_f)
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_f) // g).to(torch.int32)
    return g_idx


def _int4(w: torch.Tensor, groups: torch.Tensor, num_groups: int, sym: bool, zero_min: int = 0,
          dtype: torch.dtype = torch.float16):
    """int4 of w [out, in] (float32) by groups of input columns: (q [out, in] 0..15, zeros [groups, out]
    0..15 (8 when `sym`), scales [groups, out] in `dtype`)."""
    if not sym:
        return _minmax_int4(w, groups, num_groups, zero_min, dtype)
    amax = _group_reduce(w.abs(), groups, num_groups, "amax")
    s = (amax / 7).clamp(min=1e-4).to(dtype)
    z = torch.full_like(amax, 8, dtype=torch.int32)
    q = (w / s.float()[groups].t() + 8).round().clamp(0, 15).to(torch.int32)
    return q, z, s


def quantize_gptq(w: torch.Tensor, group_size: int, *, sym: bool, desc_act: bool, v2: bool,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """w [out, in] -> GPTQ tensors (qweight, qzeros, scales, g_idx). desc_act: the input rows are given to
    the groups in a random order (as GPTQ's activation order does), g_idx recording each row's group."""
    w = w.float()
    in_f = w.shape[1]
    g = group_size if group_size > 0 else in_f
    g_idx = _group_index(in_f, g, desc_act, seed)
    # the original format stores zero - 1: its asymmetric zeros start at 1
    q, z, s = _int4(w, g_idx.long(), in_f // g, sym, zero_min=0 if v2 else 1)
    stored = z - (0 if v2 else 1)
    return {"qweight": pack_int4(q.t(), 0), "qzeros": pack_int4(stored, 1), "scales": s, "g_idx": g_idx}


def quantize_w4a16(w: torch.Tensor, group_size: int, *, sym: bool, actorder: bool,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """w [out, in] -> compressed-tensors pack-quantized tensors (weight_packed, weight_scale, weight_shape;
    weight_zero_point when not `sym`; weight_g_idx with `actorder` (its "group" ordering)). Scales in w's
    dtype, as llm-compressor writes them; group_size -1: strategy channel."""
    out_f, in_f = w.shape
    g = group_size if group_size > 0 else in_f
    g_idx = _group_index(in_f, g, actorder, seed)
    q, z, s = _int4(w.float(), g_idx.long(), in_f // g, sym, dtype=w.dtype)
    t = {"weight_packed": pack_int4(q, 1), "weight_scale": s.t().contiguous(),
         "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64)}
    if not sym:
        t["weight_zero_point"] = pack_int4(z.t(), 0)  # [out/8, groups]: packed along the output
    if actorder:
        t["weight_g_idx"] = g_idx
    return t


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """w [out, in] -> block-wise FP8 (weight e4m3, weight_scale_inv [ceil(out/b0), ceil(in/b1)] float32)."""
    out_f, in_f = w.shape
    b0, b1 = block
    pad = torch.zeros(-(-out_f // b0) * b0, -(-in_f // b1) * b1)
    pad[:out_f, :in_f] = w.float()
    amax = pad.abs().unflatten(0, (-1, b0)).unflatten(2, (-1, b1)).amax(dim=(1, 3))  # [blocks0, blocks1]
    scale = (amax / FP8_MAX).clamp(min=1e-8)
    full = scale.repeat_interleave(b0, 0)[:out_f].repeat_interleave(b1, 1)[:, :in_f]
    return {"weight": (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), "weight_scale_inv": scale}


def quantize_fp8_channel(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [out, in] -> compressed-tensors FP8, channel strategy (weight e4m3, weight_scale [out, 1])."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-8)
    return {"weight": (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), "weight_scale": scale}


def dequantize(method: str, t: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    if method == "awq":
        return dequantize_awq(t["qweight"], t["qzeros"], t["scales"])
    if method == "gptq":
        offset = 0 if config.get("checkpoint_format") == "gptq_v2" else 1
        return dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], offset)
    if method == "fp8":
        return dequantize_fp8_block(t["weight"], t["weight_scale_inv"], tuple(config["weight_block_size"]))
    if method == "w4a16":
        return dequantize_w4a16(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                t.get("weight_g_idx"))
    return dequantize_fp8_channel(t["weight"], t["weight_scale"])


def quantization_config(method: str, *, group_size: int = 16, sym: bool = True, desc_act: bool = False,
                        v2: bool = False, block: tuple[int, int] = (16, 16)) -> dict:
    """config.json's quantization_config as each format's tool writes it ("w4a16": compressed-tensors'
    pack-quantized, desc_act meaning its actorder "group", group_size -1 its channel strategy)."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": ["visual"]}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": "gptq_v2" if v2 else "gptq", "lm_head": False, "static_groups": False,
                "true_sequential": True, "damp_percent": 0.05}
    if method == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block), "modules_to_not_convert": list(_SKIP)}
    if method == "compressed-tensors":
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {
                    "targets": ["Linear"], "format": "float-quantized",
                    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                                "dynamic": False, "group_size": None, "observer": "minmax"},
                    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                          "dynamic": True, "observer": None},
                    "output_activations": None}},
                "ignore": ["lm_head"] + [f"re:.*{p}.*" for p in _SKIP[1:]], "kv_cache_scheme": None}
    if method == "w4a16":
        weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group" if group_size > 0 else "channel",
                   "group_size": group_size if group_size > 0 else None, "dynamic": False,
                   "actorder": "group" if desc_act else None, "block_structure": None, "observer": "minmax",
                   "observer_kwargs": {}}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": weights,
                                              "input_activations": None, "output_activations": None}},
                "ignore": ["lm_head"] + [f"re:.*{p}.*" for p in _SKIP[1:]], "kv_cache_scheme": None}
    raise ValueError(f"unknown method {method!r}")


def quantize_tensors(method: str, w: torch.Tensor, config: dict, seed: int) -> dict[str, torch.Tensor]:
    if method == "awq":
        return quantize_awq(w, config["group_size"])
    if method == "gptq":
        return quantize_gptq(w, config["group_size"], sym=config["sym"], desc_act=config["desc_act"],
                             v2=config["checkpoint_format"] == "gptq_v2", seed=seed)
    if method == "fp8":
        return quantize_fp8_block(w, tuple(config["weight_block_size"]))
    if method == "w4a16":
        weights = config["config_groups"]["group_0"]["weights"]
        return quantize_w4a16(w, weights["group_size"] or -1, sym=weights["symmetric"],
                              actorder=weights["actorder"] == "group", seed=seed)
    return quantize_fp8_channel(w)


def quantize_checkpoint(src: Path, dst: Path, method: str, dequantized: Path | None = None,
                        device: torch.device | str = "cpu", **options) -> Path:
    """Write `src` (a float checkpoint) to `dst` in `method`'s published layout (options: see
    `quantization_config`), and, when given, its dequantized twin to `dequantized`. Returns `dst`.
    `device`: where the tensors are quantized (a GPU makes a 7B model's minutes seconds)."""
    src, dst = Path(src), Path(dst)
    config = quantization_config(method, **options)
    quantized: dict[str, torch.Tensor] = {}
    decoded: dict[str, torch.Tensor] = {}
    for i, (name, tensor) in enumerate(iter_safetensors(src, show_progress=False)):
        m = _LINEAR.match(name)
        if m is None or any(p in name for p in _NOT_LLM):
            quantized[name] = decoded[name] = tensor
            continue
        packed = quantize_tensors(method, tensor.to(device), config, seed=i)
        quantized.update({f"{m['base']}.{k}": v.contiguous().cpu() for k, v in packed.items()})
        if dequantized is not None:
            decoded[name] = dequantize(method, packed, config).to(tensor.dtype).contiguous().cpu()
    _write(src, dst, quantized, config)
    if dequantized is not None:
        _write(src, Path(dequantized), decoded, None)
    return dst


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quant: dict | None) -> None:
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    if quant is not None:
        config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
