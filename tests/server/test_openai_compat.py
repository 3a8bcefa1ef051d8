"""Issue 36's chat points, each through the official `openai` client against the server on the tiny
model, answered as OpenAI and vLLM answer them (or as the README says we deliberately differ):
the developer role, null assistant content, unknown image-part keys, max_tokens past the context,
stream_options without stream, a bare-string image_url, the seed range, a body that is not JSON."""
import openai
import pytest
from openai import OpenAI

from helpers import image
from server_helpers import API_KEY, data_url
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

IMG = data_url(image(96, 64, 3))
GREEDY = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny")) as s:
        yield s


def _chat(srv, messages, **kw):
    kw = {**GREEDY, **kw}
    return OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
        model="tiny", messages=messages, **kw)


def _bad(srv, messages, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(srv, messages, **kw)
    assert info.value.status_code == 400
    return info.value


def _same(a, b) -> bool:
    return (a.choices[0].message.content, a.usage.prompt_tokens) == (b.choices[0].message.content,
                                                                      b.usage.prompt_tokens)


def test_developer_role_is_the_system_instruction(srv):
    """OpenAI's developer messages replace system messages; the served families' templates know only
    system, so the template gets role system (vLLM passes "developer" to the template as is)."""
    question = {"role": "user", "content": "Name a colour."}
    as_developer = _chat(srv, [{"role": "developer", "content": "Answer in one word."}, question])
    as_system = _chat(srv, [{"role": "system", "content": "Answer in one word."}, question])
    assert _same(as_developer, as_system)
    assert as_developer.usage.prompt_tokens != _chat(srv, [question]).usage.prompt_tokens


def test_assistant_content_may_be_null(srv):
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
             {"role": "user", "content": "Hello?"}]
    empty = [turns[0], {"role": "assistant", "content": ""}, turns[2]]
    assert _same(_chat(srv, turns), _chat(srv, empty))
    missing = [turns[0], {"role": "assistant"}, turns[2]]
    assert _same(_chat(srv, missing), _chat(srv, empty))
    err = _bad(srv, [{"role": "user", "content": None}])  # only an assistant's content may be null
    assert "content" in err.message


def test_unknown_image_part_keys_are_ignored(srv):
    """OpenAI and vLLM ignore keys they do not know on an image part, as they do elsewhere; a size
    setting of another family is still refused (it would not be applied)."""
    def msg(**keys):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMG, **keys}},
                                             {"type": "text", "text": "What is it?"}]}]
    plain = _chat(srv, msg())
    assert _same(_chat(srv, msg(some_key=1, detail="low", uuid="abc")), plain)
    assert _same(_chat(srv, msg(max_pixels=None)), plain)
    err = _bad(srv, msg(max_num=2))  # InternVL's tile setting, sent to a Qwen2.5-VL model
    assert err.body["param"] == "max_num" and "InternVL" in err.message


def test_max_tokens_past_the_context_is_a_400_naming_the_numbers(srv):
    limit = srv.stats()["max_model_len"]
    prompt = [{"role": "user", "content": "Hi"}]
    n = _chat(srv, prompt, max_tokens=1).usage.prompt_tokens
    for name in ("max_tokens", "max_completion_tokens"):
        err = _bad(srv, prompt, **{"max_tokens": None, name: limit})
        assert (err.body["param"], err.body["code"]) == (name, "context_length_exceeded")
        for word in (f"'{name}' is {limit}", f"{n} tokens", f"holds {limit}", f"at most {limit - n}"):
            assert word in err.message, err.message
    fits = _chat(srv, prompt, max_tokens=limit - n, extra_body={})  # exactly the room left: served
    assert fits.choices[0].finish_reason in ("stop", "length")
    assert srv.stats()["kv_blocks_used"] == 0


def test_stream_options_needs_stream(srv):
    err = _bad(srv, [{"role": "user", "content": "Hi"}], stream_options={"include_usage": True})
    assert err.body["param"] == "stream_options" and "'stream' is true" in err.message
    ok = _chat(srv, [{"role": "user", "content": "Hi"}], stream=True, stream_options={"include_usage": True})
    assert list(ok)[-1].usage is not None


def test_image_url_must_be_an_object(srv):
    err = _bad(srv, [{"role": "user", "content": [{"type": "image_url", "image_url": IMG},
                                                  {"type": "text", "text": "What is it?"}]}])
    assert "must be an object" in err.message and '{"url": ...}' in err.message


def test_seed_is_a_signed_64_bit_integer(srv):
    msgs = [{"role": "user", "content": "Hi"}]
    for seed in (2 ** 63 - 1, -(2 ** 63)):
        assert _chat(srv, msgs, seed=seed, temperature=1.0).choices[0].message.content is not None
    for seed in (2 ** 63, 2 ** 64 - 1):
        err = _bad(srv, msgs, seed=seed, temperature=1.0)
        assert err.body["param"] == "seed" and str(2 ** 63 - 1) in err.message


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_declared_json_is_a_415(srv, content_type):
    with pytest.raises(openai.APIStatusError) as info:
        _chat(srv, [{"role": "user", "content": "Hi"}], extra_headers={"Content-Type": content_type})
    assert info.value.status_code == 415
    assert info.value.body["code"] == "unsupported_media_type" and content_type in info.value.message
    client = OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny", prompt="Hi", extra_headers={"Content-Type": content_type})
    assert info.value.status_code == 415
    assert _chat(srv, [{"role": "user", "content": "Hi"}],  # with parameters it is still JSON
                 extra_headers={"Content-Type": "application/json; charset=utf-8"}).choices
