"""The dry run: what the engine would do with one request, priced before anything is paid for.

    build (caller's thread / a prep pool)   InputProcessor.build_prompt(check_fit=False): the prompt the
                                            request would run (template, images decoded and resized,
                                            tokens) with no vision tower, no grammar compiled, and a too-
                                            long prompt returned instead of refused (bad input, and one
                                            image or video over max_model_len alone, raise as for chat:
                                            refused before it is resized or decoded)
    inspect (the engine's thread)           `inspect(engine, prompt, params)`: the cache as it is now,
                                            read, never changed: nothing is scheduled or taken

`RenderedRequest` is what `LLM.render`, `AsyncLLM.render` and the server's /v1/chat/completions/render and
/v1/completions/render return (server/render.py turns it into vLLM's fields plus ours):

    tokens        the prompt's token ids; per part (text, each image, each video with its frames and
                  grid): tokens, placeholder range, item hash
    kv            per cache group the blocks one sample holds at most running alone to its end (prompt +
                  the output it may generate: max_tokens, at most max_model_len; its last sampled token is
                  never written, a speculative step's drafts are) and their bytes; the
                  state slot of a model with state layers. n samples (SamplingParams.n): each later sample
                  starts on the first's cached prompt, as the scheduler admits them (the same step; a model
                  with state layers a step or two later, once the first's last-boundary checkpoint is
                  taken), sharing per group its hit (`shared`: every full block of the prompt but the one of
                  its last token; a sliding window's blocks in its window): the request holds `total_blocks`
                  = blocks + cached + (n - 1) x (blocks - shared) per group, and n state slots. `cached`: hit
                  blocks the cache held before the first ran that the first does not reuse (a state model's
                  first recomputes a prefix it has no checkpoint for; its copy does not replace the cached one)
    prefix_cache  the tokens `CacheCoordinator.start` would find cached now (its `peek_hit`)
    steps         `first_step_tokens`: what its first step computes were it admitted alone (the scheduler's
                  chunk rules: max_num_batched_tokens, block alignment, whole images, and the step's vision
                  budget, max_num_encoder_tokens_per_step: a chunk ends before the first image the budget does
                  not hold, an image over the whole budget alone in its step); `prefill_steps`: the steps to
                  its first token running alone, each step with a fresh budget (a video's frame groups over
                  several)
    fits          now: admission this step would take it (blocks its first chunk needs <= free, a state
                  slot, a sequence slot); ever: the prompt fits max_model_len. When it does not, `error`
                  is the engine's InputTooLongError (its message, fixes, together, video_fixes)

Equal to what the engine then does for the same request on the same cache: the prompt's ids, each
group's blocks after its first step, the pool's free blocks it takes, `metrics.cached_tokens`
(tests/engine/test_render.py).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from vlm_sdk.engine.core.block_hash import extend_block_hashes
from vlm_sdk.engine.core.cache_managers import NULL_BLOCK
from vlm_sdk.engine.core.sequence import Sequence
from vlm_sdk.engine.core.vision_budget import VisionBudget
from vlm_sdk.errors import InputTooLongError
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.protocol.blocks import blocks_needed
from vlm_sdk.sampling_params import SamplingParams


@dataclass(frozen=True)
class PartTokens:
    """One image or video part: its tokens from `offset` (the first item's first token) over `length`
    tokens (to the last item's end: a Qwen3-VL video's timestamps between its patches included)."""
    kind: str  # "image" | "video"
    index: int  # among the parts of its kind
    tokens: int  # placeholder (image) tokens: what the vision tower fills
    offset: int
    length: int
    items: int  # vision-tower items (an image's crops / tiles call, a video's temporal patches / frames)
    frames: int
    grid: tuple[int, ...] | None
    hash: str | None  # hex of the item keys (multimodal/image_key.py); None: not cacheable
    source_size: tuple[int, int] | None  # (height, width) as decoded

    def to_dict(self) -> dict:
        return {"index": self.index, "tokens": self.tokens, "offset": self.offset, "length": self.length,
                "items": self.items, "frames": self.frames, "grid": list(self.grid) if self.grid else None,
                "hash": self.hash, "height": self.source_size[0] if self.source_size else None,
                "width": self.source_size[1] if self.source_size else None}


@dataclass(frozen=True)
class GroupBlocks:
    group: int
    kind: str  # "full_attention" | "sliding_window"
    layers: int
    window: int | None
    blocks: int  # held at most running alone to the request's end
    bytes: int
    prompt_blocks: int  # held after its first step (hits included; a window's early hits are not held)
    shared: int = 0  # each later sample's prefix-cache hit, held (the first's blocks, or `cached` ones)
    cached: int = 0  # of them, blocks cached before the first ran, past its own hit: shared by the later samples
    total_blocks: int = 0  # the n samples together: blocks + cached + (n - 1) * (blocks - shared)


@dataclass(frozen=True)
class NoFit:
    """The engine's `InputTooLongError` for this request, as plain data (it crosses to Ray replicas)."""
    message: str
    fixes: dict
    together: dict
    video_fixes: dict

    @classmethod
    def of(cls, e: InputTooLongError) -> "NoFit":
        return cls(str(e), dict(e.fixes), dict(e.together), dict(e.video_fixes))


@dataclass(frozen=True)
class RenderedRequest:
    token_ids: list[int] | None  # None: refused before it was tokenized whole (see error)
    num_tokens: int
    text_tokens: int
    parts: tuple[PartTokens, ...]
    max_tokens: int | None  # asked (None: up to max_model_len)
    output_tokens: int  # the output room it gets: max_tokens, at most max_model_len - num_tokens
    block_size: int
    bytes_per_block: int
    groups: tuple[GroupBlocks, ...]
    state_slot_bytes: int  # 0: no state layers
    prefix_hit_tokens: int
    new_blocks: int  # taken from the free pool by its first step now (cached-free hits revived included)
    first_step_tokens: int  # tokens its first step computes (max_num_batched_tokens, chunk rules, vision budget)
    prefill_steps: int | None  # steps to its first token running alone (None: refused, or never: see fits_now)
    free_blocks: int
    free_state_slots: int | None  # None: no state layers
    n: int  # samples (SamplingParams.n): sequences the engine runs
    running: int
    waiting: int  # sequences queued before it: admission takes them first
    max_num_seqs: int
    max_model_len: int
    capacity_tokens: int
    max_num_encoder_tokens_per_step: int | None = None  # the vision budget of a step (None: no bound)
    sample_hit_tokens: int = 0  # each later sample's prefix-cache hit (the first's prompt cached)
    sample_new_blocks: int = 0  # the free blocks each later sample's start takes
    sample_revived: int = 0  # the free cached blocks the later samples' hits take back (once, for all of them)
    cache_salt: str | None = None
    error: NoFit | None = None  # it never fits: the too-long error's message and fixes

    @property
    def total_tokens(self) -> int:
        return self.num_tokens + self.output_tokens

    @property
    def kv_blocks(self) -> int:
        """Blocks the request's n samples hold together at most (each group's `total_blocks`)."""
        return sum(g.total_blocks for g in self.groups)

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.bytes_per_block + self.n * self.state_slot_bytes

    @property
    def state_slots(self) -> int:
        """Live state slots its samples hold (0: no state layers)."""
        return self.n if self.free_state_slots is not None else 0

    @property
    def all_new_blocks(self) -> int:
        """Free blocks its n samples' starts take: the first's first step, each later one's start."""
        return self.new_blocks + (self.n - 1) * self.sample_new_blocks + self.sample_revived

    @property
    def fits_ever(self) -> bool:
        return self.error is None

    @property
    def fits_now(self) -> bool:
        """Admission now, were it first in line: its n samples' starting blocks free, a state slot and a
        sequence slot each (and a first chunk: a whole-image model's budget holds the image it starts in)."""
        slot = self.free_state_slots is None or self.free_state_slots >= self.n
        return (self.fits_ever and self.first_step_tokens > 0 and self.all_new_blocks <= self.free_blocks and slot
                and self.running + self.n <= self.max_num_seqs)

    def images(self) -> list[PartTokens]:
        return [p for p in self.parts if p.kind == "image"]

    def videos(self) -> list[PartTokens]:
        return [p for p in self.parts if p.kind == "video"]

    def to_dict(self) -> dict:
        """Ours, as the server sends them beside vLLM's fields (server/render.py)."""
        e = self.error
        return {
            "num_tokens": self.num_tokens,
            "parts": {"text_tokens": self.text_tokens, "images": [p.to_dict() for p in self.images()],
                      "videos": [p.to_dict() for p in self.videos()]},
            "kv": {"block_size": self.block_size, "bytes_per_block": self.bytes_per_block,
                   "tokens": self.total_tokens, "output_tokens": self.output_tokens, "blocks": self.kv_blocks,
                   "bytes": self.kv_bytes, "state_slot_bytes": self.state_slot_bytes, "n": self.n,
                   "state_slots": self.state_slots,
                   "groups": [g.__dict__ for g in self.groups]},
            "prefix_cache": {"hit_tokens": self.prefix_hit_tokens,
                             "hit_blocks": self.prefix_hit_tokens // self.block_size,
                             "sample_hit_tokens": self.sample_hit_tokens},
            "fits": {"now": self.fits_now, "ever": self.fits_ever, "new_blocks": self.new_blocks,
                     "sample_new_blocks": self.sample_new_blocks,
                     "first_step_tokens": self.first_step_tokens, "prefill_steps": self.prefill_steps,
                     "max_num_encoder_tokens_per_step": self.max_num_encoder_tokens_per_step,
                     "free_blocks": self.free_blocks,
                     "free_state_slots": self.free_state_slots, "running": self.running, "waiting": self.waiting,
                     "max_num_seqs": self.max_num_seqs, "max_model_len": self.max_model_len,
                     "capacity_tokens": self.capacity_tokens},
            "error": None if e is None else {
                "message": e.message, "code": "context_length_exceeded", "fixes": dict(e.fixes),
                "together": dict(e.together), "video_fixes": dict(e.video_fixes)},
        }


def build(inputs, request, params: SamplingParams | None, options=None, *, cancelled=None):
    """(the prompt `request` would run, its media parts) on the caller's thread or a prep pool, or (None,
    the InputTooLongError) when it is refused before its ids are known. No grammar is compiled."""
    try:
        prompt = inputs.build_prompt(request, params, cancelled=cancelled, options=options, compile_grammar=False,
                                     check_fit=False)
    except InputTooLongError as e:
        return None, e
    return prompt, inputs.processor.media_parts(prompt)


def render(engine, built: tuple, params: SamplingParams | None) -> RenderedRequest:
    """`build`'s result inspected on `engine`'s thread."""
    prompt, parts = built
    if prompt is None:
        return refused(engine, parts, params)
    return inspect(engine, prompt, params, parts)


def settle(done, compute) -> None:
    """Run `compute()` here (the engine thread) and hand its result or exception to the asyncio future
    `done` on its own loop; nothing when its caller went away or its loop is closed."""
    try:
        result, failed = compute(), False
    except Exception as e:  # the caller's error to raise: the engine thread goes on
        result, failed = e, True

    def deliver() -> None:
        if not done.done():
            (done.set_exception if failed else done.set_result)(result)
    try:
        done.get_loop().call_soon_threadsafe(deliver)
    except RuntimeError:  # the caller's loop is closed
        pass


def refused(engine, error: InputTooLongError, params: SamplingParams | None) -> RenderedRequest:
    """The render of a request refused before its ids were known (its text or an image too long to
    count or resize): the counts the error gives, nothing of the cache."""
    cache, sched = engine.cache, engine.scheduler_config
    return RenderedRequest(
        token_ids=None, num_tokens=error.prompt_tokens, text_tokens=error.prompt_tokens - sum(error.image_tokens),
        parts=(), max_tokens=(params or SamplingParams()).max_tokens, output_tokens=0, block_size=cache.block_size,
        bytes_per_block=engine.cache_config.bytes_per_block, groups=(), state_slot_bytes=0, prefix_hit_tokens=0,
        new_blocks=0, first_step_tokens=0, prefill_steps=None, free_blocks=cache.num_free_blocks,
        free_state_slots=cache.num_free_slots if cache.state_pool is not None else None,
        n=(params or SamplingParams()).n,
        running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting), max_num_seqs=sched.max_num_seqs,
        max_model_len=sched.max_model_len, capacity_tokens=engine.cache_config.capacity_tokens,
        max_num_encoder_tokens_per_step=sched.max_num_encoder_tokens_per_step, error=NoFit.of(error))


def inspect(engine, prompt: PromptInputs, params: SamplingParams | None, parts: list) -> RenderedRequest:
    """What `engine` (an `LLMEngine`, read on its own thread) would do with `prompt` now. `parts`: the
    family processor's `media_parts(prompt)`."""
    params = params or SamplingParams()
    cache, sched, cc = engine.cache, engine.scheduler_config, engine.cache_config
    n, size = len(prompt.token_ids), cache.block_size
    error = None
    try:
        engine.inputs.check_prompt(prompt, params)
    except InputTooLongError as e:
        error = NoFit.of(e)
    want = sched.max_model_len - n if params.max_tokens is None else params.max_tokens
    output = max(0, min(want, sched.max_model_len - n))
    seq = Sequence("render", prompt, params)
    k = cache.peek_hit(seq) if error is None else 0
    computed = k * size
    step = _first_chunk(cache, sched, seq, computed)
    later = _sample_hit(cache, seq, k) if params.n > 1 and error is None else k  # blocks a later sample reuses
    sample_new = (max(cache.blocks_for(later * size + _first_chunk(cache, sched, seq, later * size)) - later, 0)
                  * cache.num_groups if params.n > 1 else 0)
    steps = _prefill_steps(cache, sched, seq, computed, step) if error is None else None
    need = max(cache.blocks_for(computed + step) - k, 0)
    pool = cache.pool
    hits = [m.hit_blocks(seq.block_hashes, k) for m in cache.managers] if k else [[] for _ in cache.managers]
    revived = sum(1 for blocks in hits for b in blocks if b != NULL_BLOCK and pool.ref_count[b] == 0)
    # the tokens whose keys it writes at most: its last sampled token never is; a verification step writes its
    # drafts' (speculative decoding: up to num_speculative_tokens past the token it decodes)
    cached, sample_revived = _sample_cached(cache, seq, k, later) if params.n > 1 else ([0] * cache.num_groups, 0)
    spec = engine.spec.config.num_speculative_tokens if getattr(engine, "spec", None) is not None else 0
    written = max(n + output - 1 + spec, n) if output else n
    groups = tuple(_group(g, cache, written, sched.max_num_batched_tokens, cc.bytes_per_block,
                          sum(1 for b in hits[g.index] if b != NULL_BLOCK) + need, params.n, later, cached[g.index])
                   for g in _groups(cache))
    return RenderedRequest(
        token_ids=list(prompt.token_ids), num_tokens=n, text_tokens=n - sum(prompt.image_tokens),
        parts=tuple(_parts(prompt, parts)), max_tokens=params.max_tokens, output_tokens=output,
        block_size=size, bytes_per_block=cc.bytes_per_block, groups=groups,
        state_slot_bytes=cc.state_slot_bytes if cache.state_pool is not None else 0,
        prefix_hit_tokens=computed, new_blocks=need * cache.num_groups + revived, first_step_tokens=step,
        prefill_steps=steps, n=params.n, sample_hit_tokens=later * size if params.n > 1 else 0,
        sample_new_blocks=sample_new, sample_revived=sample_revived,
        free_blocks=cache.num_free_blocks,
        free_state_slots=cache.num_free_slots if cache.state_pool is not None else None,
        running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting),
        max_num_seqs=sched.max_num_seqs, max_model_len=sched.max_model_len, capacity_tokens=cc.capacity_tokens,
        max_num_encoder_tokens_per_step=sched.max_num_encoder_tokens_per_step, cache_salt=prompt.cache_salt,
        error=error)


def _first_chunk(cache, sched, seq: Sequence, computed: int) -> int:
    """The tokens `start` computes for `seq` from `computed` in a step it starts alone (the budget,
    block alignment, whole images, the step's vision budget)."""
    step = min(seq.num_prompt_tokens - computed, sched.max_num_batched_tokens)
    if cache.aligned:
        step = cache.align(seq, computed, step)
    step = cache.whole_image(seq, computed, step)
    return VisionBudget(sched.max_num_encoder_tokens_per_step).cut(seq, computed, step)


def _sample_hit(cache, seq: Sequence, k: int) -> int:
    """The blocks a later sample of `seq`'s request finds cached once the first has run its prompt: every
    full block before its last token's (`_cached_prefix`'s limit; fewer where an image without a key stops
    the hash chain), at least the hit `k` now; the first's blocks are offered to the cache when scheduled,
    and a model with state layers checkpoints the last boundary (prompt chunks align to it). None without
    prefix caching. Sample 0's prompt logprobs do not stop the later ones (theirs are not asked for)."""
    if not cache.enable_prefix_caching:
        return 0
    size = cache.block_size
    limit = (seq.num_tokens - 1) // size
    extend_block_hashes(seq.block_hashes, seq.token_ids, seq.image_spans, size, limit * size, seq.hash_seed)
    return max(k, min(limit, len(seq.block_hashes)))


def _sample_cached(cache, seq: Sequence, k: int, later: int) -> tuple[list[int], int]:
    """(per group, the blocks of a later sample's hit of `later` blocks that are cached now past the first's
    own hit of `k`: the later samples take these, not the first's copies; how many of them are free now,
    taken back from the pool once)."""
    pool, out, revived = cache.pool, [], 0
    for g, m in enumerate(cache.managers):
        window = getattr(m, "window_blocks", None)  # a sliding window holds only its hit's last blocks
        start = k if window is None else max(k, later - window)
        ids = [b for b in (pool.lookup(h, g) for h in seq.block_hashes[start:later]) if b is not None]
        out.append(len(ids))
        revived += sum(1 for b in ids if pool.ref_count[b] == 0)
    return out, revived


def _prefill_steps(cache, sched, seq: Sequence, computed: int, first: int) -> int | None:
    """The steps `seq` (a throwaway copy: it is changed) takes to its first token running alone, its first
    chunk `first` tokens from `computed`: each later chunk as the scheduler cuts a running sequence's (the
    whole token budget, no decode rows beside it; align, whole images, a fresh vision budget, the images
    the worker holds not counted again). None when a chunk is cut to nothing (start-up refuses a budget
    that cannot hold the largest image, so only a first step can be: see `fits_now`)."""
    if first == 0:
        return None
    end, steps, n_prompt = computed + first, 1, seq.num_prompt_tokens
    seq.in_worker = True  # from its second step on, the worker holds the image its last chunk ended inside
    while end < n_prompt:
        n = min(n_prompt - end, sched.max_num_batched_tokens)
        if cache.aligned and n > 1:
            n = cache.align(seq, end, n)
        n = cache.whole_image(seq, end, n)
        n = VisionBudget(sched.max_num_encoder_tokens_per_step).cut(seq, end, n)
        if n == 0:
            return None
        end, steps = end + n, steps + 1
    return steps


@dataclass(frozen=True)
class _Group:
    index: int
    kind: str
    layers: int
    window: int | None


def _groups(cache) -> list[_Group]:
    return [_Group(g, m.kind, len(group.layers), group.spec.window)
            for g, (group, m) in enumerate(zip(cache.layout.attention_groups, cache.managers))]


def _group(g: _Group, cache, total: int, chunk: int, per_block: int, prompt_blocks: int, n: int,
           later: int, cached: int) -> GroupBlocks:
    """A group's blocks for a sequence of `total` tokens running alone (CacheLayout.blocks_for_tokens'
    rule, one group): all of them, or a sliding window's keys and one chunk; and for `n` samples, the
    later ones on a hit of `later` blocks (held whole, or a sliding window's last blocks of it)."""
    size = cache.block_size
    full = blocks_needed(total, size)
    blocks = full if g.window is None else min(full, (g.window - 1 + min(chunk, total) - 1) // size + 2)
    shared = later if g.window is None else min(later, -(-(g.window - 1) // size))  # SlidingWindowManager.hit_blocks
    shared = min(shared, blocks) if n > 1 else 0
    return GroupBlocks(g.index, g.kind, g.layers, g.window, blocks, blocks * per_block, prompt_blocks, shared,
                       cached, blocks + cached + (n - 1) * (blocks - shared))


def _parts(prompt: PromptInputs, parts: list) -> list[PartTokens]:
    out, counts = [], {"image": 0, "video": 0}
    images, starts = prompt.images, prompt.image_positions
    for part in parts:
        first, last = part.items[0], part.items[-1]
        keys = [images[i].key for i in part.items]
        digest = None
        if all(key is not None for key in keys):
            digest = keys[0].hex() if len(keys) == 1 else hashlib.blake2b(b"".join(keys), digest_size=32).hexdigest()
        offset = starts[first]
        out.append(PartTokens(part.kind, counts[part.kind], sum(images[i].num_tokens for i in part.items), offset,
                              starts[last] + images[last].num_tokens - offset, len(part.items), part.frames,
                              part.grid, digest, images[first].source_size))
        counts[part.kind] += 1
    return out
