"""server/json_pieces.py: a large body parsed member by member equals json.loads, errors included, and
no single C call parses more than one member of the top levels (what lets the GIL change hands)."""
import json
import random

import pytest

from vlm_sdk.bench.red_team import pick_rows
from vlm_sdk.server import json_pieces
from vlm_sdk.server.body import decode_json


def _outcome(parse, text: str):
    try:
        return "ok", parse(text)
    except json.JSONDecodeError as e:
        return "error", e.msg, e.pos


EDGES = ['{}', '[]', ' { "a" : [1, 2, {"b": [3, {"c": [4, [5, [6]]]}]}], "a": 2 } ', '[1,]', '{"a":1,}', '{', '[',
         '[1', '{"a"', '{"a":', '{"a" 1}', '{1:2}', '"x"', '3', '  ', '', '[1] x', '{"a":NaN}', '[1 2]',
         '{"a":1 "b":2}', '\ufeff{}', '{"a":"\\ud800"}', '[[[[[[[[1]]]]]]]]', '{"a":[1,,2]}', '{"a": tru}', '[-]',
         '{"a":"unterminated}', '{"k\\u00e9": 1e400}', '{"a":{"b":{"c":{"d":{"e":[1,}}}}}']


@pytest.mark.parametrize("text", EDGES)
def test_equals_json_loads_on_edges(text):
    assert repr(_outcome(json_pieces.loads_in_pieces, text)) == repr(_outcome(json.loads, text))


def test_equals_json_loads_on_broken_bodies():
    """Random deletions, insertions and replacements of structural characters in a chat body with tools:
    the same value or the same error message at the same position."""
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi \u00e9"},
                                                                     {"type": "image_url", "image_url": {"url": "x"}}]}],
            "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
                      for i in range(3)], "n": 2, "x": [1.5, None, True, False]}
    rng = random.Random(0)
    for indent in (None, 1):
        base = json.dumps(body, indent=indent)
        for _ in range(2500):
            chars = list(base)
            for _ in range(rng.randint(1, 3)):
                i, op = rng.randrange(len(chars)), rng.random()
                if op < 0.4:
                    del chars[i]
                elif op < 0.8:
                    chars.insert(i, rng.choice('{}[],:" \n1a\\'))
                else:
                    chars[i] = rng.choice('{}[],:" 1')
            text = "".join(chars)
            assert repr(_outcome(json_pieces.loads_in_pieces, text)) == repr(_outcome(json.loads, text)), text


def test_a_large_body_is_parsed_one_member_per_call(monkeypatch):
    """10,000 tools (2 MB, issue 41 row 7's body): through decode_json, no C call spans two tools."""
    spans = []

    class Recording(json.JSONDecoder):
        def raw_decode(self, s, idx=0):
            value, end = super().raw_decode(s, idx)
            spans.append(end - idx)
            return value, end

    monkeypatch.setattr(json_pieces, "_DECODER", Recording())
    tool = {"type": "function", "function": {"name": "t", "description": "a tool", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
    value = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool] * 10_000}
    raw = json.dumps(value).encode()
    assert decode_json(raw, 200_000) == value
    assert len(spans) > 10_000 and max(spans) < len(json.dumps(tool))


def test_red_team_rows_filter_by_prefix_and_name_the_rows_there_are():
    table = [("41.7 tool lists", [], 1, False), ("41.9 tool turns", [], 1, False), ("28.1 x", [], 1, False)]
    assert [r[0] for r in pick_rows(table, "41.7, 28")] == ["41.7 tool lists", "28.1 x"]
    assert pick_rows(table, None) is table
    with pytest.raises(ValueError, match=r"no row starts with 99.*the rows are 41.7, 41.9, 28.1"):
        pick_rows(table, "41.7,99")
