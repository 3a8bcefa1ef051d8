"""`EngineClient`: what a caller of an engine that runs elsewhere sees, the OpenAI server
(vlm_sdk/server/) first. Two implement it: `AsyncLLM` (one engine on a thread of this process,
vlm_sdk/async_llm.py) and `ReplicaSetLLM` (data-parallel engine replicas on Ray Serve, each call routed
to one: vlm_sdk/replicas/client.py). The server is typed on this protocol, never on either; which one
it gets is decided where it is built (`server.runner.serve`, `server.background.BackgroundServer`).
tests/server/test_engine_client.py checks both have every member below with the same parameters.

Contract of each member:
    args              the engine's `EngineArgs` (its per-request limits, which the server also applies)
    output_processor  an `OutputProcessor` of the caller's side: its `tokenizer` (used under its `lock`)
                      spells logprobs and echoes prompts
    build_prompt      validate, decode media and tokenize, off the caller's event loop; raises the
                      request's own typed error before anything is queued. `group`: a hashable naming
                      the request a prompt is part of (several prompts of one HTTP request), whose
                      prompts share the prep pools and the waiting queue as one
    render            the dry run of one request (engine/render.py `RenderedRequest`): built as build_prompt
                      builds it (a too-long prompt returned, with the error's fixes), then read against
                      the engine's cache now; nothing encoded or scheduled
    generate          stream a prompt's `RequestOutput`s (a built prompt, a text or token ids); closing
                      the iterator early aborts the request; `group` as build_prompt's
    chat_stream       build_prompt of chat messages (`chat_options`: `ChatOptions`' fields), then generate
    stats             live cache and queue numbers (`LLMEngine.stats`' keys)
    is_alive          accepts requests
    on_death          `callback(error)` once if the engine dies (never for replicas: Serve replaces them)
    shutdown          abort what runs and stop; False when `timeout` passed first
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the protocol imports no engine
    from vlm_sdk.chat_options import ChatOptions
    from vlm_sdk.config import EngineArgs
    from vlm_sdk.engine.output.output_processor import OutputProcessor
    from vlm_sdk.multimodal.inputs import PromptInputs
    from vlm_sdk.outputs import RequestOutput
    from vlm_sdk.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    @property
    def args(self) -> EngineArgs: ...

    output_processor: OutputProcessor

    async def build_prompt(self, request: Any, params: SamplingParams | None = None,
                           options: ChatOptions | None = None, group: Any = None) -> PromptInputs: ...

    async def render(self, request: Any, params: SamplingParams | None = None,
                     options: ChatOptions | None = None, group: Any = None) -> Any: ...

    def generate(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None,
                 group: Any = None) -> AsyncIterator[RequestOutput]: ...

    def chat_stream(self, messages: Any, params: SamplingParams | None = None, request_id: str | None = None,
                    **chat_options: Any) -> AsyncIterator[RequestOutput]: ...

    def stats(self) -> dict: ...

    @property
    def is_alive(self) -> bool: ...

    def on_death(self, callback: Callable[[BaseException], None]) -> None: ...

    async def shutdown(self, timeout: float | None = None) -> bool: ...


# the members a client has, in the contract's order (the conformance test walks them)
MEMBERS = ("args", "output_processor", "build_prompt", "render", "generate", "chat_stream", "stats", "is_alive", "on_death",
           "shutdown")
