"""The vision towers on two tensor-parallel ranks: each rank, loaded strictly from the tiny checkpoint's
tensors through the tower's `checkpoint_map`, holds exactly its slice of q, k, v (a fused q | k | v
tensor split per part: `SplitSlot`), proj, the MLP and the projector; one block composed by hand across
the ranks (column outputs concatenated per head group, row partials summed, the bias added once)
equals the tp=1 block."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tolerance import assert_reduction_close, layer_terms
from vlm_sdk.errors import CheckpointError
from vlm_sdk.kernels.rms_norm_torch import rms_norm
from vlm_sdk.layers.linear import QKVParallelLinear
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.model_loader import iter_safetensors, read_config, text_config
from vlm_sdk.models.internvl.model import hf_canonical_name
from vlm_sdk.models.internvl.vision import InternVisionConfig, InternVLVisionTower
from vlm_sdk.models.qwen2_5_vl.vision import Qwen2_5_VisionTransformer
from vlm_sdk.testing import make_tiny_checkpoint
from vlm_sdk.weight_loading import ParamSlot, Shard, SplitSlot, load_checked

RANKS = (TPGroup(0, 2), TPGroup(1, 2))
# One vision block composed by hand against the whole block (tests/tolerance.py): a block's chain of the
# tiny towers (width 32, MLP 64, at most 16 tokens here) plus the projector's two matmuls (inputs 4 x 32).
TERMS = layer_terms(hidden=32, intermediate=64, tokens=16) + 4 * 32 + 4 * 32


def close(actual, expected):
    assert_reduction_close(actual, expected, TERMS)


def _rows(t: torch.Tensor, rank: int, parts: int = 1) -> torch.Tensor:
    """Rank `rank` of 2's rows of each of `parts` equal parts along dim 0, back to back."""
    return torch.cat([part.chunk(2, dim=0)[rank] for part in t.chunk(parts, dim=0)])


def _cols(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.chunk(2, dim=1)[rank]


def _tensors(ckpt, prefixes: tuple[str, ...], canonical=lambda name: name) -> dict[str, torch.Tensor]:
    named = ((canonical(n), t) for n, t in iter_safetensors(ckpt, show_progress=False))
    return {n: t for n, t in named if n.startswith(prefixes)}


# ----------------------------------------------------------------------------------------------
# SplitSlot: one checkpoint tensor loaded as several slices


class Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Parameter(torch.zeros(6, 4))  # rank r of 2: [q_r | k_r | v_r] of a [12, 4] q | k | v


def _split(rank: int, shape=(12, 4)) -> SplitSlot:
    return SplitSlot(tuple(ParamSlot("qkv", shape, 2 * i, Shard(0, 4 * i + 2 * rank, 2)) for i in range(3)))


def test_split_slot_loads_each_parts_slice_back_to_back_and_stays_strict():
    w = torch.arange(48.0).reshape(12, 4)
    for rank in (0, 1):
        m = Fused()
        load_checked(m, [("attn.qkv", w)], {"attn.qkv": _split(rank)})
        assert torch.equal(m.qkv, _rows(w, rank, 3))
    m = Fused()
    load_checked(m, [("x.attn.qkv", w)], {"x.attn.qkv": _split(1).under("")})
    with pytest.raises(CheckpointError, match=r"tensor attn.qkv has shape \[12, 5\] but Fused expects \[12, 4\] "
                                              r"for qkv rows \[0, 2\) \(its dim-0 slice \[2, 4\)\) and qkv rows"):
        load_checked(Fused(), [("attn.qkv", torch.zeros(12, 5))], {"attn.qkv": _split(1)})
    with pytest.raises(CheckpointError, match="1 tensor.s. of Fused missing from the checkpoint: attn.qkv"):
        load_checked(Fused(), [], {"attn.qkv": _split(0)})
    with pytest.raises(CheckpointError, match="tensor attn.qkv appears twice"):
        load_checked(Fused(), [("attn.qkv", w), ("attn.qkv", w)], {"attn.qkv": _split(0)})
    bad = SplitSlot(_split(0).parts[:2] + (ParamSlot("qkv", (12, 4), 3, Shard(0, 8, 2)),))
    with pytest.raises(ValueError, match=r"slots for attn.qkv and attn.qkv overlap"):
        load_checked(Fused(), [("attn.qkv", w)], {"attn.qkv": bad})
    with pytest.raises(ValueError, match=r"leave 1 parameter.s. of Fused unloaded: qkv rows \[4, 6\)"):
        load_checked(Fused(), [], {"attn.qkv": SplitSlot(_split(0).parts[:2])})
    with pytest.raises(ValueError, match="one checkpoint shape"):
        SplitSlot((ParamSlot("qkv", (12, 4)), ParamSlot("qkv", (6, 4))))


def test_fused_slots_are_plain_at_one_rank_and_split_per_part_at_two():
    one = QKVParallelLinear(8, 2, 4, 2, True)
    assert one.fused_slots("qkv.", "w", "b") == {"w": ParamSlot("qkv.weight", (16, 8)),
                                                 "b": ParamSlot("qkv.bias", (16,))}
    two = QKVParallelLinear(8, 2, 4, 2, True, tp=TPGroup(1, 2)).fused_slots("qkv.", "w")["w"]
    assert [(p.row_start, p.shard) for p in two.parts] == [(0, Shard(0, 4, 4)), (4, Shard(0, 10, 2)),
                                                           (6, Shard(0, 14, 2))]
    with pytest.raises(ValueError, match=r"vision attention heads \(3\) is not divisible by the tensor-parallel "
                                         r"size 2"):
        InternVLVisionTower(InternVisionConfig(
            layout="hf", hidden_size=12, num_heads=3, intermediate_size=8, num_layers=1, layers_used=1,
            norm_type="layer_norm", norm_eps=1e-6, qkv_bias=False, qk_norm=False, qk_norm_eps=1e-6, image_size=8,
            patch_size=4, hidden_act="gelu", final_norm=False, final_norm_used=False, downsample_ratio=0.5,
            text_hidden_size=8, projector_act="gelu", tile_size=8), tp=TPGroup(0, 2))


# ----------------------------------------------------------------------------------------------
# Qwen2.5-VL


def _qwen(vc, tensors, tp: TPGroup) -> Qwen2_5_VisionTransformer:
    tower = Qwen2_5_VisionTransformer(vc, tp=tp)
    load_checked(tower, tensors.items(), tower.checkpoint_map("visual."))
    return tower


def test_qwen_vision_ranks_hold_their_slices_and_compose_to_the_unsharded_block(tiny_checkpoints):
    ckpt = tiny_checkpoints("qwen2_5_vl")
    vc = read_config(ckpt).hf_config.vision_config
    t = _tensors(ckpt, ("visual.",))
    full = _qwen(vc, t, TPGroup())
    ranks = [_qwen(vc, t, tp) for tp in RANKS]
    for r, tower in enumerate(ranks):
        assert torch.equal(tower.patch_embed.weight, full.patch_embed.weight)  # whole on every rank
        for i, b in enumerate(tower.blocks):
            src = f"visual.blocks.{i}."
            assert b.heads == vc.num_heads // 2
            assert torch.equal(b.qkv.weight, _rows(t[f"{src}attn.qkv.weight"], r, 3))  # [q_r | k_r | v_r]
            assert torch.equal(b.qkv.bias, _rows(t[f"{src}attn.qkv.bias"], r, 3))
            assert torch.equal(b.proj.weight, _cols(t[f"{src}attn.proj.weight"], r))
            assert torch.equal(b.proj.bias, t[f"{src}attn.proj.bias"])
            assert torch.equal(b.gate_up_proj.weight, torch.cat([_rows(t[f"{src}mlp.gate_proj.weight"], r),
                                                                 _rows(t[f"{src}mlp.up_proj.weight"], r)]))
            assert torch.equal(b.down_proj.weight, _cols(t[f"{src}mlp.down_proj.weight"], r))
        m = tower.merger
        assert torch.equal(m.fc1.weight, _rows(t["visual.merger.mlp.0.weight"], r))
        assert torch.equal(m.fc1.bias, _rows(t["visual.merger.mlp.0.bias"], r))
        assert torch.equal(m.fc2.weight, _cols(t["visual.merger.mlp.2.weight"], r))

    g = torch.Generator().manual_seed(0)
    n, dim, heads = 16, vc.hidden_size, vc.num_heads
    d = dim // heads
    x = torch.randn(n, dim, generator=g)  # [N, dim]
    positions = torch.randint(0, 30, (2, n), generator=g)  # [2, N] patch row, column
    rope = full.ops.rotary_inputs(positions, full.rotary, torch.float32)
    plan = full.ops.attention.segments([8, 8], x.device)
    blocks = [tower.blocks[0] for tower in ranks]
    h = rms_norm(x, blocks[0].norm1.weight, blocks[0].norm1.eps)
    qkv = torch.cat([b.qkv(h).view(n, 3, heads // 2, d) for b in blocks], dim=2)  # per head group
    close(qkv, full.blocks[0].qkv(h).view(n, 3, heads, d))
    zero = torch.zeros(1, dim // 2)  # a rank's input columns
    assert torch.equal(blocks[0].proj(zero)[0], blocks[0].proj.bias) and not blocks[1].proj(zero).any()
    x1 = x + sum(b.attention(h, rope, plan) for b in blocks)  # row partials summed, bias once
    h2 = rms_norm(x1, blocks[0].norm2.weight, blocks[0].norm2.eps)
    out = x1 + sum(b.mlp(h2) for b in blocks)
    nxt = full.blocks[1].norm1  # the block hands on (next norm1(out), out)
    full_h, full_out = full.blocks[0](h, x, rope, plan, nxt)
    close(out, full_out)
    close(rms_norm(out, nxt.weight, nxt.eps), full_h)
    close(sum(tower.merger(x) for tower in ranks), full.merger(x))


# ----------------------------------------------------------------------------------------------
# InternVL (InternViT + mlp1 projector), both checkpoint layouts

_NAMES = {
    "hf": dict(prefixes=("model.vision_tower.", "model.multi_modal_projector."),
               layer="model.vision_tower.encoder.layer",
               proj="attention.projection_layer", fc1="model.multi_modal_projector.linear_1",
               fc2="model.multi_modal_projector.linear_2"),
    "original": dict(prefixes=("vision_model.", "mlp1."), layer="vision_model.encoder.layers", proj="attn.proj",
                     fc1="mlp1.1", fc2="mlp1.3"),
}


def _internvl(ckpt, layout: str, tp: TPGroup) -> tuple[InternVLVisionTower, dict[str, torch.Tensor]]:
    hf_config = read_config(ckpt).hf_config
    cfg = InternVisionConfig.from_hf(hf_config, text_config(hf_config).hidden_size)
    t = _tensors(ckpt, _NAMES[layout]["prefixes"], hf_canonical_name if layout == "hf" else lambda name: name)
    tower = InternVLVisionTower(cfg, tp=tp)
    load_checked(tower, t.items(), tower.checkpoint_map(layout))
    return tower, t


def _qkv(t: dict[str, torch.Tensor], src: str, layout: str, what: str) -> torch.Tensor:
    """The checkpoint's q | k | v `weight` or `bias` of one layer, fused."""
    if layout == "original":
        return t[f"{src}attn.qkv.{what}"]
    return torch.cat([t[f"{src}attention.{p}_proj.{what}"] for p in "qkv"])


def _compose_layer(layers, x: torch.Tensor, qk_norm: bool) -> torch.Tensor:  # [T, N, C] by hand across ranks
    h = layers[0].norm1(x)
    parts = [layer.qkv_local(h) for layer in layers]  # per rank: q, k, v [T, N, C/2]
    if qk_norm:  # the norm spans both ranks' heads: gather q, k and the weights' slices, norm, split back
        def normed(i: int, norm: str) -> tuple[torch.Tensor, ...]:
            weight = torch.cat([getattr(layer, norm).weight for layer in layers])  # [C]
            return rms_norm(torch.cat([p[i] for p in parts], dim=-1), weight, layers[0].q_norm.eps).chunk(2, dim=-1)
        q, k = normed(0, "q_norm"), normed(1, "k_norm")
        parts = [(q[r], k[r], parts[r][2]) for r in range(2)]
    x1 = x + layers[0].ls1 * sum(layer.attend(*p) for layer, p in zip(layers, parts))
    h2 = layers[0].norm2(x1)
    return x1 + layers[0].ls2 * sum(layer.mlp(h2) for layer in layers)


@pytest.mark.parametrize("layout", ["hf", "original"])
def test_internvl_vision_ranks_hold_their_slices_and_compose_to_the_unsharded_layer(layout, request):
    ckpt = request.getfixturevalue("internvl_ckpt" if layout == "hf" else "internvl_original_ckpt")
    names = _NAMES[layout]
    full, t = _internvl(ckpt, layout, TPGroup())
    ranks = [_internvl(ckpt, layout, tp)[0] for tp in RANKS]
    for r, tower in enumerate(ranks):
        assert torch.equal(tower.patch_embed.weight, full.patch_embed.weight)
        for i, layer in enumerate(tower.layers):
            src = f"{names['layer']}.{i}."
            assert layer.heads == full.cfg.num_heads // 2
            assert torch.equal(layer.qkv.weight, _rows(_qkv(t, src, layout, "weight"), r, 3))
            if full.cfg.qkv_bias:
                assert torch.equal(layer.qkv.bias, _rows(_qkv(t, src, layout, "bias"), r, 3))
            assert torch.equal(layer.proj.weight, _cols(t[f"{src}{names['proj']}.weight"], r))
            assert torch.equal(layer.proj.bias, t[f"{src}{names['proj']}.bias"])
            assert torch.equal(layer.fc1.weight, _rows(t[f"{src}mlp.fc1.weight"], r))
            assert torch.equal(layer.fc1.bias, _rows(t[f"{src}mlp.fc1.bias"], r))
            assert torch.equal(layer.fc2.weight, _cols(t[f"{src}mlp.fc2.weight"], r))
        p = tower.projector
        assert torch.equal(p.linear_1.weight, _rows(t[f"{names['fc1']}.weight"], r))
        assert torch.equal(p.linear_2.weight, _cols(t[f"{names['fc2']}.weight"], r))
        assert torch.equal(p.linear_2.bias, t[f"{names['fc2']}.bias"])

    g = torch.Generator().manual_seed(0)
    c = full.cfg.hidden_size
    x = torch.randn(2, 5, c, generator=g)  # [T, N, C]
    layers = [tower.layers[0] for tower in ranks]
    q, k, v = full.layers[0].qkv_local(full.layers[0].norm1(x))
    local = [layer.qkv_local(layers[0].norm1(x)) for layer in layers]
    for i, whole in enumerate((q, k, v)):  # column outputs concatenated per head group
        close(torch.cat([part[i] for part in local], dim=-1), whole)
    close(_compose_layer(layers, x, full.cfg.qk_norm), full.layers[0](x))
    y = torch.randn(7, full.projector.norm_weight.shape[0], generator=g)
    close(sum(tower.projector(y) for tower in ranks), full.projector(y))


def test_internvl_qk_norm_spans_every_ranks_heads(tmp_path):
    """q_norm / k_norm normalise over the full hidden size: each rank holds its columns of their weights;
    composing by hand gathers q and k first. A rank without a process group refuses to run them (its
    all-reduce of the sums of squares would be an identity: a silently wrong norm). The real
    all-reduce is checked over gloo in tests/models/test_tp_models.py."""
    ckpt = make_tiny_checkpoint(tmp_path, family="internvl", use_qk_norm=True, vision_depth=1)
    full, t = _internvl(ckpt, "hf", TPGroup())
    ranks = [_internvl(ckpt, "hf", tp)[0] for tp in RANKS]
    layers = [tower.layers[0] for tower in ranks]
    src = "model.vision_tower.encoder.layer.0.attention."
    for r, layer in enumerate(layers):
        assert torch.equal(layer.q_norm.weight, _rows(t[f"{src}q_norm.weight"], r))
        assert torch.equal(layer.k_norm.weight, _rows(t[f"{src}k_norm.weight"], r))
    x = torch.randn(2, 5, full.cfg.hidden_size, generator=torch.Generator().manual_seed(0))  # [T, N, C]
    close(_compose_layer(layers, x, True), full.layers[0](x))
    with pytest.raises(ValueError, match="need the 2 ranks' process group"):
        layers[1](x)
