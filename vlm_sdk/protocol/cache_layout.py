"""A model's per-layer cache specs (`cache_spec.py`) grouped the way the engine, the memory package and
every rank allocate them (vLLM's hybrid allocator: `kv_cache_utils._get_kv_cache_groups_uniform_page_size`).

Attention layers of one spec form a kind. Every attention group holds `group_size` layers, the smallest
kind's layer count; a larger kind is cut into chunks of `group_size` layers (its last chunk may be short:
the pages of its missing layers are wasted, and the plan says so). All attention groups share ONE block
pool: there are `group_size` KV tensors, layer j of every group views tensor j, so one block id is a page
in each of the `group_size` tensors and belongs to exactly one group at a time. State layers of one spec
form one group each; every state layer's tensors are `[num_state_slots, *shape]` and one slot id per
request indexes all of them.

    6 layers  S S F S S F   (S: sliding window, F: full attention; S has 4 layers, F 2: group_size 2)
    groups    0: S (0, 1)   1: F (2, 5)   2: S (3, 4)       (attention groups by first layer, then state)
    tensors   2 KV pairs of [num_blocks, block_size, kv_heads, head_dim]
    layer  -> (group, tensor)   0 -> (0, 0)  1 -> (0, 1)  2 -> (1, 0)  3 -> (2, 0)  4 -> (2, 1)  5 -> (1, 1)

A model of one full-attention kind is one group of every layer: today's `[layers, 2, blocks, ...]` cache
exactly, with the same bytes per block. Attention kinds must share one page shape (KV heads, head dim,
dtype); a model whose attention layers differ there is refused (`LayoutError`) naming the shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

from vlm_sdk.protocol.blocks import blocks_needed
from vlm_sdk.protocol.cache_spec import AttentionSpec, CacheGroup, LayerCacheSpec, StateSpec


class LayoutError(ValueError):
    """A model's cache specs cannot share one block pool (the message names the layers and shapes)."""


@dataclass(frozen=True)
class CacheLayout:
    specs: tuple[LayerCacheSpec, ...]  # one per decoder layer
    groups: tuple[CacheGroup, ...]  # the attention groups (by first layer), then the state groups
    group_size: int  # layers per attention group: a block is a page in each of this many KV tensors
    layer_group: tuple[int, ...]  # layer -> its group's index in `groups`
    layer_tensor: tuple[int, ...]  # layer -> its KV tensor (attention) or its place among the state layers

    @classmethod
    def from_specs(cls, specs: list[LayerCacheSpec] | tuple[LayerCacheSpec, ...]) -> "CacheLayout":
        specs = tuple(specs)
        if not specs:
            raise LayoutError("a model declares no cache spec: it has no decoder layer")
        kinds: dict[LayerCacheSpec, list[int]] = {}
        for i, s in enumerate(specs):
            if not isinstance(s, (AttentionSpec, StateSpec)):
                raise LayoutError(f"layer {i}'s cache spec is a {type(s).__name__}, not an AttentionSpec or StateSpec")
            kinds.setdefault(s, []).append(i)
        attention = {s: ls for s, ls in kinds.items() if isinstance(s, AttentionSpec)}
        if not attention:
            raise LayoutError("every layer keeps a state and none attends: a model without attention layers has no "
                              "KV blocks, which this engine does not serve")
        shapes = {(s.num_kv_heads, s.head_dim, s.dtype): ls for s, ls in attention.items()}
        if len(shapes) > 1:
            named = "; ".join(f"layers {ls[:4]}{'...' if len(ls) > 4 else ''}: {h} KV heads x {d} x {t}"
                              for (h, d, t), ls in shapes.items())
            raise LayoutError(f"attention layers of different page shapes cannot share one block pool ({named}); "
                              f"every attention layer must keep the same KV heads, head dim and dtype")
        size = min(len(ls) for ls in attention.values())
        chunks = [(s, tuple(ls[j:j + size])) for s, ls in attention.items() for j in range(0, len(ls), size)]
        chunks.sort(key=lambda c: c[1][0])
        states = sorted(((s, tuple(ls)) for s, ls in kinds.items() if isinstance(s, StateSpec)), key=lambda c: c[1][0])
        groups = tuple(CacheGroup(s, ls) for s, ls in chunks + states)
        layer_group, layer_tensor = [0] * len(specs), [0] * len(specs)
        for g, group in enumerate(groups):
            for j, layer in enumerate(group.layers):
                layer_group[layer], layer_tensor[layer] = g, j
        state_layers = [i for i, s in enumerate(specs) if isinstance(s, StateSpec)]
        for j, layer in enumerate(state_layers):
            layer_tensor[layer] = j
        return cls(specs, groups, size, tuple(layer_group), tuple(layer_tensor))

    @classmethod
    def uniform(cls, num_layers: int, spec: AttentionSpec) -> "CacheLayout":
        """Every layer full attention with one spec: one group of all of them."""
        return cls.from_specs([spec] * num_layers)

    # -- the groups ------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.specs)

    @property
    def attention_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if isinstance(g.spec, AttentionSpec))

    @property
    def state_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if isinstance(g.spec, StateSpec))

    @property
    def num_attention_groups(self) -> int:
        return sum(isinstance(g.spec, AttentionSpec) for g in self.groups)

    @property
    def has_state(self) -> bool:
        return any(isinstance(s, StateSpec) for s in self.specs)

    @property
    def state_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.specs) if isinstance(s, StateSpec))

    @property
    def page_spec(self) -> AttentionSpec:
        """The attention page every group shares (its window aside)."""
        return next(s for s in self.specs if isinstance(s, AttentionSpec))

    @property
    def kinds(self) -> tuple[str, ...]:
        """"full", "sliding_window", "state": the kinds this model's layers keep, in group order."""
        return tuple(dict.fromkeys(g.spec.kind for g in self.groups))

    @property
    def wasted_layers(self) -> int:
        """Pages per block no layer uses: the short last chunks of larger attention kinds."""
        return sum(self.group_size - len(g.layers) for g in self.attention_groups)

    # -- bytes -----------------------------------------------------------------------------------
    def block_bytes(self, block_size: int) -> int:
        """One block of the shared pool: a page in each of the `group_size` KV tensors."""
        return self.group_size * self.page_spec.page_bytes(block_size)

    @property
    def state_slot_bytes(self) -> int:
        """One request's state in every state layer (0 without state layers)."""
        return sum(s.slot_bytes for s in self.specs if isinstance(s, StateSpec))

    # -- what one sequence holds -------------------------------------------------------------------
    def blocks_for_tokens(self, num_tokens: int, block_size: int, chunk_tokens: int) -> int:
        """The most blocks one sequence of `num_tokens` tokens holds at once, over every attention group,
        running alone with prefill chunks of up to `chunk_tokens` tokens: a full group holds all its
        tokens' blocks; a sliding group of window W holds the blocks of the step's keys, the W - 1 before
        its first query and its new tokens (at most (W - 1 + chunk - 1) // block_size + 2 blocks)."""
        full = blocks_needed(num_tokens, block_size)
        chunk = min(chunk_tokens, num_tokens)
        total = 0
        for g in self.attention_groups:
            w = g.spec.window
            total += full if w is None else min(full, (w - 1 + chunk - 1) // block_size + 2)
        return total

    def capacity_tokens(self, num_blocks: int, block_size: int, chunk_tokens: int, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) whose blocks fit `num_blocks`. One full group:
        num_blocks * block_size, as a uniform cache has always held."""
        if num_blocks < 1:
            return 0
        if self.blocks_for_tokens(limit, block_size, chunk_tokens) <= num_blocks:
            return limit
        lo, hi = 0, limit  # blocks_for_tokens grows with the tokens: the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for_tokens(mid, block_size, chunk_tokens) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def prefix_reuse(self, enable_prefix_caching: bool, num_state_slots: int = 0,
                     max_num_seqs: int = 0) -> dict[str, str]:
        """Per kind: whether it reuses cached prefixes, and how or why not (stats() and the plan say it).
        A checkpoint takes a state slot no running request holds: with `num_state_slots` <= `max_num_seqs`
        a full batch leaves none, which is said rather than left to find out."""
        if not enable_prefix_caching:
            return {k: "off: enable_prefix_caching=False" for k in self.kinds}
        how = {"full": "reuses cached prefixes", "sliding_window": "reuses cached prefixes whose window is intact",
               "state": "reuses cached prefixes at checkpointed block boundaries (where prefill chunks end, "
                        "the prompt's last two among them, and the latest generated one)"}
        if num_state_slots and num_state_slots <= max_num_seqs:
            how["state"] += (f", only while fewer than num_state_slots={num_state_slots} requests run: a checkpoint "
                             f"takes a slot no running request holds (raise num_state_slots above "
                             f"max_num_seqs={max_num_seqs})")
        return {k: how[k] for k in self.kinds}

    def describe(self) -> str:
        """The groups in words (reports, errors)."""
        parts = []
        for g in self.groups:
            s = g.spec
            what = ("full attention" if s.kind == "full" else f"sliding window {s.window}"
                    if s.kind == "sliding_window" else "state " + ", ".join(f"{t.name} {list(t.shape)} {t.dtype}"
                                                                             for t in s.tensors))
            parts.append(f"{what}: {len(g.layers)} layers")
        return "; ".join(parts)
