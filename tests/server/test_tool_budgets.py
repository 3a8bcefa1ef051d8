"""Issue 41 rows 7, 9 and 10 (tools, tool turns, template kwargs, grammar processes) over HTTP on the
tiny model: a tool list is priced before it is paid for, and every malformed tool turn is a 400 naming
its field.

    row 7   10,000 tools sharing one schema, or 2,000 distinct: 400 naming max_tools before any tool is
            converted, rendered or compiled (was 240 s and +1.17 GB); tools over max_tool_bytes: 400;
            tools whose definitions make the prompt too long: 400 context_length_exceeded with nothing
            compiled; 20 tools, forced ("required" / a named function) or not: at most two compiles (the
            schemas checked as one grammar, the forced call's grammar), the same tools again none
    row 9   tool-call arguments nested 100,000 deep or holding "\\ud800", chat_template_kwargs naming the
            template's own globals or the renderer's arguments ({"namespace": 1}, {"self": 1}): 400 naming
            the field (were 500s); a grammar process killed mid-compile: the documented 400
    row 10  duplicate tool_call ids: 400; tools / chat_template_kwargs / other chat-only fields on
            /v1/completions: 400 naming them (were silently ignored); a client hanging up during a grammar
            compile kills no grammar worker (was InvalidStateError: CANCELLED), and the next compile works
The wall-clock bounds (the victim's worst gap while row 7's attacks run, the time before each 400)
are the `timing` test at the end.
"""
from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request

import pytest

from server_helpers import API_KEY, VictimStream, post, post_bytes, rss_bytes, wait_for
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import MiB, ServerConfig

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
SLOW = "start: " + " | ".join(f'"c{i}"' for i in range(64_000))  # ~20 s of compile: past the timeout


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, api_key=API_KEY), num_blocks=600,
                          grammar_compile_timeout=1.5) as s:
        yield s


def _tool(name: str, schema: dict = SCHEMA, description: str = "a tool") -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


def _distinct(n: int, description: str = "a tool") -> list[dict]:
    return [_tool(f"tool_{i}", {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 4}}},
                  description) for i in range(n)]


def _body(srv, **fields) -> dict:
    return {"model": srv.model_name, "messages": MESSAGES, "max_tokens": 4, **fields}


def _error(result, status: int = 400) -> dict:
    got, body = result
    assert got == status, (got, body)
    return body["error"]


def _compiles(srv) -> int:
    return srv.engine.engine.grammars.compiles


def test_too_many_tools_are_refused_before_any_is_converted(srv):
    before = _compiles(srv)
    for tools in ([_tool(f"t{i}") for i in range(10_000)], _distinct(2_000)):
        e = _error(post(srv.url, _body(srv, tools=tools)))
        assert (e["param"], e["code"]) == ("tools", "too_many_tools")
        assert f"holds {len(tools)} tools" in e["message"] and "max_tools=128" in e["message"]
        assert "--max-tools" in e["message"]
    big = [_tool(f"t{i}", description="d" * 12_000) for i in range(100)]  # 100 tools, 1.2 MB
    e = _error(post(srv.url, _body(srv, tools=big)))
    assert (e["param"], e["code"]) == ("tools", "tools_too_large")
    assert "max_tool_bytes=1048576" in e["message"] and "--max-tool-bytes" in e["message"]
    assert _compiles(srv) == before


def test_tools_that_make_the_prompt_too_long_compile_nothing(srv):
    before = _compiles(srv)
    words = " ".join(f"word{i} lorem ipsum" for i in range(55))  # ~1,000 characters: ~570 tokens a tool
    e = _error(post(srv.url, _body(srv, tools=_distinct(100, words), tool_choice="required")))
    assert e["code"] == "context_length_exceeded"
    assert _compiles(srv) == before  # neither the schemas' check nor the forced call's grammar


def test_many_tools_cost_at_most_two_compiles(srv):
    tools = _distinct(20)  # as many as the tiny model's 4,096 positions hold
    before = _compiles(srv)
    status, body = post(srv.url, _body(srv, tools=tools, tool_choice="required", max_tokens=40))
    assert status == 200, body
    assert _compiles(srv) == before + 2  # the 20 schemas checked as one grammar + the forced call's grammar
    assert post(srv.url, _body(srv, tools=tools, tool_choice="required", max_tokens=40))[0] == 200
    assert _compiles(srv) == before + 2  # the same tools again: both from the cache
    named = {"type": "function", "function": {"name": "tool_7"}}
    status, body = post(srv.url, _body(srv, tools=tools, tool_choice=named, max_tokens=40))
    assert status == 200 and body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "tool_7"
    assert _compiles(srv) == before + 3  # the check cached; the named call's grammar is new
    shared = [_tool(f"s{i}") for i in range(20)]  # one schema, 20 tools
    assert post(srv.url, _body(srv, tools=shared))[0] == 200
    assert _compiles(srv) == before + 4


def test_a_bad_schema_is_named_by_its_tool(srv):
    tools = _distinct(20)
    tools[17] = _tool("broken", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})
    e = _error(post(srv.url, _body(srv, tools=tools)))
    assert e["param"] == "tools[17].function.parameters" and "missing" in e["message"]


def _tool_turn(arguments: str, second_id: str | None = None) -> list[dict]:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]
    if second_id is not None:
        calls.append({"id": second_id, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}})
    return MESSAGES + [{"role": "assistant", "content": None, "tool_calls": calls},
                       {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


@pytest.mark.parametrize("messages,param,words", [
    (_tool_turn('{"city": ' + "[" * 100_000 + "]" * 100_000 + "}"), "messages[1].tool_calls[0].function.arguments",
     "nests deeper than 64 levels"),
    (_tool_turn('{"city": "\\ud800"}'), "messages[1].tool_calls[0].function.arguments", "lone surrogate U+D800"),
    (_tool_turn('{"city": "Oslo"}', second_id="call_1"), "messages[1].tool_calls[1].id", "the id of call 0"),
])
def test_bad_tool_turns_are_400s_naming_the_field(srv, messages, param, words):
    e = _error(post(srv.url, _body(srv, messages=messages, tools=[_tool("get_weather")])))
    assert e["param"] == param and words in e["message"]


@pytest.mark.parametrize("kwargs", [{"namespace": 1}, {"self": 1}, {"range": "x"}, {"return_tensors": "pt"}])
def test_template_kwargs_that_collide_with_the_renderer_are_refused(srv, kwargs):
    e = _error(post(srv.url, _body(srv, chat_template_kwargs=kwargs)))
    assert e["param"] == "chat_template_kwargs" and next(iter(kwargs)) in e["message"]


def _post_completions(srv, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("field,value", [("tools", [_tool("get_weather")]),
                                         ("chat_template_kwargs", {"enable_thinking": False}),
                                         ("tool_choice", "required"), ("max_completion_tokens", 5),
                                         ("messages", MESSAGES), ("top_logprobs", 2)])
def test_chat_only_fields_on_completions_are_refused(srv, field, value):
    e = _error(_post_completions(srv, {"model": srv.model_name, "prompt": "Hello", "max_tokens": 2, field: value}))
    assert (e["param"], e["code"]) == (field, "unsupported_parameter") and "/v1/chat/completions" in e["message"] \
        or "max_tokens" in e["message"] or "logprobs" in e["message"]
    off = {"tools": [], "tool_choice": "none", "chat_template_kwargs": {}}
    if field in off:  # what asks for nothing is accepted
        assert _post_completions(srv, {"model": srv.model_name, "prompt": "Hello", "max_tokens": 2,
                                       field: off[field]})[0] == 200


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _compiling_process(srv):
    """The grammar process that is compiling (its CPU time grows), once it has used 0.3 s."""
    found = []

    def busy():
        for proc in srv.engine.engine.grammars.processes:
            pid = proc.pid
            if pid is not None:
                try:
                    if _cpu_seconds(pid) >= 0.3:
                        found.append(proc)
                        return True
                except OSError:
                    pass
        return False
    assert wait_for(busy, timeout=60, interval=0.05), "no grammar process started compiling"
    return found[0]


def test_a_grammar_process_killed_mid_compile_is_a_400(srv):
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(post, srv.url, _body(srv, structured_outputs={"grammar": SLOW + ' | "k"'}))
        os.kill(_compiling_process(srv).pid, 9)
        e = _error(answer.result(timeout=120))
    assert e["param"] == "structured_outputs" and "ended with signal 9" in e["message"]
    status, body = post(srv.url, _body(srv, structured_outputs={"choice": ["yes", "no"]}))
    assert status == 200 and body["choices"][0]["message"]["content"] in ("yes", "no")


def test_a_client_hanging_up_mid_compile_kills_no_grammar_worker(srv):
    grammars = srv.engine.engine.grammars
    body = json.dumps(_body(srv, structured_outputs={"grammar": SLOW + ' | "h"'})).encode()
    host, port = srv.url.rsplit("/", 1)[-1].rsplit(":", 1)
    conn = socket.create_connection((host, int(port)))
    conn.sendall(post_bytes(body))
    proc = _compiling_process(srv)
    conn.close()  # the handler is cancelled, and with it the future it awaited
    assert wait_for(lambda: proc.pid is None, timeout=60, interval=0.1)  # the compile ran out its timeout
    assert grammars._workers and all(w.is_alive() for w in grammars._workers)
    for choice in (["a", "b"], ["c", "d"], ["e", "f"]):  # more than there are workers: each still serves
        assert post(srv.url, _body(srv, structured_outputs={"choice": choice}))[0] == 200


@pytest.mark.timing  # wall-clock bounds: ./run test runs these alone, after the rest
def test_row_7_beside_a_victim(srv):
    """Row 7's attacks while an innocent client streams: each 400 comes in under a second, the victim's
    worst gap stays under 0.5 s, and the server grows by less than 100 MiB; the largest tool list allowed
    (128 distinct tools, forced), too long for the tiny model's 4,096 positions, is refused with nothing
    compiled."""
    attacks = {
        "10,000 tools, one schema": _body(srv, tools=[_tool(f"t{i}") for i in range(10_000)]),
        "2,000 distinct tools": _body(srv, tools=_distinct(2_000)),
        "4 MB of tool-call arguments": _body(srv, messages=_tool_turn(json.dumps({"city": "x" * (4 * MiB)}))),
        "128 distinct tools, forced": _body(srv, tools=_distinct(128, "x" * 100), tool_choice="required"),
    }
    base, compiles = rss_bytes(), _compiles(srv)
    seconds = {}
    with VictimStream(srv.url, srv.model_name) as victim:
        t0 = time.monotonic()
        for name, body in attacks.items():
            data = json.dumps(body).encode()
            start = time.monotonic()
            status, answer = post(srv.url, None, raw=data, timeout=120)
            seconds[name] = time.monotonic() - start
            assert status == 400, (name, answer)
        t1 = time.monotonic()
        gap = victim.worst_gap(t0, t1)
    growth = rss_bytes() - base
    print(f"row 7: seconds before each 400 {seconds}; victim's worst gap {gap:.3f} s; RSS {growth / MiB:+.0f} MiB")
    assert _compiles(srv) == compiles
    assert all(s < 1.0 for s in seconds.values()), seconds
    assert gap < 0.5 and growth < 100 * MiB, (gap, growth)
