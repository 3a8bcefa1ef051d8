"""Structured outputs in the Python API on the tiny random-weight checkpoint: whatever the weights say,
the output matches the schema / regex / choices; the mask touches only its own rows of a batch; a
grammar is compiled once (cached) and never on the engine thread; whitespace between JSON tokens is
bounded even when the model wants nothing else; max_tokens cutting a value short is "length"."""
import asyncio
import json
import re
import threading

import jsonschema
import pytest

from vlm_sdk import LLM, AsyncLLM, SamplingParams
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.engine.structured_output import GrammarCompiler, JSON_WHITESPACE

CONV = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["cook", "pilot", "nurse"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


def schema_format(schema=PERSON) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, show_progress=False)


def test_schema_outputs_validate_at_temperature_one(llm):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, response_format=schema_format())
              for s in range(8)]
    outs = llm.chat([CONV] * 8, params)
    texts = [o.text for o in outs]
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len(set(texts)) > 1  # seeds draw different (valid) objects


def test_json_object_regex_choice_and_grammar(llm):
    obj = llm.chat(CONV, SamplingParams(temperature=1.0, seed=3, max_tokens=300,
                                        response_format={"type": "json_object"}))[0]
    if obj.finish_reason == "stop":  # a free-form object may run to max_tokens on random weights
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.finish_reason == "length" and obj.text.startswith("{")
    regex = r"[0-9]{3}-[a-z]{2,4}"
    for seed in range(3):
        out = llm.chat(CONV, SamplingParams(temperature=1.0, seed=seed, max_tokens=20,
                                            structured_outputs={"regex": regex}))[0]
        assert re.fullmatch(regex, out.text) and out.finish_reason == "stop"
    choices = ["yes", "no", "maybe so"]
    seen = {llm.chat(CONV, SamplingParams(temperature=1.0, seed=s, max_tokens=20,
                                          structured_outputs={"choice": choices}))[0].text for s in range(6)}
    assert seen <= set(choices)
    lark = 'start: "ab" NUM\nNUM: /[0-9]{2}/'
    out = llm.chat(CONV, SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                                        structured_outputs={"grammar": lark}))[0]
    assert re.fullmatch(r"ab[0-9]{2}", out.text)


def test_max_tokens_cutting_a_value_short_is_length(llm):
    out = llm.chat(CONV, SamplingParams(temperature=1.0, seed=0, max_tokens=3, response_format=schema_format()))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_mask_leaves_other_rows_of_the_batch_alone(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)]
    alone = llm.chat([CONV] * 2, free)
    constrained = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, response_format=schema_format())
                   for s in range(3)]
    mixed = llm.chat([CONV] * 5, [free[0], constrained[0], free[1], constrained[1], constrained[2]])
    assert mixed[0].token_ids == alone[0].token_ids
    assert mixed[2].token_ids == alone[1].token_ids
    done = [out for out in (mixed[1], mixed[3], mixed[4]) if out.finish_reason == "stop"]
    assert len(done) == 3
    for out in done:
        jsonschema.validate(json.loads(out.text), PERSON)


def test_logprobs_are_of_the_constrained_distribution(llm):
    out = llm.chat(CONV, SamplingParams(temperature=0.0, max_tokens=10, logprobs=5,
                                        structured_outputs={"choice": ["alpha", "beta"]}))[0]
    assert out.text in ("alpha", "beta")
    first = out.logprobs[0]
    finite = [v for _, v in first.top_logprobs if v != float("-inf")]
    # the first token: only the tokens that begin "alpha" or "beta" have any mass
    assert 1 <= len(finite) < 5 and first.top_logprobs[0][0] == first.token_id
    assert sum(pow(2.718281828459045, v) for v in finite) == pytest.approx(1.0, abs=1e-4)


def test_whitespace_between_json_tokens_is_bounded(llm):
    """A model that wants only whitespace: every whitespace token biased by +100. The mask lets a
    bounded run through at each gap, so the object still closes well before max_tokens."""
    ws = [t for t in range(llm.engine.grammars.vocab_size)
          if (s := llm.tokenizer.decode([t])) and not s.strip() and s in (" ", "\n", "\t", "\r", "  ")]
    assert ws
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    out = llm.chat(CONV, SamplingParams(temperature=0.0, max_tokens=400, response_format=schema_format(schema),
                                        logit_bias={t: 100 for t in ws}))[0]
    assert out.finish_reason == "stop", repr(out.text)
    assert json.loads(out.text)["a"] in range(10)
    gaps = re.findall(r"\s+", out.text)
    assert gaps and all(re.fullmatch(JSON_WHITESPACE, g) for g in gaps), repr(out.text)
    assert len(out.token_ids) < 200


def test_bad_schema_regex_and_field_are_refused_naming_them(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.chat(CONV, SamplingParams(response_format=schema_format({"type": "object", "properties":
                                                                      {"a": {"$ref": "#/nope"}}})))
    assert e.value.param == "response_format" and "nope" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        llm.chat(CONV, SamplingParams(structured_outputs={"regex": "(ab"}))
    assert e.value.param == "structured_outputs" and "regex" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}})
    assert e.value.param == "response_format.json_schema.schema"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(structured_outputs={"choice": []})
    assert e.value.param == "structured_outputs.choice"
    with pytest.raises(InvalidRequestError):
        SamplingParams(response_format={"type": "json_object"}, structured_outputs={"regex": "a"})
    with pytest.raises(InvalidRequestError) as e:  # the grammar's end would be masked: refused, not ignored
        SamplingParams(min_tokens=10, structured_outputs={"choice": ["yes", "no"]})
    assert e.value.param == "min_tokens"
    assert llm.engine.stats()["kv_blocks_used"] == 0  # nothing was left running


def test_compiled_once_and_off_the_engine_thread(tiny_ckpt):
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=200, response_format=schema_format())
    threads = []

    async def main():
        async with AsyncLLM(tiny_ckpt) as engine:
            compiler: GrammarCompiler = engine.engine.grammars
            build = compiler._build

            def spy(spec, proc, validate_only):
                threads.append(threading.current_thread().name)
                return build(spec, proc, validate_only)
            compiler._build = spy
            outs = await asyncio.gather(*(engine.chat(CONV, params.sample(i)) for i in range(4)))
            return outs, compiler.compiles

    outs, compiles = asyncio.run(main())
    assert compiles == 1  # four requests, one schema: one compile, the rest from the cache
    assert threads and all(name != "vlm-engine" for name in threads)
    assert all(out.finish_reason == "stop" for out in outs)
    for out in outs:
        jsonschema.validate(json.loads(out.text), PERSON)


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.chat(CONV, SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=200,
                                        response_format=schema_format()))[0]
    assert len(out.outputs) == 3
    for sample in out.outputs:
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(sample.text), PERSON)


def test_preemption_changes_no_constrained_token(tiny_ckpt, llm):
    """A preempted constrained request keeps its matcher (its output tokens are kept and recomputed),
    so it generates exactly what it does with room to spare."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, response_format=schema_format())
              for s in range(4)]
    free = llm.chat([CONV] * 4, params)
    longest = max(len(o.prompt_token_ids) + 60 for o in free)
    blocks = -(-longest // 16) + 1  # the longest fits alone; four at once do not
    tight = LLM(tiny_ckpt, num_blocks=blocks, allow_unfit_images=True, show_progress=False)
    outs = tight.chat([CONV] * 4, params)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in free]
    assert tight.stats()["kv_blocks_used"] == 0
