"""What rank 0 hands back each step: the sampled tokens (the other ranks return an empty output).

    executor.execute(sched)        -> ModelRunnerOutput
    executor.execute_async(sched)  -> PendingOutput; .result() -> ModelRunnerOutput once it has landed

The worker's pending output waits for a device event (vlm_sdk/worker/pending_output.py); `Ready` is
one whose output is already on the host.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from vlm_sdk.outputs import TokenLogprob


@dataclass(frozen=True)
class EncoderCacheStats:
    """The rank's encoder cache counters since start-up (every rank's are alike under tensor parallelism:
    all ranks see the same steps and capacity)."""
    hits: int = 0
    queries: int = 0
    num_bytes: int = 0


@dataclass(frozen=True, eq=False)
class PromptLogprobsChunk:
    """The prompt logprobs of the prompt positions one step computed for one request: rows for prompt
    tokens `start`.. (each row: that token given the tokens before it). `token_ids` / `logprobs`
    [rows, k + 1]: the prompt token first, then the k most likely tokens there; `ranks` [rows]: the
    prompt token's rank (1: the most likely; ties count as above, as vLLM ranks)."""
    start: int
    token_ids: np.ndarray  # [rows, k + 1] int32
    logprobs: np.ndarray  # [rows, k + 1] float32
    ranks: np.ndarray  # [rows] int64


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # request id -> its new token
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # only requests that asked for them
    encoder_cache: EncoderCacheStats | None = None  # after the step (None: unchanged, or not rank 0)
    # request id -> the prompt logprobs this step computed (SamplingParams.prompt_logprobs; any step with
    # prompt tokens of such a request, sampling or not)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # speculative decoding: request id -> the tokens its verification step yields (the accepted drafts, then
    # the correction at the first rejection or the bonus token); such a request is not in sampled_token_ids
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # one per token, when asked for
    # EAGLE-3: request id -> the drafts its next step verifies (after the tokens this step gave it), and the
    # rank's time proposing them
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_seconds: float = 0.0


class PendingOutput(ABC):
    """A launched step; `result()` waits for it and returns its output (idempotent)."""

    @abstractmethod
    def result(self) -> ModelRunnerOutput:
        """The step's output, once its tokens are on the host."""


class Ready(PendingOutput):
    """An output already on the host (a rank that does not sample, an empty step, an executor without
    asynchronous steps)."""

    def __init__(self, output: ModelRunnerOutput):
        self._output = output

    def result(self) -> ModelRunnerOutput:
        return self._output
