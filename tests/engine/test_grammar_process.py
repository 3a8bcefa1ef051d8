"""The grammar compiler's budgets (issue 28 rows 1-4), on the tiny checkpoint's tokenizer, without an
engine: what crashes, runs too long or holds too much memory in llguidance does so in the grammar
process and comes back as an InvalidRequestError naming the setting; the cache is bounded in bytes;
each grammar carries its first mask; llguidance's internal failures are not echoed."""
from __future__ import annotations

import json
import time

import pytest
import torch

from vlm_sdk.engine.structured_output import GrammarCompiler, MaskFiller, clean_error, fill_row
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.model_loader import load_tokenizer
from vlm_sdk.sampling_params import SamplingParams

VOCAB = 1024  # the tiny checkpoint's logits width


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


@pytest.fixture
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id], timeout=5.0, workers=1)
    yield c
    c.close()


def spec(**structured):
    return SamplingParams(structured_outputs=structured).grammar


def ref_chain(n: int) -> dict:
    """`$defs` d0 -> d1 -> ... -> dn, each an object whose property `a` refs the next (issue 28 row 1)."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def rule_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def test_a_crash_is_the_requests_error_and_the_next_grammar_compiles(compiler):
    with pytest.raises(InvalidRequestError) as e:  # segfaults llguidance on a 16 MiB stack
        compiler.compile(spec(json=ref_chain(3000)))
    assert e.value.param == "structured_outputs"
    assert "crashed" in str(e.value) and "nested too deeply" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:  # deep enough to crash, if its memory does not end it first
        compiler.compile(spec(grammar=rule_chain(30_000)))
    assert "crashed" in str(e.value) or "--max-grammar-memory" in str(e.value)
    proc = compiler.processes[0]
    assert proc.starts == 2  # each cost its process; the next grammar started a fresh one
    grammar = compiler.compile(spec(json=ref_chain(1000)))  # compiles there, so here, on a larger stack
    matcher = grammar.matcher()
    text = '{"a": ' * 1000 + '"x"' + "}" * 1000
    assert matcher.consume_tokens(compiler._tokenizer().tokenize_str(text)) and matcher.is_accepting()
    assert proc.starts == 3


@pytest.mark.timing  # a wall-clock bound: run alone
def test_timeout_names_the_setting(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id], timeout=1.0, workers=1)
    try:
        c.compile(spec(choice=["warm"]))  # the process started and its tokenizer built
        t0 = time.monotonic()
        with pytest.raises(InvalidRequestError) as e:  # 64,000 parser alternatives compile in ~20 s
            c.compile(spec(grammar="start: " + " | ".join(f'"c{i}"' for i in range(64_000))))
        seconds = time.monotonic() - t0
    finally:
        c.close()
    assert "did not compile within 1 s of CPU time" in str(e.value)
    assert "grammar_compile_timeout=1.0" in str(e.value) and "--grammar-compile-timeout" in str(e.value)
    assert seconds < 4, seconds  # 1 s of CPU time: on a quiet machine about as much wall time


def test_memory_over_the_limit_names_it(compiler):
    with pytest.raises(InvalidRequestError) as e:  # its first mask builds ~170 MiB of lexer states
        compiler.compile(spec(regex="((a{1001}){1000}){1000}"))
    message = str(e.value)
    assert "this regex needs more than 64.0 MiB to compile with its first mask" in message
    assert "max_grammar_memory='64MiB'" in message and "--max-grammar-memory" in message
    assert compiler.cache_bytes == 0


def test_spec_size_is_checked_before_any_work(compiler):
    with pytest.raises(InvalidRequestError) as e:
        compiler.submit(spec(choice=["x" * 100] * 11_000))
    assert "bytes; this engine compiles at most 1048576" in str(e.value) and "--max-grammar-bytes" in str(e.value)
    assert not compiler.processes  # nothing was started for it


def test_cache_is_bounded_in_bytes(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id], cache_memory=4 << 20, workers=2)
    try:
        lists = [spec(choice=[f"item {k} {i}" for i in range(5000)]) for k in range(8)]
        grammars = [c.compile(s) for s in lists]
        sizes = [g.nbytes for g in grammars]
        assert all(512 << 10 < n < 4 << 20 for n in sizes), sizes  # ~1.4 MiB each, measured
        assert c.cache_bytes <= 4 << 20 and 1 <= len(c._cache) < 8
        kept = [text for _, text, _, _ in c._cache]  # keyed by content: (kind, text, prefix, validate_only)
        assert kept == [s.text for s in lists[-len(c._cache):]]  # the least recently used went first
        assert c.compiles == 8
        c.compile(lists[-1])  # a hit
        assert c.compiles == 8
    finally:
        c.close()


def test_first_mask_is_the_grammars_start(compiler):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = compiler.compile(spec(json=schema))
    fresh = torch.full((1, VOCAB // 32), -1, dtype=torch.int32)
    fill_row(grammar.matcher(), fresh, 0)
    assert torch.equal(grammar.first_mask, fresh[0])
    # a row at its start takes the stored mask; a row past it is computed
    moved = grammar.matcher()
    assert moved.consume_tokens(compiler._tokenizer().tokenize_str('{"n'))
    masks = MaskFiller(VOCAB)([("a", moved, grammar.first_mask), ("b", moved, None)]).bitmask
    assert torch.equal(masks[0], grammar.first_mask) and not torch.equal(masks[1], grammar.first_mask)


def test_llguidance_messages_carry_no_state_or_panic(compiler):
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(spec(regex="(ab"))
    assert "<state>" not in str(e.value) and len(str(e.value)) < 400
    panic = "panic: assertion failed: x < y\nat src/earley/parser.rs:120:9\nstack backtrace:\n 0: rust_begin_unwind"
    assert clean_error(panic) == "the grammar compiler failed on it (an internal error of llguidance, logged)"
    assert clean_error("expected ')'\n  at 3") == "expected ')' at 3"


def test_close_ends_the_processes(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id], workers=2)
    c.compile(spec(choice=["a", "b"]))
    pids = [p.pid for p in c.processes if p.pid is not None]
    assert pids
    c.close()
    assert all(p.pid is None for p in c.processes)
    with pytest.raises(RuntimeError):
        c.submit(spec(choice=["c"]))


def test_a_schema_that_cannot_compile_is_named(compiler):
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(SamplingParams(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": json.loads('{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}')}}).grammar)
    assert e.value.param == "response_format" and "nope" in str(e.value)


def test_an_idle_process_ends_and_the_next_grammar_starts_one(tokenizer, monkeypatch):
    from vlm_sdk.engine import structured_output
    monkeypatch.setattr(structured_output, "PROCESS_IDLE_S", 0.5)
    c = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id], workers=1)
    try:
        c.compile(spec(choice=["a", "b"]))
        proc = c.processes[0]
        assert proc.pid is not None and c.process_bytes() > 0
        deadline = time.monotonic() + 10
        while proc.pid is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.pid is None and c.process_bytes() == 0  # its memory went back
        c.compile(spec(choice=["c", "d"]))
        assert proc.starts == 2
    finally:
        c.close()
