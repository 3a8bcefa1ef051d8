"""One coordinator over every cache group of a model (vLLM v1's `kv_cache_coordinator.py`): the scheduler
asks it to start, grow and free sequences; it runs a manager per attention group over one shared
`BlockPool` and, for a model with state layers, one `StatePool` of state slots.

A sequence with `n` tokens in the cache holds `ceil(n / block_size)` entries in each attention group
(`Sequence.block_ids[g]`). Before a step that computes `k` more tokens, the scheduler asks for the
blocks that `n + k` tokens need, in every group:

    block_size = 4, n = 6, k = 3, one group     blocks held: [7, 2]   (slots 0..7)
    tokens  0 1 2 3 | 4 5 . . | . . . .          need ceil(9 / 4) = 3 -> allocate 1 more: [7, 2, 5]
            block 7   block 2   block 5          token 8 goes to slot 5 * 4 + 0 = 20

A sliding-window group first lets go of the blocks before its window (cache_managers.py). A sequence
that starts (or restarts after a preemption) first looks its full blocks up by hash (`engine.block_hash`):
the hit is the longest prefix EVERY group can serve (full: its leading cached blocks; sliding: the window
before it cached; state: a checkpoint exactly there), found as HybridKVCacheCoordinator does, each manager
lowering the candidate until none does. At least one token is always left to compute, since the step that
computes a sequence's last token is the one that samples:

    prompt of 11 tokens, block_size 4: blocks 0, 1 full (hashes h0, h1), block 2 partial
    cache holds h0 -> block 9, h1 -> block 3       start: block_ids [9, 3], computed = 8, compute 3
    prompt of 8 tokens, same two blocks cached     only block 0 is reused: the last token is computed

Attention blocks are offered to the cache as soon as a step is scheduled to fill them (`_commit`): a
sequence admitted later in the same step may share them, since every layer stores the whole step's K/V
before any attention reads it. Free blocks keep their content until a fresh block is needed
(`engine.block_pool`), so `num_free_blocks` counts them: cached or not, they are free.

State layers (vLLM's mamba "align" mode): a running sequence holds one live slot, taken on admission and
freed on finish or preemption. With prefix caching, prefill chunks end on block boundaries (`align`), and
after a step that ends on a boundary whose tokens are all known, the state there is copied into a free slot
released at once cached-free under that boundary's hash (a checkpoint, `end_step`); a hit restores it into
the new sequence's live slot before its first step. A checkpoint written by a step is visible from the
next schedule on (the copy runs after that step's forward): a sequence that would resume from a boundary
one admitted in the same step computes (n > 1 siblings: one `add`) waits for the next step, and admission
with it (`start` returns None), then restores from it. A sequence keeps its prompt's checkpoints and its
latest generated-side one (an older one it wrote is let go when it writes the next).
"""
from __future__ import annotations

from vlm_sdk.engine.core.block_hash import extend_block_hashes
from vlm_sdk.engine.core.block_pool import BlockPool, StatePool
from vlm_sdk.engine.core.cache_managers import NULL_BLOCK, StateManager, attention_manager
from vlm_sdk.engine.core.sequence import Sequence
from vlm_sdk.protocol.blocks import blocks_needed
from vlm_sdk.protocol.cache_layout import CacheLayout

NO_COPIES: tuple[tuple[int, int], ...] = ()


class CacheCoordinator:
    def __init__(self, layout: CacheLayout, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_state_slots: int = 0, whole_images: bool = False):
        """`num_state_slots`: the state pool's size when the model has state layers (ignored otherwise);
        `whole_images`: no prefill chunk ends inside an image (`whole_image_chunk`)."""
        self.whole_images = whole_images
        self.layout = layout
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        groups = layout.attention_groups
        self.num_groups = len(groups)
        self.pool = BlockPool(num_blocks, self.num_groups)
        self.managers = [attention_manager(g, group.spec, self.pool, block_size) for g, group in enumerate(groups)]
        self.sliding = [m for m in self.managers if m.kind == "sliding_window"]
        self.state_pool = StatePool(num_state_slots) if layout.has_state else None
        self.state = StateManager(self.state_pool, block_size) if layout.has_state else None
        self.kinds = layout.kinds
        # prefill chunks end on block boundaries, so that the state there can be checkpointed
        self.aligned = self.state is not None and enable_prefix_caching
        self.hit_tokens = 0  # prompt tokens found in the prefix cache, since start-up
        self.query_tokens = 0  # tokens looked up (each start and restart of a sequence)
        # per kind, the prompt tokens it alone could have served (the hit is the shortest of them)
        self.kind_hit_tokens = dict.fromkeys(self.kinds, 0)
        self._restores: list[tuple[int, int]] = []  # this step's (checkpoint slot, live slot)
        self._pinned: list[int] = []  # checkpoint slots read by this step's restores: not evicted before
        self._coming: set[bytes] = set()  # boundaries sequences admitted this step will be checkpointed at

    # -- counts ----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold reusable content (evicted when a fresh block is needed)."""
        return self.pool.num_cached_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free

    @property
    def num_free_slots(self) -> int:
        """State slots a sequence can be admitted with (cached checkpoints count: they are evicted)."""
        return self.state_pool.num_free if self.state_pool is not None else 0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks of one group for `num_tokens` tokens."""
        return blocks_needed(num_tokens, self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks (over every group) the next `num_new_tokens` of `seq` take from the pool, its window's
        releases aside."""
        held = len(seq.block_ids[0]) if seq.block_ids else 0
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - held) * self.num_groups

    # -- sequences -------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give `seq` the blocks its next `num_new_tokens` need in every group (a sliding group first
        lets go of what falls out of its window); False (and nothing taken) if too few are free."""
        computed = seq.num_computed_tokens
        total, size = computed + num_new_tokens, self.block_size
        ids = seq.block_ids
        if not ids:  # never started (the unit tests grow sequences directly)
            ids = seq.block_ids = tuple([] for _ in range(self.num_groups))
        caching = self.enable_prefix_caching
        if self.sliding:
            if caching:
                self._commit(seq, computed)  # what the window lets go of is offered to the cache first
            for m in self.sliding:
                m.release_skipped(ids[m.group], computed)
        need = -(-total // size) - len(ids[0])
        if need > 0:
            if need * self.num_groups > self.pool.num_free:
                return False
            take = self.pool.take
            for g, blocks in enumerate(ids):
                blocks.extend(take(need, g))
        if caching and total // size > seq.num_cached_blocks:  # a block filled up
            self._commit(seq, total)
        return True

    def start(self, seq: Sequence, budget: int, cut=None) -> int | None:
        """Start (or restart) `seq`, which holds nothing: share its cached prefix, take a state slot, then
        allocate for up to `budget` more tokens. The number of tokens to compute this step; None (nothing
        taken) when the free blocks or state slots are too few, or when `cut(seq, computed, n)` (the step's
        vision budget: engine/core/vision_budget.py), which may shorten the chunk, leaves nothing."""
        k, restore = self._cached_prefix(seq)
        if self._coming and any(h in self._coming for h in seq.block_hashes[k:(seq.num_tokens - 1) // self.block_size]):
            return None  # a sequence admitted this step computes (and checkpoints) its prefix: resume from it next
        size, pool = self.block_size, self.pool
        computed = k * size
        n = min(seq.num_tokens - computed, budget)
        if self.aligned:
            n = self.align(seq, computed, n)
        if self.whole_images:
            n = whole_image_chunk(seq, computed, n)
            if n == 0:  # it starts inside an image the budget cannot hold whole: not this step
                return None
        if cut is not None and (n := cut(seq, computed, n)) == 0:
            return None
        hits = [m.hit_blocks(seq.block_hashes, k) for m in self.managers] if k else None
        need = self.blocks_for(computed + n) - k
        # free now: taking them back uses free room
        revived = sum(1 for blocks in hits for b in blocks if b != NULL_BLOCK and pool.ref_count[b] == 0) if k else 0
        if need * self.num_groups + revived > pool.num_free:
            return None
        state = self.state_pool
        if state is not None and 1 + (restore is not None and state.ref_count[restore] == 0) > state.num_free:
            return None
        take = pool.take
        if k:
            for blocks in hits:
                pool.touch(b for b in blocks if b != NULL_BLOCK)
            seq.block_ids = tuple(blocks + take(need, g) for g, blocks in enumerate(hits))
        else:
            seq.block_ids = tuple(take(need, g) for g in range(self.num_groups))
        if state is not None:
            if restore is not None:
                state.touch([restore])  # pinned until this step's copies are decided (`end_step`)
                self._pinned.append(restore)
            seq.state_slot = state.take(1)[0]
            if restore is not None:
                self._restores.append((restore, seq.state_slot))
        seq.num_computed_tokens = computed
        seq.num_cached_blocks = k
        if self.enable_prefix_caching:
            self.query_tokens += seq.num_tokens
            self.hit_tokens += computed
        if seq.num_preemptions == 0:
            seq.metrics.cached_tokens = computed
        self._commit(seq, computed + n)
        self.note_coming(seq, computed + n)
        return n

    def note_coming(self, seq: Sequence, end: int) -> None:
        """`seq`'s step this schedule computes up to `end`: a boundary there is checkpointed after it, so
        a sequence that would resume from it waits a step (`start`) instead of computing it again."""
        size = self.block_size
        if self.aligned and end % size == 0 and end <= seq.num_tokens and len(seq.block_hashes) >= end // size:
            self._coming.add(seq.block_hashes[end // size - 1])

    def peek_hit(self, seq: Sequence) -> int:
        """The blocks of `seq`'s cached prefix that `start` would reuse now: nothing taken, nothing counted
        (the dry run, engine/render.py)."""
        return self._cached_prefix(seq, count=False)[0]

    def _cached_prefix(self, seq: Sequence, count: bool = True) -> tuple[int, int | None]:
        """(blocks of `seq`'s longest prefix every group serves, leaving its last token; the checkpoint
        slot to restore its state from, or None). None for a request that asks for its prompt's logprobs:
        every prompt position must be computed. `count` False: the per-kind hit counters are left alone."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0, None
        size = self.block_size
        limit = (seq.num_tokens - 1) // size
        extend_block_hashes(seq.block_hashes, seq.token_ids, seq.image_spans, size, limit * size, seq.hash_seed)
        hashes = seq.block_hashes
        k = min(limit, len(hashes))  # fewer when an image without a key stops the chain
        managers = self.managers + ([self.state] if self.state is not None else [])
        if len(managers) == 1:
            k = managers[0].longest_hit(hashes, k)
            if count:
                self.kind_hit_tokens[managers[0].kind] += k * size
            return k, None
        for m in managers if count else ():  # what each kind alone would serve (the stats' per-kind hits)
            self.kind_hit_tokens[m.kind] += m.longest_hit(hashes, k) * size
        while True:  # each manager lowers the candidate to its longest hit at most that long
            before = k
            for m in managers:
                k = m.longest_hit(hashes, k)
            if k == before:
                break
        restore = self.state.checkpoint(hashes, k) if self.state is not None and k else None
        return k, restore

    def _commit(self, seq: Sequence, num_tokens: int) -> None:
        """Offer the blocks that the first `num_tokens` tokens fill to the cache, in every group."""
        if not self.enable_prefix_caching:
            return
        # a token still on the device (asynchronous scheduling) cannot be hashed yet: its block is
        # offered by a later step, once the token has arrived
        size = self.block_size
        full = min(num_tokens, seq.num_tokens) // size
        if full <= seq.num_cached_blocks:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids, seq.image_spans, size, full * size, seq.hash_seed)
        hashed = min(full, len(seq.block_hashes))  # fewer when an image without a key stops the chain
        cache, hashes = self.pool.cache, seq.block_hashes
        for g, blocks in enumerate(seq.block_ids):
            for i in range(seq.num_cached_blocks, hashed):
                if blocks[i] != NULL_BLOCK:
                    cache(blocks[i], hashes[i], g)
        seq.num_cached_blocks = max(seq.num_cached_blocks, hashed)

    def truncate(self, seq: Sequence, keep: int) -> None:
        """Return `seq`'s blocks past its first `keep` in every group (speculative decoding's rollback:
        they hold only rejected drafts' KV, never a cached block), last first."""
        release = self.pool.release
        for blocks in seq.block_ids:
            release(b for b in reversed(blocks[keep:]) if b != NULL_BLOCK)
            del blocks[keep:]

    def free(self, seq: Sequence) -> None:
        """Return every block and the state slot of `seq` (finished, aborted or preempted)."""
        release = self.pool.release
        for blocks in seq.block_ids:
            release(b for b in reversed(blocks) if b != NULL_BLOCK)  # the prefix stays cached longest
        seq.block_ids = ()
        seq.num_cached_blocks = 0
        if seq.state_slot >= 0:
            self.state_pool.release([seq.state_slot] + seq.draft_slots)
            seq.state_slot = -1
            seq.draft_slots = []

    # -- state layers ------------------------------------------------------------------------------
    def take_draft_slots(self, seq: Sequence, k: int, reserve: int) -> int:
        """Speculative decoding on state layers: a free slot for each of `seq`'s first `k` drafts (the state
        after it), leaving `reserve` free (the sequences admission may still start this step: drafts never
        cost admission); how many were taken (fewer drafts then). A model without state layers: `k`."""
        if self.state_pool is None:
            return k
        k = min(k, self.state_pool.num_free - reserve)
        if k > 0:
            seq.draft_slots = self.state_pool.take(k)
            seq.draft_start = seq.num_computed_tokens
        return max(k, 0)

    def settle_draft_slots(self, seq: Sequence) -> int | None:
        """After `seq`'s verification step, rolled back to its accepted tokens (`num_computed_tokens` past its
        last accepted draft): the slot holding the state there becomes its live slot, the others go back.

            draft_start 9, 3 drafts (rows at 9 10 11 12), slots live L, drafts [d0 d1 d2] = states after 9, 10, 11
            1 accepted: computed 11 -> the state after 10 is d1's: live d1, L d0 d2 freed; 3 accepted: L stays

        The new live slot, or None when it stays (every draft accepted, or no drafts held)."""
        slots = seq.draft_slots
        if not slots:
            return None
        seq.draft_slots = []
        accepted = seq.num_computed_tokens - seq.draft_start - 1  # drafts whose state it keeps
        if accepted >= len(slots):
            self.state_pool.release(slots)
            return None
        keep = slots[accepted]
        self.state_pool.release([seq.state_slot] + [s for s in slots if s != keep])
        seq.state_slot = keep
        return keep

    def whole_image(self, seq: Sequence, computed: int, n: int) -> int:
        """`n` as `whole_image_chunk` cuts it when the model asks for whole images, else `n`."""
        return whole_image_chunk(seq, computed, n) if self.whole_images else n

    def align(self, seq: Sequence, computed: int, n: int) -> int:
        """A prefill chunk of `n` tokens from `computed`, cut to end on a block boundary (so that the
        state there can be checkpointed), and at each of the last two boundaries before the sequence's
        last token: the last is the longest hit a later sequence of the same tokens can use; the one
        before serves the next turn of a chat, whose history re-renders the last few prompt tokens (the
        generation prompt: `<think>` opened there is not in the assistant turn that replaces it). A chunk
        shorter than the next boundary is left as it is (no checkpoint ends it); a decode step (n == 1) too."""
        size, end = self.block_size, computed + n
        last = (len(seq.token_ids) - 1) // size * size
        for stop in (last - size, last):
            if computed < stop < end:
                return stop - computed
        if end < last:
            aligned = end // size * size
            return aligned - computed if aligned > computed else n
        return n

    def end_step(self, scheduled: list[tuple[Sequence, int]]) -> tuple[tuple[tuple[int, int], ...], ...]:
        """The step's state copies, once every sequence is scheduled: (restores: checkpoint slot -> live
        slot, before the forward; checkpoints: live slot -> checkpoint slot, after it). A checkpoint is
        taken for each scheduled sequence whose step ends on a block boundary of known tokens that has
        none yet, while a slot is free (a live slot never is: checkpoints never cost admission)."""
        if self.state is None:
            return NO_COPIES, NO_COPIES
        checkpoints = []
        pool, size = self.state_pool, self.block_size
        if self.enable_prefix_caching:
            for seq, n in scheduled:
                end = seq.num_computed_tokens + n
                if end % size or end > len(seq.token_ids) or pool.num_free == 0:
                    continue
                k = end // size
                extend_block_hashes(seq.block_hashes, seq.token_ids, seq.image_spans, size, end, seq.hash_seed)
                if len(seq.block_hashes) < k:  # an image without a key stops the chain
                    continue
                h = seq.block_hashes[k - 1]
                if pool.lookup(h) is not None:
                    continue
                slot = pool.take(1)[0]
                pool.cache(slot, h)
                pool.release([slot])
                if end > seq.num_prompt_tokens:  # generated side: only the latest is kept
                    last = seq.last_checkpoint
                    if last is not None and pool.block_hash[last[0]] == last[1]:
                        pool.uncache(last[0])
                    seq.last_checkpoint = (slot, h)
                checkpoints.append((seq.state_slot, slot))
        restores, self._restores = tuple(self._restores), []
        self._coming.clear()
        if self._pinned:
            pool.release(self._pinned)
            self._pinned = []
        return restores, tuple(checkpoints)

    # -- reports ---------------------------------------------------------------------------------
    def prefix_reuse(self, max_num_seqs: int = 0) -> dict[str, str]:
        """Per kind: whether it reuses cached prefixes, and how or why not."""
        slots = self.state_pool.num_blocks if self.state_pool is not None else 0
        return self.layout.prefix_reuse(self.enable_prefix_caching, slots, max_num_seqs)

    def group_stats(self) -> list[dict]:
        """Per group: its kind, layers and what it holds (attention: blocks of the shared pool held by
        its sequences; state: the shared slots)."""
        out = []
        for g, (group, m) in enumerate(zip(self.layout.attention_groups, self.managers)):
            out.append({"group": g, "kind": m.kind, "layers": len(group.layers), "window": group.spec.window,
                        "blocks_used": self.pool.used[g]})
        state = self.state_pool
        for i, group in enumerate(self.layout.state_groups):
            used = state.num_blocks - state.num_free
            out.append({"group": self.num_groups + i, "kind": "state", "layers": len(group.layers),
                        "slot_bytes": group.spec.slot_bytes, "slots_used": used, "slots_free": state.num_free,
                        "slots_cached": state.num_cached_free})
        return out


def whole_image_chunk(seq: Sequence, computed: int, n: int) -> int:
    """A chunk of `n` tokens from `computed` that ends inside no image: cut to end where the image its end
    falls in starts, or 0 when it starts inside (or at the start of) that image, which it cannot hold
    whole (the sequence waits for a step with budget for the rest of the image). A model whose image
    tokens attend to each other needs this: tokens of an image computed in one chunk could not see the
    image's tokens of the next."""
    end = computed + n
    for span in seq.image_spans:  # ascending
        if span.start < end < span.end:
            return span.start - computed if span.start > computed else 0
        if span.start >= end:
            break
    return n
