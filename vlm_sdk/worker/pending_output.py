"""A launched step whose sampled tokens are on their way to the host (asynchronous scheduling).

    runner.execute_async(sched) -> DevicePendingOutput   the step is queued on the device; nothing waited
    ...                                              the engine schedules and launches the next step
    pending.result() -> ModelRunnerOutput            waits for this step's event, reads its tokens

Every step records its event, sampling or not: `result()` is also what tells the runner that the
step's pinned host buffers (staged inputs, used in turns of two) are free to be packed again.
"""
from __future__ import annotations

import torch

from vlm_sdk.protocol.runner_output import EncoderCacheStats, ModelRunnerOutput, PendingOutput, PromptLogprobsChunk
from vlm_sdk.sample.sampled_tokens import SampledTokens


class DevicePendingOutput(PendingOutput):
    def __init__(self, request_ids: list[str], sampled: SampledTokens | None, device: torch.device,
                 encoder_cache: EncoderCacheStats | None = None,
                 prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None, spec: tuple[dict, dict] | None = None):
        """`request_ids`: the sampled rows' requests, in row order. Queues the host copies and records
        the step's event (CUDA). `encoder_cache`: the counters after this step's vision stage;
        `prompt_logprobs`: the step's, already on the host. `spec`: the verification step's tokens and logprobs
        per request (already on the host: its acceptances were read to decide them)."""
        self._request_ids, self._sampled, self._output = request_ids, sampled, None
        self._encoder_cache = encoder_cache
        self._prompt_logprobs = prompt_logprobs or {}
        self._spec = spec or ({}, {})
        self._event = None
        if sampled is not None:
            sampled.start_copy()
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> ModelRunnerOutput:
        """The step's `ModelRunnerOutput`, once its copies have landed (waits for the device)."""
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()
            if self._sampled is None:
                self._output = ModelRunnerOutput(encoder_cache=self._encoder_cache,
                                                 prompt_logprobs=self._prompt_logprobs, spec_token_ids=self._spec[0],
                                                 spec_logprobs=self._spec[1])
            else:
                tokens, logprobs = self._sampled.lists()
                ids = self._request_ids
                self._output = ModelRunnerOutput(dict(zip(ids, tokens)),
                                                 {r: lp for r, lp in zip(ids, logprobs) if lp is not None},
                                                 self._encoder_cache, self._prompt_logprobs, *self._spec)
        return self._output
