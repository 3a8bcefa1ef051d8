"""InternLM2 checkpoints (the LLM of InternVL2-8B, InternVL2.5-8B, ...) for the Llama-style decoder.

InternLM2 is a Llama with other tensor names and one packed q/k/v projection. Rather than a second
decoder, its checkpoint is streamed through `internlm2_to_llama_names`, which renames every tensor
to the Llama/Qwen2 layout that `LlamaDecoder.checkpoint_map` describes and splits `wqkv`:

    InternLM2 (under prefix P)                       Llama (under out_prefix O)
    P model.tok_embeddings.weight                    O model.embed_tokens.weight
    P model.layers.i.attention.wqkv.{weight,bias}    O model.layers.i.self_attn.{q,k,v}_proj.{weight,bias}
    P model.layers.i.attention.wo.{weight,bias}      O model.layers.i.self_attn.o_proj.{weight,bias}
    P model.layers.i.feed_forward.w1 / w3 / w2       O model.layers.i.mlp.gate_proj / up_proj / down_proj
    P model.layers.i.attention_norm / ffn_norm       O model.layers.i.input_layernorm / post_attention_layernorm
    P model.norm.weight                              O model.norm.weight
    P output.weight                                  O lm_head.weight

wqkv rows are grouped per KV head (InternLM2's `rearrange(qkv, "b q (h gs d) -> b q h gs d",
gs=G + 2)`, G = num_heads // num_kv_heads): for KV head h, the G query heads h*G .. h*G+G-1, then
key head h, then value head h, each head_dim rows. Query head h*G + g attending to KV head h is the
same pairing as Llama's `repeat_kv`, so the split q/k/v need no further reordering.

Lazy checkpoints (`iter_safetensors(lazy=True)`, tensor parallelism): a lazy wqkv is split into three
lazy parts (`_WqkvPart`); narrowing one to a rank's rows reads only the KV groups those rows lie in
(a rank's q heads and KV heads are whole groups, or one group's part when KV heads are replicated),
once for the three parts (`_LazyWqkv` keeps the last block), so no rank reads the whole wqkv.

The remote modeling code is never imported: the layout above is all we take from it.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

from vlm_sdk.errors import CheckpointError
from vlm_sdk.models.common.llama_config import LlamaDecoderConfig, llm_family
from vlm_sdk.weight_loading import CheckpointTensor, LazyTensor

__all__ = ["pack_wqkv", "unpack_wqkv", "internlm2_decoder_config", "internlm2_to_llama_names"]

# InternLM2 name inside a layer -> Llama name (wqkv is split separately)
_LAYER_RENAMES = {
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_RENAMES = {
    "model.tok_embeddings.weight": "model.embed_tokens.weight",
    "model.norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _groups(num_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads


def pack_wqkv(q: Tensor,  # [H*D, ...]
              k: Tensor,  # [Hkv*D, ...]
              v: Tensor,  # [Hkv*D, ...]
              num_heads: int, num_kv_heads: int, head_dim: int) -> Tensor:  # [(H + 2*Hkv)*D, ...]
    """q/k/v projection weights `[rows, hidden]` (or biases `[rows]`) -> InternLM2's grouped wqkv."""
    g = _groups(num_heads, num_kv_heads)
    want = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
    tail = q.shape[1:]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() == 0 or t.shape[0] != want[name] or t.shape[1:] != tail:
            raise ValueError(f"{name} has shape {list(t.shape)}; expected {[want[name], *tail]}")
    parts = (q.reshape(num_kv_heads, g * head_dim, *tail),  # [Hkv, G*D, ...]: the G query heads of each KV head
             k.reshape(num_kv_heads, head_dim, *tail),  # [Hkv, D, ...]
             v.reshape(num_kv_heads, head_dim, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)  # [Hkv*(G+2)*D, ...]


def unpack_wqkv(wqkv: Tensor,  # [(H + 2*Hkv)*D, ...]
                num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """InternLM2's grouped wqkv (weight or bias) -> contiguous (q `[H*D, ...]`, k `[Hkv*D, ...]`, v `[Hkv*D, ...]`)."""
    g = _groups(num_heads, num_kv_heads)
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    if wqkv.dim() == 0 or wqkv.shape[0] != rows:
        raise ValueError(f"wqkv has shape {list(wqkv.shape)}; expected {rows} rows "
                         f"(({num_heads} + 2 * {num_kv_heads}) heads * {head_dim})")
    tail = wqkv.shape[1:]
    grouped = wqkv.reshape(num_kv_heads, (g + 2) * head_dim, *tail)  # [Hkv, (G+2)*D, ...]
    q, k, v = grouped.split([g * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *tail).contiguous(),  # [H*D, ...], query head h*G + g at rows (h*G + g)*D
            k.reshape(-1, *tail).contiguous(),  # [Hkv*D, ...]
            v.reshape(-1, *tail).contiguous())


class _LazyWqkv:
    """A lazy wqkv and the last block of whole KV groups read from it: a rank's q, k and v lie in the
    same groups, so the three parts read the file once."""

    def __init__(self, wqkv: LazyTensor, num_heads: int, num_kv_heads: int, head_dim: int):
        self.wqkv, self.num_heads, self.num_kv_heads, self.head_dim = wqkv, num_heads, num_kv_heads, head_dim
        self.groups = _groups(num_heads, num_kv_heads)
        self._last: tuple[int, int, tuple[Tensor, Tensor, Tensor]] | None = None

    def groups_of(self, first: int, stop: int) -> tuple[Tensor, Tensor, Tensor]:
        """(q, k, v) of KV groups [first, stop), unpacked."""
        if self._last is None or self._last[:2] != (first, stop):
            rows = (self.groups + 2) * self.head_dim  # one group's rows
            block = self.wqkv.narrow(0, first * rows, (stop - first) * rows)  # [(stop-first)*(G+2)*D, ...]
            self._last = (first, stop, unpack_wqkv(block, (stop - first) * self.groups, stop - first, self.head_dim))
        return self._last[2]

    def parts(self) -> list["_WqkvPart"]:
        return [_WqkvPart(self, i) for i in range(3)]


class _WqkvPart:
    """q (`part` 0), k (1) or v (2) of a lazy wqkv, itself lazy (`weight_loading.LazyTensor`)."""

    def __init__(self, source: _LazyWqkv, part: int):
        self.source, self.part = source, part
        self.rows_per_group = (source.groups if part == 0 else 1) * source.head_dim  # this part's rows in a group
        self.shape = torch.Size([source.num_kv_heads * self.rows_per_group, *source.wqkv.shape[1:]])
        self.dtype = source.wqkv.dtype

    def narrow(self, dim: int, start: int, length: int) -> Tensor:
        if dim != 0:  # a column slice needs every row: not a slice any layer takes of q/k/v
            return self.materialize().narrow(dim, start, length)
        per = self.rows_per_group
        first, stop = start // per, -(-(start + length) // per)  # the KV groups the rows lie in
        return self.source.groups_of(first, stop)[self.part].narrow(0, start - first * per, length)

    def materialize(self) -> Tensor:
        return self.source.groups_of(0, self.source.num_kv_heads)[self.part]


def internlm2_decoder_config(llm_config: Any, tie_word_embeddings: bool | None = None) -> LlamaDecoderConfig:
    """The decoder config of an InternLM2 `llm_config` (a generic `PretrainedConfig` from the remote-code
    config dict). `tie_word_embeddings` None: the config's own (InternLM2 defaults to a separate
    `output.weight`). Always 1-D RoPE; `rope_scaling` "dynamic" is plain RoPE in our position range."""
    try:
        family = llm_family(llm_config)
    except CheckpointError:  # a bare dict config may name neither model_type nor architectures
        family = "internlm2"
    if family != "internlm2":
        raise CheckpointError(f"llm_config is a {family} config (model_type "
                              f"{getattr(llm_config, 'model_type', None)!r}), not InternLM2")
    tied = getattr(llm_config, "tie_word_embeddings", False) if tie_word_embeddings is None else tie_word_embeddings
    return LlamaDecoderConfig.from_hf(llm_config, tie_word_embeddings=bool(tied), mrope=False, family="internlm2")


def internlm2_to_llama_names(weights: Iterable[tuple[str, CheckpointTensor]], cfg: LlamaDecoderConfig,
                             prefix: str = "", out_prefix: str = "") -> Iterator[tuple[str, CheckpointTensor]]:
    """Stream checkpoint tensors with InternLM2 names under `prefix` renamed to the Llama names under
    `out_prefix` (table in the module docstring), wqkv split into q/k/v. Names under `prefix` that are
    not InternLM2 weights, and names outside it, pass through unchanged, so `load_checked` reports them
    under their checkpoint name. A wqkv whose shape does not fit `cfg` raises `CheckpointError`. Lazy
    tensors stay lazy (a wqkv's parts are `_WqkvPart`s)."""
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rows = (h + 2 * hkv) * d
    for name, tensor in weights:
        if not name.startswith(prefix):
            yield name, tensor
            continue
        rel = name[len(prefix):]
        top = _TOP_RENAMES.get(rel)
        if top is not None:
            yield out_prefix + top, tensor
            continue
        m = _LAYER_NAME.fullmatch(rel)
        if m is None:
            yield name, tensor
            continue
        layer, leaf = f"{out_prefix}model.layers.{m.group(1)}.", m.group(2)
        if leaf in ("attention.wqkv.weight", "attention.wqkv.bias"):
            kind = leaf.rsplit(".", 1)[1]
            expected = [rows, cfg.hidden_size] if kind == "weight" else [rows]
            if list(tensor.shape) != expected:
                raise CheckpointError(
                    f"tensor {name} has shape {list(tensor.shape)} but an InternLM2 wqkv {kind} for {h} heads, "
                    f"{hkv} KV heads of dim {d} and hidden size {cfg.hidden_size} must be {expected}: "
                    f"config.json does not match the weights")
            parts = unpack_wqkv(tensor, h, hkv, d) if isinstance(tensor, Tensor) else \
                _LazyWqkv(tensor, h, hkv, d).parts()  # lazy: each rank reads its KV groups only, once
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                yield f"{layer}self_attn.{proj}.{kind}", part
        elif leaf in _LAYER_RENAMES:
            yield layer + _LAYER_RENAMES[leaf], tensor
        else:
            yield name, tensor
