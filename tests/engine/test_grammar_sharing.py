"""Issue 41 rows 7, 9 and 10 at the grammar compiler, without an engine: grammars are known by their
content, so N tools sharing one schema, or one schema sent under two fields, compile once (counted);
a request's tool schemas are checked as one grammar whose error names the tool; a caller that goes
away (a client hanging up: asyncio cancels the future it awaits) neither kills a compile worker nor
takes the compile from others who asked; a grammar process killed while it starts is replaced
before the grammar is judged."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from vlm_sdk.chat_options import ChatOptions
from vlm_sdk.engine.input.chat_setup import schemas_grammar
from vlm_sdk.engine.structured_output import GrammarCompiler
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.model_loader import load_tokenizer
from vlm_sdk.sampling_params import SamplingParams, StructuredOutputs

VOCAB = 1024  # the tiny checkpoint's logits width
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
BAD = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
SLOW = "start: " + " | ".join(f'"c{i}"' for i in range(64_000))  # ~20 s of compile: over any timeout here


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


@pytest.fixture
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id], timeout=2.0, workers=1)
    yield c
    c.close()


def _tools(schemas) -> tuple:
    return ChatOptions(tools=[{"type": "function", "function": {"name": f"f{i}", "parameters": s}}
                              for i, s in enumerate(schemas)]).tools


def _check(compiler, tools):
    text, line_params = schemas_grammar(tools)
    return compiler.submit(StructuredOutputs("grammar", text, "tools"), validate_only=True, line_params=line_params)


def test_identical_schemas_compile_once(compiler):
    text, _ = schemas_grammar(_tools([SCHEMA] * 10_000))
    assert text.count("%json") == 1  # 10,000 tools, one schema: one line of the grammar
    assert _check(compiler, _tools([SCHEMA] * 10_000)).result() is None
    assert compiler.compiles == 1
    assert _check(compiler, _tools([SCHEMA] * 3)).result() is None  # the same content: a hit
    assert compiler.compiles == 1
    distinct = [{"type": "object", "properties": {f"p{i}": {"type": "string"}}} for i in range(200)]
    _check(compiler, _tools(distinct)).result()
    assert compiler.compiles == 2  # 200 distinct schemas: one grammar, one compile
    # a schema is known by its text, not the field it came from
    a = SamplingParams(structured_outputs={"json": SCHEMA}).grammar
    b = SamplingParams(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}).grammar
    assert (a.param, b.param) == ("structured_outputs", "response_format") and a.text == b.text
    assert compiler.compile(a) is compiler.compile(b)
    assert compiler.compiles == 3


def test_the_error_names_the_tool_and_each_asker_its_own_field(compiler):
    with pytest.raises(InvalidRequestError) as e:
        _check(compiler, _tools([SCHEMA, {"type": "object"}, BAD, SCHEMA, BAD])).result()
    assert e.value.param == "tools[2].function.parameters"  # the first tool with the bad schema
    message = str(e.value)
    assert message.startswith("'tools[2].function.parameters': cannot be compiled: failed to compile JSON schema")
    assert "missing" in message and "%json" not in message  # llguidance's quoted grammar lines left out
    # two askers of one failing compile, under different fields: each error names the asker's own
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(ab"}}}
    f1 = compiler.submit(SamplingParams(structured_outputs={"json": bad}).grammar)
    f2 = compiler.submit(SamplingParams(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": bad}}).grammar)
    params = []
    for f in (f1, f2):
        with pytest.raises(InvalidRequestError) as e:
            f.result()
        params.append(e.value.param)
    assert params == ["structured_outputs", "response_format"]


def _wait_for_cpu(pid: int, seconds: float) -> None:
    """Until the process `pid` has used `seconds` of CPU (its compile is under way)."""
    def cpu():
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    base, deadline = cpu(), time.monotonic() + 60
    while cpu() - base < seconds and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_caller_that_goes_away_kills_no_worker(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id], timeout=1.0, workers=1)
    compiler.compile(StructuredOutputs("choice", '["warm"]'))  # the process started
    worker = compiler._workers[0]

    async def hang_up(spec, after):
        task = asyncio.ensure_future(asyncio.wrap_future(compiler.submit(spec)))
        await after()
        task.cancel()  # what a disconnected client's handler does: wrap_future cancels the future
        with pytest.raises(asyncio.CancelledError):
            await task

    async def main():
        proc = compiler.processes[0]
        # cancelled while compiling: its result has nobody to go to
        await hang_up(StructuredOutputs("grammar", SLOW), lambda: asyncio.to_thread(_wait_for_cpu, proc.pid, 0.3))
        # queued behind it and cancelled before it started: never compiled
        busy = compiler.submit(StructuredOutputs("grammar", SLOW + ' | "x"'))
        await hang_up(StructuredOutputs("choice", '["dropped"]'), lambda: asyncio.sleep(0.1))
        with pytest.raises(InvalidRequestError):  # over the 1 s timeout
            await asyncio.wrap_future(busy)
    try:
        asyncio.run(main())
        # queued behind "dropped": once it is served, the worker has passed "dropped" by, uncompiled
        assert compiler.compile(StructuredOutputs("choice", '["next"]')) is not None  # the worker still serves
        assert worker.is_alive() and compiler.abandoned == 1
    finally:
        compiler.close()


def test_one_caller_going_away_leaves_the_compile_to_the_others(compiler):
    spec = StructuredOutputs("json", '{"type":"object","properties":{"z":{"type":"integer"}}}')
    first, second = compiler.submit(spec), compiler.submit(spec)
    assert first.cancel()
    assert second.result() is not None and first.cancelled()
    assert compiler.compiles == 1


def _children() -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    found.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return found


def test_a_grammar_process_killed_while_starting_is_replaced(compiler):
    before = set(_children())
    killed = []

    def killer():  # the first grammar process this compiler starts dies in its set-up
        deadline = time.monotonic() + 30
        while not killed and time.monotonic() < deadline:
            for pid in set(_children()) - before:
                os.kill(pid, 9)
                killed.append(pid)
                break
            time.sleep(0.0005)
    thread = threading.Thread(target=killer)
    thread.start()
    grammar = compiler.compile(StructuredOutputs("json", '{"type":"object"}'))  # was EOFError: a 500
    thread.join()
    assert killed and grammar is not None
    assert compiler.processes[0].starts == 2
