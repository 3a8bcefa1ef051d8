"""Structured outputs over HTTP with the official `openai` package on the tiny server: 20 schema-
constrained requests at temperature 1 (different seeds, sent together so they share steps with free
ones) all parse and validate with `jsonschema`; json_object replies parse; a schema the engine cannot
compile is a 400 naming the problem; vLLM's structured_outputs / guided_* fields; streaming; "length"
when max_tokens cuts the value short."""
import asyncio
import json
import re

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from server_helpers import API_KEY
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

MESSAGES = [{"role": "user", "content": "Extract the receipt as JSON."}]
RECEIPT = {
    "type": "object",
    "properties": {
        "store": {"type": "string", "maxLength": 16},
        "total": {"type": "number", "minimum": 0, "maximum": 1000},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["name", "qty"], "additionalProperties": False}},
    },
    "required": ["store", "total", "currency", "items"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "receipt", "schema": RECEIPT, "strict": True}}


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny")) as s:
        yield s


def _client(srv) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)


def test_twenty_seeded_schema_requests_all_validate(srv):
    async def main():
        client = AsyncOpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        constrained = [client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=s,
                                                      max_tokens=300, response_format=FORMAT) for s in range(20)]
        free = [client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=s,
                                               max_tokens=20) for s in range(4)]
        results = await asyncio.gather(*constrained, *free)
        await client.close()
        return results[:20], results[20:]
    constrained, free = asyncio.run(main())
    texts = []
    for resp in constrained:
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), RECEIPT)
        texts.append(choice.message.content)
    assert len(set(texts)) > 10  # twenty seeds, twenty draws of valid receipts
    assert all(r.choices[0].message.content for r in free)  # the free ones in the same steps ran as usual


def test_json_object_replies_parse(srv):
    client = _client(srv)
    for seed in range(4):
        resp = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=seed,
                                              max_tokens=400, response_format={"type": "json_object"})
        choice = resp.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # random weights may fill a free-form object until max_tokens
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_cut_short_is_length(srv):
    resp = _client(srv).chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=1,
                                                max_tokens=4, response_format=FORMAT)
    assert resp.choices[0].finish_reason == "length"


def test_bad_schema_is_a_400_naming_it(srv):
    client = _client(srv)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, response_format=bad)
    assert e.value.param == "response_format" and "missing" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                       response_format={"type": "xml"})
    assert e.value.param == "response_format.type"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                       extra_body={"structured_outputs": {"regex": "[a-"}})
    assert e.value.param == "structured_outputs"
    assert srv.stats()["kv_blocks_used"] == 0  # refused before anything ran
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].message.content is not None  # the server serves on


def test_regex_choice_and_guided_aliases(srv):
    client = _client(srv)
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=2, max_tokens=20,
                                          extra_body={"structured_outputs": {"regex": r"[A-Z]{2}[0-9]{4}"}})
    assert re.fullmatch(r"[A-Z]{2}[0-9]{4}", resp.choices[0].message.content)
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=2, max_tokens=20,
                                          extra_body={"guided_choice": ["receipt", "invoice"]})
    assert resp.choices[0].message.content in ("receipt", "invoice")
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=3, max_tokens=300,
                                          extra_body={"guided_json": RECEIPT})
    jsonschema.validate(json.loads(resp.choices[0].message.content), RECEIPT)


def test_streamed_schema_output_validates(srv):
    stream = _client(srv).chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=5,
                                                  max_tokens=300, response_format=FORMAT, stream=True)
    parts, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads("".join(parts)), RECEIPT)
