"""The dry run (engine/render.py) equals what the engine then does with the same request: token ids, each
cache group's blocks after the first step, the free blocks that step takes, the prefix-cache hit, the
tokens of its first step and the steps to its first token (the vision budget on and off); for
every family (one image request each), text, a video and tools; a request that does not fit lists fixes
that each make it fit once applied."""
import asyncio

import pytest

from helpers import image
from vlm_sdk import LLM, AsyncLLM, SamplingParams
from vlm_sdk.chat_options import ChatOptions
from vlm_sdk.engine.core.cache_managers import NULL_BLOCK
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.multimodal.prompts import TextPrompt
from vlm_sdk.testing.videos import write_video

PARAMS = SamplingParams(max_tokens=5, temperature=0)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _image_request(seed: int = 3) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image(96, 64, seed)},
                                         {"type": "text", "text": "What is in this image?"}]}]


def _held(seq) -> list[int]:
    return [sum(1 for b in blocks if b != NULL_BLOCK) for blocks in seq.block_ids]


def _run_and_compare(llm: LLM, request, params=PARAMS, tools=None):
    """Render, then run the same request: the render's numbers against the engine's after its first step."""
    rendered = llm.render(request, params, tools=tools)
    options = ChatOptions(tools=tools) if tools else None
    assert rendered.fits_now and rendered.fits_ever and rendered.error is None
    engine = llm.engine
    prompt = llm.inputs.build_prompt(request, params, options=options)
    assert rendered.token_ids == prompt.token_ids
    free = engine.cache.num_free_blocks
    rid = engine.add_request(prompt, params)
    seq = engine.requests[rid]
    outs = engine.step()
    steps = 1
    assert seq.metrics.cached_tokens == rendered.prefix_hit_tokens
    assert seq.num_computed_tokens == rendered.prefix_hit_tokens + rendered.first_step_tokens
    assert _held(seq) == [g.prompt_blocks for g in rendered.groups]
    assert free - engine.cache.num_free_blocks == rendered.new_blocks
    most = _held(seq)
    while engine.has_unfinished():  # to its end: no group ever holds more than the render said
        steps += seq.num_computed_tokens < seq.num_prompt_tokens  # this step is still its prompt's
        outs = engine.step() or outs
        if seq.block_ids:
            most = [max(a, b) for a, b in zip(most, _held(seq))]
    assert all(m <= g.blocks for m, g in zip(most, rendered.groups))
    assert steps == rendered.prefill_steps  # the steps to its first token
    assert sum(g.bytes for g in rendered.groups) == rendered.kv_blocks * rendered.bytes_per_block
    return rendered


@pytest.fixture(scope="module")
def family_llm(family_ckpt):
    family, ckpt = family_ckpt
    with LLM(ckpt, num_blocks=1024, block_size=4, allow_unfit_images=True, show_progress=False) as llm:
        yield family, llm


def test_render_equals_the_engine_for_every_family(family_llm):
    family, llm = family_llm
    cold = _run_and_compare(llm, _image_request())
    assert cold.prefix_hit_tokens == 0
    (part,) = cold.images()
    run = cold.token_ids[part.offset:part.offset + part.length]
    assert part.length == part.tokens and len(set(run)) == 1  # one run of the placeholder token
    assert cold.text_tokens + part.tokens == cold.num_tokens and part.hash and part.source_size == (64, 96)
    warm = _run_and_compare(llm, _image_request())  # the same again: its prefix comes from the cache
    assert 0 < warm.prefix_hit_tokens < warm.num_tokens
    llm.engine.release_finished()


def test_n_samples_share_the_prompt_as_the_engine_shares_it(family_llm):
    """n = 3: the later samples' hit, the blocks each takes at its start and holds, the request's blocks
    together at their peak (distinct block ids over its sequences) and its state slots, against the engine
    running the 3 sequences as LLM / AsyncLLM add them (one group, params.sample(i))."""
    family, llm = family_llm
    params = SamplingParams(n=3, max_tokens=5, temperature=0.8, seed=1, ignore_eos=True)
    request = _image_request(11)  # an image no earlier test cached
    rendered = llm.render(request, params)
    engine = llm.engine
    assert rendered.n == 3 and rendered.fits_now and rendered.sample_hit_tokens > 0
    prompt = llm.inputs.build_prompt(request, params)
    seqs = [engine.requests[engine.add_request(prompt, params.sample(i), group="n3")] for i in range(3)]
    free = engine.cache.num_free_blocks
    started: dict[int, list[int]] = {}  # sample -> its blocks per group at its first step
    seen = {"peak": 0, "slots": 0, "first": None}
    schedule = engine.scheduler.schedule

    def watched():  # the blocks held as each step is scheduled (a step that finishes them frees its last at once)
        batch = schedule()
        if seen["first"] is None:
            seen["first"] = free - engine.cache.num_free_blocks
        for i, seq in enumerate(seqs):
            if seq.block_ids and i not in started:
                started[i] = _held(seq)
        held = {b for seq in seqs for blocks in seq.block_ids for b in blocks if b != NULL_BLOCK}
        seen["peak"] = max(seen["peak"], len(held))
        seen["slots"] = max(seen["slots"], sum(1 for seq in seqs if seq.state_slot >= 0))
        return batch
    engine.scheduler.schedule = watched
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        del engine.scheduler.schedule
    peak, slots, first_step = seen["peak"], seen["slots"], seen["first"]
    assert [seq.metrics.cached_tokens for seq in seqs] == [rendered.prefix_hit_tokens] + [rendered.sample_hit_tokens] * 2
    later = [g.shared + rendered.sample_new_blocks // len(rendered.groups) for g in rendered.groups]
    assert started[0] == [g.prompt_blocks for g in rendered.groups] and started[1] == started[2] == later
    windowed = any(g.window is not None for g in rendered.groups)  # a window's blocks: the render's bound
    assert (peak == rendered.kv_blocks) if not windowed else (peak <= rendered.kv_blocks), (peak, rendered.groups)
    assert slots == rendered.state_slots == (3 if rendered.free_state_slots is not None else 0)
    if not llm.engine.cache.aligned:  # all three start in the first step (a state model's later ones wait for
        assert first_step == rendered.all_new_blocks  # the first's checkpoint)
    engine.release_finished()


@pytest.fixture(scope="module")
def qwen(tiny_ckpt):
    with LLM(tiny_ckpt, num_blocks=512, block_size=4, show_progress=False) as llm:
        yield llm


def test_text_tools_and_completions_prompts(qwen):
    text = _run_and_compare(qwen, [{"role": "user", "content": "Hello there, how are you?"}])
    assert text.parts == () and text.text_tokens == text.num_tokens
    tools = _run_and_compare(qwen, [{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS)
    assert tools.num_tokens > text.num_tokens  # the tool's definition is in the prompt
    raw = _run_and_compare(qwen, TextPrompt("Once upon a time"))
    assert raw.num_tokens == len(qwen.tokenizer.encode("Once upon a time"))


def test_a_video_is_one_part_with_its_frames_and_grid(qwen, tmp_path):
    clip = write_video(frames=16, fps=8, width=64, height=48)
    request = [{"role": "user", "content": [{"type": "video", "video": clip}, {"type": "text", "text": "What?"}]}]
    rendered = _run_and_compare(qwen, request)
    (video,) = rendered.videos()
    prompt = qwen.inputs.build_prompt(request, PARAMS)
    assert video.items == len(prompt.images) > 1 and video.frames == 2 * video.items  # 2 frames per patch
    assert video.grid[0] == video.items and video.tokens == sum(prompt.image_tokens)
    t, h, w = video.grid
    assert video.tokens == t * h * w // 4  # merged 2x2
    assert rendered.to_dict()["parts"]["videos"][0]["frames"] == video.frames


@pytest.fixture(scope="module")
def budgeted(tiny_ckpt):
    """The vision budget on (16 image tokens a step, as `vlm-sdk serve` sets one on the CPU): a 6-token image
    fits it, a 24-token one runs alone in its step, a video's 140-token frame groups one a step."""
    with LLM(tiny_ckpt, num_blocks=512, block_size=4, max_num_encoder_tokens_per_step=16, show_progress=False) as llm:
        yield llm


def _two_images() -> list[dict]:  # 6 and 24 image tokens on the tiny Qwen2.5-VL
    return [{"role": "user", "content": [{"type": "image", "image": image(96, 64, 1)},
                                         {"type": "image", "image": image(160, 112, 2)},
                                         {"type": "text", "text": "Compare them."}]}]


def test_the_vision_budget_cuts_the_render_as_the_scheduler_cuts_the_step(qwen, budgeted):
    clip = write_video(frames=16, fps=8, width=64, height=48)
    video = [{"role": "user", "content": [{"type": "video", "video": clip}, {"type": "text", "text": "What?"}]}]
    off_images, off_video = _run_and_compare(qwen, _two_images()), _run_and_compare(qwen, video)
    on_images, on_video = _run_and_compare(budgeted, _two_images()), _run_and_compare(budgeted, video)
    assert off_images.max_num_encoder_tokens_per_step is None and on_images.max_num_encoder_tokens_per_step == 16
    small, large = on_images.images()
    assert (small.tokens, large.tokens) == (6, 24) and on_images.token_ids == off_images.token_ids
    # off: the whole prompt in one step; on: the first step ends before the image the budget does not hold,
    # which then runs alone (over the whole budget: never split)
    assert off_images.prefill_steps == 1 and off_images.first_step_tokens == off_images.num_tokens - off_images.prefix_hit_tokens
    assert on_images.prefill_steps == 2 and on_images.prefix_hit_tokens + on_images.first_step_tokens == large.offset
    (frames,) = on_video.videos()
    assert frames.items == 2 and off_video.prefill_steps == 1 and on_video.prefill_steps == 2  # a frame group a step
    assert on_video.to_dict()["fits"]["prefill_steps"] == 2
    for llm in (qwen, budgeted):
        llm.engine.release_finished()


@pytest.mark.parametrize("case", ["image", "large_image", "long_text"])
def test_a_request_that_never_fits_lists_fixes_that_each_make_it_fit(tiny_ckpt, case):
    if case == "image":  # a cache of 32 tokens: the prompt is ~40; its ids are known
        request, settings = _image_request(), dict(num_blocks=8, block_size=4, allow_unfit_images=True)
    elif case == "large_image":  # 256 image tokens in a 256-token cache: a smaller max_pixels fits it too
        request = [{"role": "user", "content": [{"type": "image", "image": image(448, 448, 3)},
                                                {"type": "text", "text": "What is in this image?"}]}]
        settings = dict(num_blocks=64, block_size=4, allow_unfit_images=True)
    else:  # a text past max_model_len (set by you): the fix names max_model_len
        request = [{"role": "user", "content": "tell me a story " * 12}]
        settings = dict(num_blocks=64, block_size=4, max_model_len=40, allow_unfit_images=True)
    with LLM(tiny_ckpt, show_progress=False, **settings) as llm:
        rendered = llm.render(request, PARAMS)
        with pytest.raises(InvalidRequestError):  # the engine refuses what the render says does not fit
            llm.chat(request, PARAMS)
    assert not rendered.fits_ever and not rendered.fits_now and rendered.num_tokens > rendered.max_model_len
    assert rendered.token_ids is None or len(rendered.token_ids) == rendered.num_tokens
    assert rendered.error.fixes and rendered.to_dict()["error"]["fixes"] == rendered.error.fixes
    assert ("max_pixels" in rendered.error.fixes) == (case == "large_image")
    for name, value in rendered.error.fixes.items():  # each alone: applied, the same request fits whole
        with LLM(tiny_ckpt, show_progress=False, **{**settings, name: value}) as llm:  # max_pixels too
            again = llm.render(request, PARAMS)
            assert again.fits_ever and again.fits_now, (name, value)
            assert again.num_tokens + PARAMS.max_tokens <= again.max_model_len
            assert llm.chat(request, PARAMS)[0].finish_reason in ("length", "stop")


def test_async_render_is_read_on_the_engine_thread(tiny_ckpt):
    async def main():
        async with AsyncLLM(tiny_ckpt, num_blocks=128, block_size=4, show_progress=False) as engine:
            first = await engine.render(_image_request(), PARAMS, ChatOptions())
            await engine.chat(_image_request(), PARAMS)
            second = await engine.render(_image_request(), PARAMS, ChatOptions())
            stats = engine.stats()
            return first, second, stats
    first, second, stats = asyncio.run(main())
    assert first.token_ids == second.token_ids and first.prefix_hit_tokens == 0 < second.prefix_hit_tokens
    # a dry run looks nothing up in the counters and takes nothing
    assert stats["prefix_cache_query_tokens"] == first.num_tokens and stats["kv_blocks_used"] == 0


def test_fits_now_follows_the_free_blocks(tiny_ckpt):
    request = [{"role": "user", "content": "Tell me about the sea, the sky and the mountains."}]  # 43 tokens
    settings = dict(num_blocks=16, block_size=4, enable_prefix_caching=False, allow_unfit_images=True)
    with LLM(tiny_ckpt, show_progress=False, **settings) as llm:
        first = llm.render(request, PARAMS)
        assert first.fits_now and first.new_blocks == -(-first.num_tokens // 4) == 11
        engine = llm.engine
        rid = engine.add_request(llm.inputs.build_prompt(request, PARAMS), PARAMS)
        engine.step()  # it holds its prompt's 11 blocks: 5 are free
        busy = llm.render(request, PARAMS)
        assert (busy.free_blocks, busy.new_blocks, busy.running) == (5, 11, 1)
        assert busy.fits_ever and not busy.fits_now and busy.to_dict()["fits"]["now"] is False
        engine.abort(rid)
        engine.release_finished()
        assert llm.render(request, PARAMS).fits_now
