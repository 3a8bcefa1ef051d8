"""What each decoder layer keeps between steps: its cache spec (vLLM v1's `kv_cache_interface.py` idea).

A model declares one spec per decoder layer (`VisionLanguageModel.cache_specs`); the engine groups the
layers whose specs are equal, a manager per kind allocates for each group, the memory package sizes
them, and every rank allocates the same tensors from the same specs:

    AttentionSpec(window=None)   full attention: K and V of every token, in paged blocks
    AttentionSpec(window=W)      sliding window: a query at position p reads keys at p - W < q <= p;
                                 blocks wholly before every running request's window are dead weight
    StateSpec                    a fixed-size state per request (a causal-conv state and a recurrent
                                 state for Gated DeltaNet), whatever its length: one slot per request

Plain data: shapes are this rank's (heads split under tensor parallelism), dtypes are torch dtype
names ("bfloat16", "float8_e4m3fn", "float32"), so specs travel between processes as they are. An
attention page's dtype may also be "int8" or "int4" (kv_cache_dtype int8 / int4, LMDeploy's quant_policy
8 / 4): uint8 code pages (D or D/2 bytes a token and head) with a float32 (scale, zero) pair a token and
head beside them (kernels/kv_int.py), both counted in `page_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_sdk.config import INT_KV_BITS

SZ_BYTES = 4  # each of a token and head's scale and zero in an int8 / int4 page (float32: kernels/kv_int.py)


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of the torch dtype named `dtype` (e.g. "bfloat16" -> 2)."""
    return getattr(torch, dtype).itemsize


@dataclass(frozen=True)
class AttentionSpec:
    """Paged K/V of one attention layer; `window` None for full attention."""
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: str  # the cache's (the model's, "float8_e4m3fn" with kv_cache_dtype="fp8", or "int8" / "int4")
    window: int | None = None  # sliding window in tokens (HF's `sliding_window`)

    @property
    def kind(self) -> str:
        return "full" if self.window is None else "sliding_window"

    @property
    def quant_bits(self) -> int:
        """8 or 4 for an int8 / int4 page, else 0."""
        return INT_KV_BITS.get(self.dtype, 0)

    @property
    def code_dim(self) -> int:
        """Elements (int: bytes) of one token's head in the K or V page: head_dim, or head_dim / 2 for int4."""
        return self.head_dim // 2 if self.quant_bits == 4 else self.head_dim

    def page_bytes(self, block_size: int) -> int:
        """One layer's K and V for `block_size` tokens (an int page: its codes and its scales and zeros)."""
        if self.quant_bits:
            return 2 * block_size * self.num_kv_heads * (self.code_dim + 2 * SZ_BYTES)
        return 2 * block_size * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a layer's per-request state, e.g. ("conv", (conv_dim, kernel - 1), "bfloat16")."""
    name: str
    shape: tuple[int, ...]  # one request's, this rank's
    dtype: str

    @property
    def num_bytes(self) -> int:
        n = dtype_bytes(self.dtype)
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StateSpec:
    """A fixed-size state per request of one layer (Gated DeltaNet, Mamba-like): its tensors, in the
    order the layer takes them. Every such layer's tensors are `[num_state_slots, *shape]`; one slot id
    indexes a request's state in all of them. `draft_states`: the layer keeps, in a verification step of
    speculative decoding, the state after each draft position in that draft's slot (`StateMetadata.drafts`),
    so a rejected draft's state can be left behind (engine/core/spec_decode.py); a layer without it cannot
    verify drafts (`spec_config.check_speculation`)."""
    tensors: tuple[StateTensor, ...]
    draft_states: bool = False

    @property
    def kind(self) -> str:
        return "state"

    @property
    def slot_bytes(self) -> int:
        """One request's state in this layer."""
        return sum(t.num_bytes for t in self.tensors)


LayerCacheSpec = AttentionSpec | StateSpec


@dataclass(frozen=True)
class CacheGroup:
    """Layers with one spec: they share a block table (attention) or a slot (state) per request."""
    spec: LayerCacheSpec
    layers: tuple[int, ...]  # decoder layer indices, ascending
