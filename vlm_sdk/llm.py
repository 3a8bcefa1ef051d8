"""`LLM`: offline batch chat (`chat`) and completion (`generate`, no chat template) on the caller's thread.

Each `engine.step()` returns token ids; the `OutputProcessor` (its own tokenizer) turns them into
text on the same caller's thread, between steps, and finishes requests that hit a stop string.
"""
from __future__ import annotations

import weakref
from typing import Sequence as Seq

from vlm_sdk.chat_options import ChatOptions
from vlm_sdk.engine.llm_engine import LLMEngine
from vlm_sdk.engine.output.output_processor import OutputProcessor
from vlm_sdk.engine import render as dry_run
from vlm_sdk.errors import InputTooLongError, InvalidRequestError, VLMError
from vlm_sdk.model_loader import load_tokenizer
from vlm_sdk.models.registry import engine_args as make_engine_args
from vlm_sdk.multimodal.prompts import parse_prompts
from vlm_sdk.outputs import RequestOutput
from vlm_sdk.sampling_params import SamplingParams


class LLM:
    """`LLM(model_dir, **engine_args)`; see `EngineArgs` for the settings."""

    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(str(model), make_engine_args(**engine_args))
        self.inputs = self.engine.inputs  # prompts are built on the caller's thread
        self.output_processor = OutputProcessor(load_tokenizer(self.engine.checkpoint.model_dir))
        # an LLM dropped without shutdown() still ends its rank processes when it is collected
        weakref.finalize(self, self.engine.shutdown)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """End the tensor-parallel rank processes (with one rank there is nothing to end). Also done
        when the interpreter exits; call it (or use `with LLM(...)`) to free the GPUs sooner."""
        self.engine.shutdown()

    def chat(self, conversations, sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
             tools=None, tool_choice=None, parallel_tool_calls: bool | None = None,
             chat_template_kwargs: dict | None = None, cache_salt: str | None = None) -> list[RequestOutput]:
        """Run every conversation to completion; outputs in input order. A single conversation (a list
        of message dicts) is accepted too. Every conversation is checked before any runs: an invalid
        or too-long one raises, naming its index, and nothing is run. With `SamplingParams(n=k)` each
        output is sample 0 and its `outputs` holds the k samples (seed + i for sample i).

        `tools`, `tool_choice`, `parallel_tool_calls`, `chat_template_kwargs`, `cache_salt`: OpenAI's and
        vLLM's fields (`vlm_sdk.chat_options.ChatOptions`), for every conversation; an output's
        `tool_calls`, `content` and `reasoning_content` are then its parsed parts."""
        options = ChatOptions(tools, tool_choice, parallel_tool_calls, chat_template_kwargs, cache_salt)
        if _is_single_conversation(conversations):
            conversations = [conversations]
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise InvalidRequestError("chat() needs a conversation (a list of messages) or a list of them")
        return self._run(list(conversations), sampling_params, "conversation", options)

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Complete prompts without a chat template: a text, token ids, or a list of either
        (`"Once upon a time"`, `[9707, 11]`, `["a", "b"]`, `[[9707], [641]]`, or `TextPrompt` /
        `TokensPrompt`); outputs in input order, one per prompt. Special-token text in a text prompt
        is the special token; token ids must be in the vocabulary. Checked, run and returned as `chat`
        does (errors name the prompt's index); `cache_salt` as in `chat`."""
        return self._run(parse_prompts(prompts, "prompts"), sampling_params, "prompt",
                         ChatOptions(cache_salt=cache_salt))

    def render(self, request, sampling_params: SamplingParams | None = None, *, tools=None, tool_choice=None,
               parallel_tool_calls: bool | None = None, chat_template_kwargs: dict | None = None,
               cache_salt: str | None = None):
        """The dry run of one request (`vlm_sdk.engine.render.RenderedRequest`): its token ids, tokens per
        part, KV blocks and bytes per cache group, the prefix-cache hit, whether it fits now and ever
        and, when not, the too-long error's fixes. `request`: a conversation (as `chat`) or a prompt (as
        `generate`: a text, token ids, `TextPrompt` / `TokensPrompt`). Images are decoded and resized,
        never encoded; nothing is scheduled. Bad input raises as `chat` / `generate` would."""
        options = ChatOptions(tools, tool_choice, parallel_tool_calls, chat_template_kwargs, cache_salt)
        if not _is_single_conversation(request):
            request = parse_prompts(request, "request")
            if len(request) != 1:
                raise InvalidRequestError(f"render takes one request, got {len(request)} prompts", param="request")
            request = request[0]
        self.inputs.check_params(sampling_params)
        return dry_run.render(self.engine, dry_run.build(self.inputs, request, sampling_params, options),
                              sampling_params)

    def _run(self, requests: list, sampling_params, noun: str, options: ChatOptions | None) -> list[RequestOutput]:
        """Build every request's prompt (any failure raises, naming its `noun` and index, before
        anything runs), then run them all to completion."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(requests)
        else:
            params = list(sampling_params)
            if len(params) != len(requests):
                raise InvalidRequestError(f"got {len(params)} sampling params for {len(requests)} {noun}s")
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise InvalidRequestError(f"sampling params {i} must be a SamplingParams, got {type(p).__name__}")
        prompts = []
        for i, request in enumerate(requests):
            try:
                prompts.append(self.inputs.build_prompt(request, params[i], options=options))
            except InputTooLongError as e:
                raise e.with_conversation(i, noun) from None
            except InvalidRequestError as e:
                raise type(e)(f"{noun} {i}: {e}", param=e.param) from e
            except VLMError as e:
                raise type(e)(f"{noun} {i}: {e}") from e
        return self._complete(prompts, params)

    def _complete(self, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
        groups: list[list[str]] = []  # per prompt, the engine ids of its n samples
        states = {}
        final: dict[str, RequestOutput] = {}
        try:
            for prompt, sp in zip(prompts, params):
                # the n samples of a prompt join the same step: the first's blocks serve the others
                samples = [sp.sample(i) for i in range(sp.n)] if sp.n > 1 else [sp]
                group = []
                for i, sample in enumerate(samples):
                    rid = self.engine.add_request(prompt, sample)
                    group.append(rid)
                    states[rid] = self.output_processor.new_request(rid, prompt.token_ids, sample, index=i,
                                                                    output_format=prompt.output_format)
                groups.append(group)
            while len(final) < len(states):
                for engine_out in self.engine.step():
                    state = states[engine_out.request_id]
                    out = state.process(engine_out)
                    if out is not None and out.finished:
                        final[out.request_id] = out
                        if state.finished_by_stop_string:
                            self.engine.abort(out.request_id, "stop")
            self.engine.release_finished()
        finally:
            for rid in states:  # only after an exception (e.g. KeyboardInterrupt) are any still running
                if rid not in final:
                    self.engine.abort(rid)
        results = []
        for group in groups:
            outputs = [final[rid] for rid in group]
            for out in outputs:
                out.set_whole()  # one output per request: its delta is all of it
                out.request_id = group[0]  # the samples are one request
            outputs[0].outputs = outputs
            results.append(outputs[0])
        return results

    def stats(self) -> dict:
        """Live KV and queue numbers (see `LLMEngine.stats`)."""
        return self.engine.stats()

    @property
    def memory_report(self):
        """`StartupMemory`: weights, activation peak and KV cache as measured at start-up (`.format()`
        is the table the engine logged, `.to_dict()` has `vlm-sdk plan`'s JSON keys)."""
        return self.engine.memory_report

    @property
    def tokenizer(self):
        return self.inputs.tokenizer


def _is_single_conversation(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], dict)
