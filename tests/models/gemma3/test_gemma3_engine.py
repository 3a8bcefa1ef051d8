"""Gemma 3 through the engine against transformers' `generate` on the tiny checkpoint, whose sliding window
(12 tokens) is shorter than every prompt here: greedy tokens equal for text past the window, one image,
two images, pan-and-scan crops, chunked prefill that reaches an image (never cut: the scheduler ends a
chunk before it), preemption, prefix caching on and off; the Triton kernels (interpreter) give the torch
backend's tokens; the sliding-window layers' blocks go back to the pool during a long decode.

transformers' prompt is its own Gemma3Processor's (with `token_type_ids`, so that `generate` attends
bidirectionally within each image as ours does)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from helpers import image
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.model_loader import read_checkpoint
from vlm_sdk.models.gemma3 import reference
from vlm_sdk.testing.reference import hf_batch, hf_greedy

MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SMALL_CROPS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}
STORY = "Tell me a long story about the sea, the boats on it, the fish below and the birds above."


def conversations() -> dict[str, list[dict]]:
    a, b, c, wide = image(320, 200, 1), image(100, 90, 2), image(64, 200, 3), image(900, 200, 4)
    return {
        "text": [{"role": "user", "content": STORY}],
        "one_image": [{"role": "user", "content": [{"type": "image", "image": a},
                                                   {"type": "text", "text": "What is in this image?"}]}],
        "two_images": [{"role": "system", "content": "You compare pictures."},
                       {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image", "image": b},
                                                    {"type": "text", "text": "with"}, {"type": "image", "image": c}]}],
        "wide": [{"role": "user", "content": [{"type": "image", "image": wide}, {"type": "text", "text": "Read it."}]}],
        "multi_turn": [{"role": "user", "content": [{"type": "image", "image": b}, {"type": "text", "text": "Describe it."}]},
                       {"role": "assistant", "content": "A colourful square with a few shapes in it."},
                       {"role": "user", "content": "Which colour is most common?"}],
    }


class Oracle:
    def __init__(self, ckpt):
        self.model = reference.hf_model(str(ckpt))
        self.tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
        self.image_processor = reference.hf_image_processor(str(ckpt))
        self.config = read_checkpoint(ckpt).hf_config

    def greedy(self, conv, **images_kwargs) -> tuple[list[int], list[int]]:
        inputs = reference.hf_prompt(self.tokenizer, self.image_processor, self.config, conv, **images_kwargs)
        batch = hf_batch([inputs], self.tokenizer.pad_token_id)
        return inputs["input_ids"][0].tolist(), hf_greedy(self.model, batch, MAX_TOKENS)[0]


@pytest.fixture(scope="module")
def oracle(gemma3_ckpt):
    return Oracle(gemma3_ckpt)


@pytest.fixture(scope="module")
def expected(oracle):
    out = {name: oracle.greedy(conv) for name, conv in conversations().items()}
    out["wide_crops"] = oracle.greedy(conversations()["wide"], **SMALL_CROPS)
    return out


@pytest.fixture(scope="module")
def llm(gemma3_ckpt):
    return LLM(gemma3_ckpt, show_progress=False)


def _check(outs, names, expected):
    for out, name in zip(outs, names):
        prompt, tokens = expected[name]
        assert out.prompt_token_ids == prompt, name
        assert out.token_ids == tokens, name
        assert len(set(tokens)) > 3, f"{name}: random weights gave a degenerate reference"


def test_every_prompt_is_longer_than_the_window(expected, gemma3_ckpt):
    window = read_checkpoint(gemma3_ckpt).hf_config.text_config.sliding_window
    assert all(len(prompt) > window for prompt, _ in expected.values())


@pytest.mark.parametrize("name", list(conversations()))
def test_greedy_alone_equals_transformers(llm, expected, name):
    _check(llm.chat(conversations()[name], GREEDY), [name], expected)


def test_greedy_batched_equals_transformers(llm, expected):
    names = list(conversations())
    _check(llm.chat([conversations()[n] for n in names], GREEDY), names, expected)
    assert llm.stats()["kv_blocks_used"] == 0


def test_pan_and_scan_crops_equal_transformers(gemma3_ckpt, expected):
    crops = LLM(gemma3_ckpt, show_progress=False, **SMALL_CROPS)
    out = crops.chat(conversations()["wide"], GREEDY)
    assert len(crops.engine.inputs.build_prompt(conversations()["wide"]).images) == 5  # the image and 4 crops
    _check(out, ["wide_crops"], expected)


@pytest.mark.parametrize("budget", [16, 20, 37])  # one frame's 16 tokens at least
def test_chunked_prefill_never_cuts_an_image(gemma3_ckpt, expected, budget):
    names = list(conversations())
    chunked = LLM(gemma3_ckpt, show_progress=False, max_num_batched_tokens=budget)
    _check(chunked.chat([conversations()[n] for n in names], GREEDY), names, expected)


def test_a_chunk_budget_below_one_image_is_refused(gemma3_ckpt):
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        LLM(gemma3_ckpt, show_progress=False, max_num_batched_tokens=15)


def test_preemption_changes_no_token(llm, gemma3_ckpt, expected):
    names = list(conversations()) * 2
    blocks_for = llm.engine.cache_config.blocks_for  # in every cache group: the sliding ones their window's
    longest = max(len(prompt) for prompt, _ in expected.values()) + MAX_TOKENS
    assert blocks_for(longest + 16) < sum(blocks_for(len(expected[n][0]) + MAX_TOKENS) for n in names)
    small = LLM(gemma3_ckpt, show_progress=False, num_blocks=blocks_for(longest + 16), allow_unfit_images=True)
    _check(small.chat([conversations()[n] for n in names], GREEDY), names, expected)
    assert small.stats()["num_preemptions"] > 0, "the batch was meant to preempt"
    assert small.stats()["kv_blocks_used"] == 0


def test_prefix_cache_on_and_off_give_the_same_tokens(gemma3_ckpt, expected):
    names = ["one_image", "multi_turn", "two_images"]
    off = LLM(gemma3_ckpt, show_progress=False, enable_prefix_caching=False, encoder_cache_memory=0)
    on = LLM(gemma3_ckpt, show_progress=False)
    convs = [conversations()[n] for n in names]
    _check(off.chat(convs, GREEDY), names, expected)
    _check(on.chat(convs, GREEDY), names, expected)
    again = on.chat(convs, GREEDY)
    _check(again, names, expected)
    assert all(o.num_cached_tokens > 0 for o in again)


def test_the_triton_kernels_give_transformers_tokens(gemma3_ckpt, expected):
    """Windowed decode and prefill with the image spans in the Triton kernels (the interpreter: a few
    tokens, its programs are slow) on a prompt past the window with two images."""
    triton = LLM(gemma3_ckpt, show_progress=False, attention_backend="triton")
    out = triton.chat(conversations()["two_images"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    prompt, tokens = expected["two_images"]
    assert out.prompt_token_ids == prompt and out.token_ids == tokens[:6]


def test_sliding_window_blocks_go_back_to_the_pool_during_a_long_decode(gemma3_ckpt):
    """A 300-token decode in blocks of 4: the global layer's group holds every block of the sequence, each
    sliding group (window 12) only the blocks its window reaches, let go of whenever a new block is taken
    (the scheduler allocates at block boundaries), so the pool's used blocks grow by one per block of
    tokens, not three."""
    block, window = 4, 12
    llm = LLM(gemma3_ckpt, show_progress=False, enable_prefix_caching=False, block_size=block)
    engine = llm.engine
    rid = engine.add_request(engine.inputs.build_prompt(conversations()["text"]),
                             SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))
    prompt = engine.requests[rid].num_prompt_tokens
    window_blocks = -(-(window - 1) // block)  # the blocks before a block boundary a query there reads
    full_blocks, sliding_most = [], 0
    while engine.has_unfinished():
        engine.step()
        seq = engine.requests.get(rid)
        if seq is None:
            break
        stats = engine.stats()
        full = [g["blocks_used"] for g in stats["cache_groups"] if g["kind"] == "full"]
        sliding = [g["blocks_used"] for g in stats["cache_groups"] if g["kind"] == "sliding_window"]
        assert len(full) == 1 and len(sliding) == 2
        assert full[0] == len(seq.block_ids[stats["cache_groups"].index(
            next(g for g in stats["cache_groups"] if g["kind"] == "full"))])
        full_blocks.append(full[0])
        assert stats["kv_blocks_used"] == full[0] + sum(sliding)
        if seq.num_computed_tokens > prompt + block:  # a block was taken since the prefill: the window holds
            assert all(n <= window_blocks + 1 for n in sliding), (seq.num_computed_tokens, sliding)
            sliding_most = max(sliding_most, *sliding)
    assert max(full_blocks) >= (prompt + 299) // block  # the global layer kept every token's block
    assert sliding_most == window_blocks + 1  # the sliding layers kept a window's worth, no more
    assert engine.stats()["kv_blocks_used"] == 0


def test_structured_output_on_an_image_prompt_past_the_window(llm):
    """A JSON schema constrains what the random weights say, on an image prompt longer than the window,
    sampled with different seeds (the grammar runs beside the sliding-window layers' freed blocks)."""
    import json

    import jsonschema
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, response_format=fmt) for s in range(4)]
    outs = llm.chat([conversations()["two_images"]] * 4, params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert len({o.text for o in outs}) > 1
