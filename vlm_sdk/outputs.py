"""What a caller receives: one `RequestOutput` per stream update, and the final one."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    prompt_tokens: int = 0
    image_tokens: int = 0
    generated_tokens: int = 0
    preprocess_time: float = 0.0  # seconds spent decoding images and building the prompt

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_time(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """`text` and `token_ids` hold everything generated so far; `delta_text` what is new since the
    previous output of this request. `finish_reason` is None while running, then "stop", "length" or
    "abort"."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    finish_reason: str | None
    metrics: RequestMetrics = field(repr=False, default=None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
