"""Asynchronous scheduling (`async_scheduling=True`): step t+1 is scheduled and launched before step
t's tokens are read, its decode ids taken from the device. On the CPU a step's work is done when it
returns, so these tests check the bookkeeping, not the overlap: every token, logprob and finish
reason equals the synchronous engine's (itself checked against transformers elsewhere), through
preemption, chunked prefill, prefix caching, the graphs' input path, stops, aborts, structured
outputs and penalties; the extra token of a finishing request is never emitted; no block or worker
state is left behind."""
import asyncio
import json
import math

import pytest

from helpers import conversations
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk import LLM, AsyncLLM, SamplingParams
from vlm_sdk.config import EngineArgs
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.worker.cuda_graphs import DecodeGraphs

CONVS = list(conversations().values())


def mixed_params(n: int = 4) -> list[SamplingParams]:
    """Greedy, seeded with logprobs, a short one, and temperature without a seed (the engine's stream)."""
    kinds = [SamplingParams(max_tokens=20, temperature=0.0),
             SamplingParams(max_tokens=17, temperature=0.8, seed=3, logprobs=2),
             SamplingParams(max_tokens=5, temperature=0.0, logprobs=0),
             SamplingParams(max_tokens=23, temperature=1.0, top_p=0.9, seed=11)]
    return [kinds[i % len(kinds)] for i in range(n)]


def run(ckpt, params, convs=CONVS, **kw):
    llm = LLM(ckpt, show_progress=False, **kw)
    outs = llm.chat(convs, params)
    return llm, outs


def assert_same(outs, ref):
    for o, r in zip(outs, ref, strict=True):
        assert o.token_ids == r.token_ids and o.finish_reason == r.finish_reason and o.text == r.text
        if r.logprobs is not None:
            for a, b in zip(o.logprobs, r.logprobs, strict=True):
                assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, rel_tol=1e-5, abs_tol=1e-5)
                assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def assert_clean(llm):
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert llm.engine.executor.collective_rpc("held_state")[0] == (0, 0)
    assert llm.engine._inflight is None


def count_device_ids(llm) -> list[int]:
    """Spy: how many step inputs took their id from the device (the token not yet read)."""
    runner, seen = local_worker(llm.engine).runner, [0]
    real = runner._token_source

    def spy(state):
        seen[0] += 1
        return real(state)
    runner._token_source = spy
    return seen


def test_async_equals_sync_on_every_family(family_ckpt):
    ckpt = family_ckpt[1]
    sync_llm, ref = run(ckpt, mixed_params(), async_scheduling=False)
    assert not sync_llm.engine.async_scheduling
    llm = LLM(ckpt, show_progress=False, async_scheduling=True)
    device_ids = count_device_ids(llm)
    outs = llm.chat(CONVS, mixed_params())
    assert llm.engine.async_scheduling and local_worker(llm.engine).runner.keep_sampled
    assert device_ids[0] > 0  # decode steps really read ids that had not reached the host
    assert_same(outs, ref)
    assert [len(o.token_ids) for o in outs] == [20, 17, 5, 23] or any(o.finish_reason == "stop" for o in outs)
    assert llm.stats()["total_generation_tokens"] == sum(len(o.token_ids) for o in outs)  # no extra token counted
    assert_clean(llm)


def test_one_step_in_flight_and_the_extra_token_dropped(tiny_ckpt):
    """The engine's own view: after a step the next is launched with the last token on the device;
    a request that finishes has one token computed past its end, never emitted."""
    llm = LLM(tiny_ckpt, show_progress=False, async_scheduling=True)
    eng = llm.engine
    prompt = eng.inputs.build_prompt(CONVS[0])
    rid = eng.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    seq = eng.requests[rid]
    assert eng.step() == []  # the prefill is launched; nothing read yet
    assert seq.num_inflight == 1 and seq.num_tokens == seq.num_prompt_tokens
    outs = eng.step()  # decode 1 launched with token 0 on the device, prefill read
    assert [o.new_token_ids for o in outs] == [[seq.token_ids[-1]]] and seq.num_inflight == 1
    assert seq.num_computed_tokens == seq.num_tokens  # it computes the token it has not read
    emitted = [t for o in outs for t in o.new_token_ids]
    while eng.has_unfinished():
        emitted += [t for o in eng.step() for t in o.new_token_ids]
    assert emitted == seq.output_token_ids and len(emitted) == 3 and seq.finish_reason == "length"
    # max_tokens was certain once the third token was on its way: no step computed past it
    assert seq.num_computed_tokens == seq.num_prompt_tokens + 2
    assert_clean(llm)


def test_stop_token_finishes_and_drops_what_was_launched(tiny_ckpt):
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    _, free = run(tiny_ckpt, [greedy] * 2, CONVS[:2], async_scheduling=False)
    stop_at = free[0].token_ids[6]
    first = free[0].token_ids.index(stop_at)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at]), greedy]
    _, ref = run(tiny_ckpt, params, CONVS[:2], async_scheduling=False)
    llm, outs = run(tiny_ckpt, params, CONVS[:2], async_scheduling=True)
    assert_same(outs, ref)
    assert outs[0].finish_reason == "stop" and outs[0].token_ids == free[0].token_ids[:first + 1]
    assert_clean(llm)


def test_preemption_chunked_prefill_and_small_batches(family_ckpt):
    """Preemption while a token is on its way, chunked prefill beside decodes (eager steps mixing
    device ids and prompt chunks), more requests than max_num_seqs."""
    ckpt = family_ckpt[1]
    convs = CONVS * 2
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=26, temperature=0.7, seed=5)] * 4
    # against the synchronous engine unconstrained: preemption and chunking change no token there
    # (tests/e2e/test_prefix_caching.py, test_families.py), so this is the synchronous engine's answer
    sync, free = run(ckpt, params, convs, async_scheduling=False)
    # the longest sequence's blocks, in every cache group (tokens / 16 for one full-attention group), and
    # a block more in each group that grows
    blocks_for = sync.engine.cache_config.blocks_for
    need = max(blocks_for(len(o.prompt_token_ids) + 30) for o in free)
    kw = dict(num_blocks=blocks_for(max(len(o.prompt_token_ids) for o in free) + 30 + 32),
              allow_unfit_images=True, max_num_batched_tokens=40, max_num_seqs=3)
    assert kw["num_blocks"] >= need
    llm = LLM(ckpt, show_progress=False, async_scheduling=True, **kw)
    device_ids = count_device_ids(llm)
    outs = llm.chat(convs, params)
    assert llm.stats()["num_preemptions"] > 0 and device_ids[0] > 0
    assert_same(outs, free)
    assert_clean(llm)


def test_prefix_caching_hashes_only_arrived_tokens(tiny_ckpt):
    """Blocks a decode step fills hold a token still on the device: they are offered to the cache
    once it has arrived, and a later request sharing the whole conversation so far hits them."""
    params = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
    results = {}
    for mode in (False, True):
        llm = LLM(tiny_ckpt, show_progress=False, async_scheduling=mode, block_size=4)
        first = llm.chat(CONVS[0], params)[0]
        follow = CONVS[0] + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "More."}]
        second = llm.chat(follow, params)[0]
        results[mode] = (first.token_ids, second.token_ids, llm.stats()["prefix_cache_hit_tokens"])
        assert_clean(llm)
    assert results[True] == results[False] and results[True][2] > 0


def test_decode_graph_inputs_take_ids_from_the_device(tiny_ckpt):
    """The graphs' input path (`DecodeGraphs(capture=False)`: the buffers a replay reads): decode rows
    whose token is on the device carry its row in `token_src`, picked inside the graph."""
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.9, seed=7)] * 2
    _, ref = run(tiny_ckpt, params, CONVS, async_scheduling=False)
    llm = LLM(tiny_ckpt, show_progress=False, async_scheduling=True, block_size=4)
    eng, runner = llm.engine, local_worker(llm.engine).runner
    graphs = DecodeGraphs(local_worker(eng).model, runner.caches, runner.layout, max_num_seqs=8, max_model_len=eng.scheduler_config.max_model_len,
                          block_size=4, device=eng.device, attention=local_worker(eng).ops.attention, capture=False)
    runner.graphs = graphs
    sources = []
    real_run = graphs.run

    def spy(n):
        sources.append(graphs._host[graphs._turn].numpy()[graphs.row_src, :n].tolist())
        return real_run(n)
    graphs.run = spy
    outs = llm.chat(CONVS, params)
    assert_same(outs, ref)
    assert sources and any(all(s >= 0 for s in row) for row in sources)  # whole steps fed from the device
    assert_clean(llm)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_graph_steps_take_the_graphs_argmax_without_the_sampler(tiny_ckpt, async_scheduling):
    """The decode graphs end with the logits and their argmax: a step whose held requests are all
    greedy reads its tokens there (no sampler call, no copy into the next step's id buffer); once a
    request samples, every graph step goes through the sampler on the graphs' logits. Tokens equal the
    synchronous engine without graphs either way."""
    # four requests: the captured size 4 exactly (the torch backend on the CPU writes no padding rows)
    greedy = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 4
    mixed = greedy[:3] + [SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True)]
    refs = {name: run(tiny_ckpt, params, CONVS[:4], async_scheduling=False)[1]
            for name, params in (("greedy", greedy), ("mixed", mixed))}
    llm = LLM(tiny_ckpt, show_progress=False, async_scheduling=async_scheduling, block_size=4)
    eng, runner = llm.engine, local_worker(llm.engine).runner
    runner.graphs = DecodeGraphs(local_worker(eng).model, runner.caches, runner.layout, max_num_seqs=8,
                                 max_model_len=eng.scheduler_config.max_model_len, block_size=4, device=eng.device,
                                 attention=local_worker(eng).ops.attention, capture=False)
    calls = {"graph": 0, "sampler": 0, "keep": 0}
    for name, owner, attr in (("graph", runner.graphs, "run"), ("sampler", runner.sampler, "sample_on_device"),
                              ("keep", runner, "_keep")):
        def counted(*a, _real=getattr(owner, attr), _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        setattr(owner, attr, counted)
    assert_same(llm.chat(CONVS[:4], greedy), refs["greedy"])
    # the prompts' steps sample (and keep) through the sampler; every graph step skipped both
    prefill_steps = calls["sampler"]
    assert calls["graph"] >= 8 and prefill_steps <= 4 and calls["keep"] <= (prefill_steps if async_scheduling else 0)
    calls.update(graph=0, sampler=0, keep=0)
    assert_same(llm.chat(CONVS[:4], mixed), refs["mixed"])
    assert calls["graph"] >= 6 and calls["sampler"] >= calls["graph"]
    assert_clean(llm)


def test_grammar_and_penalty_steps_are_read_at_once(tiny_ckpt):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    params = [SamplingParams(temperature=1.0, seed=2, max_tokens=40, response_format={
                  "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}),
              SamplingParams(temperature=0.9, seed=4, max_tokens=15, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=15, min_tokens=6, stop_token_ids=[1, 2, 3]),
              SamplingParams(temperature=0.0, max_tokens=18)]
    _, ref = run(tiny_ckpt, params, CONVS, async_scheduling=False)
    llm = LLM(tiny_ckpt, show_progress=False, async_scheduling=True)
    reads = []
    real = llm.engine._read_inflight

    def spy():
        reads.append(llm.engine._inflight[0])
        return real()
    llm.engine._read_inflight = spy
    outs = llm.chat(CONVS, params)
    assert_same(outs, ref)
    assert json.loads(outs[0].text).keys() == {"n"}
    assert len(outs[2].token_ids) >= 6
    assert_clean(llm)
    assert reads  # every step was read; those sampling a bound request before the next was scheduled


def test_aborts_and_streams_with_async_llm(tiny_ckpt):
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)

    async def main():
        async with AsyncLLM(tiny_ckpt, show_progress=False, async_scheduling=True) as engine:
            async def quitter():
                seen = 0
                async for _ in engine.chat_stream(CONVS[1], long, request_id="quitter"):
                    seen += 1
                    if seen == 4:
                        break
                return seen
            full, seen = await asyncio.gather(engine.chat(CONVS[0], long), quitter())
            for _ in range(200):
                if not engine.engine.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            return full, seen, engine.engine
    full, seen, eng = asyncio.run(main())
    assert seen == 4 and len(full.token_ids) == 60
    _, ref = run(tiny_ckpt, [long], [CONVS[0]], async_scheduling=False)
    assert full.token_ids == ref[0].token_ids
    assert eng.cache.num_used_blocks == 0


def test_max_model_len_is_never_passed(tiny_ckpt):
    """A request running to max_model_len stops there: the step that would compute past it is not
    scheduled while the last token is on its way."""
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    _, ref = run(tiny_ckpt, [params], [CONVS[0]], async_scheduling=False, max_model_len=80, allow_unfit_images=True)
    llm, outs = run(tiny_ckpt, [params], [CONVS[0]], async_scheduling=True, max_model_len=80, allow_unfit_images=True)
    assert_same(outs, ref)
    assert outs[0].finish_reason == "length" and len(outs[0].prompt_token_ids) + len(outs[0].token_ids) == 80
    assert_clean(llm)


def test_refused_with_tensor_parallelism_before_any_rank_starts(tiny_ckpt):
    with pytest.raises(InvalidRequestError, match="async_scheduling=True needs tensor_parallel_size=1"):
        LLM(tiny_ckpt, tensor_parallel_size=2, async_scheduling=True, show_progress=False)


def test_the_setting():
    cpu = EngineArgs().resolve_device()
    assert EngineArgs().resolve_async_scheduling(cpu, 1) is False  # nothing to overlap on the CPU
    assert EngineArgs(async_scheduling=True).resolve_async_scheduling(cpu, 1) is True
    import torch
    assert EngineArgs().resolve_async_scheduling(torch.device("cuda", 0), 1) is True
    assert EngineArgs().resolve_async_scheduling(torch.device("cuda", 0), 2) is False
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size=1") as e:
        EngineArgs(async_scheduling=True).resolve_async_scheduling(cpu, 2)
    assert e.value.param == "async_scheduling"
    with pytest.raises(InvalidRequestError, match="async_scheduling must be"):
        EngineArgs(async_scheduling="yes").validate()
    from vlm_sdk.server.cli import add_engine_flags, engine_kwargs
    import argparse
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_kwargs(p.parse_args(["--async-scheduling"]))["async_scheduling"] is True
    assert engine_kwargs(p.parse_args(["--no-async-scheduling"]))["async_scheduling"] is False
    assert "async_scheduling" not in engine_kwargs(p.parse_args([]))
