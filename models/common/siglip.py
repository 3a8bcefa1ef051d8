"""The SigLIP vision tower (transformers' `SiglipVisionModel`, without its attention-pooling head): patch
embedding, learned position embeddings, pre-norm encoder layers (LayerNorm, attention with biases, a
GELU MLP), the final LayerNorm. Gemma 3's tower (so400m: 27 layers of width 1152, patch 14, 896x896
images, 4096 patches each), PaliGemma's and Idefics3's are this one.

Every image has the tower's own size (`image_size`, so the position grid is never resampled), so a call
attends within each image with one batched SDPA (non-causal, no mask). The Conv2d patch embedding
(kernel = stride = patch) is a Linear over patches unfolded in the conv weight's (channel, row, column)
order; its output rows are the patches row by row, as the conv's flatten(2) gives them.

Tensor parallelism (`tp`): a layer holds its rank's heads of q, k, v (QKVParallelLinear over the
checkpoint's q_proj / k_proj / v_proj) and of out_proj's input (row-parallel, all-reduced), fc1's rows
and fc2's columns; the residual stream, norms and embeddings are whole on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.activation import ACTIVATIONS
from vlm_sdk.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.weight_loading import ParamSlot

# SiglipVisionConfig's defaults (transformers 5.24) for fields a config.json omits
_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
             "layer_norm_eps": 1e-6, "vision_use_head": True}


@dataclass(frozen=True)
class SiglipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # the side of every image the tower takes, in pixels
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    num_channels: int = 3

    @property
    def grid(self) -> int:
        """Patches per side of an image."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid ** 2

    @classmethod
    def from_hf(cls, vision_config: Any, where: str = "vision_config") -> "SiglipVisionConfig":
        """From transformers' `SiglipVisionConfig` or a dict of its fields. The attention-pooling head
        (`vision_use_head`) is refused: a tower feeding a decoder reads the patch states, and a checkpoint
        with head tensors would load weights nothing uses."""
        def get(name: str) -> Any:
            value = vision_config.get(name) if isinstance(vision_config, dict) else getattr(vision_config, name, None)
            return _DEFAULTS[name] if value is None else value

        if get("vision_use_head"):
            raise CheckpointError(f"config.json {where}.vision_use_head=true: the SigLIP attention-pooling head is not "
                                  f"served (a vision-language model reads the patch states; the published VLM configs set false)")
        act = get("hidden_act")
        if act not in ACTIVATIONS:
            raise CheckpointError(f"config.json {where}.hidden_act {act!r} is not supported "
                                  f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        cfg = cls(hidden_size=int(get("hidden_size")), intermediate_size=int(get("intermediate_size")),
                  num_layers=int(get("num_hidden_layers")), num_heads=int(get("num_attention_heads")),
                  image_size=int(get("image_size")), patch_size=int(get("patch_size")),
                  layer_norm_eps=float(get("layer_norm_eps")), hidden_act=act, num_channels=int(get("num_channels")))
        if cfg.hidden_size % cfg.num_heads:
            raise CheckpointError(f"config.json {where}.hidden_size {cfg.hidden_size} is not divisible by "
                                  f"num_attention_heads {cfg.num_heads}")
        if cfg.image_size % cfg.patch_size:
            raise CheckpointError(f"config.json {where}.image_size {cfg.image_size} is not a multiple of patch_size "
                                  f"{cfg.patch_size}")
        return cfg


class _LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig, dtype: torch.dtype, device: torch.device | str, tp: TPGroup):
        super().__init__()
        c = cfg.hidden_size
        self.head_dim = c // cfg.num_heads
        self.heads = tp.split(cfg.num_heads, "vision attention heads")  # this rank's
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.layer_norm1 = _LayerNorm(c, cfg.layer_norm_eps, dtype, device)
        self.qkv = QKVParallelLinear(c, self.head_dim, cfg.num_heads, cfg.num_heads, True, dtype, device, tp)
        self.out_proj = RowParallelLinear(c, c, True, dtype, device, tp)
        self.layer_norm2 = _LayerNorm(c, cfg.layer_norm_eps, dtype, device)
        self.fc1 = ColumnParallelLinear(c, cfg.intermediate_size, True, dtype, device, tp)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, c, True, dtype, device, tp)

    def attention(self, h: torch.Tensor) -> torch.Tensor:  # [B, N, C] layer_norm1(x) -> [B, N, C], summed over ranks
        b, n, _ = h.shape
        q, k, v = (t.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)  # [B, H/tp, N, D] each
                   for t in self.qkv(h).split(self.heads * self.head_dim, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)  # [B, H/tp, N, D]
        return self.out_proj(o.transpose(1, 2).reshape(b, n, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, C] -> [B, N, C]
        x = x + self.attention(self.layer_norm1(x))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class SiglipVisionTower(nn.Module):
    """`forward(pixels [B, 3, S, S])` -> the final-norm patch states `[B, (S / patch)^2, C]`."""

    def __init__(self, cfg: SiglipVisionConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 tp: TPGroup = TPGroup()):
        super().__init__()
        self.cfg = cfg
        c, p = cfg.hidden_size, cfg.patch_size
        self.patch_embedding = ColumnParallelLinear(cfg.num_channels * p * p, c, True, dtype, device)  # whole per rank
        self.position_embedding = nn.Parameter(torch.empty(cfg.num_patches, c, dtype=dtype, device=device))
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg, dtype, device, tp) for _ in range(cfg.num_layers))
        self.post_layernorm = _LayerNorm(c, cfg.layer_norm_eps, dtype, device)
        self.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B, 3, S, S] -> [B, g*g, C]
        cfg = self.cfg
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (cfg.num_channels, cfg.image_size, cfg.image_size):
            raise ValueError(f"the SigLIP tower takes [images, {cfg.num_channels}, {cfg.image_size}, {cfg.image_size}] "
                             f"pixels, got {list(pixel_values.shape)}")
        b, ch, g, p = pixel_values.shape[0], cfg.num_channels, cfg.grid, cfg.patch_size
        w = self.patch_embedding.weight
        x = pixel_values.to(device=w.device, dtype=w.dtype).reshape(b, ch, g, p, g, p)
        x = x.permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, ch * p * p)  # [B, g*g, 3*p*p], conv weight order
        x = self.patch_embedding(x) + self.position_embedding  # [B, g*g, C]
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)

    def checkpoint_map(self, prefix: str) -> dict[str, ParamSlot]:
        """Checkpoint name (`{prefix}embeddings.patch_embedding.weight`, `{prefix}encoder.layers.N...`, with
        `prefix` e.g. "model.vision_tower.vision_model.") -> this rank's slot, relative to this module."""
        cfg = self.cfg
        c, p, ch = cfg.hidden_size, cfg.patch_size, cfg.num_channels
        out = {f"{prefix}embeddings.patch_embedding.weight": ParamSlot("patch_embedding.weight", (c, ch, p, p)),
               f"{prefix}embeddings.patch_embedding.bias": ParamSlot("patch_embedding.bias", (c,)),
               f"{prefix}embeddings.position_embedding.weight": ParamSlot("position_embedding", (cfg.num_patches, c))}
        for name in ("weight", "bias"):
            out[f"{prefix}post_layernorm.{name}"] = ParamSlot(f"post_layernorm.{name}", (c,))
        for i, layer in enumerate(self.layers):
            src, dst = f"{prefix}encoder.layers.{i}.", f"layers.{i}."
            attn = [f"{src}self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")]
            out.update(layer.qkv.slots(f"{dst}qkv.", [f"{a}.weight" for a in attn], [f"{a}.bias" for a in attn]))
            out.update(layer.out_proj.slots(f"{dst}out_proj.", f"{src}self_attn.out_proj.weight",
                                            f"{src}self_attn.out_proj.bias"))
            for ours in ("fc1", "fc2"):
                out.update(getattr(layer, ours).slots(f"{dst}{ours}.", f"{src}mlp.{ours}.weight", f"{src}mlp.{ours}.bias"))
            for norm in ("layer_norm1", "layer_norm2"):
                for name in ("weight", "bias"):
                    out[f"{src}{norm}.{name}"] = ParamSlot(f"{dst}{norm}.{name}", (c,))
        return out
