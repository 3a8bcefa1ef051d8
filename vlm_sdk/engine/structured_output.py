"""Structured outputs: a request's `StructuredOutputs` (JSON Schema, regex, choice, Lark/GBNF grammar)
compiled by llguidance into a matcher that, at each step, allows only the tokens that keep the output
inside the grammar.

    build_prompt (caller's thread; AsyncLLM awaits it first, no thread held)
        GrammarCompiler.submit(spec) -> Future[Grammar]    cached by content, not field (bounded in
                                                            bytes); else queued to the grammar workers:
        grammar worker (`grammar_workers` threads with a 64 MiB stack, beside the prompt pools)
            the spec's size checked (max_grammar_bytes); llguidance's grammar text made
            GrammarProcess.check: compiled with its first mask in a child process
              (engine/grammar_process.py): a crash, a timeout (grammar_compile_timeout) or memory over
              max_grammar_memory there -> each asker's InvalidRequestError (400, its own field named:
              engine/grammar_errors.py), and the server never compiles it
            compiled here, its first mask computed here -> Grammar (template, first mask, bytes held)
    add_request (engine thread)
        seq.matcher = grammar.matcher()                 a copy of the compiled start state
    each step, before the worker runs (engine thread)
        token_bitmask(the grammar rows sampling now)    -> GrammarBitmask: 1 bit per vocabulary token;
                                                           a row at its start takes the grammar's first mask
    worker (sample/token_mask.py)
        those rows' logits masked to -inf outside the grammar, then sampled as usual; other rows untouched
    postprocess
        accept(seq, token): the matcher consumes it; once the grammar admits no more text the request
        finishes ("stop"); max_tokens reached first -> "length" (the value may be cut short)

Why llguidance (not xgrammar): one self-contained wheel with no dependencies, a grammar "compiles" in
well under a millisecond (its lexer builds lazily, so no per-schema precomputation over the
vocabulary), and masks are computed for a whole batch in parallel with the GIL released; it covers
JSON Schema as OpenAI's structured outputs do, regexes, and Lark/GBNF grammars. vLLM and SGLang ship
it as a backend. Its per-step work is bounded by its own parser limits (lexer fuel, Earley items).

Whitespace between JSON tokens is bounded (`JSON_WHITESPACE`): llguidance's default allows any run,
and a weak model can emit newlines until max_tokens. A schema may choose its own through llguidance's
"x-guidance" key (e.g. {"whitespace_flexible": false} for compact JSON).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import queue
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

import torch

from vlm_sdk.config import (DEFAULT_GRAMMAR_CACHE_MEMORY, DEFAULT_GRAMMAR_COMPILE_TIMEOUT, DEFAULT_MAX_GRAMMAR_BYTES,
                            DEFAULT_MAX_GRAMMAR_MEMORY)
from vlm_sdk.engine.grammar_errors import Refusal, clean_error, compile_refusal, one_line
from vlm_sdk.engine.grammar_process import SERVER_STACK, CheckResult, GrammarProcess, parser_limits
from vlm_sdk.errors import InvalidRequestError, limit_text
from vlm_sdk.sampling_params import StructuredOutputs
from vlm_sdk.protocol.scheduler_output import GrammarBitmask

logger = logging.getLogger("vlm_sdk")

# at most one line break and 8 spaces in any gap between JSON tokens: enough for a model's usual
# pretty-printing (2-space indents, 4 levels deep), too little to loop on
JSON_WHITESPACE = r"\n?[ ]{0,8}"
_WHAT = {"json": "JSON Schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}
_WORKER_NICE = 5  # the compile threads yield the CPU to the engine and the event loop
PROCESS_IDLE_S = 60.0  # a grammar process without a grammar this long ends (the next one starts afresh)


def _cost(key: tuple, grammar: Grammar | None) -> int:
    """What a cache entry holds: the grammar's measured bytes (none for a validated one) and its text."""
    return (grammar.nbytes if grammar is not None else 0) + len(key[1])


class Grammar:
    """A compiled grammar in its start state; `matcher()` gives each request its own copy.
    `first_mask`: the mask at its start ([ceil(vocab / 32)] int32), computed when it was compiled, so
    that no step builds it; `nbytes`: what it holds, as measured where it was first compiled."""

    def __init__(self, template, first_mask: torch.Tensor, nbytes: int):
        self._template = template  # an llguidance.LLMatcher that never consumes a token
        self.first_mask = first_mask
        self.nbytes = nbytes

    def matcher(self):
        return self._template.deep_copy()


@dataclass
class _Job:
    """One grammar being compiled for everyone who asked for it: each asker has a future of its own
    (cancelled alone when its caller goes away) and its spec (whose field the errors name)."""
    spec: StructuredOutputs
    validate_only: bool
    askers: list = field(default_factory=list)  # [(Future, spec, line_params)]


def _settle(future: Future, result=None, error: BaseException | None = None) -> None:
    """Complete an asker's future unless its caller cancelled it (a client that hung up: asyncio's
    wrap_future cancels the future it waits on); the compile worker must never raise here."""
    if not future.set_running_or_notify_cancel():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class GrammarCompiler:
    """Compiles `StructuredOutputs` with llguidance, for a tokenizer and the model's vocabulary size
    (the logits' width, which may exceed the tokenizer's), on `workers` threads of its own, each with a
    grammar process (see the module docstring). Thread-safe. Grammars are known by their content (kind,
    text, prefix), not by the field they came from: one being compiled is compiled once however many ask,
    and compiled ones are kept, least recently used first out, while their measured bytes (and their
    text's) fit `cache_memory`. Nothing starts until the first grammar."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int], *,
                 cache_memory: int = DEFAULT_GRAMMAR_CACHE_MEMORY, max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
                 max_memory: int = DEFAULT_MAX_GRAMMAR_MEMORY, timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
                 workers: int = 2):
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = hf_tokenizer, vocab_size, list(eos_token_ids)
        self.cache_memory, self.max_bytes, self.max_memory, self.timeout = cache_memory, max_bytes, max_memory, timeout
        self.num_workers = workers
        self._cache: OrderedDict[tuple, Grammar | None] = OrderedDict()  # content key -> grammar (None: validated)
        self.cache_bytes = 0  # what the kept grammars hold, as measured, plus their texts
        self._pending: dict[tuple, _Job] = {}  # queued or being compiled
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._workers: list[threading.Thread] = []
        self.processes: list[GrammarProcess] = []
        self._tokenizer_lock = threading.Lock()
        self._ll_tokenizer = None
        self._closed = False
        self.compiles = 0  # grammars compiled or validated (cache misses), for tests and stats
        self.abandoned = 0  # jobs dropped unstarted: everyone who asked had gone

    # -- asking for a grammar ----------------------------------------------------------------------
    def submit(self, spec: StructuredOutputs, *, validate_only: bool = False,
               line_params: Sequence[str] | None = None) -> Future:
        """A future of the compiled grammar of `spec` (already done on a cache hit); its exception is
        the `InvalidRequestError` naming `spec.param` (or, with `line_params`, the field of the line the
        compiler's error points at) when the spec cannot be served. `validate_only`: checked in the
        grammar process alone, never compiled here; the future's result is then None. Cancelling the
        future (its caller went away) leaves the compile to whoever else asked, and an unstarted
        compile nobody waits for any more is dropped."""
        size = len(spec.text.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise InvalidRequestError(
                f"'{spec.param}': this {_WHAT[spec.kind]} is {size} bytes; this engine compiles at most "
                f"{self.max_bytes} bytes per grammar ({limit_text('max_grammar_bytes', self.max_bytes)})",
                param=spec.param)
        key = (spec.kind, spec.text, spec.prefix, validate_only)
        asker: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler was closed with its engine")
            if key in self._cache:
                self._cache.move_to_end(key)
                _settle(asker, self._cache[key])
                return asker
            job = self._pending.get(key)
            if job is None:
                self._start_workers()  # raises before anything is pending when the tokenizer cannot be used
                job = self._pending[key] = _Job(spec, validate_only)
                self._jobs.put((key, job))
            job.askers.append((asker, spec, line_params))
        return asker

    def compile(self, spec: StructuredOutputs) -> Grammar:
        """`submit(spec)`, waited for (raises the compiler's error)."""
        return self.submit(spec).result()

    def process_bytes(self) -> int:
        """The grammar processes' resident memory together (0 before the first grammar)."""
        return sum(p.resident_bytes() for p in self.processes)

    def close(self) -> None:
        """Stop the workers and their processes (the engine's shutdown); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while True:  # what is queued is not compiled: its callers learn why
                try:
                    key, job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                self._pending.pop(key, None)
                for asker, _, _ in job.askers:
                    _settle(asker, error=RuntimeError("the grammar compiler was closed with its engine"))
            for _ in self._workers:
                self._jobs.put(None)
        for proc in self.processes:  # a compile under way ends with its process: its worker moves on
            proc.close()
        for worker in self._workers:
            worker.join(timeout=2.0)

    # -- the workers -------------------------------------------------------------------------------
    def _start_workers(self) -> None:
        """Under the lock: the worker threads, with a stack larger than the grammar process's compile
        thread (a grammar that compiled there cannot overflow here). `threading.stack_size` is the
        interpreter's: set for these threads only, then put back."""
        if self._workers:
            return
        tokenizer_json = self._tokenizer_json()
        previous = threading.stack_size(SERVER_STACK)
        try:
            for i in range(self.num_workers):
                proc = GrammarProcess(tokenizer_json, self.vocab_size, self.eos_token_ids, self.max_memory)
                self.processes.append(proc)
                worker = threading.Thread(target=self._work, args=(proc,), name=f"vlm-grammar-{i}", daemon=True)
                worker.start()
                self._workers.append(worker)
        finally:
            threading.stack_size(previous)

    def _work(self, proc: GrammarProcess) -> None:
        if sys.platform.startswith("linux"):  # Linux nice values are per thread: this one only
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WORKER_NICE)
            except OSError:
                pass
        while True:
            try:
                item = self._jobs.get(timeout=PROCESS_IDLE_S)
            except queue.Empty:  # no grammar for a while: its process's memory goes back (restarted on the next)
                proc.close()
                continue
            if item is None:
                return
            key, job = item
            with self._lock:  # nobody waits for it any more (their clients hung up): not compiled at all
                if all(asker.cancelled() for asker, _, _ in job.askers):
                    self._pending.pop(key, None)
                    self.abandoned += 1
                    continue
            try:
                grammar = self._build(job.spec, proc, job.validate_only)
            except BaseException as e:
                with self._lock:
                    self._pending.pop(key, None)
                    askers = list(job.askers)
                for asker, spec, line_params in askers:
                    _settle(asker, error=e.error(spec.param, line_params) if isinstance(e, Refusal) else e)
                continue
            with self._lock:  # cached and no longer pending at once: nobody can find neither
                self.compiles += 1
                self._pending.pop(key, None)
                self._keep(key, grammar)
                askers = list(job.askers)
            for asker, _, _ in askers:
                _settle(asker, grammar)

    def _keep(self, key: tuple, grammar: Grammar | None) -> None:
        """Under the lock: cache `grammar`, evicting the least recently used beyond `cache_memory`."""
        cost = _cost(key, grammar)
        if cost > self.cache_memory:
            return  # served to its requests, not kept
        self._cache[key] = grammar
        self.cache_bytes += cost
        while self.cache_bytes > self.cache_memory:
            old_key, old = self._cache.popitem(last=False)
            self.cache_bytes -= _cost(old_key, old)

    def _build(self, spec: StructuredOutputs, proc: GrammarProcess, validate_only: bool) -> Grammar | None:
        """Check `spec` in the grammar process, then (unless `validate_only`) compile it here with its first
        mask. Raises a `Refusal` when it cannot be served."""
        import llguidance
        text = grammar_text(spec)
        checked = proc.check(text, self.timeout)
        if checked.error:
            raise self._refusal(spec, checked)
        if validate_only:
            return None
        limits = parser_limits()
        matcher = llguidance.LLMatcher(self._tokenizer(), text, log_level=0, limits=limits)
        first = torch.full((1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)  # [1, words]
        if not matcher.is_error():
            fill_row(matcher, first, 0)
        if matcher.is_error():  # it compiled in the grammar process: this is not expected
            raise compile_refusal(_WHAT[spec.kind], matcher.get_error())
        return Grammar(matcher, first[0], checked.bytes + first.numel() * 4)

    def _refusal(self, spec: StructuredOutputs, checked: CheckResult) -> Refusal:
        what = _WHAT[spec.kind]
        if checked.kind == "grammar":
            return compile_refusal(what, checked.error)
        if checked.kind == "timeout":
            text = (f"this {what} did not compile within {self.timeout:g} s of CPU time "
                    f"({limit_text('grammar_compile_timeout', self.timeout)}); simplify it")
        elif checked.kind == "memory":
            text = (f"this {what} needs more than {self.max_memory / 2**20:.1f} MiB to compile with its first mask "
                    f"(at least {checked.bytes / 2**20:.1f} MiB) ({limit_text('max_grammar_memory', self.max_memory)}"
                    f"); simplify it")
        elif checked.kind == "start":
            text = f"the grammar process did not start ({one_line(checked.error)}), so this {what} was not compiled"
        else:
            text = f"the grammar compiler {crash_text(checked)} on this {what}; simplify it"
        logger.warning("structured outputs: a %s of %d bytes refused after %.2f s: %s%s", what, len(spec.text),
                       checked.seconds, text, f" ({one_line(checked.error)})" if checked.kind == "crash" else "")
        return Refusal(text)

    # -- the tokenizer -----------------------------------------------------------------------------
    def _tokenizer_json(self) -> str:
        """The tokenizer as llguidance reads it (what `llguidance.hf.from_tokenizer` sends it)."""
        backend = getattr(self.hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise InvalidRequestError(f"structured outputs need a fast (tokenizers-backed) tokenizer; this model's "
                                      f"{type(self.hf_tokenizer).__name__} cannot be used")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    def _tokenizer(self):
        import llguidance
        with self._tokenizer_lock:  # its own lock: the cache stays usable while it is built
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                            eos_token=self.eos_token_ids)
            return self._ll_tokenizer


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar text for `spec` (a wrapper around it: nothing is compiled yet). A choice
    list is one Lark terminal, an alternation its lexer matches (llguidance's own `grammar_from("choice")`
    makes each string a parser alternative: past 2,000 of them the parser's row limit ends the request
    at its second token, and 64,000 take 20 s to compile, against 1 s as a terminal)."""
    import llguidance
    try:
        if spec.kind == "json":
            text = llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults={"whitespace_pattern": JSON_WHITESPACE})
        elif spec.kind == "choice":
            choices = json.loads(spec.text)
            text = llguidance.LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(map(json.dumps, choices)))
        else:
            text = llguidance.grammar_from(spec.kind, spec.text)
    except ValueError as e:
        raise Refusal(clean_error(str(e))) from None
    if spec.prefix is not None:  # the prefix's grammar first, this one nested in it as @answer
        inner = json.loads(text)["grammars"][0] if text.lstrip().startswith("{") else {"lark_grammar": text}
        text = json.dumps({"grammars": [{"lark_grammar": spec.prefix}, {**inner, "name": "answer"}]})
    return text


def crash_text(checked: CheckResult) -> str:
    """What a grammar process's end says about the grammar."""
    words = checked.error.lower()
    if "memory allocation" in words or "out of memory" in words or "cannot allocate" in words:
        return "ran out of the memory its process may use (4 x max_grammar_memory, at least 1 GiB)"
    if checked.signal in (11, 7):  # SIGSEGV, SIGBUS: its stack overflowed
        return "crashed (most likely nested too deeply: a long chain of $ref or of rules)"
    return f"ended{f' with signal {checked.signal}' if checked.signal else ''}"


class MaskFiller:
    """Fills the step's grammar masks on the engine thread (llguidance's threads, GIL released); a row at
    its grammar's start takes the mask computed when the grammar was compiled."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._executor = None

    def __call__(self, rows: list[tuple[str, object, torch.Tensor | None]]) -> GrammarBitmask | None:
        """`rows`: (request id, matcher, its first mask while it has consumed nothing, else None) of the
        constrained requests sampling this step."""
        if not rows:
            return None
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)  # [rows, words]: bit t of word w = token 32w+t
        todo = []
        for i, (_, matcher, first) in enumerate(rows):
            if first is not None:
                bitmask[i] = first
            else:
                todo.append((matcher, i))
        if todo:
            import llguidance
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            # llguidance.torch's fill_next_token_bitmask_par, which is this call (importing that module
            # runs a torch.compile decorator: seconds of the GIL)
            self._executor.unsafe_compute_mask_ptr(todo, bitmask.data_ptr(), words * 4, len(rows))
        return GrammarBitmask(tuple(rid for rid, _, _ in rows), bitmask)


def fill_row(matcher, bitmask: torch.Tensor, row: int) -> None:
    """Row `row` of `bitmask` ([rows, words] int32, contiguous, on the CPU) := `matcher`'s next mask
    (llguidance.torch's fill_next_token_bitmask, without importing it: see MaskFiller)."""
    target = bitmask[row]  # [words]
    matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)


def accept(matcher, token: int) -> str | None:
    """Advance a request's matcher past its new token: "stop" when the grammar admits no more text,
    "abort" (logged) if the token was outside the grammar, which the mask rules out; else None."""
    if not matcher.consume_token(token):
        logger.warning("a structured-output request sampled token %d outside its grammar (%s); it is "
                       "stopped", token, one_line(matcher.get_error()))
        return "abort"
    return "stop" if matcher.is_stopped() else None
