"""Structured outputs: a request's `StructuredOutputs` (JSON Schema, regex, choice, Lark/GBNF grammar)
compiled by llguidance into a matcher that, at each step, allows only the tokens that keep the output
inside the grammar.

    build_prompt (caller's thread; AsyncLLM: a prep pool)
        GrammarCompiler.compile(spec) -> Grammar        cached by spec; a bad one -> InvalidRequestError (400)
    add_request (engine thread)
        seq.matcher = grammar.matcher()                 a copy of the compiled start state
    each step, before the worker runs (engine thread)
        token_bitmask(the grammar rows sampling now)    -> GrammarBitmask: 1 bit per vocabulary token
    worker (sample/token_mask.py)
        those rows' logits masked to -inf outside the grammar, then sampled as usual; other rows untouched
    postprocess
        accept(seq, token): the matcher consumes it; once the grammar admits no more text the request
        finishes ("stop"); max_tokens reached first -> "length" (the value may be cut short)

Why llguidance (not xgrammar): one self-contained wheel with no dependencies, a grammar "compiles" in
well under a millisecond (its lexer builds lazily, so no per-schema precomputation over the
vocabulary), and masks are computed for a whole batch in parallel with the GIL released; it covers
JSON Schema as OpenAI's structured outputs do, regexes, and Lark/GBNF grammars. vLLM and SGLang ship
it as a backend.

Whitespace between JSON tokens is bounded (`JSON_WHITESPACE`): llguidance's default allows any run,
and a weak model can emit newlines until max_tokens. A schema may choose its own through llguidance's
"x-guidance" key (e.g. {"whitespace_flexible": false} for compact JSON).
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future

import torch

from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.sampling_params import StructuredOutputs
from vlm_sdk.protocol.scheduler_output import GrammarBitmask

logger = logging.getLogger("vlm_sdk")

# at most one line break and 8 spaces in any gap between JSON tokens: enough for a model's usual
# pretty-printing (2-space indents, 4 levels deep), too little to loop on
JSON_WHITESPACE = r"\n?[ ]{0,8}"


class Grammar:
    """A compiled grammar in its start state; `matcher()` gives each request its own copy."""

    def __init__(self, template):
        self._template = template  # an llguidance.LLMatcher that never consumes a token

    def matcher(self):
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles `StructuredOutputs` with llguidance, for a tokenizer and the model's vocabulary size
    (the logits' width, which may exceed the tokenizer's). Thread-safe: prep threads compile while
    the engine thread takes matchers. The llguidance tokenizer is built on the first compile (about
    a second for a 150k vocabulary), not at start-up."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = 512):
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = hf_tokenizer, vocab_size, list(eos_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredOutputs, Grammar] = OrderedDict()
        self._pending: dict[StructuredOutputs, Future] = {}  # being compiled by some thread
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._ll_tokenizer = None
        self.compiles = 0  # grammars compiled (cache misses), for tests and stats

    def _tokenizer(self):
        import llguidance.hf
        with self._tokenizer_lock:  # its own lock: the cache stays usable while it is built
            if self._ll_tokenizer is None:
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                except ValueError as e:  # kept: every later request gets the answer without the retry
                    self._ll_tokenizer = InvalidRequestError(
                        f"structured outputs need a fast (tokenizers-backed) tokenizer; this model's "
                        f"{type(self.hf_tokenizer).__name__} cannot be used: {e}")
            if isinstance(self._ll_tokenizer, InvalidRequestError):
                raise self._ll_tokenizer
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputs) -> Grammar:
        """The compiled grammar of `spec`; a spec another thread is compiling is waited for, not
        compiled twice."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            pending = self._pending.get(spec)
            mine = pending is None
            if mine:
                pending = self._pending[spec] = Future()
        if not mine:
            return pending.result()  # raises the compiler's error too
        try:  # outside the lock: other prep threads go on with other grammars
            grammar = Grammar(self._build(spec))
        except BaseException as e:
            with self._lock:
                self._pending.pop(spec, None)
            pending.set_exception(e)
            raise
        with self._lock:  # cached and no longer pending at once: nobody can find neither
            self.compiles += 1
            self._cache[spec] = grammar
            self._pending.pop(spec, None)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        pending.set_result(grammar)
        return grammar

    def _build(self, spec: StructuredOutputs):
        import llguidance
        tokenizer = self._tokenizer()
        if spec.kind == "json":
            text = llguidance.LLMatcher.grammar_from_json_schema(
                spec.text, defaults={"whitespace_pattern": JSON_WHITESPACE})
        else:
            try:
                text = llguidance.grammar_from(spec.kind, spec.text)
            except ValueError as e:
                raise InvalidRequestError(f"'{spec.param}': {e}", param=spec.param) from None
        if spec.prefix is not None:  # the prefix's grammar first, this one nested in it as @answer
            inner = json.loads(text)["grammars"][0] if text.lstrip().startswith("{") else {"lark_grammar": text}
            text = json.dumps({"grammars": [{"lark_grammar": spec.prefix}, {**inner, "name": "answer"}]})
        error = llguidance.LLMatcher.validate_grammar(text, tokenizer)
        if error:
            what = {"json": "JSON Schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}[spec.kind]
            raise InvalidRequestError(f"'{spec.param}': this {what} cannot be compiled: {error.strip()}",
                                      param=spec.param)
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"'{spec.param}': this grammar cannot be compiled: {matcher.get_error()}",
                                      param=spec.param)
        return matcher


class MaskFiller:
    """Fills the step's grammar masks on the engine thread (llguidance's threads, GIL released)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._executor = None

    def __call__(self, rows: list[tuple[str, object]]) -> GrammarBitmask | None:
        """`rows`: (request id, matcher) of the constrained requests sampling this step."""
        if not rows:
            return None
        import llguidance
        import llguidance.torch as llt
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)  # [rows, words]: bit t of word w = token 32w+t
        llt.fill_next_token_bitmask_par(self._executor, [(m, i) for i, (_, m) in enumerate(rows)], bitmask)
        return GrammarBitmask(tuple(rid for rid, _ in rows), bitmask)


def accept(matcher, token: int) -> str | None:
    """Advance a request's matcher past its new token: "stop" when the grammar admits no more text,
    "abort" (logged) if the token was outside the grammar, which the mask rules out; else None."""
    if not matcher.consume_token(token):
        logger.warning("a structured-output request sampled token %d outside its grammar (%s); it is "
                       "stopped", token, matcher.get_error())
        return "abort"
    return "stop" if matcher.is_stopped() else None

