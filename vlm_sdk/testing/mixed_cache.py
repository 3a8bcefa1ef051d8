"""A test model whose decoder mixes every cache kind (issue 42), and a straightforward reference for it.

The tiny Qwen2.5-VL checkpoint with five decoder layers, each kept as `KINDS` says:

    layer 0   sliding window (WINDOW tokens)      attention over the last WINDOW keys
    layer 1   state: a gated linear recurrence    a causal conv over v (CONV taps) and S <- GATE S + k^T conv(v)
    layer 2   full attention
    layer 3   sliding window
    layer 4   state

so the engine groups them (group_size 1: one full layer) as two sliding-window groups, one full group
and one state group of two layers, and runs every manager. The state layer reuses the checkpoint's q/k/v
projections (no new weights): its output for a query is q S (the recurrent state of its KV head),
computed token by token, so it is the same whatever the chunks are.

`reference_greedy` keeps everything and recomputes: for each new token, the whole sequence through the
same layers with dense attention (causal, or within the window) and the recurrence from token 0, the
attention written out here with no block, slot or metadata. The engine, with its paged blocks, freed
windows, state slots, checkpoints, chunks and preemptions, must give the same tokens.

Loaded by `EngineArgs(model_family="vlm_sdk.testing.mixed_cache")`: the engine's seam for a family
outside the registry. Two more families keep one kind beside one full layer, as the real ones do
(`model_family="vlm_sdk.testing.mixed_cache:WINDOWED"`: four sliding layers, Gemma 3-like;
`...:STATEFUL`: four state layers, Qwen3.5-like). Runtime code never imports this module.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.models import registry
from vlm_sdk.protocol.cache_spec import AttentionSpec, LayerCacheSpec, StateSpec, StateTensor

# Qwen2.5-VL's classes, reached through the registry as shared code reaches a family
_QWEN = registry.load("qwen2_5_vl")

KINDS = ("sliding", "state", "full", "sliding", "state")
WINDOW = 6
CONV = (0.5, 0.3, 0.2)  # the causal conv's taps: x_t, x_{t-1}, x_{t-2}
GATE = 0.9


class GatedRecurrence(nn.Module):
    """A state layer in the attention's place: `forward(q, k, v, cache, meta)` with `cache` = (conv state
    [slots, Hkv, len(CONV) - 1, D], recurrent state [slots, Hkv, D, D]) and `meta` a `StateMetadata`:
    each request continues from its slot's state (zeros when it starts from token 0) and leaves its
    state there. A slot of -1 (graph padding) is neither read nor written."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q, k, v, cache, meta, stored: bool = False):  # q [N, H, D]; k, v [N, Hkv, D] -> [N, H, D]
        conv_state, rec_state = cache
        out = torch.zeros_like(q)
        starts = meta.query_start_loc.tolist()
        slots = meta.state_slots.tolist()
        for b, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
            slot = slots[b]
            if slot < 0:
                continue
            conv, s = (conv_state[slot].float(), rec_state[slot].float()) if meta.has_initial_state_cpu[b] else \
                (conv_state.new_zeros(conv_state.shape[1:]).float(), rec_state.new_zeros(rec_state.shape[1:]).float())
            o, conv, s = recur(q[lo:hi], k[lo:hi], v[lo:hi], conv, s, self.scale)
            out[lo:hi] = o.to(out.dtype)
            conv_state[slot] = conv.to(conv_state.dtype)
            rec_state[slot] = s.to(rec_state.dtype)
        return out


def recur(q, k, v, conv, s, scale):
    """The recurrence over tokens in order from states (conv [Hkv, taps - 1, D], s [Hkv, D, D]): outputs
    [n, H, D] and the states after the last token."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for t in range(q.shape[0]):
        x = v[t].float()  # [Hkv, D]
        mixed = CONV[0] * x + sum(CONV[j] * conv[:, -j] for j in range(1, len(CONV)))  # [Hkv, D]
        conv = torch.cat([conv[:, 1:], x[:, None]], dim=1)  # [Hkv, taps - 1, D]: the latest inputs
        kn = F.normalize(k[t].float(), dim=-1)  # [Hkv, D]
        s = GATE * s + kn[:, :, None] * mixed[:, None, :]  # [Hkv, D, D]
        heads = s.repeat_interleave(group, dim=0)  # [H, D, D]
        outs.append(torch.einsum("hd,hde->he", q[t].float(), heads) * scale)  # [H, D]
    return torch.stack(outs), conv, s


class MixedCacheModel(_QWEN.model_cls):
    """Qwen2.5-VL with its decoder layers kept as `kinds` says (module docstring)."""
    kinds = KINDS

    def __init__(self, hf_config: Any, **kw):
        super().__init__(hf_config, **kw)
        if len(self.decoder.layers) != len(self.kinds):
            raise ValueError(f"the mixed-cache model has {len(self.kinds)} layers; this checkpoint has "
                             f"{len(self.decoder.layers)} (make_mixed_checkpoint)")
        for layer, kind in zip(self.decoder.layers, self.kinds):
            if kind == "sliding":
                layer.attn.window = WINDOW
            elif kind == "state":
                layer.attn = GatedRecurrence(layer.num_heads, layer.num_kv_heads, layer.head_dim)

    def cache_specs(self, kv_dtype: torch.dtype) -> list[LayerCacheSpec]:
        full = AttentionSpec(self.num_kv_heads, self.head_dim, str(kv_dtype).removeprefix("torch."))
        taps = len(CONV) - 1
        state = StateSpec((StateTensor("conv", (self.num_kv_heads, taps, self.head_dim), "float32"),
                           StateTensor("recurrent", (self.num_kv_heads, self.head_dim, self.head_dim), "float32")))
        return [{"full": full, "sliding": dataclasses.replace(full, window=WINDOW), "state": state}[k]
                for k in self.kinds]

    def checkpoint_map(self):
        """The checkpoint's; a state layer has no attention scales to load."""
        skip = tuple(f"{self.lm_prefix}layers.{i}.self_attn." for i, k in enumerate(self.kinds) if k == "state")
        return {name: slot for name, slot in super().checkpoint_map().items()
                if not (name.startswith(skip) and "scale" in name.rsplit(".", 1)[-1])}

    def decoder_stack(self):
        return None  # a state layer has no attention call to split around


class WindowedModel(MixedCacheModel):
    kinds = ("sliding", "sliding", "full", "sliding", "sliding")


class StatefulModel(MixedCacheModel):
    kinds = ("state", "state", "full", "state", "state")


class MixedCacheSpec(type(_QWEN)):
    name = "mixed_cache_test"
    display_name = "Mixed-cache test model"

    def __init__(self, model: type = MixedCacheModel):
        self._model = model

    @property
    def model_cls(self) -> type:
        return self._model


FAMILY = MixedCacheSpec()
WINDOWED = MixedCacheSpec(WindowedModel)
STATEFUL = MixedCacheSpec(StatefulModel)


def make_mixed_checkpoint(path: Path, seed: int = 0) -> Path:
    """The tiny Qwen2.5-VL checkpoint with the model's five layers."""
    from vlm_sdk.testing import make_tiny_checkpoint
    return make_tiny_checkpoint(path, family="qwen2_5_vl", seed=seed, num_layers=len(KINDS))


@torch.inference_mode()
def reference_greedy(model: MixedCacheModel, prompt_positions, token_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens after `token_ids`, every one from a full recompute of the sequence (module docstring)."""
    ids = list(token_ids)
    dec, kinds = model.decoder, model.kinds
    for _ in range(max_tokens):
        n = len(ids)
        positions = model.positions(prompt_positions, 0, n)  # [3, n]
        x = model.embed_tokens(torch.tensor(ids))  # [n, hidden]
        rope = dec.rotary_inputs(positions, x.dtype)
        residual = None
        for layer, kind in zip(dec.layers, kinds):
            q, k, v, residual = layer.pre_attention(x, residual, rope)
            if kind == "state":
                taps = len(CONV) - 1
                zeros = q.new_zeros(k.shape[1], taps, k.shape[2]).float(), q.new_zeros(k.shape[1], k.shape[2],
                                                                                         k.shape[2]).float()
                o = recur(q, k, v, *zeros, layer.head_dim ** -0.5)[0].to(q.dtype)
            else:
                o = _dense(q, k, v, layer.attn.scale, WINDOW if kind == "sliding" else None)
            x, residual = layer.post_attention(o, residual)
        hidden = dec.final_norm(x, residual)
        ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return ids[len(token_ids):]


def _dense(q, k, v, scale, window):  # q [n, H, D], k/v [n, Hkv, D] -> [n, H, D]
    n, group = q.shape[0], q.shape[1] // k.shape[1]
    pos = torch.arange(n)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
                                       v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask, scale=scale)
    return o.transpose(0, 1)
