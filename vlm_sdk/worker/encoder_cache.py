"""Image embeddings on the worker, keyed by (request id, image index).

Filled on the first step that computes a request's image tokens (every image the request still
needs, encoded together with the other such requests' images); an entry is dropped once prefill has
computed its image's last token, and all of a request's entries when it finishes or is preempted
(a preempted request recomputes from token 0 and encodes its images again).
"""
from __future__ import annotations

import torch


class EncoderCache:
    def __init__(self):
        self._embeds: dict[tuple[str, int], torch.Tensor] = {}  # -> [image tokens, hidden]
        self.hits = 0  # images whose embeddings were found here (the vision tower skipped)
        self.queries = 0  # images looked up
        self.num_bytes = 0  # held for reuse

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._embeds

    def __len__(self) -> int:
        return len(self._embeds)

    def get(self, request_id: str, image: int) -> torch.Tensor | None:
        return self._embeds.get((request_id, image))

    def put(self, request_id: str, image: int, embeds: torch.Tensor) -> None:
        self._embeds[(request_id, image)] = embeds

    def drop(self, request_id: str, image: int) -> None:
        self._embeds.pop((request_id, image), None)

    def free(self, request_id: str) -> None:
        """Drop every entry of `request_id` (finished, aborted or preempted)."""
        for key in [k for k in self._embeds if k[0] == request_id]:
            del self._embeds[key]
