"""The cache managers and their coordinator on fake sequences, with exact block and slot ids (vLLM's
test_single_type_kv_cache_manager.py and test_prefix_caching.py, mini-sglang's allocator tests): a
sliding window lets go of what falls out of it, state slots follow admission, preemption and finish,
prefix hits per kind, and the coordinator's combined hit."""
from vlm_sdk.config import SchedulerConfig
from vlm_sdk.engine.core.block_hash import extend_block_hashes
from vlm_sdk.engine.core.block_pool import BlockPool, StatePool
from vlm_sdk.engine.core.cache_coordinator import CacheCoordinator
from vlm_sdk.engine.core.cache_managers import NULL_BLOCK, FullAttentionManager, SlidingWindowManager, StateManager
from vlm_sdk.engine.core.scheduler import Scheduler
from vlm_sdk.engine.core.sequence import Sequence, SequenceStatus
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.protocol.cache_layout import CacheLayout
from vlm_sdk.protocol.cache_spec import AttentionSpec, StateSpec, StateTensor
from vlm_sdk.sampling_params import SamplingParams

FULL = AttentionSpec(2, 8, "float32")
STATE = StateSpec((StateTensor("conv", (4, 3), "float32"), StateTensor("recurrent", (2, 4, 4), "float32")))


def sliding(window):
    return AttentionSpec(2, 8, "float32", window)


def _seq(name, ids, max_tokens=100):
    return Sequence(name, PromptInputs(token_ids=list(ids)), SamplingParams(max_tokens=max_tokens))


def _coordinator(specs, num_blocks, caching=False, slots=0, block_size=4):
    return CacheCoordinator(CacheLayout.from_specs(specs), num_blocks, block_size, caching, slots)


def _compute(seq, n):
    """The engine's launch and postprocess: the step's tokens computed; sampled when it caught up."""
    seq.num_computed_tokens += n
    if seq.num_computed_tokens == seq.num_tokens:
        seq.token_ids.append(7)


def _hashes(n_blocks, block_size=4):
    h = []
    extend_block_hashes(h, list(range(n_blocks * block_size)), [], block_size, n_blocks * block_size)
    return h


def test_a_sliding_window_lets_go_of_the_blocks_before_it_and_full_attention_keeps_all():
    kv = _coordinator([FULL, sliding(6)], 20)  # group 0 full, group 1 window 6; 4-token blocks
    a = _seq("a", range(20))
    assert kv.start(a, 100) == 20
    assert a.block_ids == ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
    _compute(a, 20)
    # the next query is token 20: it reads keys 15..20, so blocks 0-2 of the window group (tokens 0-11) go,
    # last first, each to the front of the free queue; the block each group then needs comes from there
    assert kv.allocate(a, 1)
    assert a.block_ids == ([0, 1, 2, 3, 4, 5], [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 8, 9, 6])
    assert kv.num_free_blocks == 11 and kv.pool.used == [6, 3]
    _compute(a, 1)  # 22 tokens, 21 computed
    assert kv.allocate(a, 1)  # the query at 21 reads keys 16..21: block 3 (tokens 12-15) goes too
    assert a.block_ids[1] == [NULL_BLOCK] * 4 + [9, 6]
    _compute(a, 1)
    for _ in range(2):  # tokens 22 and 23: the blocks held suffice, nothing falls out of the window
        assert kv.allocate(a, 1) and a.block_ids[1] == [NULL_BLOCK] * 4 + [9, 6]
        _compute(a, 1)
    assert kv.allocate(a, 1)  # token 24 needs a block in each group: the two let go of last
    assert a.block_ids == ([0, 1, 2, 3, 4, 5, 8], [NULL_BLOCK] * 4 + [9, 6, 7])
    kv.free(a)
    assert a.block_ids == () and kv.num_free_blocks == 20 and kv.pool.used == [0, 0]


def test_sliding_window_hit_needs_only_the_window_before_it():
    """The module docstring's example: block size 4, window 6 (2 blocks before a boundary)."""
    pool = BlockPool(10, 1)
    h = _hashes(5)
    taken = pool.take(10)
    for block, i in ((taken[9], 0), (taken[3], 2), (taken[7], 3), (taken[8], 4)):
        pool.cache(block, h[i])
    window = SlidingWindowManager(0, sliding(6), pool, 4)
    full = FullAttentionManager(0, FULL, pool, 4)
    assert window.longest_hit(h, 5) == 5 and window.hit_blocks(h, 5) == [NULL_BLOCK] * 3 + [7, 8]
    assert full.longest_hit(h, 5) == 1 and full.hit_blocks(h, 1) == [9]
    assert window.longest_hit(h, 4) == 4 and window.hit_blocks(h, 4) == [NULL_BLOCK, NULL_BLOCK, 3, 7]
    assert window.longest_hit(h, 3) == 1  # blocks 1 is missing: only the run from the first block
    wide = SlidingWindowManager(0, sliding(13), pool, 4)  # 3 blocks before a boundary
    assert wide.longest_hit(h, 5) == 5 and wide.hit_blocks(h, 5) == [NULL_BLOCK, NULL_BLOCK, 3, 7, 8]


def test_a_preempted_window_sequence_finds_its_window_blocks_when_it_returns():
    kv = _coordinator([FULL, sliding(6)], 24, caching=True)
    a = _seq("a", range(21))
    assert kv.start(a, 100) == 21
    _compute(a, 21)  # 22 tokens now
    kv.allocate(a, 1)  # lets go of window blocks 0-3 (cached: they stay cached-free)
    kv.free(a)  # preempted
    assert kv.num_cached_free_blocks == 10  # 5 full blocks per group, its window group's included
    n = kv.start(a, 100)
    assert n == 2 and a.num_computed_tokens == 20  # the last token is computed to sample
    assert a.block_ids[1][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in a.block_ids[0]


def test_state_slots_are_taken_on_admission_and_freed_on_finish_and_preemption():
    kv = _coordinator([FULL, STATE], 40, slots=2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=40,
                                      max_model_len_source="test"), kv)
    a, b, c = _seq("a", range(5)), _seq("b", range(10, 15)), _seq("c", range(20, 25))
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 5), ("b", 5)]  # no third slot: c waits
    assert (a.state_slot, b.state_slot, c.state_slot) == (0, 1, -1) and kv.num_free_slots == 0
    assert out.state_restores == () and out.state_checkpoints == ()  # caching off: no checkpoint
    for s, n in out.scheduled:
        _compute(s, n)
    sched.finish(a, "stop")
    assert a.state_slot == -1 and kv.num_free_slots == 1
    out = sched.schedule()
    assert [s.request_id for s, _ in out.scheduled] == ["b", "c"] and c.state_slot == 0
    for s, n in out.scheduled:
        _compute(s, n)
    sched._preempt(c)
    assert c.state_slot == -1 and c.status is SequenceStatus.WAITING and kv.num_free_slots == 1
    out = sched.schedule()  # c comes back on the slot it left
    assert [s.request_id for s, _ in out.scheduled] == ["b", "c"] and c.state_slot == 0
    for s in (b, c):
        sched.finish(s, "stop")
    assert kv.num_free_slots == 2 and kv.num_free_blocks == 40


def test_state_checkpoints_at_aligned_chunk_ends_and_a_later_sequence_restores_one():
    kv = _coordinator([FULL, STATE], 40, caching=True, slots=5)
    sched = Scheduler(SchedulerConfig(8, 100, 40, "test"), kv)
    a = _seq("a", range(10))
    sched.add(a)
    # chunks end at the last two boundaries before the last token (4 and 8), so the states there are kept
    out = sched.schedule()
    assert out.scheduled == [(a, 4)] and a.state_slot == 0
    assert out.state_checkpoints == ((0, 1),) and out.state_restores == ()
    _compute(a, 4)
    out = sched.schedule()
    assert out.scheduled == [(a, 4)] and out.state_checkpoints == ((0, 2),)
    _compute(a, 4)
    out = sched.schedule()
    assert out.scheduled == [(a, 2)] and out.state_checkpoints == ()  # ends at 10: not a boundary
    _compute(a, 2)
    # b shares a's first 8 tokens: blocks 0-1 and the state after them; c shares only 6: the state after
    # 4 (the boundary before the last, kept for a chat's next turn, whose last few tokens differ)
    b, c = _seq("b", list(range(8)) + [50, 51, 52]), _seq("c", list(range(6)) + [60, 61, 62])
    sched.add(b), sched.add(c)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 1), ("b", 3), ("c", 4)]
    assert b.num_computed_tokens == 8 and b.block_ids[0][:2] == a.block_ids[0][:2]
    assert c.num_computed_tokens == 4 and c.block_ids[0][:1] == a.block_ids[0][:1]
    assert (b.state_slot, c.state_slot) == (3, 4)
    assert out.state_restores == ((2, 3), (1, 4))  # a's checkpoints -> the live slots, before the forward
    assert kv.kind_hit_tokens == {"full": 8 + 4, "state": 8 + 4}


def test_siblings_wait_one_step_for_the_checkpoint_their_prompt_is_computing():
    """n > 1: the siblings of one `add` would compute the same prompt; the second waits for the steps that
    checkpoint it (a checkpoint is copied after that step's forward), then each restores into its own
    live slot, the pinned checkpoint read twice."""
    kv = _coordinator([FULL, STATE], 40, caching=True, slots=6)
    sched = Scheduler(SchedulerConfig(8, 100, 40, "test"), kv)
    sibs = [_seq(f"s{i}", range(9)) for i in range(3)]
    for s in sibs:
        sched.add(s)
    # s0's prompt is cut at 4 and 8 (the last two boundaries before its last token); s1 waits for each,
    # and admission with it
    for end, slot in ((4, 1), (8, 2)):
        out = sched.schedule()
        assert [(s.request_id, n) for s, n in out.scheduled] == [("s0", 4)]
        assert sibs[0].state_slot == 0 and out.state_checkpoints == ((0, slot),)
        for s, n in out.scheduled:
            _compute(s, n)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("s0", 1), ("s1", 1), ("s2", 1)]
    assert [s.state_slot for s in sibs] == [0, 3, 4] and [s.num_computed_tokens for s in sibs[1:]] == [8, 8]
    assert out.state_restores == ((2, 3), (2, 4))
    assert [s.block_ids[0][:2] for s in sibs] == [[0, 1]] * 3  # and the full-attention blocks are shared
    assert kv.state_pool.ref_count[2] == 0 and kv.state_pool.lookup(sibs[0].block_hashes[1]) == 2  # unpinned


def test_generated_side_checkpoints_keep_only_the_latest():
    kv = _coordinator([FULL, STATE], 40, caching=True, slots=4)
    sched = Scheduler(SchedulerConfig(8, 100, 40, "test"), kv)
    a = _seq("a", range(6))
    sched.add(a)
    seen = []
    for _ in range(12):
        out = sched.schedule()
        seen.append(out.state_checkpoints)
        for s, n in out.scheduled:
            _compute(s, n)
    # the prompt's boundary 4 (its chunk is cut there), then generated-side boundaries 8, 12 and 16, each
    # letting go of the one before it (moved to the front of the free queue: the next one reuses it)
    assert [c for c in seen if c] == [((0, 1),), ((0, 2),), ((0, 3),), ((0, 2),)]
    lookup, h = kv.state_pool.lookup, a.block_hashes
    assert [lookup(h[i]) for i in range(4)] == [1, None, None, 2]


def test_the_combined_hit_is_the_longest_every_kind_serves():
    h = _hashes(6)
    kv = _coordinator([FULL, sliding(6), STATE], 40, caching=True, slots=4)
    seq = _seq("x", range(6 * 4 + 1))  # up to 6 blocks may hit
    seq.block_hashes = list(h)
    full_blocks, window_blocks = kv.pool.take(6, 0), kv.pool.take(6, 1)
    for i in range(6):
        kv.pool.cache(full_blocks[i], h[i], 0)
    for i in (1, 2, 4, 5):  # the window group lost blocks 0 and 3
        kv.pool.cache(window_blocks[i], h[i], 1)
    ckpt = kv.state_pool.take(2)
    kv.state_pool.cache(ckpt[0], h[4 - 1])  # the state after 4 and after 3 blocks
    kv.state_pool.cache(ckpt[1], h[3 - 1])
    kv.pool.release(full_blocks + window_blocks)
    kv.state_pool.release(ckpt)
    # full serves 6, the window 6 (blocks 4-5), the state 4 at most; at 4 the window needs blocks 2-3
    # (3 is gone), at 3 it needs 1-2: held, and the state has a checkpoint at 3
    assert kv._cached_prefix(seq) == (3, ckpt[1])
    assert kv.kind_hit_tokens == {"full": 24, "sliding_window": 24, "state": 16}


def test_state_hits_need_a_checkpoint_exactly_there():
    pool = StatePool(3)
    h = _hashes(4)
    s = pool.take(1)[0]
    pool.cache(s, h[1])
    pool.release([s])
    state = StateManager(pool, 4)
    assert state.longest_hit(h, 4) == 2 and state.checkpoint(h, 2) == s
    assert state.longest_hit(h, 1) == 0
