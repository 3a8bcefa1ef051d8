"""A prompt that can never fit is refused alone, with its numbers and fixes that each work (Qwen2.5-VL:
two images, max_pixels the largest that fits, kv_cache_memory, max_model_len, settings needed together).
What every family shares (one image, each fix runs, the engine goes on, typed bad input) is in
tests/e2e/test_family_capacity.py."""
import pytest

from helpers import conversations, image
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import format_size
from vlm_sdk.errors import InputTooLongError, InvalidRequestError, VLMError

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)  # a fixed request: runs all 4
BLOCKS = 6  # 96 tokens: too few for two images


@pytest.fixture(scope="module")
def small(tiny_ckpt):
    # its largest allowed image (256 tokens) does not fit 96: per-request refusals need the flag
    return LLM(tiny_ckpt, num_blocks=BLOCKS, allow_unfit_images=True, show_progress=False)


def _big_conv():
    return [{"role": "user", "content": [{"type": "image", "image": image(400, 300, 5)},
                                         {"type": "image", "image": image(250, 250, 6)},
                                         {"type": "text", "text": "What differs?"}]}]


def test_error_numbers_message_and_each_fix(tiny_ckpt, small):
    reference = LLM(tiny_ckpt, show_progress=False).engine.inputs.build_prompt(_big_conv())
    with pytest.raises(InputTooLongError) as info:
        small.chat(_big_conv(), PARAMS)
    err = info.value
    assert isinstance(err, VLMError)
    assert err.prompt_tokens == len(reference.token_ids)
    assert err.image_tokens == reference.image_tokens and len(err.image_tokens) == 2
    assert err.capacity_tokens == BLOCKS * 16
    msg = str(err)
    for number in (err.prompt_tokens, err.capacity_tokens, *err.image_tokens, BLOCKS):
        assert str(number) in msg
    # num_blocks sized this cache and overrides kv_cache_memory, so kv_cache_memory is no fix here
    assert set(err.fixes) == {"num_blocks", "max_pixels"}
    # the fixes fit the whole request: the prompt and its max_tokens=4
    assert err.fixes["num_blocks"] == -(-(err.prompt_tokens + 4) // 16)
    assert err.output_tokens == err.max_tokens == 4 and "with its max_tokens=4 output tokens" in msg
    for key, value in err.fixes.items():
        assert f"{key}={value}" in msg and f"--{key.replace('_', '-')} {value}" in msg
        fixed = LLM(tiny_ckpt, show_progress=False, allow_unfit_images=True, **{"num_blocks": BLOCKS, key: value})
        out = fixed.chat(_big_conv(), PARAMS)[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 4  # all its max_tokens
    # max_pixels is the largest that leaves room for the 4 output tokens: one more 28x28 step does not
    text_tokens = err.prompt_tokens - sum(err.image_tokens)
    at = small.engine.inputs.processor.image_tokens_with_max_pixels
    assert text_tokens + sum(at(reference, err.fixes["max_pixels"])) + 4 <= err.capacity_tokens
    assert text_tokens + sum(at(reference, err.fixes["max_pixels"] + 28 * 28)) + 4 > err.capacity_tokens


def test_kv_cache_memory_sized_cache_offers_kv_cache_memory(tiny_ckpt, small):
    per_block = small.stats()["kv_bytes_per_block"]
    llm = LLM(tiny_ckpt, kv_cache_memory=BLOCKS * per_block + per_block // 2, allow_unfit_images=True,
              show_progress=False)
    with pytest.raises(InputTooLongError) as info:
        llm.chat(_big_conv(), PARAMS)
    fixes = info.value.fixes
    # the same bytes hold 4x the tokens as float8 (this float32 cache's 6.5 blocks -> 26): kv_cache_dtype
    # is a fix too (tests/e2e/test_fp8_kv_cache.py has where it is not)
    assert set(fixes) == {"num_blocks", "kv_cache_memory", "max_pixels", "kv_cache_dtype"}
    assert fixes["kv_cache_memory"] == fixes["num_blocks"] * per_block
    fp8 = LLM(tiny_ckpt, kv_cache_memory=BLOCKS * per_block + per_block // 2, allow_unfit_images=True,
              show_progress=False, kv_cache_dtype=fixes["kv_cache_dtype"])
    assert len(fp8.chat(_big_conv(), PARAMS)[0].token_ids) == 4
    # printed with a unit, exactly: it pastes into LLM(...) as a string and into --kv-cache-memory
    printed = format_size(fixes["kv_cache_memory"])
    assert f"kv_cache_memory={printed!r}" in str(info.value) and f"--kv-cache-memory {printed}" in str(info.value)
    for value in (fixes["kv_cache_memory"], printed):
        fixed = LLM(tiny_ckpt, kv_cache_memory=value, show_progress=False)
        assert fixed.stats()["kv_blocks_total"] == fixes["num_blocks"]
        assert len(fixed.chat(_big_conv(), PARAMS)[0].token_ids) == 4


def test_checks_every_conversation_first_and_names_it(small):
    good = conversations()["text"]
    with pytest.raises(InputTooLongError) as info:
        small.chat([good, good, _big_conv()], PARAMS)
    assert info.value.conversation_index == 2 and "conversation 2" in str(info.value)
    stats = small.stats()
    assert stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0


def test_max_model_len_fix(tiny_ckpt):
    conv = conversations()["one_image"]
    llm = LLM(tiny_ckpt, max_model_len=32, allow_unfit_images=True, show_progress=False)
    with pytest.raises(InputTooLongError) as info:
        llm.chat(conv, PARAMS)
    err = info.value
    assert err.capacity_tokens == 32 and "max_model_len=32" in str(err)
    assert err.fixes["max_model_len"] == err.prompt_tokens + 4  # the prompt and its max_tokens
    fixed = LLM(tiny_ckpt, max_model_len=err.fixes["max_model_len"], allow_unfit_images=True, show_progress=False)
    out = fixed.chat(conv, PARAMS)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_bad_engine_args_are_typed(tiny_ckpt):
    with pytest.raises(TypeError, match="num_blokcs"):
        LLM(tiny_ckpt, num_blokcs=3)
    with pytest.raises(InvalidRequestError, match="max_model_len=4096 does not fit once .* needs 256 blocks"):
        LLM(tiny_ckpt, num_blocks=10, max_model_len=4096, show_progress=False)
    with pytest.raises(InvalidRequestError, match="kv_cache_memory"):
        LLM(tiny_ckpt, kv_cache_memory=10, show_progress=False)


# -- settings needed together, the limit named, the error's constructor ------------------------------

def test_max_model_len_and_num_blocks_needed_together_are_named_together(tiny_ckpt):
    llm = LLM(tiny_ckpt, num_blocks=6, max_model_len=64, allow_unfit_images=True, show_progress=False)
    conv = [{"role": "user", "content": "word " * 60}]
    with pytest.raises(InputTooLongError) as info:
        llm.chat(conv, PARAMS)
    err = info.value
    n = err.prompt_tokens + 4  # the whole request
    blocks = -(-n // 16)
    assert n > 96 and err.fixes == {}
    assert err.together == {"max_model_len": n, "num_blocks": blocks}
    assert (f"No single setting makes it fit; these together do with its max_tokens=4 output tokens: "
            f"max_model_len={n}, num_blocks={blocks}") in str(err)
    assert "max_model_len=64 (set by you)" in str(err)
    # the other settings kept (the flag too: max_model_len stays below the largest image)
    fixed = LLM(tiny_ckpt, num_blocks=blocks, max_model_len=n, allow_unfit_images=True, show_progress=False)
    assert len(fixed.chat(conv, PARAMS)[0].token_ids) == 4
    with pytest.raises(InputTooLongError) as info:  # the conversation index keeps them
        llm.chat([conversations()["text"], conv], PARAMS)
    assert info.value.together == err.together and "conversation 1" in str(info.value)


def test_user_set_max_model_len_equal_to_the_cache_is_named(tiny_ckpt):
    llm = LLM(tiny_ckpt, num_blocks=6, max_model_len=96, allow_unfit_images=True, show_progress=False)
    with pytest.raises(InputTooLongError) as info:
        llm.chat([{"role": "user", "content": "word " * 60}], PARAMS)
    assert "max_model_len=96 (set by you)" in str(info.value)
    assert "max_model_len" in info.value.together


def test_input_too_long_error_takes_positional_arguments_and_words_together_fixes():
    old = InputTooLongError(100, [10], 50, {"num_blocks": 7}, "a reason", 2)
    assert old.together == {} and old.conversation_index == 2
    assert "Any one of these settings makes it fit: num_blocks=7 (flags: --num-blocks 7)." in str(old)
    both = InputTooLongError(100, [], 50, {"max_pixels": 784}, "r", together={"max_model_len": 100, "num_blocks": 7})
    assert "So do these together: max_model_len=100, num_blocks=7." in str(both)
