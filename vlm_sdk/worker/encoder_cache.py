"""Vision embeddings kept for reuse, keyed by image (`ImageInput.key`: pixels + the settings that
shaped them), bounded by bytes, least recently used evicted first.

A request holds the embeddings of each image it still needs in its own `RequestState` (from the
step that first needs them until prefill passes the image's last token), whether they came from
here or from the vision tower; this cache is what outlives the request: a later turn of the same
conversation, or another user sending the same image, skips the vision tower.

Under tensor parallelism every rank keeps its own copy with the same capacity and sees the same
steps, so every rank hits and misses on the same images and the vision tower's collectives line up.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from vlm_sdk.protocol.runner_output import EncoderCacheStats


class EncoderCache:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes  # 0: nothing is kept
        self._embeds: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # key -> [image tokens, hidden]
        self.hits = 0  # lookups answered here (the vision tower skipped)
        self.queries = 0  # lookups
        self.num_bytes = 0  # held for reuse

    def __len__(self) -> int:
        return len(self._embeds)

    def stats(self) -> EncoderCacheStats:
        return EncoderCacheStats(self.hits, self.queries, self.num_bytes)

    def get(self, key: bytes | None) -> torch.Tensor | None:
        """The embeddings of image `key` (a lookup, counted), marked most recently used; None if absent."""
        self.queries += 1
        embeds = None if key is None else self._embeds.get(key)
        if embeds is not None:
            self._embeds.move_to_end(key)
            self.hits += 1
        return embeds

    def count_hit(self) -> None:
        """A lookup answered without the cache: a second request in the same step with an image the
        step encodes anyway (it too skips the vision tower)."""
        self.queries += 1
        self.hits += 1

    def put(self, key: bytes | None, embeds: torch.Tensor) -> None:
        """Keep `embeds` (its own storage: not a view into a larger tensor), evicting the least recently
        used; an image larger than the whole capacity is not kept."""
        size = embeds.numel() * embeds.element_size()
        if key is None or size > self.capacity_bytes or key in self._embeds:
            return
        while self.num_bytes + size > self.capacity_bytes:
            _, old = self._embeds.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()
        self._embeds[key] = embeds
        self.num_bytes += size
