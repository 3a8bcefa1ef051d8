"""Every field of OpenAI's legacy completions request (the installed `openai` package's
`completion_create_params`) is honoured or refused with a 400 naming it, and the request's shapes
(the four prompt shapes, max_tokens' default, echo, logprobs) read as vLLM reads them."""
import typing

import pytest
from openai.types import completion_create_params

from vlm_sdk.multimodal.prompts import TextPrompt, TokensPrompt
from vlm_sdk.server.completions import DEFAULT_MAX_TOKENS, parse_completion_request
from vlm_sdk.server.protocol import APIError

BASE = {"model": "m", "prompt": "hi"}
HONOURED = {
    "model": "m", "prompt": ["a", "b"], "best_of": 2, "echo": True, "frequency_penalty": 0.5,
    "logit_bias": {"1": 5}, "logprobs": 3, "max_tokens": 5, "n": 2, "presence_penalty": 0.5, "seed": 3,
    "stop": ["x"], "stream_options": {"include_usage": True}, "temperature": 0.5, "top_p": 0.9, "user": "u1",
}
REFUSED = {"suffix": "the end", "best_of": 3}


def _parse(body, **limits):
    return parse_completion_request(body, "m", **limits)


def test_every_field_is_classified():
    fields = set(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase))
    assert "prompt" in fields and "suffix" in fields  # the field list really is OpenAI's
    missing = sorted(fields - set(HONOURED) - set(REFUSED))
    assert not missing, f"OpenAI completions fields neither honoured nor refused here: {missing}"


@pytest.mark.parametrize("name", sorted(HONOURED))
def test_honoured_field_is_accepted(name):
    needs = {"stream_options": {"stream": True}, "best_of": {"n": 2}}.get(name, {})
    if name == "echo":  # echo is refused with logprobs only
        needs = {"logprobs": None}
    _parse({**BASE, **needs, name: HONOURED[name]})


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_field_is_a_400_naming_it(name):
    with pytest.raises(APIError) as e:
        _parse({**BASE, name: REFUSED[name]})
    body = e.value.body()["error"]
    assert (e.value.status, body["code"], body["param"]) == (400, "unsupported_parameter", name)
    assert f"'{name}'" in body["message"]


def test_the_four_prompt_shapes_and_the_defaults():
    assert _parse(BASE).prompts == [TextPrompt("hi")]
    assert _parse({**BASE, "prompt": ["a", "b"]}).prompts == [TextPrompt("a"), TextPrompt("b")]
    assert _parse({**BASE, "prompt": [1, 2.0, 3]}).prompts == [TokensPrompt((1, 2, 3))]  # JSON 2.0 is 2
    assert _parse({**BASE, "prompt": [[1], [2, 3]]}).prompts == [TokensPrompt((1,)), TokensPrompt((2, 3))]
    req = _parse(BASE)
    assert req.params.max_tokens == DEFAULT_MAX_TOKENS == 16 and req.params.n == 1 and req.generate
    assert _parse({**BASE, "max_tokens": None}).params.max_tokens == 16  # null is the default, as in vLLM
    assert (req.echo, req.stream, req.include_usage, req.params.logprobs) == (False, False, False, None)
    req = _parse({**BASE, "prompt": ["a", "b", "c"], "n": 2, "logprobs": 0, "stream": True,
                  "stream_options": {"include_usage": True}, "top_k": 4, "ignore_eos": True})
    assert req.num_choices == 6 and req.params.logprobs == 0 and req.stream and req.include_usage
    assert req.params.top_k == 4 and req.params.ignore_eos  # vLLM's extra sampling fields, as chat reads them
    echo_only = _parse({**BASE, "echo": True, "max_tokens": 0})
    assert echo_only.echo and not echo_only.generate


@pytest.mark.parametrize("body, param, code, words", [
    ({"model": "m"}, "prompt", None, ["'prompt' is required"]),
    ({**BASE, "prompt": ""}, "prompt", None, ["empty string"]),
    ({**BASE, "prompt": []}, "prompt", None, ["non-empty"]),
    ({**BASE, "prompt": [[]]}, "prompt", None, ["'prompt[0]'"]),
    ({**BASE, "prompt": [1, -2]}, "prompt", None, ["-2", ">= 0"]),
    ({**BASE, "prompt": {"text": "x"}}, "prompt", None, ["list of token ids"]),
    ({**BASE, "prompt": ["x"] * 5}, "prompt", "too_many_prompts", ["5 prompts", "at most 4",
                                                                   "--max-completion-prompts"]),
    ({**BASE, "n": 9}, "n", "too_many_choices", ["--max-n"]),
    ({**BASE, "prompt": ["x"] * 3, "n": 6}, "n", "too_many_sequences", ["3 prompts x 'n' 6 = 18 sequences",
                                                                        "at most 16", "--max-sequences-per-request"]),
    ({**BASE, "max_tokens": 0}, "max_tokens", None, [">= 1"]),
    ({**BASE, "logprobs": 21}, "logprobs", None, ["0 to 20"]),
    ({**BASE, "logprobs": True}, "logprobs", None, ["0 to 20"]),
    ({**BASE, "echo": "yes"}, "echo", None, ["true or false"]),
    ({**BASE, "echo": True, "logprobs": 1}, "logprobs", "unsupported_parameter", ["prompt tokens' logprobs"]),
    ({**BASE, "stream_options": {"include_usage": True}}, "stream_options", None, ["'stream' is true"]),
    ({**BASE, "seed": 2 ** 63}, "seed", None, [str(2 ** 63 - 1)]),
    ({**BASE, "model": "other"}, "model", "model_not_found", ["'m'"]),
])
def test_bad_request_is_a_400_naming_the_field(body, param, code, words):
    with pytest.raises(APIError) as e:
        _parse(body, max_prompts=4, max_sequences=16)
    err = e.value.body()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert e.value.status == (404 if code == "model_not_found" else 400)
    for word in words:
        assert word in err["message"], err["message"]


def test_chat_n_counts_against_the_sequences_per_request_too():
    from vlm_sdk.server.protocol import parse_chat_request
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 12}
    assert parse_chat_request(body, "m", 4096, 8, max_n=16, max_sequences=12).params.n == 12
    with pytest.raises(APIError) as e:
        parse_chat_request(body, "m", 4096, 8, max_n=16, max_sequences=10)
    err = e.value.body()["error"]
    assert (e.value.status, err["code"], err["param"]) == (400, "too_many_sequences", "n")
    assert "'n' 12 sequences" in err["message"] and "--max-sequences-per-request" in err["message"]
