"""Prefix caching and the encoder cache change no token: on every registered family, outputs with both
caches on equal outputs with both off (greedy and seeded, batched, multi-turn, under preemption, a
cached prefix that ends inside an image with and without the encoder cache), images that differ in
one pixel or in their settings never share a block, and the figures in stats() add up."""
import pytest

from helpers import chunk_budget, conversations, image
from vlm_sdk import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
OFF = {"enable_prefix_caching": False, "encoder_cache_memory": 0}
SYSTEM = "You answer questions about pictures carefully, briefly and in plain words. " * 3
# (width, height) of the image these prompts ask about: in every family's tiny checkpoint its tokens end
# inside a KV block that the question also fills, so a cached prefix can end inside the image (at
# 300x200 Qwen3-VL's 54 tokens end where a block does)
IMAGE_SIZE = (320, 200)
# a per-image setting that changes that image's patches: fewer pixels, or fewer tiles
SMALLER = {"qwen2_5_vl": {"max_pixels": 28 * 28 * 16}, "internvl": {"max_num": 1},
           "qwen3_vl": {"max_pixels": 32 * 32 * 16}, "qwen3_vl_moe": {"max_pixels": 32 * 32 * 16},
           "gemma3": {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32},  # Gemma 3: crops (more frames)
           "qwen3_5": {"max_pixels": 32 * 32 * 16}, "qwen3_5_moe": {"max_pixels": 32 * 32 * 16}}


@pytest.fixture(scope="module")
def engines(family_ckpt):
    """(caches on, caches off) on the family's tiny checkpoint."""
    on = LLM(family_ckpt[1], show_progress=False)
    off = LLM(family_ckpt[1], show_progress=False, **OFF)
    return on, off


def _ask(img, question, **image_options):
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "image", "image": img, **image_options},
                                         {"type": "text", "text": question}]}]


def _tokens(outs):
    return [o.token_ids for o in outs]


def test_batched_greedy_and_seeded_outputs_equal_with_caching_off(engines):
    on, off = engines
    img = image(*IMAGE_SIZE, 11)
    convs = [_ask(img, q) for q in ("What is it?", "Which colours?", "Is it a photo?")]
    for params in (GREEDY, SEEDED):
        want = _tokens(off.chat(convs, params))
        first = on.chat(convs, params)  # the batch shares its prefix within itself
        again = on.chat(convs, params)  # ... and now with the cache warm
        assert _tokens(first) == want and _tokens(again) == want
        assert all(o.num_cached_tokens > 0 for o in again)
    s = on.stats()
    assert s["prefix_cache_hit_tokens"] > 0 and s["prefix_cache_query_tokens"] >= s["prefix_cache_hit_tokens"]
    assert s["encoder_cache_hits"] > 0 and s["encoder_cache_bytes"] > 0
    assert s["kv_blocks_used"] == 0 and s["kv_blocks_cached"] > 0
    assert s["kv_blocks_free"] == s["kv_blocks_total"]  # cached blocks are free: reclaimable
    assert s["largest_prompt_tokens_now"] == min(s["kv_blocks_total"] * s["kv_block_size"], s["max_model_len"])
    o = off.stats()
    assert o["prefix_cache_hit_tokens"] == o["kv_blocks_cached"] == o["encoder_cache_hits"] == 0


def test_multi_turn_reuses_the_conversation_and_changes_no_token(engines):
    on, off = engines
    conv = _ask(image(240, 180, 12), "Describe it.")
    for turn in range(3):
        got, want = on.chat(conv, GREEDY)[0], off.chat(conv, GREEDY)[0]
        assert got.token_ids == want.token_ids
        if turn:  # everything before this turn's new words was computed before
            assert got.num_cached_tokens >= len(got.prompt_token_ids) // 2
        assert want.num_cached_tokens == 0
        conv = conv + [{"role": "assistant", "content": got.text}, {"role": "user", "content": f"And {turn}?"}]


def test_preempted_requests_find_their_blocks_and_change_no_token(family_ckpt, engines):
    _, off = engines
    convs = list(conversations().values())
    """Recompute after preemption, caches on, against both caches off (tests/e2e/test_families.py's
    preemption check is this one: the default engine has the caches on)."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    free = off.chat(convs, params)
    longest = max(len(o.prompt_token_ids) + 40 for o in free)
    # the engine's own count of a sequence's blocks: in every cache group (a sliding-window group holds
    # only its window's), the same as tokens / 16 for a model of one full-attention group
    blocks_for = off.engine.cache_config.blocks_for
    need = sum(blocks_for(len(o.prompt_token_ids) + 40) for o in free)
    blocks = blocks_for(longest + 16)  # the longest fits alone; all four together need `need` blocks
    assert blocks < need
    tight = LLM(family_ckpt[1], num_blocks=blocks, allow_unfit_images=True, show_progress=False)
    assert _tokens(tight.chat(convs, params)) == _tokens(free)
    s = tight.stats()
    assert s["num_preemptions"] > 0
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0


@pytest.mark.parametrize("encoder_cache", [True, False])
def test_a_cached_prefix_ending_inside_an_image_changes_no_token(family_ckpt, engines, encoder_cache):
    """B arrives while A's prefill is part-way through their shared image (a family that computes an image
    in one chunk: once A is past it): B's cached prefix ends inside it, and B takes the image's other rows
    from the same image's embeddings (cached, or encoded again)."""
    on, off = engines
    img = image(*IMAGE_SIZE, 13)
    a, b = _ask(img, "What is it?"), _ask(img, "Why?")
    llm = LLM(family_ckpt[1], max_num_batched_tokens=chunk_budget(on), show_progress=False,
              **({} if encoder_cache else {"encoder_cache_memory": 0}))
    engine = llm.engine
    pa, pb = engine.inputs.build_prompt(a), engine.inputs.build_prompt(b)
    first, last = pa.image_positions[0], pa.image_positions[0] + pa.images[0].num_tokens
    engine.add_request(pa, GREEDY, "a")
    whole = engine.cache.whole_images
    while engine.requests["a"].num_computed_tokens < (last if whole else first + 16):
        engine.step()
    computed = engine.requests["a"].num_computed_tokens
    assert whole or computed < last - 16, "A should be part-way through the image"
    engine.add_request(pb, GREEDY, "b")
    tokens = {"a": [], "b": []}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    cached = engine.stats()["prefix_cache_hit_tokens"]
    assert first < cached < last, "B's cached prefix should end inside the image"
    assert tokens["a"] == off.chat(a, GREEDY)[0].token_ids
    assert tokens["b"] == off.chat(b, GREEDY)[0].token_ids
    assert engine.stats()["encoder_cache_hits"] == (1 if encoder_cache else 0)


def _image_start(llm, conv) -> int:
    return llm.engine.inputs.build_prompt(conv).image_positions[0]


def test_images_differing_in_one_pixel_or_in_settings_share_only_the_text_before_them(family_ckpt, engines):
    on, _ = engines
    # an empty cache of its own; a model with state layers resumes only where a state was checkpointed, at
    # the end of a prefill chunk: chunks of one block put one at every boundary, so that the text before
    # the image can be reused by the state layers too
    state = "state" in on.stats()["prefix_cache_kinds"]
    llm = LLM(family_ckpt[1], show_progress=False, **({"max_num_batched_tokens": 16} if state else {}))
    img = image(*IMAGE_SIZE, 14)
    changed = img.copy()
    changed.putpixel((7, 9), tuple((c + 1) % 256 for c in img.getpixel((7, 9))))
    start = _image_start(llm, _ask(img, "What is it?"))
    assert start >= 16, "the system prompt should fill at least one block"
    text_blocks = start // 16 * 16  # full blocks before the image's first token
    assert llm.chat(_ask(img, "What is it?"), GREEDY)[0].num_cached_tokens == 0
    assert llm.chat(_ask(changed, "What is it?"), GREEDY)[0].num_cached_tokens == text_blocks
    assert llm.chat(_ask(img, "What is it?", **SMALLER[family_ckpt[0]]), GREEDY)[0].num_cached_tokens == text_blocks
    # the same image and setting again: past the image
    assert llm.chat(_ask(img, "What is it?"), GREEDY)[0].num_cached_tokens > start
    # three distinct images went through the tower (their vision inputs: one each, or an image and its
    # crops, whose whole frame the encoder cache shares with the plain image); the last request's cached
    # prefix covers its image
    seen, queries, hits = set(), 0, 0
    for conv in (_ask(img, "What is it?"), _ask(changed, "What is it?"),
                 _ask(img, "What is it?", **SMALLER[family_ckpt[0]])):
        for im in llm.engine.inputs.build_prompt(conv).images:
            queries, hits = queries + 1, hits + (im.key in seen)
            seen.add(im.key)
    s = llm.stats()
    assert s["encoder_cache_queries"] == queries and s["encoder_cache_hits"] == hits
    assert queries - hits >= 3 and hits <= 1
