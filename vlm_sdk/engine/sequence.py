"""One request's state inside the engine.

There is no prefill phase and no decode phase: a sequence has `token_ids` (prompt, then generated
tokens) and `num_computed_tokens`, the prefix whose K/V is in the cache. Each step the scheduler
lets `num_computed_tokens` catch up by some tokens; when it reaches `len(token_ids)` the step also
samples one new token. Preemption frees the blocks and sets `num_computed_tokens` back to 0.
"""
from __future__ import annotations

import enum
import time

import torch

from vlm_sdk.engine.detokenizer import IncrementalDetokenizer
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.outputs import RequestMetrics
from vlm_sdk.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt: PromptInputs, params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.token_ids: list[int] = list(prompt.token_ids)
        self.num_prompt_tokens = len(prompt.token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.detokenizer = detokenizer
        self.image_embeds: torch.Tensor | None = None  # [image tokens, hidden] while prefill still needs them
        # image tokens' indices in the prompt, so a prefill chunk finds its rows of image_embeds
        self.image_token_index = _image_token_index(prompt)  # [num image tokens] int64
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic(),
                                      prompt_tokens=self.num_prompt_tokens,
                                      image_tokens=sum(prompt.image_tokens),
                                      preprocess_time=prompt.preprocess_seconds)
        self.num_preemptions = 0
        self.num_emitted_chars = 0  # text already streamed; a possible stop-string prefix waits

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_images(self) -> bool:
        """Whether a step that computes this sequence's next tokens may read image embeddings."""
        n = self.image_token_index.numel()
        return n > 0 and self.num_computed_tokens <= int(self.image_token_index[-1])

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids})")


def _image_token_index(prompt: PromptInputs) -> torch.Tensor:
    index = [torch.arange(start, start + image.num_tokens)
             for start, image in zip(prompt.image_positions, prompt.images)]
    return torch.cat(index) if index else torch.empty(0, dtype=torch.long)
