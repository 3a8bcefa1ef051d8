"""Qwen3.5 and Qwen3.5-MoE end to end on their tiny checkpoints (transformers' own classes wrote them),
transformers as the oracle: greedy tokens and their logprobs equal `generate`'s for several images, one
image and a long text, through chunked prefill (chunks cut inside the images), preemption and the
prefix cache's state checkpoints; n > 1 siblings restore their prompt's checkpoint; a four-turn image
chat reuses each earlier turn (turns 2-4 hit the cache) with the tokens of the cache off. Shared behaviour
(batching, seeds, stops, async scheduling, TP=2, the server) runs on these families in the other e2e
files; video in tests/models/qwen2_5_vl/test_qwen_video.py."""
from __future__ import annotations

import pytest
import torch

from helpers import conversations, image
from tolerance import forward_terms, reduction_atol
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.testing.families import fixtures

FAMILIES = ("qwen3_5", "qwen3_5_moe")
STEPS = 12
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=0)
BLOCK = 16


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def ckpt(family, tiny_checkpoints):
    return tiny_checkpoints(family)


@pytest.fixture(scope="module")
def hf(family, ckpt):
    """(transformers' model, tokenizer, image processor, the family's reference hooks)."""
    from transformers import AutoTokenizer
    ref = fixtures(family).reference
    return ref.hf_model(str(ckpt)), AutoTokenizer.from_pretrained(str(ckpt)), ref.hf_image_processor(str(ckpt)), ref


def _convs() -> list:
    long_text = [{"role": "user", "content": " ".join(f"item {i} is a {w}" for i, w in
                                                      enumerate(["lake", "hill", "road", "tree"] * 6))}]
    return [conversations()["two_images"], long_text, conversations()["one_image"]]


@torch.inference_mode()
def _hf_greedy_logprobs(model, inputs, steps):
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=steps, do_sample=False, pad_token_id=0, output_logits=True,
                           return_dict_in_generate=True, eos_token_id=None)
    out = model.generate(**inputs, generation_config=cfg)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, torch.stack([torch.log_softmax(s[0].float(), -1)[t] for s, t in zip(out.logits, tokens)])


def _atol(model, logprobs, prompt_tokens: int, images: bool) -> float:
    """Two summation orders of the forward (chunked delta rule against transformers' recurrent one, split
    prefill, the fused experts), its longest chain: each layer's mixer over the tokens (the Gated DeltaNet
    state sums over them as attention does), its MLP, then the softmax over the vocabulary; an image's
    error comes through the vision tower too, bounded by 4x the text's (as tests/e2e/test_quantized_checkpoints.py)."""
    text = model.config.get_text_config()
    experts = getattr(text, "num_experts", 0) or 0
    intermediate = (text.moe_intermediate_size * text.num_experts_per_tok + text.shared_expert_intermediate_size
                    if experts else text.intermediate_size)
    terms = forward_terms(layers=text.num_hidden_layers, hidden=text.hidden_size, intermediate=intermediate,
                          tokens=prompt_tokens + STEPS, head_dim=text.head_dim) + text.vocab_size
    return reduction_atol(logprobs, terms) * (4 if images else 1)


def _check_against_transformers(outs, convs, hf):
    model, tokenizer, image_processor, ref = hf
    seen = set()
    for conv, out in zip(convs, outs):
        inputs = ref.hf_prompt(tokenizer, image_processor, model.config, conv)
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        tokens, logprobs = _hf_greedy_logprobs(model, inputs, STEPS)
        assert out.token_ids == tokens
        mine = torch.tensor([lp.logprob for lp in out.logprobs])
        gap = (mine - logprobs).abs().max().item()
        assert gap <= _atol(model, logprobs, len(tokens) + len(out.prompt_token_ids), "pixel_values" in inputs), gap
        seen.update(tokens)
    assert len(seen) > 3  # varied tokens: a real comparison


def test_greedy_tokens_and_logprobs_equal_transformers_through_chunks_preemption_and_checkpoints(ckpt, hf):
    convs = _convs()
    probe = LLM(ckpt, show_progress=False, enable_prefix_caching=False)
    lengths = [len(probe.engine.inputs.build_prompt(c).token_ids) + STEPS for c in convs]
    assert max(lengths) > 4 * 24  # the long prompt runs over several chunks
    blocks = -(-max(lengths) // BLOCK) + 1  # the longest fits alone, not all three together
    assert blocks < sum(-(-n // BLOCK) for n in lengths)
    llm = LLM(ckpt, show_progress=False, num_blocks=blocks, max_num_batched_tokens=24, allow_unfit_images=True)
    first = llm.chat(convs, GREEDY)
    s = llm.stats()
    assert s["num_preemptions"] > 0
    _check_against_transformers(first, convs, hf)
    s = llm.stats()
    assert s["kv_blocks_used"] == 0 and s["num_running"] == s["num_waiting"] == 0
    # a cache with room: the second time, each prompt's state is restored from a checkpoint the first
    # run left at a chunk's end (the tight cache above evicted the blocks before them)
    roomy = LLM(ckpt, show_progress=False, max_num_batched_tokens=24)
    assert [o.token_ids for o in roomy.chat(convs, GREEDY)] == [o.token_ids for o in first]
    for conv, want in zip(convs, first):
        again = roomy.chat(conv, GREEDY)[0]
        assert again.token_ids == want.token_ids
        assert again.num_cached_tokens == (len(want.prompt_token_ids) - 1) // BLOCK * BLOCK  # its last boundary
    state = next(g for g in roomy.stats()["cache_groups"] if g["kind"] == "state")
    assert state["slots_used"] == 0 and state["slots_cached"] > 0


def test_n_siblings_restore_their_prompts_checkpoint_and_equal_single_requests(ckpt):
    llm, off = LLM(ckpt, show_progress=False), LLM(ckpt, show_progress=False, enable_prefix_caching=False)
    conv = conversations()["one_image"]
    greedy = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    one = off.chat(conv, greedy)[0]
    [many] = llm.chat(conv, SamplingParams(n=3, max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in many.outputs] == [one.token_ids] * 3
    # the 2nd and 3rd waited for the 1st's prompt and restored its state at the prompt's last boundary
    assert llm.stats()["prefix_cache_hit_tokens"] == 2 * ((len(one.prompt_token_ids) - 1) // BLOCK * BLOCK) > 0
    [seeded] = llm.chat(conv, SamplingParams(n=3, max_tokens=STEPS, temperature=1.0, seed=7, ignore_eos=True))
    alone = [off.chat(conv, SamplingParams(max_tokens=STEPS, temperature=1.0, seed=7 + i, ignore_eos=True))[0]
             for i in range(3)]  # sample i draws from seed + i
    assert [o.token_ids for o in seeded.outputs] == [a.token_ids for a in alone]
    assert len({tuple(a.token_ids) for a in alone}) == 3
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_four_turn_image_chat_hits_the_cache_from_turn_two_with_the_tokens_of_caching_off(ckpt):
    on, off = LLM(ckpt, show_progress=False), LLM(ckpt, show_progress=False, enable_prefix_caching=False)
    conv = [{"role": "user", "content": [{"type": "image", "image": image(240, 180, 12)},
                                         {"type": "text", "text": "Describe it."}]}]
    prompt = 0
    for turn in range(4):
        got, want = on.chat(conv, GREEDY)[0], off.chat(conv, GREEDY)[0]
        assert got.token_ids == want.token_ids and want.num_cached_tokens == 0
        if turn:  # the history re-renders the last turn's generation prompt: the boundary before its last
            assert got.num_cached_tokens >= (prompt - 1) // BLOCK * BLOCK - BLOCK > 0
        prompt = len(got.prompt_token_ids)
        conv = conv + [{"role": "assistant", "content": got.text}, {"role": "user", "content": f"And {turn}?"}]


def test_the_qwen3_5_template_reasoning_structured_outputs_and_its_xml_tool_form(tiny_checkpoints):
    """The template opens a <think> block (the qwen3 reasoning parser reads it), closes it empty with
    enable_thinking=False, where a schema's output validates; its tool calls are the Qwen3-Coder XML
    form (the qwen3_coder parser, chosen from the template): a forced call is written in that form and
    reads back as a call whose arguments validate against the function's schema, typed by it."""
    import json

    import jsonschema

    from vlm_sdk.errors import InvalidRequestError
    llm = LLM(tiny_checkpoints("qwen3_5"), show_progress=False)
    conv = conversations()["one_image"]
    thinking = llm.chat(conv, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert thinking.reasoning_content == thinking.text and thinking.content == ""  # the random weights never close the block
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}, "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "seen", "schema": schema, "strict": True}}
    plain = llm.chat(conv, SamplingParams(max_tokens=60, temperature=1.0, seed=3, response_format=fmt),
                     chat_template_kwargs={"enable_thinking": False})[0]
    assert plain.finish_reason == "stop" and not plain.reasoning_content
    jsonschema.validate(json.loads(plain.content), schema)
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                               "unit": {"enum": ["c", "f"]}}, "required": ["city", "days"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    [called] = llm.chat(conv, SamplingParams(max_tokens=80, temperature=1.0, seed=5, n=3), tools=[tool],
                        tool_choice=named, chat_template_kwargs={"enable_thinking": False})
    calls = [out for out in called.outputs if out.finish_reason == "stop"]
    assert calls  # the grammar lets the model open a <think> block of its own first, which may run out of tokens
    assert all(out.reasoning_content and not out.tool_calls for out in called.outputs if out not in calls)
    for out in calls:
        assert out.text.lstrip().startswith("<tool_call>\n<function=get_weather>")
        [call] = out.tool_calls
        args = json.loads(call.arguments)
        jsonschema.validate(args, params)
        assert isinstance(args["days"], int)
    assert llm.chat(conv, SamplingParams(max_tokens=4), tools=[tool])[0].outputs[0].token_ids  # "auto"
    with pytest.raises(InvalidRequestError, match="nope"):
        llm.chat(conv, SamplingParams(max_tokens=4), tools=[tool], tool_choice={"type": "function",
                                                                                "function": {"name": "nope"}})
    assert llm.stats()["kv_blocks_used"] == 0
