"""Pipeline parallelism through the engine on the CPU (gloo): two stages give the tokens of one rank for
each family whose decoder runs stages, batched with images; PP=2 x TP=2; an uneven partition; chunked
prefill, preemption and prefix caching; the transfers in the order of the schedule; each stage loads only
its own layers; the partition checked with the numbers named. Every engine here runs its default of two
micro-batches in flight (the tests say where they checked that two were); the stages' overlap itself is
measured in tests/executor/test_pp_overlap.py."""
from __future__ import annotations

import pytest

from helpers import image
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.pp_partition import layer_counts, layer_range, parse_partition
from vlm_sdk.testing import make_tiny_checkpoint
from vlm_sdk.testing.pp_hooks import rank_process, stage_transfers

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
STAGED_FAMILIES = ("qwen2_5_vl", "internvl", "qwen3_vl", "qwen3_vl_moe", "gemma3", "qwen3_5", "qwen3_5_moe")
CACHE = {"qwen2_5_vl": {"num_blocks": 18}, "internvl": {"num_blocks": 60, "max_dynamic_patch": 1},
         "qwen3_vl": {"num_blocks": 18}, "qwen3_vl_moe": {"num_blocks": 18}, "gemma3": {"num_blocks": 24},
         # Qwen3.5's 4 tiny layers are [state x 3, full]: stage 0 holds only state layers (no KV at all)
         "qwen3_5": {"num_blocks": 18}, "qwen3_5_moe": {"num_blocks": 18}}


def _conversations() -> list:
    one = [{"role": "user", "content": [{"type": "image", "image": image(64, 48, 1)},
                                        {"type": "text", "text": "What is this?"}]}]
    two = [{"role": "user", "content": [{"type": "image", "image": image(56, 56, 2)},
                                        {"type": "text", "text": "and"},
                                        {"type": "image", "image": image(90, 40, 3)},
                                        {"type": "text", "text": "Compare them."}]}]
    text = [{"role": "user", "content": "Tell me about lakes."}]
    return [one, two, text]


def test_partition_follows_vllms_rule():
    """vLLM's get_pp_indices: even; the remainder to the stages before the last; a given partition as is."""
    assert layer_counts(20, 4) == (5, 5, 5, 5)
    assert layer_counts(5, 2) == (3, 2)
    assert layer_counts(8, 3) == (3, 3, 2)
    assert layer_counts(6, 4) == (1, 2, 2, 1)  # remainder 2 to the two middle stages
    assert [layer_range(20, s, 4, (4, 6, 6, 4)) for s in range(4)] == [(0, 4), (4, 10), (10, 16), (16, 20)]
    assert parse_partition("4,6") == (4, 6)


@pytest.mark.parametrize("partition, stages, words", [
    ((3, 3), 2, "sums to 6 layers but the model has 5"),
    ((5, 0), 2, "at least 1 decoder layer"),
    ((2, 2, 1), 2, "names 3 stages but pipeline_parallel_size is 2"),
])
def test_a_partition_that_does_not_fit_is_refused_with_its_numbers(partition, stages, words):
    with pytest.raises(InvalidRequestError, match=words) as e:
        layer_counts(5, stages, partition)
    assert e.value.param == "pp_layer_partition"
    with pytest.raises(InvalidRequestError, match="not a list of layer counts"):
        parse_partition("4;6")


def test_the_engine_refuses_a_bad_partition_before_any_rank_starts(tiny_ckpt):
    with pytest.raises(InvalidRequestError, match=r"pp_layer_partition=1,2 sums to 3 layers but the model has 2"):
        LLM(tiny_ckpt, show_progress=False, pipeline_parallel_size=2, pp_layer_partition="1,2")
    with pytest.raises(InvalidRequestError, match="pipeline_parallel_size is 1"):
        LLM(tiny_ckpt, show_progress=False, pp_layer_partition="1,1")
    with pytest.raises(InvalidRequestError, match="async_scheduling=True needs one rank") as e:
        LLM(tiny_ckpt, show_progress=False, pipeline_parallel_size=2, async_scheduling=True)
    assert "micro-batches" in str(e.value)  # the pipeline's own overlap is named
    with pytest.raises(InvalidRequestError, match="pipeline_micro_batches=3 exceeds pipeline_parallel_size=2") as e:
        LLM(tiny_ckpt, show_progress=False, pipeline_parallel_size=2, pipeline_micro_batches=3)
    assert e.value.param == "pipeline_micro_batches"


def test_deepstack_layers_stay_on_the_first_stage(tiny_checkpoints):
    """Qwen3-VL adds DeepStack features after its first 2 layers: a first stage of 1 layer is refused."""
    with pytest.raises(InvalidRequestError, match="first pipeline stage holds 1 decoder layers but DeepStack adds "
                                                  "vision features after the first 2") as e:
        LLM(tiny_checkpoints("qwen3_vl"), show_progress=False, pipeline_parallel_size=2, pp_layer_partition="1,2")
    assert e.value.param == "pipeline_parallel_size"


@pytest.mark.parametrize("family", STAGED_FAMILIES)
def test_two_stages_give_the_tokens_of_one(family, tiny_checkpoints):
    """Text, one image and two images, batched, on two stages: the greedy tokens of one rank; each stage
    holds its own layers only, and lets go of every request."""
    ckpt = tiny_checkpoints(family)
    convs = _conversations()
    want = [o.token_ids for o in LLM(ckpt, show_progress=False, **CACHE[family]).chat(convs, GREEDY)]
    with LLM(ckpt, show_progress=False, pipeline_parallel_size=2, **CACHE[family]) as two:
        assert [o.token_ids for o in two.chat(convs, GREEDY)] == want
        ranks = two.engine.executor.collective_rpc(rank_process)
        layers = [r[3] for r in ranks]
        assert [r[:2] for r in ranks] == [(0, 0), (1, 1)] and layers[0][0] == 0 and layers[0][1] == layers[1][0]
        assert two.engine.executor.collective_rpc("held_state") == [(0, 0), (0, 0)]
        assert two.stats()["kv_blocks_used"] == 0
        assert two.engine.executor._stage_queue.peak == 2  # two micro-batches were in the stages at once


def test_transfers_follow_the_schedule(tiny_ckpt):
    """Every step with tokens: stage 0 sends once, stage 1 receives once, the same token count, in the
    engine's step order; nothing else crosses (a transfer out of order or on the side would show here)."""
    with LLM(tiny_ckpt, show_progress=False, pipeline_parallel_size=2, num_blocks=40,
             max_num_batched_tokens=64) as two:
        two.chat(_conversations(), GREEDY)
        first, last = two.engine.executor.collective_rpc(stage_transfers)
        assert two.engine.executor._stage_queue.peak == 2  # with two micro-batches in flight
    assert first and [op for _, op, _, _ in first] == ["send"] * len(first)
    assert [op for _, op, _, _ in last] == ["recv"] * len(last)
    assert [(step, n) for step, _, _, n in first] == [(step, n) for step, _, _, n in last]
    assert [step for step, *_ in first] == list(range(len(first)))  # one transfer per step, none skipped
    assert {peer for _, _, peer, _ in first} == {1} and {peer for _, _, peer, _ in last} == {0}
    assert max(n for *_, n in first) <= 64  # chunked prefill: a step never carries more than its budget


def test_uneven_partition_chunked_prefill_preemption_and_prefix_caching(tmp_path_factory):
    """Three layers split 1 + 2: a small cache that preempts, 32-token chunks, a prompt repeated so its
    prefix is cached: the tokens of one rank, with two micro-batches in flight and with the stages taking
    turns (pipeline_micro_batches=1: one step at a time, nothing in flight while the next is scheduled)."""
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("pp3"), "qwen2_5_vl", num_layers=3)
    convs = _conversations() * 3
    params = [SamplingParams(max_tokens=30 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(len(convs))]
    kw = dict(show_progress=False, num_blocks=18, max_num_batched_tokens=32)
    want = [o.token_ids for o in LLM(ckpt, **kw).chat(convs, params)]
    with LLM(ckpt, pipeline_parallel_size=2, pp_layer_partition="1,2", **kw) as two:
        assert [o.token_ids for o in two.chat(convs, params)] == want
        stats = two.stats()
        assert stats["num_preemptions"] > 0, "the batch was meant to preempt"
        assert stats["prefix_cache_hit_tokens"] > 0, "the repeated prompts were meant to hit the prefix cache"
        assert [r[3] for r in two.engine.executor.collective_rpc(rank_process)] == [(0, 1), (1, 3)]
        report = two.memory_report
        # stage 0 keeps one layer's KV per block, stage 1 two: the report is rank 0's
        assert report.ranks[0].num_blocks_possible == report.ranks[1].num_blocks_possible == 18
        assert two.engine.executor._stage_queue.peak == 2
    with LLM(ckpt, pipeline_parallel_size=2, pp_layer_partition="1,2", pipeline_micro_batches=1, **kw) as turns:
        assert [o.token_ids for o in turns.chat(convs, params)] == want
        assert turns.stats()["num_preemptions"] > 0
        assert turns.engine.executor._stage_queue.peak == 1


def test_two_stages_of_two_ranks(tiny_ckpt):
    """PP=2 x TP=2 (four ranks, stage-major): the tokens of one rank."""
    convs = _conversations()
    want = [o.token_ids for o in LLM(tiny_ckpt, show_progress=False, num_blocks=40).chat(convs, GREEDY)]
    with LLM(tiny_ckpt, show_progress=False, pipeline_parallel_size=2, tensor_parallel_size=2,
             num_blocks=40) as four:
        assert [o.token_ids for o in four.chat(convs, GREEDY)] == want
        assert [r[1] for r in four.engine.executor.collective_rpc(rank_process)] == [0, 0, 1, 1]


def test_a_killed_stage_fails_every_request_and_leaves_no_rank(tiny_ckpt):
    """Stage 1's process killed while three streams run: each fails with EngineDeadError naming the stage,
    the rank, its pid and node; the engine is dead and no rank process is left."""
    import asyncio
    import os
    import signal
    import socket
    import time

    from vlm_sdk import AsyncLLM
    from vlm_sdk.errors import EngineDeadError
    long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)

    async def main():
        async with AsyncLLM(tiny_ckpt, show_progress=False, pipeline_parallel_size=2, num_blocks=400,
                            max_model_len=2048) as engine:
            pid = engine.engine.executor.collective_rpc(rank_process)[1][2]
            started = asyncio.Event()

            async def stream(conv):
                async for _ in engine.chat_stream(conv, long):
                    started.set()
            tasks = [asyncio.create_task(stream(c)) for c in _conversations()]
            await started.wait()
            while engine.engine.executor._stage_queue.peak < 2:  # killed with two micro-batches in flight
                await asyncio.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            errors = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)
            # the streams fail first; the dead engine's requests are finished right after (async_llm.py)
            for _ in range(100):
                if engine.stats()["kv_blocks_used"] == 0:
                    break
                await asyncio.sleep(0.05)
            return pid, errors, engine.stats()

    pid, errors, stats = asyncio.run(main())
    assert all(isinstance(e, EngineDeadError) for e in errors), errors
    for e in errors:
        assert f"pipeline stage 1 (tensor-parallel rank 0, rank 1, pid {pid} on node {socket.gethostname()})" in str(e)
    assert (stats["num_running"], stats["num_waiting"], stats["kv_blocks_used"]) == (0, 0, 0), stats
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1][:3]:
        assert time.monotonic() < deadline, f"rank process {pid} still running"
        time.sleep(0.1)


@pytest.mark.parametrize("family, partition", [("qwen2_5_vl", None), ("qwen3_5", "3,1")])
def test_plan_equals_the_engine_per_stage(family, partition, tiny_checkpoints):
    """`plan(pp=2)` gives each stage's weights, KV share of a block and the blocks it could hold, as the
    engine's start-up report shows them (the CPU default cache, sized per stage); Qwen3.5 3 + 1: stage 0
    holds only state layers (no KV), stage 1 the attention layer."""
    from vlm_sdk.plan import plan
    ckpt = tiny_checkpoints(family)
    kw = dict(max_model_len=512, max_num_seqs=4)
    with LLM(ckpt, show_progress=False, pipeline_parallel_size=2, pp_layer_partition=partition, **kw) as two:
        report = two.memory_report
        engine_blocks = two.engine.cache_config.num_blocks
    planned = plan(ckpt, device="cpu", pp=2, pp_layer_partition=partition, **kw)
    assert [(s.layers, s.weights_bytes, s.kv_bytes_per_block, s.num_blocks_possible) for s in planned.stages] == \
        [(r.layers, r.weights_bytes, r.kv_bytes_per_block, r.num_blocks_possible) for r in report.ranks]
    assert planned.num_blocks == engine_blocks
    assert planned.balanced_partition is not None and sum(planned.balanced_partition) == planned.num_layers
    if family == "qwen3_5":
        assert planned.stages[0].kv_bytes_per_block == 0 < planned.stages[1].kv_bytes_per_block
