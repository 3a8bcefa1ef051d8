"""Block pool and scheduler on fake sequences: exact block ids, budgets, preemption order."""
import torch

from helpers import full_attention_cache

from vlm_sdk.config import SchedulerConfig
from vlm_sdk.protocol.blocks import slot_mapping
from vlm_sdk.engine.core.scheduler import Scheduler
from vlm_sdk.engine.core.sequence import Sequence, SequenceStatus
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.sampling_params import SamplingParams


def _seq(name, n_prompt):
    return Sequence(name, PromptInputs(token_ids=list(range(n_prompt))), SamplingParams(max_tokens=100))


def _step(sched, tokens_per_sampled=1):
    """Mimic the engine's postprocess: computed tokens catch up, sampled sequences grow by one."""
    out = sched.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return out


def test_allocation_exact_block_ids_and_free():
    bm = full_attention_cache(6, 4)
    a, b = _seq("a", 6), _seq("b", 3)
    assert bm.allocate(a, 6) and a.block_ids[0] == [0, 1]
    assert bm.allocate(b, 3) and b.block_ids[0] == [2]
    a.num_computed_tokens = 6
    assert bm.num_new_blocks(a, 2) == 0  # tokens 6, 7 still fit block 1
    assert bm.allocate(a, 3) and a.block_ids[0] == [0, 1, 3]
    assert slot_mapping(a.block_ids[0], 4, 8, 9) == [3 * 4 + 0]
    assert not bm.allocate(b, 4 * 3 + 1)  # asks 4 blocks, only 2 free: nothing taken
    assert b.block_ids[0] == [2] and bm.num_free_blocks == 2
    bm.free(a)
    assert a.block_ids == () and bm.num_free_blocks == 5
    # blocks without cached content go to the front of the free queue, in order: 0, 1, 3, then 4, 5
    assert bm.allocate(b, 4 * 3) and b.block_ids[0] == [2, 0, 1]


def test_token_budget_chunks_prefill_and_decodes_first():
    bm = full_attention_cache(100, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=400,
                                  max_model_len_source="test"), bm)
    a, b = _seq("a", 4), _seq("b", 25)
    s.add(a), s.add(b)
    out = _step(s)
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 4), ("b", 6)]
    out = _step(s)  # a decodes 1, b continues its prefill with the rest of the budget
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 9)]
    out = _step(s)
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 9)]
    assert b.num_computed_tokens == 24 and b.num_tokens == 25
    out = _step(s)
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 1)]
    assert b.num_tokens == 26  # b sampled its first token when its prefill finished


def test_max_num_seqs_limits_running():
    bm = full_attention_cache(100, 4)
    s = Scheduler(SchedulerConfig(2, 1000, 400, "test"), bm)
    seqs = [_seq(str(i), 3) for i in range(3)]
    for q in seqs:
        s.add(q)
    out = _step(s)
    assert [q.request_id for q, _ in out.scheduled] == ["0", "1"]
    assert len(s.waiting) == 1


def test_preempts_most_recent_and_recomputes():
    bm = full_attention_cache(4, 4)
    s = Scheduler(SchedulerConfig(8, 100, 16, "test"), bm)
    a, b = _seq("a", 7), _seq("b", 7)
    s.add(a), s.add(b)
    _step(s)  # a: blocks [0, 1]; b: [2, 3]; both sampled -> 8 tokens each
    assert a.block_ids[0] == [0, 1] and b.block_ids[0] == [2, 3]
    _step(s)  # token 7 still fits the second block
    assert bm.num_free_blocks == 0 and s.num_preemptions == 0
    _step(s)  # token 8 of each needs a third block: none free -> b (most recent) preempted
    assert b.status is SequenceStatus.WAITING and b.block_ids == () and b.num_computed_tokens == 0
    assert s.num_preemptions == 1 and a.block_ids[0] == [0, 1, 2]
    assert b.num_tokens == 9  # its generated tokens are kept for recompute
    while a.num_tokens < 16:
        _step(s)
    s.finish(a, "length")
    assert bm.num_free_blocks == 4
    out = _step(s)  # b comes back and recomputes all 9 tokens in one step
    assert [(q.request_id, n) for q, n in out.scheduled] == [("b", 9)]


def test_lone_sequence_preempting_itself_does_not_loop():
    bm = full_attention_cache(2, 4)
    s = Scheduler(SchedulerConfig(8, 100, 8, "test"), bm)
    a = _seq("a", 8)
    s.add(a)
    _step(s)
    assert a.num_tokens == 9  # the engine would finish it here (max_model_len 8); the scheduler must not hang
    out = s.schedule()
    assert out.scheduled == [] and out.preempted == [a]
    s.finish(a, "length")
    assert bm.num_free_blocks == 2 and not s.has_unfinished()


def test_finish_frees_waiting_and_running():
    bm = full_attention_cache(10, 4)
    s = Scheduler(SchedulerConfig(1, 100, 40, "test"), bm)
    a, b = _seq("a", 5), _seq("b", 5)
    s.add(a), s.add(b)
    _step(s)
    s.finish(b, "abort")  # still waiting
    s.finish(a, "abort")  # running
    assert bm.num_free_blocks == 10 and not s.has_unfinished()
    assert a.finish_reason == "abort" and b.status is SequenceStatus.FINISHED


def test_worker_state_knows_which_images_a_step_may_still_read():
    from vlm_sdk.multimodal.inputs import ImageInput
    from vlm_sdk.protocol.scheduler_output import NewRequestData
    from vlm_sdk.worker.request_state import RequestState
    im = ImageInput(data=torch.zeros(16, 4), num_tokens=4)
    new = NewRequestData("x", [1] * 12, [], [im, im], [2, 8], None, SamplingParams(), ([0],), 0)
    state = RequestState.from_new(new)
    assert [state.image_end(i) for i in range(2)] == [6, 12]
    assert state.images_needed() == [0, 1]
    state.num_computed_tokens = 6
    assert state.images_needed() == [1]
    state.num_computed_tokens = 12
    assert state.images_needed() == []


def test_micro_batches_leave_out_what_is_in_flight_and_share_the_sequences():
    """Two pipeline micro-batches: a micro-batch takes half the live sequences (rounded up); a sequence whose
    token is on its way is left out of the next one, a prefilling one's next chunk goes into it; the tokens
    landing in launch order bring the decoders back."""
    from vlm_sdk.engine.llm_engine import LLMEngine
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=400,
                                  max_model_len_source="test"), full_attention_cache(100, 4), micro_batches=2)
    a, b, c, d = _seq("a", 4), _seq("b", 4), _seq("c", 4), _seq("d", 100)
    for q in (a, b, c, d):
        s.add(q)

    def launch():
        batch = s.schedule()
        LLMEngine._launched(batch)  # the engine's own bookkeeping at launch
        return [(q.request_id, n) for q, n in batch.scheduled]

    def land(*seqs):  # the engine's postprocess of an older micro-batch: each sampled token arrives
        for q in seqs:
            q.num_inflight -= 1
            q.token_ids.append(7)
    assert launch() == [("a", 4), ("b", 4)]  # 4 live sequences: 2 per micro-batch
    assert (a.num_inflight, b.num_inflight) == (1, 1)
    assert launch() == [("c", 4), ("d", 60)]  # a and b in flight: left out; d's first chunk takes the rest
    assert launch() == [("d", 40)]  # c in flight; d's next chunk follows the one still in the stages
    assert d.num_inflight == 1  # that chunk ends its prompt: it samples
    land(a, b)
    assert launch() == [("a", 1), ("b", 1)]
    land(c)
    assert launch() == [("c", 1)]
