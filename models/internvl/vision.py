"""The InternVL vision stage: InternViT -> drop CLS -> pixel shuffle -> MLP projector, tiles batched.

Equal to transformers' `InternVLModel.get_image_features` (the oracle) and to the original
`InternVLChatModel.extract_feature` of the published InternVL 2 / 2.5 / 3 checkpoints.

Feature layer. Both implementations index hidden states the same way: hidden_states[0] is the
embedding output (the input of layer 0) and hidden_states[i] the output of layer i, so
`vision_feature_layer` / `select_layer` k picks the output of layer k mod (num_layers + 1) and only
that many layers run. -1 is special in transformers: it reads `last_hidden_state`, which is the only
path through the final LayerNorm of a tower built with `use_mean_pooling=False`; an explicit
k = num_layers gives the same layer output without that norm.

Unused layers. Every one of the config's `num_layers` layers is built and loaded even when fewer run
(`layers_used`): checkpoints hold all of them and `load_checked` refuses tensors without a slot, so
this keeps loading strict; published InternVL 2+ configs select the last layer, so nothing is wasted.

Fused weights. q/k/v are one Linear, rows [0, C) = q | [C, 2C) = k | [2C, 3C) = v: the original
layout's packed `attn.qkv` fills it whole, transformers' q_proj/k_proj/v_proj fill those rows. The
Conv2d patch embedding (kernel = stride = patch) is a Linear over patches unfolded in the conv
weight's (channel, row, column) order.

Tensor parallelism (`tp`, one rank of size 1 by default): a layer holds its rank's heads of q, k and v
(transformers' q_proj/k_proj/v_proj and the original packed `attn.qkv`, a `SplitSlot`, load the same
slices), its columns of proj / fc2 and rows of fc1; the projector likewise. proj, fc2 and the
projector's linear_2 all-reduce their outputs (`RowParallelLinear`), so `attention` / `mlp` return the
whole sum on every rank. The residual stream, norm1 / norm2, layer scales and embeddings are whole on
every rank. q_norm / k_norm normalise over the FULL hidden size (all heads): each rank holds its slice
of their weights, and the ranks all-reduce one sum of squares per token (`InternVisionLayer.qk_norm`).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vlm_sdk.layers.ops import KernelOps, TorchOps
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.weight_loading import ParamSlot, Shard, SplitSlot
from vlm_sdk.models.internvl.projector import InternVLProjector, pixel_shuffle

_ACTIVATIONS = MappingProxyType({
    "gelu": F.gelu,  # exact erf GELU, as transformers' ACT2FN["gelu"] and InternVL's nn.GELU()
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
})
_HF_QK_NORM_EPS = 1e-6  # transformers builds q_norm/k_norm with the RMSNorm default, not layer_norm_eps
_MISSING = object()


def _get(section: Any, name: str, where: str, default: Any = _MISSING) -> Any:
    """A config field from an object or a plain dict (None counts as absent); CheckpointError when a
    required one (no default) is absent."""
    value = section.get(name, _MISSING) if isinstance(section, dict) else getattr(section, name, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise CheckpointError(f"config.json{' ' + where if where else ''} has no {name!r}; it is required to "
                                  f"build the InternVL vision tower")
        return default
    return value


def _side(value: Any, name: str) -> int:
    """An image/patch size given as an int or a square (h, w) pair."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise CheckpointError(f"config.json vision_config.{name} {list(value)} is not square; "
                                  f"only square sizes are supported")
        value = value[0]
    return int(value)


def _activation(name: str, field: str) -> str:
    if name not in _ACTIVATIONS:
        raise CheckpointError(f"config.json {field} {name!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
    return name


@dataclass(frozen=True)
class InternVisionConfig:
    layout: str                 # "hf" (transformers' InternVLForConditionalGeneration) or "original" (internvl_chat)
    hidden_size: int
    num_heads: int
    intermediate_size: int
    num_layers: int             # layers built and loaded
    layers_used: int            # layers run: the selected hidden state (0 = embedding output)
    norm_type: str              # "layer_norm" | "rms_norm"
    norm_eps: float
    qkv_bias: bool
    qk_norm: bool               # RMSNorm over the full hidden size on q and k, before the head split
    qk_norm_eps: float
    image_size: int             # side in pixels of the position-embedding grid
    patch_size: int
    hidden_act: str
    final_norm: bool            # a final LayerNorm exists (transformers' use_mean_pooling=False)
    final_norm_used: bool       # ... and is applied: only on the last_hidden_state path (feature layer -1)
    downsample_ratio: float
    text_hidden_size: int
    projector_act: str
    tile_size: int              # tile side the checkpoint was trained on (force_image_size or image_size)
    num_channels: int = 3

    @property
    def shuffle(self) -> int:
        """Patches per side folded into one token (1 / downsample_ratio)."""
        return round(1 / self.downsample_ratio)

    def grid_of(self, tile_size: int) -> int:
        """Patches per side of a tile; `ValueError` unless the pixel shuffle divides them evenly."""
        p, s = self.patch_size, self.shuffle
        if tile_size % p or (tile_size // p) % s:
            raise ValueError(f"tile side {tile_size} must be a multiple of patch_size * (1 / downsample_ratio) "
                             f"= {p * s}")
        return tile_size // p

    def tokens_per_tile(self, tile_size: int) -> int:
        """Image tokens one tile becomes: (tile_size / patch_size)^2 * downsample_ratio^2 (256 for 448/14/0.5)."""
        return (self.grid_of(tile_size) // self.shuffle) ** 2

    @classmethod
    def from_hf(cls, hf_config: Any, text_hidden_size: int) -> "InternVisionConfig":
        """From transformers' `InternVLConfig` (model_type "internvl") or the generic config of an
        original `internvl_chat` checkpoint (vision_config a dict with InternViT's keys)."""
        vc = _get(hf_config, "vision_config", "")
        original = getattr(hf_config, "model_type", None) == "internvl_chat" or any(
            _get(hf_config, k, "", None) is not None for k in ("ps_version", "select_layer"))
        fields = cls._original_fields(hf_config, vc) if original else cls._hf_fields(hf_config, vc)
        ratio = float(_get(hf_config, "downsample_ratio", "", 0.5))
        if not 0 < ratio <= 1 or abs(round(1 / ratio) * ratio - 1) > 1e-6:
            raise CheckpointError(f"config.json downsample_ratio {ratio} is not 1/n for an integer n")
        layers, k = fields["num_layers"], fields.pop("feature_layer")
        field = "select_layer" if original else "vision_feature_layer"
        if isinstance(k, bool) or not isinstance(k, int):
            raise CheckpointError(f"config.json {field} {k!r}: only a single int layer index is supported")
        if not -(layers + 1) <= k <= layers:
            raise CheckpointError(f"config.json {field} {k} is out of range for {layers} vision layers "
                                  f"(hidden states 0..{layers}, or -{layers + 1}..-1)")
        if fields["norm_type"] not in ("layer_norm", "rms_norm"):
            raise CheckpointError(f"config.json vision_config.norm_type {fields['norm_type']!r} is not supported "
                                  f"(supported: 'layer_norm', 'rms_norm')")
        if fields["hidden_size"] % fields["num_heads"]:
            raise CheckpointError(f"config.json vision_config.hidden_size {fields['hidden_size']} is not divisible "
                                  f"by num_attention_heads {fields['num_heads']}")
        final_norm = fields.pop("final_norm")
        return cls(layers_used=k % (layers + 1), final_norm=final_norm, final_norm_used=final_norm and k == -1,
                   downsample_ratio=ratio, text_hidden_size=int(text_hidden_size), **fields)

    @staticmethod
    def _hf_fields(hf_config: Any, vc: Any) -> dict:
        where = "vision_config"
        strategy = _get(hf_config, "vision_feature_select_strategy", "", "default")
        if strategy != "default":
            raise CheckpointError(f"config.json vision_feature_select_strategy {strategy!r} is not supported "
                                  f"(only 'default', which drops the CLS token)")
        if not _get(vc, "use_absolute_position_embeddings", where, True):
            raise CheckpointError("config.json vision_config.use_absolute_position_embeddings=false is not "
                                  "supported (InternViT uses absolute position embeddings)")
        image = _side(_get(vc, "image_size", where, (448, 448)), "image_size")
        return dict(
            layout="hf", hidden_size=int(_get(vc, "hidden_size", where)),
            num_heads=int(_get(vc, "num_attention_heads", where)),
            intermediate_size=int(_get(vc, "intermediate_size", where)),
            num_layers=int(_get(vc, "num_hidden_layers", where)),
            norm_type=_get(vc, "norm_type", where, "layer_norm"),
            norm_eps=float(_get(vc, "layer_norm_eps", where, 1e-6)),
            qkv_bias=bool(_get(vc, "attention_bias", where, False)),
            qk_norm=bool(_get(vc, "use_qk_norm", where, False)), qk_norm_eps=_HF_QK_NORM_EPS, image_size=image,
            patch_size=_side(_get(vc, "patch_size", where, (14, 14)), "patch_size"),
            hidden_act=_activation(_get(vc, "hidden_act", where, "gelu"), "vision_config.hidden_act"),
            final_norm=not _get(vc, "use_mean_pooling", where, True),
            projector_act=_activation(_get(hf_config, "projector_hidden_act", "", "gelu"), "projector_hidden_act"),
            tile_size=image, num_channels=int(_get(vc, "num_channels", where, 3)),
            feature_layer=_get(hf_config, "vision_feature_layer", "", -1))

    @staticmethod
    def _original_fields(hf_config: Any, vc: Any) -> dict:
        where = "vision_config"
        ps_version = _get(hf_config, "ps_version", "", "v1")  # InternVLChatConfig's default
        if ps_version != "v2":
            raise CheckpointError(f"config.json ps_version {ps_version!r} (InternVL 1.x pixel shuffle; 'v1' when "
                                  f"absent) is not supported: only ps_version 'v2' (InternVL 2 / 2.5 / 3) is")
        eps = float(_get(vc, "layer_norm_eps", where, 1e-6))
        image = _side(_get(vc, "image_size", where), "image_size")
        # flags absent from config.json take InternViT's own InternVisionConfig defaults, as the remote code does
        return dict(
            layout="original", hidden_size=int(_get(vc, "hidden_size", where)),
            num_heads=int(_get(vc, "num_attention_heads", where)),
            intermediate_size=int(_get(vc, "intermediate_size", where)),
            num_layers=int(_get(vc, "num_hidden_layers", where)),
            norm_type=_get(vc, "norm_type", where, "rms_norm"), norm_eps=eps,
            qkv_bias=bool(_get(vc, "qkv_bias", where, False)), qk_norm=bool(_get(vc, "qk_normalization", where, True)),
            qk_norm_eps=eps, image_size=image, patch_size=_side(_get(vc, "patch_size", where), "patch_size"),
            hidden_act=_activation(_get(vc, "hidden_act", where, "gelu"), "vision_config.hidden_act"),
            final_norm=False, projector_act="gelu",  # mlp1 is LayerNorm, Linear, nn.GELU(), Linear
            tile_size=int(_get(hf_config, "force_image_size", "", None) or image),
            num_channels=int(_get(vc, "num_channels", where, 3)),
            feature_layer=_get(hf_config, "select_layer", "", -1))


class _Norm(nn.Module):
    """LayerNorm (weight + bias) or RMSNorm (weight only, the kernel set's `rms_norm`: InternViT-6B's
    norms), weights left for the checkpoint."""

    def __init__(self, kind: str, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str,
                 ops: KernelOps | None = None):
        super().__init__()
        self.kind, self.eps, self.ops = kind, eps, ops or TorchOps()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype, device=device)) if kind == "layer_norm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rms_norm":  # [..., C] rows
            return self.ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class InternVisionLayer(nn.Module):
    def __init__(self, cfg: InternVisionConfig, dtype: torch.dtype, device: torch.device | str,
                 tp: TPGroup = TPGroup(), ops: KernelOps | None = None):
        super().__init__()
        c = cfg.hidden_size
        self.tp = tp
        self.heads, self.head_dim = tp.split(cfg.num_heads, "vision attention heads"), c // cfg.num_heads  # local
        self.scale = self.head_dim ** -0.5
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.norm1 = _Norm(cfg.norm_type, c, cfg.norm_eps, dtype, device, ops)
        self.qkv = QKVParallelLinear(c, self.head_dim, cfg.num_heads, cfg.num_heads, cfg.qkv_bias, dtype, device, tp)
        local = self.heads * self.head_dim  # this rank's columns of q and k
        self.q_norm = _Norm("rms_norm", local, cfg.qk_norm_eps, dtype, device, ops) if cfg.qk_norm else None
        self.k_norm = _Norm("rms_norm", local, cfg.qk_norm_eps, dtype, device, ops) if cfg.qk_norm else None
        self.proj = RowParallelLinear(c, c, True, dtype, device, tp)
        self.ls1 = nn.Parameter(torch.empty(c, dtype=dtype, device=device))
        self.norm2 = _Norm(cfg.norm_type, c, cfg.norm_eps, dtype, device, ops)
        self.fc1 = ColumnParallelLinear(c, cfg.intermediate_size, True, dtype, device, tp)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, c, True, dtype, device, tp)
        self.ls2 = nn.Parameter(torch.empty(c, dtype=dtype, device=device))

    def qkv_local(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [T, N, C] norm1(x) -> 3 x [T, N, C/tp]
        """This rank's heads of q, k, v (before q_norm / k_norm)."""
        return self.qkv(h).split(self.heads * self.head_dim, dim=-1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[T, N, C/tp] each (q, k normed) -> proj output [T, N, C], summed over the ranks."""
        t, n, _ = q.shape
        q, k, v = (y.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2) for y in (q, k, v))  # [T, H/tp, N, D]
        o = F.scaled_dot_product_attention(q, k, v, scale=self.scale)  # [T, H/tp, N, D]
        return self.proj(o.transpose(1, 2).reshape(t, n, -1))

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_norm(q), k_norm(k) over the full hidden size C, of this rank's columns [T, N, C/tp] each.

        Across ranks: an all-reduce of each token's sum of squares of q and of k (one [T, N, 2] float32
        tensor, one call), then each rank scales its own columns by its slice of the weights. Chosen over
        vLLM's all-gather of q and k (norm the whole [T, N, C], split again): it moves 2 numbers per token
        instead of 2*C*(tp-1)/tp, keeps the heads local (no gather, no re-split), and is the same
        arithmetic as `rms_norm` (float32 mean of squares, weight * (x * rsqrt(mean + eps)).to(dtype)):
        equal to tp=1 up to the order of the float32 sum."""
        if self.tp.size == 1:
            return self.q_norm(q), self.k_norm(k)
        if not self.tp.communicates:  # summing over the ranks is the point: an identity would be wrong
            raise ValueError(f"q_norm / k_norm over the full hidden size need the {self.tp.size} ranks' process "
                             f"group (TPGroup.group); to compose ranks by hand, norm the gathered q and k")
        squares = torch.stack([q.float().square().sum(-1), k.float().square().sum(-1)], dim=-1)  # [T, N, 2]
        # one eps for both: q_norm and k_norm are built with the same (cfg.qk_norm_eps)
        inv = torch.rsqrt(self.tp.all_reduce(squares) / (q.shape[-1] * self.tp.size) + self.q_norm.eps)  # [T, N, 2]
        return (self.q_norm.weight * (q.float() * inv[..., :1]).to(q.dtype),  # [T, N, C/tp]
                self.k_norm.weight * (k.float() * inv[..., 1:]).to(k.dtype))

    def attention(self, h: torch.Tensor) -> torch.Tensor:  # [T, N, C] norm1(x) -> [T, N, C], summed over ranks
        q, k, v = self.qkv_local(h)
        if self.q_norm is not None:
            q, k = self.qk_norm(q, k)
        return self.attend(q, k, v)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:  # [T, N, C] norm2(x) -> [T, N, C], summed over ranks
        return self.fc2(self.act(self.fc1(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, N, C] -> [T, N, C]
        x = x + self.ls1 * self.attention(self.norm1(x))
        return x + self.ls2 * self.mlp(self.norm2(x))


class InternVLVisionTower(nn.Module):
    def __init__(self, cfg: InternVisionConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup = TPGroup(), ops: KernelOps | None = None):
        super().__init__()
        self.cfg = cfg
        ops = ops or TorchOps()
        c, p = cfg.hidden_size, cfg.patch_size
        self.grid = cfg.image_size // p  # position-embedding grid side
        self.patch_embed = ColumnParallelLinear(cfg.num_channels * p * p, c, True, dtype, device)  # whole on every rank
        self.cls_token = nn.Parameter(torch.empty(1, 1, c, dtype=dtype, device=device))
        self.position_embedding = nn.Parameter(torch.empty(1, self.grid ** 2 + 1, c, dtype=dtype, device=device))
        self.layers = nn.ModuleList(InternVisionLayer(cfg, dtype, device, tp, ops) for _ in range(cfg.num_layers))
        self.final_norm = _Norm("layer_norm", c, cfg.norm_eps, dtype, device) if cfg.final_norm else None
        self.projector = InternVLProjector(c * cfg.shuffle ** 2, cfg.text_hidden_size,
                                           _ACTIVATIONS[cfg.projector_act], dtype, device, tp)
        self.requires_grad_(False)

    def tokens_per_tile(self, tile_size: int) -> int:
        return self.cfg.tokens_per_tile(tile_size)

    def _position_embedding(self, g: int) -> torch.Tensor:  # [1, 1 + g*g, C]
        """transformers' `interpolate_pos_encoding`: the patch part resized bicubically to a g x g grid."""
        pos = self.position_embedding
        if g == self.grid:
            return pos
        c = pos.shape[-1]
        patch = pos[:, 1:].reshape(1, self.grid, self.grid, c).permute(0, 3, 1, 2)  # [1, C, G, G]
        patch = F.interpolate(patch, size=(g, g), mode="bicubic", align_corners=False)  # [1, C, g, g]
        return torch.cat([pos[:, :1], patch.permute(0, 2, 3, 1).reshape(1, g * g, c)], dim=1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [T, 3, S, S] -> [T * tokens, text_hidden]
        if pixel_values.dim() != 4 or pixel_values.shape[1] != self.cfg.num_channels \
                or pixel_values.shape[2] != pixel_values.shape[3]:
            raise ValueError(f"pixel_values must be [tiles, {self.cfg.num_channels}, S, S] (square tiles), "
                             f"got {list(pixel_values.shape)}")
        t, ch, side = pixel_values.shape[:3]
        g, p, c = self.cfg.grid_of(side), self.cfg.patch_size, self.cfg.hidden_size
        w = self.patch_embed.weight
        x = pixel_values.to(device=w.device, dtype=w.dtype).reshape(t, ch, g, p, g, p)
        x = x.permute(0, 2, 4, 1, 3, 5).reshape(t, g * g, ch * p * p)  # [T, g*g, 3*p*p], conv weight order
        x = torch.cat([self.cls_token.expand(t, 1, c), self.patch_embed(x)], dim=1)  # [T, 1 + g*g, C]
        x = x + self._position_embedding(g)
        for layer in self.layers[:self.cfg.layers_used]:
            x = layer(x)
        if self.cfg.final_norm_used:
            x = self.final_norm(x)
        x = pixel_shuffle(x[:, 1:].reshape(t, g, g, c), self.cfg.shuffle)  # [T, g/s, g/s, C*s*s]
        return self.projector(x.reshape(-1, x.shape[-1]))  # [T * (g/s)^2, text_hidden]

    def checkpoint_map(self, layout: str) -> dict[str, ParamSlot | SplitSlot]:
        """Checkpoint name -> this rank's slot, for the "hf" (`model.vision_tower.*`, `model.multi_modal_projector.*`)
        or the "original" (`vision_model.*`, `mlp1.*`) layout; `param` is relative to this module."""
        if layout == "hf":
            names = _HF_NAMES
        elif layout == "original":
            if self.final_norm is not None:
                raise ValueError("the original InternVL layout has no final vision LayerNorm")
            names = _ORIGINAL_NAMES
        else:
            raise ValueError(f"unknown checkpoint layout {layout!r} (expected 'hf' or 'original')")
        cfg = self.cfg
        c, p, ch = cfg.hidden_size, cfg.patch_size, cfg.num_channels
        v = names["vision"]
        out = {
            f"{v}{names['cls']}": ParamSlot("cls_token", (1, 1, c)),
            f"{v}{names['patch']}.weight": ParamSlot("patch_embed.weight", (c, ch, p, p)),
            f"{v}{names['patch']}.bias": ParamSlot("patch_embed.bias", (c,)),
            f"{v}{names['pos']}": ParamSlot("position_embedding", (1, self.grid ** 2 + 1, c)),
        }
        for i, layer in enumerate(self.layers):
            src, dst = f"{v}{names['layer']}.{i}.", f"layers.{i}."
            if layout == "hf":
                parts = [f"{src}attention.{name}" for name in ("q_proj", "k_proj", "v_proj")]
                out.update(layer.qkv.slots(f"{dst}qkv.", [f"{n}.weight" for n in parts],
                                           [f"{n}.bias" for n in parts] if cfg.qkv_bias else None))
            else:  # the packed q | k | v tensor: each part split by heads
                out.update(layer.qkv.fused_slots(f"{dst}qkv.", f"{src}attn.qkv.weight",
                                                 f"{src}attn.qkv.bias" if cfg.qkv_bias else None))
            for ours in ("proj", "fc1", "fc2"):
                out.update(getattr(layer, ours).slots(f"{dst}{ours}.", f"{src}{names[ours]}.weight",
                                                      f"{src}{names[ours]}.bias"))
            for ours in ("norm1", "norm2"):
                out[f"{src}{names[ours]}.weight"] = ParamSlot(f"{dst}{ours}.weight", (c,))
                if cfg.norm_type == "layer_norm":
                    out[f"{src}{names[ours]}.bias"] = ParamSlot(f"{dst}{ours}.bias", (c,))
            if cfg.qk_norm:  # this rank's columns, as q and k
                local = layer.heads * layer.head_dim
                shard = None if layer.tp.size == 1 else Shard(0, layer.tp.rank * local, local)
                for ours in ("q_norm", "k_norm"):
                    out[f"{src}{names[ours]}.weight"] = ParamSlot(f"{dst}{ours}.weight", (c,), shard=shard)
            out[f"{src}{names['ls1']}"] = ParamSlot(f"{dst}ls1", (c,))
            out[f"{src}{names['ls2']}"] = ParamSlot(f"{dst}ls2", (c,))
        if self.final_norm is not None:
            out[f"{v}layernorm.weight"] = ParamSlot("final_norm.weight", (c,))
            out[f"{v}layernorm.bias"] = ParamSlot("final_norm.bias", (c,))
        out.update(self.projector.slots(names["mlp_ln"], names["mlp_fc1"], names["mlp_fc2"]))
        return out


_HF_NAMES = MappingProxyType({
    "vision": "model.vision_tower.", "cls": "embeddings.cls_token",
    "patch": "embeddings.patch_embeddings.projection", "pos": "embeddings.position_embeddings",
    "layer": "encoder.layer", "proj": "attention.projection_layer", "fc1": "mlp.fc1", "fc2": "mlp.fc2",
    "norm1": "layernorm_before", "norm2": "layernorm_after", "q_norm": "attention.q_norm",
    "k_norm": "attention.k_norm", "ls1": "lambda_1", "ls2": "lambda_2",
    "mlp_ln": "model.multi_modal_projector.layer_norm", "mlp_fc1": "model.multi_modal_projector.linear_1",
    "mlp_fc2": "model.multi_modal_projector.linear_2",
})
_ORIGINAL_NAMES = MappingProxyType({
    "vision": "vision_model.", "cls": "embeddings.class_embedding",
    "patch": "embeddings.patch_embedding", "pos": "embeddings.position_embedding",
    "layer": "encoder.layers", "proj": "attn.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2",
    "norm1": "norm1", "norm2": "norm2", "q_norm": "attn.q_norm", "k_norm": "attn.k_norm", "ls1": "ls1", "ls2": "ls2",
    "mlp_ln": "mlp1.0", "mlp_fc1": "mlp1.1", "mlp_fc2": "mlp1.3",  # mlp1.2 is the parameterless GELU
})
