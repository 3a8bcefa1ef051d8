"""Speculative decoding's engine side on fake sequences: speculative_config's checks, the n-gram proposer
(vLLM's rule), 1 + k tokens scheduled with their blocks, and the rollback of rejected drafts (exact block
ids and free counts, the worker's truncation, nothing cached past the known tokens)."""
import pytest

from helpers import full_attention_cache

from vlm_sdk.config import EngineArgs, SchedulerConfig
from vlm_sdk.engine.core.ngram_proposer import propose_ngram
from vlm_sdk.engine.core.scheduler import Scheduler
from vlm_sdk.engine.core.sequence import Sequence
from vlm_sdk.engine.core.spec_decode import SpecDecoder, rollback
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.spec_config import SpeculativeConfig, parse_speculative_config

A, B, C, D, X = 1, 2, 3, 4, 5


def test_the_config_takes_vllms_fields_and_json():
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert c == SpeculativeConfig("ngram", 4, None, 3, 3)  # one bound given: the other takes its value
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}').prompt_lookup_min == 5
    args = EngineArgs.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                      "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    assert args.speculative_config == SpeculativeConfig("ngram", 2, None, 2, 4)
    import pickle
    assert pickle.loads(pickle.dumps(args)).speculative_config == args.speculative_config  # ranks receive it


@pytest.mark.parametrize("value, words", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "not one of ['ngram', 'eagle3', 'mtp']"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "needs 'model': the draft checkpoint's directory"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "not built yet"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in 1..16"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no draft model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 is above prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown field(s) ['lookahead']"),
    ("{method: ngram}", "is not JSON"),
])
def test_bad_configs_are_refused_naming_the_field(value, words):
    with pytest.raises(InvalidRequestError, match=words.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")) as e:
        EngineArgs.from_kwargs(speculative_config=value)
    assert e.value.param == "speculative_config"


def test_what_does_not_compose_is_refused_at_resolution():
    from vlm_sdk.config import resolve_rank_config
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(InvalidRequestError, match="async_scheduling=True does not compose"):
        resolve_rank_config(EngineArgs.from_kwargs(device="cpu", speculative_config=spec, async_scheduling=True))
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size=2 is not built yet"):
        resolve_rank_config(EngineArgs.from_kwargs(device="cpu", speculative_config=spec, tensor_parallel_size=2))
    assert resolve_rank_config(EngineArgs.from_kwargs(device="cpu", speculative_config=spec)).async_scheduling is False
    eagle = {"method": "eagle3", "num_speculative_tokens": 2, "model": "draft"}
    with pytest.raises(InvalidRequestError, match="piecewise_cuda_graphs=True does not compose") as e:
        resolve_rank_config(EngineArgs.from_kwargs(device="cpu", speculative_config=eagle, piecewise_cuda_graphs=True))
    assert e.value.param == "piecewise_cuda_graphs"


def test_ngram_takes_the_longest_earliest_match():
    assert propose_ngram([A, B, C, D, A, B, C], 2, 3, 2) == [D, A]  # "A B C" at 0
    assert propose_ngram([A, B, X, A, B], 2, 3, 2) == [X, A]  # "X A B" nowhere else; "A B" at 0
    assert propose_ngram([A, B, C, A, B, D, A, B], 2, 2, 1) == [C]  # two matches of "A B": the earliest
    assert propose_ngram([A, B, C, D], 1, 3, 4) == []  # no repeat
    assert propose_ngram([A, B, C, A, B], 3, 4, 2) == []  # only "A B" repeats: shorter than min
    assert propose_ngram([C, A, B, C, A], 1, 2, 5) == [B, C, A]  # fewer than k follow the match


def _seq(name, tokens, max_tokens=100, **params):
    return Sequence(name, PromptInputs(token_ids=list(tokens)), SamplingParams(max_tokens=max_tokens, **params))


def _scheduler(num_blocks=20, block_size=4, budget=64, caching=False):
    cache = full_attention_cache(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=400,
                                     max_model_len_source="test"), cache), cache


def _launch(batch):
    for seq, n in batch.scheduled:
        seq.num_computed_tokens += n


def test_drafts_are_scheduled_then_rolled_back_with_exact_blocks():
    s, cache = _scheduler()
    spec = SpecDecoder(SpeculativeConfig("ngram", 4, None, 1, 2))
    seq = _seq("a", [A, B, C, D, A, B])  # 6 tokens
    s.add(seq)
    batch = s.schedule()
    s.worker_input(batch)  # the worker holds it now, with blocks [0, 1]
    _launch(batch)
    seq.token_ids.append(C)  # sampled: 7 tokens, 6 computed
    assert seq.block_ids[0] == [0, 1] and cache.num_free_blocks == 18 and seq.num_blocks_sent == 2
    spec.propose(s.running)
    assert seq.spec_token_ids == [D, A, B, C]  # "B C" (the longest repeat, at 1) -> D A B C
    batch = s.schedule()
    assert batch.scheduled == [(seq, 5)]  # its last token + 4 drafts: tokens 6..10
    assert seq.block_ids[0] == [0, 1, 2] and cache.num_free_blocks == 17
    work = s.worker_input(batch)
    assert work.spec_token_ids == {"a": [D, A, B, C]} and work.num_scheduled_tokens == {"a": 5}
    assert work.cached_requests[0].new_block_ids == ([2],)
    _launch(batch)
    # the target accepted D, rejected A: tokens D + its correction X -> 9 tokens, 8 computed
    seq.token_ids += [D, X]
    rollback(seq, cache, s.truncated)
    assert seq.num_computed_tokens == 8 and seq.spec_token_ids == []
    assert seq.block_ids[0] == [0, 1, 2] and cache.num_free_blocks == 17  # 9 tokens still need 3 blocks
    # a longer rejection: drafts for tokens 9..12 take block 3, then none is accepted
    spec.propose(s.running)
    seq.spec_token_ids = [A, A, A, A]
    batch = s.schedule()
    assert batch.scheduled == [(seq, 5)] and seq.block_ids[0] == [0, 1, 2, 3] and cache.num_free_blocks == 16
    work = s.worker_input(batch)
    assert work.cached_requests[0].new_block_ids == ([3],) and seq.num_blocks_sent == 4
    _launch(batch)
    seq.token_ids.append(B)  # only the correction: 10 tokens, 9 computed
    rollback(seq, cache, s.truncated)
    assert seq.num_computed_tokens == 9 and seq.block_ids[0] == [0, 1, 2] and cache.num_free_blocks == 17
    assert cache.pool.ref_count[3] == 0 and seq.num_blocks_sent == 3
    work = s.worker_input(s.schedule())  # the worker cuts its table before this step's blocks
    assert work.truncated_blocks == {"a": 3} and work.num_scheduled_tokens == {"a": 1}
    assert s.worker_input(s.schedule()).truncated_blocks == {}  # once


def test_drafts_never_cost_a_preemption_or_pass_the_budget():
    s, cache = _scheduler(num_blocks=3, budget=8)
    seq = _seq("a", [A, B, C, D, A, B, C])  # 7 tokens: blocks 0, 1 after prefill
    s.add(seq)
    _launch(s.schedule())
    s.config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=3, max_model_len=400, max_model_len_source="t")
    seq.token_ids.append(D)
    seq.spec_token_ids = [A, B, C, D]
    batch = s.schedule()  # budget 3: its last token + 2 drafts
    assert batch.scheduled == [(seq, 3)] and seq.spec_token_ids == [A, B] and not batch.preempted
    assert seq.block_ids[0] == [0, 1, 2]
    seq.num_computed_tokens = 7  # as if not launched, its drafts' block given back
    cache.truncate(seq, 2)
    assert cache.num_free_blocks == 1
    other = _seq("b", [X, X, X])
    cache.allocate(other, 3)  # the last free block
    seq.spec_token_ids = [A, B]
    batch = s.schedule()  # tokens 7..9 would need block 2: taken: the drafts go, one token fits block 1
    assert batch.scheduled == [(seq, 1)] and seq.spec_token_ids == [] and not batch.preempted


def test_no_drafts_past_the_length_limit():
    spec = SpecDecoder(SpeculativeConfig("ngram", 4, None, 1, 1))
    near = _seq("a", [A, B, A], max_tokens=3)  # limit 6 tokens
    near.token_ids += [B, A]  # 5 tokens: one more finishes it
    near.num_computed_tokens = 4
    near.status = near.status.RUNNING
    prefill = _seq("b", [A, B, A, B])
    prefill.num_computed_tokens = 2  # still in its prompt: no drafts
    free = _seq("c", [A, B, A, B])
    free.num_computed_tokens = 3
    spec.propose([near, prefill, free])
    assert near.spec_token_ids == [] and prefill.spec_token_ids == [] and free.spec_token_ids == [A, B]
    near.token_ids.pop()
    near.num_computed_tokens = 3  # 4 tokens: 1 + 1 draft reach the limit of 6
    spec.propose([near])
    assert near.spec_token_ids == [A]  # "B" first at 1: A follows; one draft only


def test_rollback_caches_only_blocks_of_known_tokens():
    s, cache = _scheduler(caching=True)
    seq = _seq("a", [A, B, C, D, A, B, C])  # 7 tokens
    s.add(seq)
    _launch(s.schedule())  # prefill 7: block 0 full and cached
    seq.token_ids.append(D)  # 8 tokens
    seq.spec_token_ids = [A, B, C, D, A]  # tokens 8..12 would fill block 2 with drafts
    batch = s.schedule()
    assert batch.scheduled == [(seq, 6)] and len(seq.block_ids[0]) == 4
    assert seq.num_cached_blocks == 2  # block 1 (tokens 4..7, all known) cached; no block of drafts
    _launch(batch)
    seq.token_ids += [A, X]  # one draft accepted: 10 tokens
    rollback(seq, cache, s.truncated)
    assert len(seq.block_ids[0]) == 3 and seq.num_cached_blocks == 2
    assert sum(h is not None for h in cache.pool.block_hash) == 2


def _state_scheduler(slots, max_num_seqs=2, caching=False):
    from vlm_sdk.engine.core.cache_coordinator import CacheCoordinator
    from vlm_sdk.protocol.cache_layout import CacheLayout
    from vlm_sdk.protocol.cache_spec import AttentionSpec, StateSpec, StateTensor
    state = StateSpec((StateTensor("recurrent", (2, 4, 4), "float32"),), draft_states=True)
    cache = CacheCoordinator(CacheLayout.from_specs([AttentionSpec(1, 4, "float32"), state]), 20, 4, caching, slots)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=400,
                                     max_model_len_source="test"), cache), cache


def test_state_layers_take_a_slot_per_draft_and_keep_the_accepted_ones():
    """A verification on a model with state layers: a free slot per draft (the state after it), then the slot of
    the last accepted position made the live slot, the others back in the pool (exact slot ids), the worker told
    with the next step; every draft accepted keeps the live slot."""
    s, cache = _state_scheduler(slots=6)
    seq = _seq("a", [A, B, C, D, A, B])
    s.add(seq)
    batch = s.schedule()
    assert seq.state_slot == 0 and batch.scheduled == [(seq, 6)]
    s.worker_input(batch)
    _launch(batch)
    seq.token_ids.append(C)  # 7 tokens, 6 computed: rows at 6 (C), 7, 8, 9 (the drafts)
    seq.spec_token_ids = [D, A, B]
    batch = s.schedule()
    assert batch.scheduled == [(seq, 4)] and seq.draft_slots == [1, 2, 3] and seq.draft_start == 6
    assert cache.num_free_slots == 2  # live 0 and three drafts' slots held
    work = s.worker_input(batch)
    assert work.draft_state_slots == {"a": (1, 2, 3)} and work.moved_state_slots == {}
    _launch(batch)
    seq.token_ids += [D, X]  # D accepted, A rejected (X its correction): the state after row 7 (D) is slot 2's
    rollback(seq, cache, s.truncated, s.moved_slots)
    assert seq.num_computed_tokens == 8 and seq.state_slot == 2 and seq.draft_slots == []
    assert cache.num_free_slots == 5 and cache.state_pool.ref_count[:6] == [0, 0, 1, 0, 0, 0]
    seq.spec_token_ids = [A, B]  # every draft accepted next: the live slot already holds the state after them
    batch = s.schedule()
    work = s.worker_input(batch)
    assert work.moved_state_slots == {"a": 2} and work.draft_state_slots == {"a": (3, 1)}  # free ones, front first
    _launch(batch)
    seq.token_ids += [A, B, C]
    rollback(seq, cache, s.truncated, s.moved_slots)
    assert seq.state_slot == 2 and s.moved_slots == {} and cache.num_free_slots == 5
    seq.spec_token_ids = [A]  # none accepted: the state after the last token alone, the first draft's slot
    batch = s.schedule()
    first = seq.draft_slots[0]
    s.worker_input(batch)
    _launch(batch)
    seq.token_ids.append(X)
    rollback(seq, cache, s.truncated, s.moved_slots)
    assert seq.state_slot == first != 2 and s.worker_input(s.schedule()).moved_state_slots == {"a": first}
    s.finish(seq, "stop")
    assert cache.num_free_slots == 6


def test_drafts_never_take_a_state_slot_admission_needs():
    """With max_num_seqs 2 and one running, one free slot stays for a sequence admission may start: a
    sequence with 3 drafts and 3 free slots verifies 2 of them; with none to spare it decodes one token."""
    s, cache = _state_scheduler(slots=4)
    seq = _seq("a", [A, B, C, D])
    s.add(seq)
    _launch(s.schedule())
    seq.token_ids.append(A)
    seq.spec_token_ids = [B, C, D]
    batch = s.schedule()
    assert batch.scheduled == [(seq, 3)] and seq.spec_token_ids == [B, C] and len(seq.draft_slots) == 2
    _launch(batch)
    seq.token_ids += [B, C, D]
    rollback(seq, cache, s.truncated, s.moved_slots)
    s.add(_seq("b", [A, B, C]))
    _launch(s.schedule())  # b admitted on the slot kept for it, a decoding a token: 4 - 2 held = 2 free
    seq.token_ids.append(A)
    seq.spec_token_ids = [A, B, C]
    batch = s.schedule()  # max_num_seqs reached: nothing to keep for admission, both free slots are drafts'
    assert dict(batch.scheduled)[seq] == 3 and len(seq.draft_slots) == 2 and cache.num_free_slots == 0
    _launch(batch)
    seq.token_ids.append(X)
    rollback(seq, cache, s.truncated, s.moved_slots)
    assert cache.num_free_slots == 2
    s.config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=400, max_model_len_source="t")
    seq.spec_token_ids = [A, B]  # room for two more sequences: both free slots kept for them, none for a draft
    assert dict(s.schedule().scheduled)[seq] == 1 and seq.draft_slots == [] and seq.spec_token_ids == []
