"""What the prompt builder hands the engine: token ids with images already expanded."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlm_sdk.errors import InvalidRequestError


@dataclass
class ImageInput:
    """One preprocessed image."""
    # Qwen2.5-VL: [num_patches, channels * temporal_patch * patch * patch]; InternVL: [tiles, 3, S, S]
    # float32; the first dim is what the vision tower's per-call cap counts
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]  # Qwen2.5-VL: patches along time, height, width (before merging);
    #                                 InternVL: (tiles, 1, 1)
    num_tokens: int  # image tokens in the prompt: t*h*w / merge^2 (Qwen), tiles * tokens per tile (InternVL)
    source_size: tuple[int, int] | None = None  # (height, width) as decoded, before resizing
    own_max_pixels: bool = False  # the image part set its own max_pixels (engine max_pixels does not apply)
    own_min_pixels: int | None = None  # the image part's own min_pixels, if it set one (it wins over the engine's)
    own_max_num: bool = False  # InternVL: the image part set its own max_num (engine max_dynamic_patch does not apply)


@dataclass
class PromptInputs:
    """A tokenized prompt ready to schedule.

    `image_positions[i]` is the index in `token_ids` of the first token of image i; its tokens are
    `num_tokens` consecutive copies of the image token id.
    """
    token_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)
    image_positions: list[int] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None  # [3, len(token_ids)] int64
    rope_delta: int = 0  # decode token at index p has position p + rope_delta on all three axes
    preprocess_seconds: float = 0.0  # time build_prompt took (image decode, resize, tokenize)

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
