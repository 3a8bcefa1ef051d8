"""The scheduler's fair waiting queue (engine/core/waiting_queue.py), exact orders: preempted first,
round-robin across requests, no request over its cap; and through the scheduler: one request's 16
sequences do not keep another's out of the next step, and n siblings admitted in one step still share
the first's prompt blocks."""
from vlm_sdk.config import SchedulerConfig
from vlm_sdk.engine.core.block_manager import BlockManager
from vlm_sdk.engine.core.scheduler import Scheduler
from vlm_sdk.engine.core.sequence import Sequence, SequenceStatus
from vlm_sdk.engine.core.waiting_queue import FairWaitingQueue
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.sampling_params import SamplingParams


def _seq(name: str, group=None, n_prompt: int = 3, tokens=None) -> Sequence:
    ids = list(tokens) if tokens is not None else list(range(n_prompt))
    return Sequence(name, PromptInputs(token_ids=ids), SamplingParams(max_tokens=100), group=group)


def _admit_all(q: FairWaitingQueue, running: list | None = None) -> list[str]:
    running = running if running is not None else []
    q.count_running(running)
    order = []
    while (seq := q.peek()) is not None:
        assert q.popleft() is seq
        seq.status = SequenceStatus.RUNNING
        running.append(seq)
        order.append(seq.request_id)
    return order


def test_round_robin_across_requests_each_in_order():
    q = FairWaitingQueue(max_running_per_group=10)
    for name, group in [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("c1", "C"), ("c2", "C")]:
        q.append(_seq(name, group))
    assert len(q) == 6 and [s.request_id for s in q] == ["a1", "b1", "c1", "a2", "c2", "a3"]
    assert _admit_all(q) == ["a1", "b1", "c1", "a2", "c2", "a3"]
    assert not q and len(q) == 0


def test_one_sequence_per_request_is_fifo():
    q = FairWaitingQueue(max_running_per_group=1)
    for i in range(5):
        q.append(_seq(str(i)))  # a group of its own each (the default)
    assert _admit_all(q) == ["0", "1", "2", "3", "4"]


def test_preempted_go_first_last_preempted_at_the_front_whatever_their_group():
    q = FairWaitingQueue(max_running_per_group=1)
    q.append(_seq("a1", "A"))
    q.append(_seq("b1", "B"))
    q.appendleft(_seq("p_old", "A"))  # preempted first (the newest running goes first)...
    q.appendleft(_seq("p_new", "A"))  # ...so the last preempted is the oldest: at the front
    assert [s.request_id for s in q] == ["p_new", "p_old", "a1", "b1"]
    # the preempted resume even past their group's cap; the cap then holds A's waiting one back
    assert _admit_all(q) == ["p_new", "p_old", "b1"]
    assert [s.request_id for s in q] == ["a1"]


def test_a_request_at_its_cap_is_passed_over_until_one_of_its_sequences_ends():
    q = FairWaitingQueue(max_running_per_group=2)
    for i in range(5):
        q.append(_seq(f"a{i}", "A"))
    running: list = []
    assert _admit_all(q, running) == ["a0", "a1"]  # the cap
    q.append(_seq("b0", "B"))
    assert _admit_all(q, running) == ["b0"]  # another request is not held back by A's queue
    running.remove(next(s for s in running if s.request_id == "a0"))  # one of A's finished
    assert _admit_all(q, running) == ["a2"]
    assert len(q) == 2


def test_remove_from_anywhere():
    q = FairWaitingQueue(max_running_per_group=8)
    seqs = {name: _seq(name, group) for name, group in [("a1", "A"), ("a2", "A"), ("b1", "B")]}
    for s in seqs.values():
        q.append(s)
    p = _seq("p", "B")
    q.appendleft(p)
    q.remove(seqs["a1"])
    q.remove(p)
    q.remove(seqs["b1"])  # B's last: its group leaves the round
    assert len(q) == 1 and _admit_all(q) == ["a2"]


def _step(sched):
    out = sched.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return out


def test_scheduler_admits_another_request_past_a_big_one_and_caps_it_at_three_quarters_of_the_batch():
    """16 sequences of one request, then one of another: FIFO admitted only the big request's first 8
    (max_num_seqs); here the other request's sequence is in the first step, and the big one holds 6."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1000, max_model_len=64,
                                  max_model_len_source="test"), BlockManager(num_blocks=200, block_size=4))
    big = [_seq(f"a{i}", "A") for i in range(16)]
    for seq in big:
        s.add(seq)
    victim = _seq("v", "V")
    s.add(victim)
    out = _step(s)
    assert [q.request_id for q, _ in out.scheduled] == ["a0", "v", "a1", "a2", "a3", "a4", "a5"]
    assert len(s.waiting) == 10 and len(s.running) == 7
    late = _seq("w", "W")
    s.add(late)
    s.finish(big[0], "stop")
    out = _step(s)  # a0's slot goes to A's next (A's turn in the round), the slot kept free to the late one
    assert [q.request_id for q, _ in out.scheduled][-2:] == ["a6", "w"] and len(s.running) == 8


def test_n_siblings_admitted_in_one_step_share_the_first_prompt_blocks():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1000, max_model_len=64,
                                  max_model_len_source="test"),
                  BlockManager(num_blocks=200, block_size=4, enable_prefix_caching=True))
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks
    siblings = [_seq(f"n{i}", "N", tokens=prompt) for i in range(3)]
    other = _seq("o", "O", n_prompt=5)
    for seq in siblings[:1] + [other] + siblings[1:]:
        s.add(seq)
    out = _step(s)
    assert [q.request_id for q, _ in out.scheduled] == ["n0", "o", "n1", "n2"]
    first = siblings[0].block_ids[:4]
    for sib in siblings[1:]:
        assert sib.block_ids[:4] == first and sib.metrics.cached_tokens == 16
