"""What the prompt builder hands the engine: token ids with images already expanded."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlm_sdk.errors import InvalidRequestError


@dataclass
class ImageInput:
    """One preprocessed image, opaque to the engine: it hands `data` and `meta` back to the model's
    `encode_images` and counts `num_tokens` and `size`; only the model family reads `meta`. Equal
    `key`s promise equal vision embeddings and equal positions for the image's tokens."""
    data: torch.Tensor  # the family's pixels (float32, or bytes it converts on its device), first dim = `size`
    num_tokens: int  # image tokens in the prompt
    meta: Any = None  # the family's per-image record (grid, the part's own settings, ...)
    source_size: tuple[int, int] | None = None  # (height, width) as decoded, before resizing
    # `multimodal.image_key.image_key` of the decoded pixels and the settings that shaped `data`; None:
    # not cacheable (the prefix cache stops before its first token, the encoder cache skips it)
    key: bytes | None = None

    @property
    def size(self) -> int:
        """Rows of `data`: what the cap on one vision-tower call counts."""
        return int(self.data.shape[0])


@dataclass
class PromptInputs:
    """A tokenized prompt ready to schedule.

    `image_positions[i]` is the index in `token_ids` of the first token of image i; its tokens are
    `num_tokens` consecutive copies of the image token id. `positions` is the family's record of the
    prompt's positions, computed once by its processor and read only by its model's `positions()`
    (None: plain 1-D positions).
    """
    token_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)
    image_positions: list[int] = field(default_factory=list)
    positions: Any = None
    preprocess_seconds: float = 0.0  # time build_prompt took (image decode, resize, tokenize)
    # a tenant's cache salt (`ChatOptions.cache_salt`): its KV blocks are hashed from it, its images'
    # keys salted, so no other salt shares either; None: the common, unsalted cache
    cache_salt: str | None = None
    # how the output is read (`vlm_sdk.parsers.OutputFormat`: reasoning, tool calls); None: plain text
    output_format: Any = None
    # the grammar the engine set for this request (a forced tool call, or the request's own after free
    # reasoning: a `StructuredOutputs`); None: the sampling params' own, if any
    grammar: Any = None

    @property
    def image_tokens(self) -> list[int]:
        return [im.num_tokens for im in self.images]


def expand_image_placeholders(ids: list[int], images: list[ImageInput], placeholder_id: int, placeholder: str,
                              before: tuple[int, ...] = (), after: tuple[int, ...] = ()) -> tuple[list[int], list[int]]:
    """(token ids, image positions): each placeholder token in the rendered prompt becomes `before` +
    `num_tokens` copies of the placeholder + `after`, in image order. `InvalidRequestError` when the
    counts differ (a placeholder typed into a text part, or a chat template that drops image parts)."""
    token_ids, positions = [], []
    it = iter(images)
    for tok in ids:
        if tok != placeholder_id:
            token_ids.append(tok)
            continue
        image = next(it, None)
        if image is None:
            raise InvalidRequestError("the prompt text contains more image placeholders than images were given; "
                                      f"do not write {placeholder} in text parts")
        token_ids.extend(before)
        positions.append(len(token_ids))
        token_ids.extend([placeholder_id] * image.num_tokens)
        token_ids.extend(after)
    if len(positions) != len(images):
        raise InvalidRequestError(f"the chat template rendered {len(positions)} image placeholders for "
                                  f"{len(images)} images; the model's chat template must render every image part")
    return token_ids, positions


def refuse_placeholders(token_ids: list[int], placeholder_id: int, placeholder: str) -> None:
    """`InvalidRequestError` when a prompt without images holds the image placeholder token: it stands
    for an image's embeddings, which a prompt of text or token ids cannot carry."""
    at = next((i for i, t in enumerate(token_ids) if t == placeholder_id), None)
    if at is not None:
        raise InvalidRequestError(f"the prompt holds the image placeholder token {placeholder} (id {placeholder_id}) "
                                  f"at position {at}, but a prompt of text or token ids carries no image; send images "
                                  f"as image parts of chat messages (/v1/chat/completions)", param="prompt")
