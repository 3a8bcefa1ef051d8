"""vLLM's extensions of the OpenAI API (issue 50 point 9) and its logit_bias errors (point 8), through the
official `openai` client on the tiny Qwen2.5-VL server, with vLLM's own test expectations
(tests/entrypoints/openai/basic/test_return_token_ids.py, test_chat_echo.py,
chat_completion/test_chat_logit_bias_validation.py): prompt_token_ids / token_ids, chat echo,
prompt_logprobs (against transformers on the same checkpoint), /tokenize, /detokenize, /version, media
uuids, and a stream's last chunk carrying its last token's text with finish_reason."""
import json
import urllib.error
import urllib.request

import openai
import pytest
import torch
from openai import OpenAI
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from helpers import image
from server_helpers import API_KEY, data_url, get
from tolerance import forward_terms, reduction_atol
from vlm_sdk import __version__
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What's the weather like in Paris? 🐱"}]


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny",
                                                  media_uuid_cache_bytes=1 << 20)) as s:
        yield s


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return AutoTokenizer.from_pretrained(tiny_ckpt)


def _client(srv) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)


def _post(srv, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_return_token_ids(srv, tok):
    """vLLM's test_chat_completion_with_emoji_and_token_ids / test_basic_completion_with_emoji, shortened."""
    client = _client(srv)
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                          extra_body={"return_token_ids": True})
    prompt_text = tok.decode(resp.prompt_token_ids)
    assert "You are a helpful assistant." in prompt_text and "Paris? 🐱" in prompt_text
    assert len(resp.choices[0].token_ids) == resp.usage.completion_tokens
    assert tok.decode(resp.choices[0].token_ids).startswith(resp.choices[0].message.content)
    # streamed: the prompt's ids in the first chunk only, each chunk's new token ids after
    ids, text, finish = [], "", None
    for i, chunk in enumerate(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                                              temperature=0, stream=True,
                                                              extra_body={"return_token_ids": True})):
        dump = chunk.model_dump()
        assert ("prompt_token_ids" in dump and dump["prompt_token_ids"] is not None) == (i == 0)
        if i == 0:
            assert tok.decode(chunk.prompt_token_ids) == prompt_text
        ids += (chunk.choices[0].model_extra or {}).get("token_ids") or []
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (ids, text, finish) == (resp.choices[0].token_ids, resp.choices[0].message.content, "length")
    without = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                             extra_body={"return_token_ids": False}).model_dump()
    assert without.get("prompt_token_ids") is None and without["choices"][0].get("token_ids") is None
    done = client.completions.create(model="tiny", prompt="I love coding 🚀", max_tokens=4, temperature=0,
                                     extra_body={"return_token_ids": True})
    encoded = tok.encode("I love coding 🚀")
    assert done.choices[0].prompt_token_ids == encoded
    assert tok.decode(done.choices[0].token_ids).startswith(done.choices[0].text)
    streamed = list(client.completions.create(model="tiny", prompt="I love coding 🚀", max_tokens=4, temperature=0,
                                              stream=True, extra_body={"return_token_ids": True}))
    assert streamed[0].choices[0].prompt_token_ids == encoded
    assert sum((c.choices[0].token_ids for c in streamed), []) == done.choices[0].token_ids


def test_chat_echo(srv):
    """vLLM's test_chat_session_with_echo: the last message's content first, when it is the assistant's."""
    saying = "Here is a common saying about apple. An apple a day, keeps"
    messages = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}]
    client = _client(srv)
    for echo in (True, False):
        msg = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, seed=2,
                                             extra_body={"echo": echo}).choices[0].message
        assert (msg.content is not None and saying in msg.content) == echo
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, seed=2, stream=True, extra_body={"echo": True}))
    assert streamed.startswith(saying)
    # the last message is the user's: nothing to echo
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, seed=2,
                                           extra_body={"echo": True}).choices[0].message.content
    assert "Paris" not in plain
    # the prompt always opens a new assistant turn: a request to continue the last one is refused, not ignored
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert e.value.body["param"] in ("continue_final_message", "add_generation_prompt")


def test_prompt_logprobs_match_transformers(srv, tiny_ckpt):
    """vLLM's test_prompt_logprobs (chat) and test_comparison_with_prompt_logprobs (completions), the values
    checked against transformers' log-softmax on the same checkpoint."""
    client = _client(srv)
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 7, 8]
    done = client.completions.create(model="tiny", prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": 2})
    plp = done.choices[0].prompt_logprobs
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    atol = reduction_atol(reference, forward_terms(layers=2, hidden=64, intermediate=128, tokens=len(ids),
                                                   head_dim=16) + reference.shape[1])
    assert plp[0] is None and len(plp) == len(ids)
    for i in range(1, len(ids)):
        entry = plp[i]
        assert list(entry)[0] == str(ids[i]) and 2 <= len(entry) <= 3
        for token, value in entry.items():
            assert abs(value["logprob"] - reference[i - 1, int(token)].item()) <= atol
            assert isinstance(value["decoded_token"], str)
        assert [v["rank"] for t, v in entry.items() if t != str(ids[i])][:2] in ([1, 2], [1], [2])
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == len(chat.prompt_token_ids)
    assert all(list(e) == [str(t)] for e, t in zip(chat.prompt_logprobs[1:], chat.prompt_token_ids[1:]))
    with pytest.raises(openai.BadRequestError) as e:  # vLLM: "not available when stream=True"
        list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stream=True,
                                            extra_body={"prompt_logprobs": 1}))
    assert e.value.body["param"] == "prompt_logprobs"


def test_tokenize_detokenize_version(srv, tok):
    status, out = _post(srv, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and out["tokens"] == tok.encode("Hello world") and out["count"] == len(out["tokens"])
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"]) and out["max_model_len"] == srv.engine.stats()["max_model_len"]
    # messages: the prompt a chat request runs (its usage counts the same tokens), image tokens included
    img = data_url(image(64, 48, seed=3))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": img}},
                                             {"type": "text", "text": "What is this?"}]}]
    status, out = _post(srv, "/tokenize", {"model": "tiny", "messages": messages})
    usage = _client(srv).chat.completions.create(model="tiny", messages=messages, max_tokens=1).usage
    assert status == 200 and out["count"] == usage.prompt_tokens
    status, back = _post(srv, "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and back["prompt"] == tok.decode(out["tokens"], skip_special_tokens=False)
    status, err = _post(srv, "/detokenize", {"tokens": [1, 10 ** 9]})
    assert status == 400 and str(10 ** 9) in err["error"]["message"]
    status, err = _post(srv, "/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404
    assert json.loads(get(srv.url, "/version", key=None)[1]) == {"version": __version__}


def test_media_uuids(srv):
    """An image sent once with a uuid is referred to by the uuid alone; an unknown uuid, or one kept for
    another cache_salt, is a 400 naming the part."""
    client = _client(srv)

    def ask(url, uuid="cat-1", **extra):
        return client.chat.completions.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": url, "uuid": uuid}, {"type": "text", "text": "What is this?"}]}],
            extra_body=extra or None)
    first = ask({"url": data_url(image(64, 48, seed=4))})
    for again in (ask(None), ask({"url": ""})):
        assert again.usage.prompt_tokens == first.usage.prompt_tokens
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same pixels: the image's blocks hit
    for call in (lambda: ask(None, uuid="never-sent"), lambda: ask(None, cache_salt="tenant-b")):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["code"] == "unknown_media_uuid" and e.value.body["param"] == "messages[0].content[0]"


def test_last_chunk_carries_the_last_text(srv, tok):
    """vLLM sends the last token's text with finish_reason; a separate empty finish chunk was sent before."""
    client = _client(srv)
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                           extra_body={"return_token_ids": True}).choices[0]
    chunks = [c for c in client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                                        stream=True) if c.choices]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    texts = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(texts) == whole.message.content
    # the last token's own text ends the finish chunk; bytes of an unfinished character held back before it
    # (this random model's output has some) are flushed with it
    ids = whole.token_ids
    last = tok.decode(ids)[len(tok.decode(ids[:-1])):]
    assert last and texts[-1].endswith(last)


def test_logit_bias_errors_name_every_bad_key(srv):
    """vLLM's test_chat_logit_bias_multiple_non_integer_keys / _invalid."""
    client = _client(srv)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                       logit_bias={"bad1": 50.0, "bad2": 20.0, "7": 1.0})
    assert "bad1" in str(e.value) and "bad2" in str(e.value) and e.value.body["param"] == "logit_bias"
    vocab = srv.engine.engine.inputs.vocab_size
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                       logit_bias={str(vocab + 1): 1.0, str(vocab + 5): 1.0})
    assert str(vocab + 1) in str(e.value) and str(vocab + 5) in str(e.value) and str(vocab) in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                       logit_bias={"1": "not_a_number", "2": 500})
    assert "logit_bias" in str(e.value) and "1:" in str(e.value) and "2: 500" in str(e.value)
