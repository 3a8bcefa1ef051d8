"""Prompts without a chat template (`LLM.generate`, `AsyncLLM.generate`), on every family's tiny
checkpoint: a text is tokenized as transformers' tokenizer does, a token-id prompt runs exactly those
ids, and the greedy tokens equal transformers' generate on the same ids; bad ids, the image
placeholder and a too-long prompt are typed errors naming the numbers, and the engine serves on."""
import asyncio

import pytest
import torch

from vlm_sdk import LLM, AsyncLLM, SamplingParams, TextPrompt, TokensPrompt
from vlm_sdk.errors import InputTooLongError, InvalidRequestError
from vlm_sdk.testing.families import fixtures

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TEXT = "The quick brown fox jumps over the lazy dog, and then"


@pytest.fixture(scope="module")
def llm(family_ckpt):
    return LLM(family_ckpt[1], show_progress=False)


def _hf_inputs(ref, tokenizer, image_processor, config, ids: list[int]) -> dict:
    """transformers' inputs for a text-only prompt of `ids`, with the keys the family's reference gives
    a text-only conversation (Qwen: mm_token_type_ids, all 0, so that transformers uses M-RoPE)."""
    keys = ref.hf_prompt(tokenizer, image_processor, config, [{"role": "user", "content": "x"}]).keys()
    out = {"input_ids": torch.tensor([ids])}
    if "mm_token_type_ids" in keys:
        out["mm_token_type_ids"] = torch.zeros(1, len(ids), dtype=torch.int)
    return out


def test_text_and_token_prompts_equal_transformers(family_ckpt, llm):
    from transformers import AutoTokenizer

    from vlm_sdk.testing.reference import hf_batch, hf_greedy
    family, path = family_ckpt
    ref = fixtures(family).reference
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = ref.hf_model(str(path))
    [by_text] = llm.generate(TEXT, GREEDY)
    ids = tokenizer(TEXT)["input_ids"]  # add_special_tokens, as vLLM's completions tokenize
    assert by_text.prompt_token_ids == ids
    inputs = _hf_inputs(ref, tokenizer, ref.hf_image_processor(str(path)), model.config, ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    theirs = hf_greedy(model, hf_batch([inputs], pad), 12)[0]
    assert by_text.token_ids == theirs and len(set(theirs)) > 3  # varied tokens: a real comparison
    # the same ids given as ids, alone and in a batch with a shorter prompt, in input order
    [by_ids] = llm.generate(ids, GREEDY)
    both = llm.generate([TokensPrompt(tuple(ids)), ids[:5]], GREEDY)
    assert by_ids.token_ids == both[0].token_ids == theirs
    assert both[1].prompt_token_ids == ids[:5] and both[1].token_ids == llm.generate(ids[:5], GREEDY)[0].token_ids
    assert by_ids.text == by_text.text and by_ids.finish_reason == "length"
    assert [o.prompt_token_ids for o in llm.generate([TEXT, TextPrompt("Hello")], GREEDY)] == [
        ids, tokenizer("Hello")["input_ids"]]


def test_special_token_text_in_a_text_prompt_is_the_special_token(llm):
    tok = llm.tokenizer.wrapped
    special = next(t for t in tok.all_special_tokens if t not in ("<|image_pad|>", "<IMG_CONTEXT>"))
    [out] = llm.generate(f"{special}user\nhi", SamplingParams(max_tokens=1))
    assert out.prompt_token_ids[0] == tok.convert_tokens_to_ids(special)
    assert out.prompt_token_ids == tok(f"{special}user\nhi")["input_ids"]


def test_seeded_samples_of_a_token_prompt(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True)
    [out] = llm.generate([11, 22, 33], params)
    texts = [o.token_ids for o in out.outputs]
    assert [o.index for o in out.outputs] == [0, 1, 2] and len({tuple(t) for t in texts}) == 3
    [alone] = llm.generate([11, 22, 33], SamplingParams(max_tokens=8, temperature=1.0, seed=6, ignore_eos=True))
    assert alone.token_ids == texts[1]  # sample i draws from seed + i


def test_bad_prompts_are_typed_errors_and_the_engine_serves_on(llm):
    vocab = len(llm.tokenizer.wrapped)
    cases = [
        ([5, vocab, 7, vocab + 4], ["2 token id(s) outside the vocabulary", f"{vocab} (position 1)",
                                    f"{vocab + 4} (position 3)", f"0 to {vocab - 1}"]),
        ([1, -3], ["token 1 is -3", ">= 0"]),
        ([], ["non-empty"]),
        ("", ["empty string"]),
        ([[1, 2], "x", 3.5], ["prompts[2]", "3.5"]),
        ([True, 2], ["non-empty string or a non-empty list of token ids"]),
    ]
    for prompt, words in cases:
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(prompt, GREEDY)
        for word in words:
            assert word in str(info.value), (prompt, str(info.value))
    pid = llm.engine.inputs.processor.image_token_id  # the family's image placeholder
    placeholder = llm.tokenizer.wrapped.convert_ids_to_tokens(pid)
    for prompt in ([1, 2, pid, 3], f"a {placeholder} b"):
        with pytest.raises(InvalidRequestError, match=f"image placeholder token .*{pid}.*carries no image") as info:
            llm.generate(prompt, GREEDY)
        assert info.value.param == "prompt"
    limit = llm.stats()["max_model_len"]
    with pytest.raises(InputTooLongError) as info:
        llm.generate(["fine", [1] * (limit + 1)], GREEDY)
    assert str(info.value).startswith(f"prompt 1: prompt is {limit + 1} tokens")
    # max_model_len is the checkpoint's max_position_embeddings here: no setting can fit it
    assert info.value.prompt_tokens == limit + 1 and str(info.value).endswith("shorten the prompt.")
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_waiting"] == 0
    assert llm.generate("still serving", GREEDY)[0].finish_reason == "length"


def test_async_generate_streams_a_text_and_token_ids(family_ckpt, llm):
    [ref] = llm.generate(TEXT, GREEDY)

    async def main():
        async with AsyncLLM(family_ckpt[1], show_progress=False) as engine:
            streamed = [out async for out in engine.generate(TEXT, GREEDY)]
            by_ids = [out async for out in engine.generate(ref.prompt_token_ids, GREEDY)]
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                [out async for out in engine.generate([10 ** 6], GREEDY)]
            return streamed, by_ids, engine.stats()
    streamed, by_ids, stats = asyncio.run(main())
    assert "".join(o.delta_text for o in streamed) == ref.text and streamed[-1].token_ids == ref.token_ids
    assert len(streamed) > 1 and by_ids[-1].token_ids == ref.token_ids
    assert stats["kv_blocks_used"] == 0
