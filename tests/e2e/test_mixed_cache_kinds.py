"""A model mixing full-attention, sliding-window and state layers (vlm_sdk/testing/mixed_cache.py) through
the engine and worker, token for token against a reference that keeps everything and recomputes: with
chunked prefill, preemption, prefix caching on and off (the state checkpoints restored), and n > 1."""
from __future__ import annotations

import pytest

from vlm_sdk import LLM, SamplingParams
from vlm_sdk.multimodal.prompts import TokensPrompt
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk.testing.mixed_cache import KINDS, WINDOW, make_mixed_checkpoint, reference_greedy

FAMILY = "vlm_sdk.testing.mixed_cache"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed_ckpt(tmp_path_factory):
    return make_mixed_checkpoint(tmp_path_factory.mktemp("mixed_cache"))


def _llm(ckpt, **kw):
    kw = {"device": "cpu", "show_progress": False, "model_family": FAMILY, "block_size": 4,
          "allow_unfit_images": True, **kw}  # text prompts only
    return LLM(str(ckpt), **kw)


def _prompt(seed: int, n: int) -> list[int]:
    return [(37 * seed + 11 * j) % 200 + 20 for j in range(n)]


def _reference(llm, ids, max_tokens=GREEDY.max_tokens):
    engine = llm.engine
    prompt = engine.build_prompt(TokensPrompt(tuple(ids)))
    return reference_greedy(local_worker(engine).model, prompt.positions, list(ids), max_tokens)


@pytest.fixture(scope="module")
def cramped(mixed_ckpt):
    """Prefill in chunks of 7 tokens, too few blocks for every request at once (preemption), no caching."""
    return _llm(mixed_ckpt, max_num_batched_tokens=7, num_blocks=40, max_model_len=48,
                enable_prefix_caching=False)


def test_the_groups_are_every_kind(cramped):
    layout = local_worker(cramped.engine).layout
    assert [g.spec.kind for g in layout.groups] == ["sliding_window", "full", "sliding_window", "state"]
    assert [g.layers for g in layout.groups] == [(0,), (2,), (3,), (1, 4)] and layout.group_size == 1
    assert len(KINDS) == 5 and WINDOW < 12  # windows shorter than the prompts: blocks are let go


def test_tokens_equal_the_reference_with_chunks_and_preemption(cramped):
    prompts = [_prompt(i, n) for i, n in enumerate((17, 9, 23, 12))]
    outs = cramped.generate([TokensPrompt(tuple(p)) for p in prompts], GREEDY)
    stats = cramped.stats()
    assert stats["num_preemptions"] > 0  # 4 x 33 tokens over 3 attention groups of 40 blocks of 4
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _reference(cramped, p)
    assert stats["kv_blocks_used"] == 0 and stats["prefix_cache_kinds"]["state"].startswith("off")
    state = next(g for g in stats["cache_groups"] if g["kind"] == "state")
    assert state["slots_used"] == 0 and state["layers"] == 2


def test_prefix_caching_restores_state_checkpoints_and_equals_caching_off(mixed_ckpt, cramped):
    llm = _llm(mixed_ckpt, max_num_batched_tokens=16, num_blocks=96, max_model_len=64)
    base = _prompt(7, 14)
    turn1 = llm.generate([TokensPrompt(tuple(base))], GREEDY)[0].outputs[0].token_ids
    assert turn1 == _reference(llm, base)
    # the same prompt again (a checkpoint at its last block boundary), then a second turn that extends
    # the first (its last boundary, reached while generating), then n = 3 samples of a fresh prompt
    again = llm.generate([TokensPrompt(tuple(base))], GREEDY)[0].outputs[0].token_ids
    turn2_ids = base + turn1 + _prompt(8, 5)
    turn2 = llm.generate([TokensPrompt(tuple(turn2_ids))], GREEDY)[0].outputs[0].token_ids
    stats = llm.stats()
    assert again == turn1 and turn2 == _reference(llm, turn2_ids)
    # turn 2 resumed at least at turn 1's prompt: 12 tokens, then its last generated boundary (20)
    assert stats["prefix_cache_hit_tokens"] >= 12 + 20
    assert stats["prefix_cache_kinds"]["state"].startswith("reuses")
    # what each kind alone could serve; the hit is the shortest (every group must serve it)
    kinds = stats["prefix_cache_kind_hit_tokens"]
    assert set(kinds) == {"sliding_window", "full", "state"} and min(kinds.values()) >= stats["prefix_cache_hit_tokens"]
    fresh = _prompt(9, 10)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    many = llm.generate([TokensPrompt(tuple(fresh))], SamplingParams(n=3, max_tokens=10, temperature=0.0,
                                                                   ignore_eos=True))[0]
    ref = _reference(llm, fresh)
    assert [s.token_ids for s in many.outputs] == [ref] * 3
    # the 2nd and 3rd samples waited a step and restored the first's state after its 8 first tokens
    assert llm.stats()["prefix_cache_hit_tokens"] - hits == 2 * 8
    # sampled, not greedy: caching on and off draw the same tokens (the seed keys each draw)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True)
    on = llm.generate([TokensPrompt(tuple(turn2_ids))], sampled)[0].outputs[0].token_ids
    off = cramped.generate([TokensPrompt(tuple(turn2_ids))], sampled)[0].outputs[0].token_ids
    assert on == off
    state = next(g for g in llm.stats()["cache_groups"] if g["kind"] == "state")
    assert state["slots_used"] == 0 and state["slots_cached"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_scheduling_and_the_decode_graphs_eager_path(mixed_ckpt, async_scheduling):
    """Decode steps through the decode graphs' buffers (capture=False: what a replay reads, run eagerly):
    a slot row per attention group and the state slots staged with the rest. Four requests of one length
    decode together: the captured size 4 (the torch backend on the CPU writes no padding rows)."""
    from vlm_sdk.worker.cuda_graphs import DecodeGraphs
    llm = _llm(mixed_ckpt, max_num_batched_tokens=64, num_blocks=96, max_model_len=48,
               async_scheduling=async_scheduling)
    worker = local_worker(llm.engine)
    runner = worker.runner
    runner.graphs = graphs = DecodeGraphs(worker.model, runner.caches, runner.layout, max_num_seqs=8,
                                          max_model_len=48, block_size=4, device=llm.engine.device,
                                          attention=worker.ops.attention, capture=False)
    assert graphs.slot_mapping.shape[0] == 3 and graphs.state_slots is not None
    staged, real_run = [], graphs.run

    def spy(n):
        staged.append(graphs._host[graphs._turn].numpy()[graphs.row_state, :n].tolist())
        return real_run(n)
    graphs.run = spy
    prompts = [_prompt(20 + i, 9) for i in range(4)]
    outs = llm.generate([TokensPrompt(tuple(p)) for p in prompts], GREEDY)
    assert staged and all(sorted(row) == [0, 1, 2, 3] for row in staged)  # each request's live slot
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _reference(llm, p)


KIND_FAMILIES = {"sliding_window": f"{FAMILY}:WINDOWED", "state": f"{FAMILY}:STATEFUL", "every kind": FAMILY}


@pytest.mark.parametrize("kind", list(KIND_FAMILIES))
@pytest.mark.parametrize("options", [{"kv_cache_memory": 400_000, "max_num_seqs": 8},
                                     {"max_num_seqs": 3, "max_num_batched_tokens": 32}])
def test_plan_equals_engine_for_each_kind(mixed_ckpt, kind, options):
    """Full attention alone is every registered family's (tests/e2e/test_family_capacity.py)."""
    from vlm_sdk.plan import plan
    family = KIND_FAMILIES[kind]
    p = plan(mixed_ckpt, device="cpu", block_size=4, model_family=family, **options)
    llm = _llm(mixed_ckpt, model_family=family, **options)
    r = llm.memory_report
    for key in ("num_blocks", "capacity_tokens", "kv_bytes_per_block", "block_size", "max_model_len",
                "num_state_slots", "state_slot_bytes", "cache_groups", "group_size", "prefix_reuse"):
        assert getattr(p, key) == getattr(r, key), key
    layout, cache = local_worker(llm.engine).layout, llm.engine.cache_config
    # the arithmetic: a block is a page in each of group_size (1) KV tensors; the state slots come first
    assert r.kv_bytes_per_block == layout.block_bytes(4) == 2 * 4 * layout.page_spec.num_kv_heads * \
        layout.page_spec.head_dim * 4
    if layout.has_state:
        assert r.num_state_slots == 2 * llm.engine.args.max_num_seqs  # prefix caching on: twice max_num_seqs
        assert r.state_slot_bytes == sum(s.slot_bytes for s in layout.specs if s.kind == "state")
    if "kv_cache_memory" in options:
        assert r.num_blocks == (400_000 - r.num_state_slots * r.state_slot_bytes) // r.kv_bytes_per_block
    # one sequence of capacity_tokens holds at most the blocks there are, one more token would not fit
    assert cache.blocks_for(r.capacity_tokens) <= r.num_blocks < cache.blocks_for(r.capacity_tokens + 1)
    assert "state slots" in r.format() if layout.has_state else "group 1: sliding window" in r.format()


def test_the_errors_name_what_binds(mixed_ckpt):
    from vlm_sdk.errors import CacheTooSmallError, InputTooLongError, InvalidRequestError
    from vlm_sdk.plan import plan
    stateful = f"{FAMILY}:STATEFUL"
    # the state slots take the room: the refusal names them and num_state_slots
    slot = plan(mixed_ckpt, device="cpu", block_size=4, model_family=stateful).state_slot_bytes
    with pytest.raises(InvalidRequestError, match=r"state slots x .*num_state_slots"):
        _llm(mixed_ckpt, model_family=stateful, kv_cache_memory=128 * slot, max_num_seqs=64)
    # more running requests than state slots: the plan's workload note names num_state_slots
    p = plan(mixed_ckpt, device="cpu", block_size=4, model_family=stateful, max_num_seqs=8, num_state_slots=3,
             prompt_tokens=10, output_tokens=10)
    assert p.max_concurrent_requests == 3 and p.notes[-1].fixes == {"num_state_slots": 8, "max_num_seqs": 3}
    # a prompt too long for the blocks: the fix counts a sequence's blocks in every attention group
    llm = _llm(mixed_ckpt, num_blocks=30, max_num_batched_tokens=16)
    cache = llm.engine.cache_config
    with pytest.raises(InputTooLongError) as e:
        llm.generate([TokensPrompt(tuple(_prompt(1, cache.capacity_tokens + 1)))],
                     SamplingParams(max_tokens=4))
    assert e.value.fixes["num_blocks"] == cache.blocks_for(cache.capacity_tokens + 1 + 4) > 30
    assert "shared by 3 attention groups" in str(e.value)
    # a max_model_len the blocks of every group cannot hold once: refused at start-up, counted over the groups
    with pytest.raises(CacheTooSmallError, match="needs 150 blocks of 4 tokens over its 3 attention groups") as e:
        _llm(mixed_ckpt, num_blocks=30, max_model_len=200)
    # 50 blocks in each of the 3 groups: a prefill chunk of up to 8,192 tokens reads the window before
    # every one of its 200 queries, so a sliding group holds them all too; 30 blocks hold 40 tokens
    assert e.value.fixes == {"max_model_len": 40, "num_blocks": 150}
    # blocks sized from bytes the state slots share: fewer slots is a fix too, and each fix named fits
    sized = {"model_family": stateful, "kv_cache_memory": 400_000, "max_num_seqs": 8, "max_num_batched_tokens": 16}
    llm = _llm(mixed_ckpt, **sized)
    cache = llm.engine.cache_config
    n = cache.capacity_tokens + 1
    with pytest.raises(InputTooLongError) as e:
        llm.generate([TokensPrompt(tuple(_prompt(1, n)))], SamplingParams(max_tokens=4))
    fixes = e.value.fixes
    assert fixes["kv_cache_memory"] == cache.blocks_for(n + 4) * cache.bytes_per_block + cache.state_bytes
    assert 8 <= fixes["num_state_slots"] < cache.num_state_slots == 16
    for key in ("kv_cache_memory", "num_state_slots"):
        fixed = _llm(mixed_ckpt, **{**sized, key: fixes[key]}).engine.cache_config
        assert fixed.capacity_tokens >= n + 4, key
