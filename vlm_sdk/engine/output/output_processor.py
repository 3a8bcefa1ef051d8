"""Token ids to `RequestOutput`s, outside the engine thread: detokenization, stop strings, deltas.

    engine thread: step() -> [EngineOutput(request id, new token ids, finish reason, metrics)]
    caller side:   RequestOutputState.process(engine output) -> RequestOutput (text, delta_text, ...)

`LLM` runs it on the caller's thread after each step; `AsyncLLM` in each stream's coroutine on the
asyncio side. It owns its own tokenizer instance (never the one prompt building uses), so a long
prompt being tokenized never holds up a stream's text. When a stop string ends a request the engine
has not finished, `finished_by_stop_string` is set and the caller tells the engine to finish it
(`LLMEngine.abort(request_id, "stop")`), which frees its blocks; later outputs for it are ignored.

A request whose prompt has an `OutputFormat` (tools, a reasoning model: engine/input/chat_setup.py) has its
visible text read by that format's `OutputStream` as it streams: reasoning, content and tool calls
beside the raw text, and finish_reason "tool_calls" when it stopped after calling a tool (not for a
named function, which OpenAI finishes with "stop").

Stop strings are matched by a `StopMatcher` (engine/output/stop_strings.py), whose cost per character does
not grow with their number. Text held back: while running, the trailing characters that could still
begin a stop string are not streamed yet; the final output releases them, cut before a stop string.
"""
from __future__ import annotations

import threading
import time

from vlm_sdk.engine.output.detokenizer import IncrementalDetokenizer
from vlm_sdk.engine.output.engine_output import EngineOutput
from vlm_sdk.engine.output.stop_strings import StopMatcher
from vlm_sdk.outputs import LogprobColumns, RequestOutput, ToolCall
from vlm_sdk.parsers import OutputFormat
from vlm_sdk.sampling_params import SamplingParams


class _SerialDecoder:
    """The output tokenizer, serialised among output processors only (fast tokenizers refuse
    concurrent use from several threads); prompt tokenization never takes this lock. `backend` and
    `lock` serve the detokenizer's DecodeStream path."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.backend = getattr(tokenizer, "_tokenizer", None)  # tokenizers.Tokenizer of a fast tokenizer
        self.lock = threading.Lock()

    def decode(self, *args, **kwargs) -> str:
        with self.lock:
            return self._tok.decode(*args, **kwargs)


class OutputProcessor:
    def __init__(self, tokenizer):
        """`tokenizer`: an instance of its own, loaded for this processor."""
        self.tokenizer = tokenizer
        self._decoder = _SerialDecoder(tokenizer)
        self.lock = self._decoder.lock  # held by anyone else who uses `tokenizer` (the server's logprobs)

    def new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    index: int = 0, output_format: OutputFormat | None = None) -> "RequestOutputState":
        """`output_format`: the prompt's (`PromptInputs.output_format`), None for plain text."""
        state = RequestOutputState(request_id, prompt_token_ids, params, IncrementalDetokenizer(self._decoder),
                                   output_format)
        state.index = index  # sample `index` of the request's n
        return state


class RequestOutputState:
    """One request's text so far; `process` each of its engine outputs in order."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, output_format: OutputFormat | None = None):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        # every token's logprobs, compact: each output holds a view of the first tokens, no copy
        self.logprobs = LogprobColumns(params.logprobs) if params.wants_logprobs else None
        self.num_emitted_chars = 0  # text already streamed; a possible stop-string prefix waits
        self.finish_reason: str | None = None
        self.finished_by_stop_string = False  # the engine must be told to finish it
        self.index = 0
        self.stops = StopMatcher(params.stop) if params.stop else None
        self.format = output_format
        self.parsed = _Parsed(output_format) if output_format is not None else None
        self.prompt_logprobs = None  # the engine's, from the first output on

    def process(self, out: EngineOutput) -> RequestOutput | None:
        """The `RequestOutput` for `out`; None once this request has finished (outputs the engine
        made before it learned of a stop string)."""
        if self.finish_reason is not None:
            return None
        detok = self.detokenizer
        reason = out.finish_reason
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        dropped = 0  # tokens after a stop string (a speculative step yields several at once): not the output's
        for k, token in enumerate(out.new_token_ids):
            self.token_ids.append(token)
            if self.logprobs is not None and out.new_logprobs:
                self.logprobs.append(out.new_logprobs[k])
            if self._stopped_by(detok.add(token)):
                self.finished_by_stop_string = out.finish_reason is None
                reason = "stop"
                dropped = len(out.new_token_ids) - k - 1
                break
        metrics = out.metrics.snapshot()  # the engine's, as of this output (it moves on: EngineOutput)
        metrics.generated_tokens = out.num_generated - dropped
        if out.finish_reason is None:
            metrics.finished_time = None  # it may have finished at a later step already
        if reason is None:
            visible = len(detok.text) - (self.stops.hold if self.stops else 0)
        elif reason == "abort":
            visible = self.num_emitted_chars  # nothing more is shown
        else:
            if not detok.text_is_final and self._stopped_by(detok.flush()):
                reason = "stop"
            visible = len(detok.text)
            if metrics.finished_time is None:
                metrics.finished_time = time.monotonic()
        delta = detok.text[self.num_emitted_chars:visible] if visible > self.num_emitted_chars else ""
        self.num_emitted_chars += len(delta)
        text = detok.text[:self.num_emitted_chars]
        if self.parsed is not None:
            self.parsed.feed(delta, finish=reason is not None and reason != "abort")
            if reason == "stop" and self.parsed.calls and not self.format.named:
                reason = "tool_calls"
        self.finish_reason = reason
        # `text` is what this request's stream has shown so far: the concatenation of its deltas
        out = RequestOutput(request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
                            token_ids=list(self.token_ids), text=text, delta_text=delta, finish_reason=reason,
                            metrics=metrics, token_logprobs=None if self.logprobs is None else self.logprobs.view(),
                            index=self.index, content=text, delta_content=delta, prompt_logprobs=self.prompt_logprobs)
        if self.parsed is not None:
            self.parsed.fill(out)
        return out

    def _stopped_by(self, new_text: str) -> bool:
        """Feed the text just appended; on a stop string, cut the text before it (for good)."""
        if self.stops is None or not new_text:
            return False
        while True:
            seen = self.stops.seen
            start = self.stops.feed(new_text)
            if start is None:
                return False
            if len(self.token_ids) >= self.params.min_tokens:
                break
            # as in vLLM, min_tokens holds back stop strings too: one ending before then is text
            new_text = new_text[self.stops.seen - seen:]
        detok = self.detokenizer
        detok.text = detok.text[:start]
        detok.text_is_final = True
        return True


class _Parsed:
    """One request's parsed output so far: its format's stream, and the parts accumulated."""

    def __init__(self, fmt: OutputFormat):
        self.stream = fmt.stream()
        self.reasoning = self.content = ""
        self.calls: dict[int, list] = {}  # index -> [id, name, arguments so far]
        self.delta = None

    def feed(self, text: str, finish: bool) -> None:
        delta = self.stream.feed(text) if text else None
        if finish:
            rest = self.stream.finish()
            if delta is None:
                delta = rest
            else:
                delta += rest
        self.delta = delta
        if delta is None:
            return
        self.reasoning += delta.reasoning
        self.content += delta.content
        for piece in delta.tool_calls:
            call = self.calls.setdefault(piece.index, [piece.id, piece.name, ""])
            call[2] += piece.arguments

    def fill(self, out: RequestOutput) -> None:
        d = self.delta
        out.content, out.delta_content = self.content, d.content if d is not None else ""
        out.reasoning_content = self.reasoning if self.stream.saw_reasoning else None
        out.delta_reasoning_content = d.reasoning if d is not None else ""
        out.delta_tool_calls = list(d.tool_calls) if d is not None else []
        out.tool_calls = [ToolCall(*self.calls[i]) for i in sorted(self.calls)]
