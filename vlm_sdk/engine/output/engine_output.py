"""What a step returns per request: token ids and the finish reasons the engine decides itself.

The engine never detokenizes: text, stop strings and stream deltas are the `OutputProcessor`'s.
"""
from __future__ import annotations

from dataclasses import dataclass

from vlm_sdk.outputs import PromptLogprobs, RequestMetrics, TokenLogprob


@dataclass(slots=True)  # made per request per step: slots, not frozen, keep it cheap
class EngineOutput:
    request_id: str
    new_token_ids: list[int]  # sampled this step (one, or none for an abort)
    # None while running; "stop" (EOS or a stop_token_id), "length" (max_tokens, max_model_len), "abort"
    finish_reason: str | None
    # the engine's own, which it goes on updating: `OutputProcessor.process` copies it as of this output
    # (generated_tokens from `num_generated`; finished_time only on a finishing output); a copy per
    # token on the engine thread cost ~0.3 us per sequence per step
    metrics: RequestMetrics
    num_generated: int  # the request's generated tokens, this output's included
    new_logprobs: list[TokenLogprob] | None = None  # one per new token when the request asked for them
    prompt_logprobs: PromptLogprobs | None = None  # on the request's first output, when it asked for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
