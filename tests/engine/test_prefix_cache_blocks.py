"""Prefix caching in the block manager on fake sequences: hashes, sharing by reference count, the
least-recently-used eviction of free cached blocks, and the free counts that capacity relies on."""
import torch

from helpers import full_attention_cache

from vlm_sdk.config import SchedulerConfig
from vlm_sdk.engine.core.block_hash import ImageSpan, extend_block_hashes
from vlm_sdk.engine.core.scheduler import Scheduler
from vlm_sdk.engine.core.sequence import Sequence
from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs
from vlm_sdk.sampling_params import SamplingParams


def _seq(name, ids, images=()):
    """`images`: (first token, tokens, key) per image."""
    ims = [ImageInput(torch.zeros(1, 1), n, key=key) for _, n, key in images]
    prompt = PromptInputs(token_ids=list(ids), images=ims, image_positions=[p for p, _, _ in images])
    return Sequence(name, prompt, SamplingParams(max_tokens=100))


def _run(bm, seq):
    """Start `seq` and compute its whole prompt in one step."""
    n = bm.start(seq, 1000)
    seq.num_computed_tokens += n
    return n


def test_hashes_chain_and_cover_images_and_stop_at_an_image_without_a_key():
    ids = [1, 2, 9, 9, 9, 9, 9, 3, 4, 5, 6, 7]
    spans = [ImageSpan(2, 7, b"k" * 16)]
    h = []
    extend_block_hashes(h, ids, spans, 4, 12)
    other = []
    extend_block_hashes(other, ids, [ImageSpan(2, 7, b"j" * 16)], 4, 12)
    assert len(h) == 3 and len(set(h)) == 3
    assert other[0] != h[0] and other[1] != h[1]  # blocks with the image differ...
    assert other[2] != h[2]  # ... and so does every block after them (the chain)
    moved = []  # the same tokens, the image one token later
    extend_block_hashes(moved, ids, [ImageSpan(3, 7, b"k" * 16)], 4, 12)
    assert moved[0] != h[0]
    stopped = []
    extend_block_hashes(stopped, ids, [ImageSpan(6, 7, None)], 4, 12)
    assert len(stopped) == 1  # block 1 holds the keyless image: nothing from it on is cached


def test_a_shared_prefix_is_reused_leaving_the_last_token_and_counted():
    bm = full_attention_cache(10, 4, True)
    a = _seq("a", range(10))
    assert _run(bm, a) == 10 and a.block_ids[0] == [0, 1, 2]
    b = _seq("b", list(range(8)) + [50, 51, 52])
    assert _run(bm, b) == 3  # blocks 0, 1 shared
    assert b.block_ids[0][:2] == [0, 1] and b.metrics.cached_tokens == 8
    assert bm.pool.ref_count[:3] == [2, 2, 1]
    c = _seq("c", range(8))  # the whole prompt is cached, but its last token must be computed to sample
    assert _run(bm, c) == 4 and c.block_ids[0][0] == 0 and c.block_ids[0][1] not in (1, 2)
    assert bm.hit_tokens == 8 + 4 and bm.query_tokens == 10 + 11 + 8
    for s in (a, b, c):
        bm.free(s)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 10
    # a's blocks 0 and 1; c recomputed block 1's content into a block of its own, which is a duplicate
    # and not cached, and b's and a's last blocks are partial
    assert bm.num_cached_free_blocks == 2 and sorted(bm.pool.cached[0].values()) == [0, 1]


def test_free_cached_blocks_are_reclaimed_least_recently_used_first_and_revived_by_a_hit():
    bm = full_attention_cache(4, 4, True)
    a, b = _seq("a", range(9)), _seq("b", range(100, 109))
    _run(bm, a)  # blocks 0, 1 full (cached), 2 partial
    bm.free(a)
    # free queue [2 (a's partial block: no content, at the front), 3, 1, 0 (a's, freed last first)]
    _run(bm, b)
    assert b.block_ids[0] == [2, 3, 1]  # the cached block 1 evicted; a's prefix block 0 outlives it
    assert bm.num_cached_free_blocks == 1
    again = _seq("a2", range(9))
    assert bm.start(again, 1000) is None  # block 0 is cached, but two fresh blocks are needed and 0 are free
    bm.free(b)
    assert _run(bm, again) == 5 and again.block_ids[0][0] == 0 and again.metrics.cached_tokens == 4


def test_disabled_caching_reuses_nothing():
    bm = full_attention_cache(10, 4, False)
    a, b = _seq("a", range(9)), _seq("b", range(9))
    _run(bm, a)
    bm.free(a)
    assert _run(bm, b) == 9 and b.metrics.cached_tokens == 0
    assert bm.num_cached_free_blocks == 0 and bm.hit_tokens == bm.query_tokens == 0


def test_blocks_scheduled_this_step_are_shared_by_a_sequence_admitted_after_them():
    bm = full_attention_cache(20, 4, True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=64,
                                      max_model_len_source="test"), bm)
    a, b = _seq("a", range(13)), _seq("b", range(13))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 13), ("b", 1)]
    assert b.block_ids[0][:3] == a.block_ids[0][:3] and b.num_computed_tokens == 12


def test_a_preempted_sequence_finds_its_own_blocks_when_it_returns():
    bm = full_attention_cache(6, 4, True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=24,
                                      max_model_len_source="test"), bm)
    a, b = _seq("a", range(9)), _seq("b", range(100, 109))
    for s in (a, b):
        sched.add(s)
    out = sched.schedule()
    for s, n in out.scheduled:
        s.num_computed_tokens += n
        s.token_ids.append(7)
    a.token_ids += [7] * 3  # a needs a fourth block: b (newest) is preempted
    out = sched.schedule()
    assert out.preempted == [b] and b.block_ids == () and bm.num_cached_free_blocks == 2
    sched.finish(a, "stop")
    out = sched.schedule()
    assert out.scheduled[0][0] is b and b.num_computed_tokens == 8  # its two full blocks were still cached
    assert b.metrics.cached_tokens == 0  # the figure of its first start


def test_a_cache_full_of_cached_blocks_admits_a_prompt_that_needs_every_block():
    """Capacity: cached-but-free blocks are free; a new prompt reclaims them all, no preemption."""
    bm = full_attention_cache(4, 4, True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=16,
                                      max_model_len_source="test"), bm)
    for i in range(2):
        s = _seq(f"old{i}", range(100 * i, 100 * i + 8))
        _run(bm, s)
        bm.free(s)
    assert bm.num_cached_free_blocks == 4 and bm.num_free_blocks == 4 and bm.num_used_blocks == 0
    big = _seq("big", range(500, 515))
    sched.add(big)
    out = sched.schedule()
    assert out.scheduled == [(big, 15)] and not out.preempted
    assert len(big.block_ids[0]) == 4 and bm.num_cached_free_blocks == 0
