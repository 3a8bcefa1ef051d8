"""What the worker remembers of one request between steps (built from `NewRequestData`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlm_sdk.multimodal.inputs import ImageInput
from vlm_sdk.sample.penalties import PenaltyTally
from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.protocol.scheduler_output import NewRequestData


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens as the engine sends them
    num_prompt_tokens: int
    images: list[ImageInput]
    image_positions: list[int]  # index of image i's first token
    prompt_positions: Any  # the family's, for `model.positions`
    params: SamplingParams
    block_ids: tuple[list[int], ...]  # per attention cache group
    num_computed_tokens: int
    min_tokens_stop_ids: tuple[int, ...] = ()  # see NewRequestData
    state_slot: int = -1  # its live state slot (a model with state layers)
    # image index -> its embeddings [image tokens, hidden], from the first step whose chunk reaches the
    # image until prefill passes its last token (a long video's temporal patches are encoded as the
    # chunks reach them, so a request holds about one chunk of them, never the whole video)
    image_embeds: dict[int, torch.Tensor] = field(default_factory=dict)
    row: int = -1  # its row in the runner's `BlockTables` (set by the runner)
    linear_positions: bool = True  # its generated tokens' positions are index + a constant (set by the runner)
    # penalties: its seen tokens and output counts kept across steps (sample/penalties.py); None without any
    tally: PenaltyTally | None = None

    @classmethod
    def from_new(cls, new: NewRequestData) -> "RequestState":
        params = new.sampling_params
        penalised = params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        return cls(new.request_id, list(new.prompt_token_ids) + list(new.output_token_ids),
                   len(new.prompt_token_ids), new.images, new.image_positions, new.prompt_positions,
                   params, tuple(list(b) for b in new.block_ids), new.num_computed_tokens,
                   new.min_tokens_stop_ids, new.state_slot, tally=PenaltyTally() if penalised else None)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def image_end(self, image: int) -> int:
        """Index one past image `image`'s last token."""
        return self.image_positions[image] + self.images[image].num_tokens

    def images_needed(self, end: int | None = None) -> list[int]:
        """Images whose tokens a step from num_computed_tokens to `end` (None: the prompt's end) reads."""
        return [i for i in range(len(self.images)) if self.image_end(i) > self.num_computed_tokens
                and (end is None or self.image_positions[i] < end)]
