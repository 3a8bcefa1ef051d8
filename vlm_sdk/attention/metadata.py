"""What one forward pass needs to read and write its caches: `AttentionMetadata` per attention cache
group, `StateMetadata` for the state layers, and `StepMetadata`, which gives each layer its group's.

The cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]` (K and V).
Token `p` of a sequence lives in block `block_table[p // block_size]` at offset `p % block_size`;
its flat slot is `block * block_size + offset`.

A batch packs the new tokens of all scheduled sequences back to back:

    tokens:  |-- seq 0: 5 prefill tokens --|-- seq 1: 1 decode token --|-- seq 2: 3 chunk tokens --|
    query_start_loc = [0, 5, 6, 9]
    seq_lens        = [5, 37, 11]      # tokens in the cache after this step, per sequence
    so seq 2 attends to its 8 earlier tokens plus its 3 new ones, causally.

The runner builds this plain, backend-neutral record once per step; the attention backend's
`prepare` then derives its own per-step metadata from it (a subclass carrying e.g. Triton's
`num_splits` or the torch decode groups). Nothing writes into it during the forward: it is frozen.

A model of several cache groups (vlm_sdk/protocol/cache_layout.py) gets one such record per attention
group (its own slots and block tables, the same lengths), one `StateMetadata` shared by its state
groups, and hands layer i `meta.layer(i)`:

    StepMetadata(groups=(meta_full, meta_window, state), layer_group=(1, 1, 0, 2, ...))
    layer 2 -> groups[0] = meta_full        layer 3 -> groups[2] = state
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot of each new token
    query_start_loc: torch.Tensor  # [batch + 1] int32, on the device
    seq_lens: torch.Tensor  # [batch] int32, on the device
    block_tables: torch.Tensor  # [batch, max_blocks_per_seq] int32, padded with 0
    query_lens_cpu: list[int]  # the same lengths as host ints, for loops without device syncs
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int  # the longest sequence; a CUDA-graph decode step is built with max_model_len here
    window: int | None = None  # the group's sliding window (its layers read keys p - window < q <= p); None: full
    # [num_tokens] int32: the last key position each query of a prefill row may see, at least its own
    # (a model's bidirectional spans: Gemma 3's image tokens see their whole image in the chunk); None:
    # causal. The model sets it on the step's metadata (models/common/image_spans.py)
    key_limits: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1

    def fields(self) -> dict:
        """The common fields, for a backend's subclass built from them (`AttentionBackend.prepare`)."""
        return {name: getattr(self, name) for name in AttentionMetadata.__dataclass_fields__}


@dataclass(frozen=True)
class DraftStates:
    """A verification step of speculative decoding on state layers: R requests verify drafts, request r at
    packed rows first[r] .. first[r] + k_r (its last token, then its k_r drafts). The layer leaves the state
    after row j < k_r in that draft's slot (the live slot gets the state after the last row, as ever), so the
    engine keeps whichever position the target accepted up to (engine/core/spec_decode.py):

        request a: rows 4 5 6 (2 drafts), live 7, draft slots (2, 9)    request b: rows 9 10 (1 draft), live 3, (5,)
        live    [7, 3]         the states before the step (read before the layer writes them)
        token   ([4, 9], [5])  per draft position j: row j of the requests with more than j drafts
        source  ([7, 3], [2])  ... the slot holding the state before that row (j = 0: the live slot's, as read)
        steps   slots ([2, 5], [9]): ... a decode-only StateMetadata whose state_slots get the state after it
        rows    ([0, 1], [0])  ... and which of the R requests each is
    """
    live: torch.Tensor  # [R] int64, on the device: each verifying request's live slot
    first: torch.Tensor  # [R] int64: its first packed row
    token: tuple[torch.Tensor, ...]  # per draft position j: [R_j] int64 packed rows
    source: tuple[torch.Tensor, ...]  # per j: [R_j] int64 slots
    steps: tuple["StateMetadata", ...]  # per j: R_j rows of one token, state_slots the draft slots
    rows: tuple[torch.Tensor, ...]  # per j: [R_j] int64 indices into the R requests
    max_rows: int  # 1 + the most drafts of a request


@dataclass(frozen=True)
class StateMetadata:
    """What a state layer (a `StateSpec` layer: Gated DeltaNet, Mamba-like) needs of one step: the
    packed tokens as `AttentionMetadata` packs them, and each request's state slot. The layer reads and
    writes its slots in place (`[num_state_slots, *shape]` tensors); a request with
    `has_initial_state` False computes from token 0 and must start from zeros, whatever its slot holds
    (slots are reused). A prefill chunk starts where the last one ended, with the state it left. A slot
    of -1 (the padding rows of a CUDA-graph decode step) is neither read nor written."""
    query_start_loc: torch.Tensor  # [batch + 1] int32, on the device
    query_lens_cpu: list[int]
    state_slots: torch.Tensor  # [batch] int64, on the device: each request's live slot
    has_initial_state: torch.Tensor  # [batch] bool, on the device
    has_initial_state_cpu: list[bool]
    max_query_len: int  # 1: a decode-only step (the recurrent rule)
    drafts: DraftStates | None = None  # speculative decoding: where the states after draft positions go

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class StepMetadata:
    """One step's metadata for every cache group of the model (the backend's `prepare`d `AttentionMetadata`
    per attention group, one `StateMetadata` for the state groups); `layer(i)` is decoder layer i's."""
    groups: tuple[AttentionMetadata | StateMetadata, ...]
    layer_group: tuple[int, ...]  # decoder layer -> index in `groups` (CacheLayout.layer_group)

    def layer(self, i: int) -> AttentionMetadata | StateMetadata:
        return self.groups[self.layer_group[i]]

    @classmethod
    def uniform(cls, meta: AttentionMetadata, num_layers: int) -> "StepMetadata":
        """Every layer in one attention group (a model of one full-attention kind)."""
        return cls((meta,), (0,) * num_layers)
