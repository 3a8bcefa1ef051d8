"""Qwen2.5-VL prompt builder: messages -> `PromptInputs`.

Images are decoded and preprocessed, the chat template renders one `<|image_pad|>` per image, and
each is expanded to the image's token count (grid_t*grid_h*grid_w / merge^2), so the prompt's
length is final before scheduling. M-RoPE positions are computed here, once per request
(`PromptInputs.positions` is an `MRopePositions`, read by the model's `positions()`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from vlm_sdk.errors import InvalidImageError, InvalidRequestError
from vlm_sdk.multimodal.image_io import load_image
from vlm_sdk.multimodal.image_key import image_key
from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs, expand_image_placeholders, refuse_placeholders
from vlm_sdk.multimodal.messages import ImageRef, parse_messages
from vlm_sdk.models.base import PromptProcessor
from vlm_sdk.models.qwen2_5_vl.fixes import max_pixels_fix
from vlm_sdk.models.qwen2_5_vl.image_processor import QwenImage, Qwen2VLImageProcessor, max_image_grid
from vlm_sdk.models.qwen2_5_vl.rope_index import MRopePositions, mrope_positions


class Qwen2_5_VLProcessor(PromptProcessor):
    """`max_image_tokens` (None: no limit) caps the tokens of one image whose own `min_pixels` /
    `max_pixels` (set on its image part) decide its size: such an image is refused before it is
    resized, so a part asking for a billion pixels costs nothing. The engine sets it to its
    max_model_len once that is known (it is a plain attribute for that reason). Images sized by the
    engine's or the preprocessor's bounds are left to the engine's prompt check, whose error offers
    fixes."""

    def __init__(self, tokenizer, image_processor: Qwen2VLImageProcessor, hf_config, *,
                 min_pixels: int | None = None, max_pixels: int | None = None,
                 max_image_pixels: int = 64_000_000, max_image_tokens: int | None = None, family):
        self.family = family  # the FamilySpec: per-image settings are checked by it
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = hf_config.image_token_id
        self.merge_size = hf_config.vision_config.spatial_merge_size
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.max_image_pixels = max_image_pixels
        self.max_image_tokens = max_image_tokens

    @classmethod
    def settings_kwargs(cls, options: dict) -> dict:
        lo, hi = options.get("min_pixels"), options.get("max_pixels")
        if lo is not None and hi is not None and lo > hi:
            raise InvalidRequestError(f"min_pixels ({lo}) must not exceed max_pixels ({hi})", param="min_pixels")
        return {"min_pixels": lo, "max_pixels": hi}

    @property
    def engine_max_pixels(self) -> int:
        return self.max_pixels or self.image_processor.max_pixels

    def largest_image(self) -> ImageInput:
        """Zero pixels of the largest image the engine's max_pixels allows, for the memory profile
        and the vision tower's per-call patch cap: bytes, as the processor hands out (so the profile
        runs the device-side normalisation too)."""
        ip = self.image_processor
        t, h, w = max_image_grid(ip, self.engine_max_pixels)
        return ImageInput(torch.zeros(t * h * w, 3 * ip.patch_size ** 2, dtype=torch.uint8),
                          t * h * w // ip.merge_size ** 2,
                          QwenImage((t, h, w), pixel_lut=ip.pixel_lut))  # data [patches, 3*p*p] uint8

    def image_setting_fixes(self, prompt: PromptInputs, capacity: int) -> dict[str, int]:
        """{"max_pixels": v}: the largest engine max_pixels below the current one that makes the prompt
        fit `capacity` tokens; {} when there is none."""
        ip = self.image_processor
        best = max_pixels_fix(prompt, capacity, self.image_tokens_with_max_pixels,
                              self.min_pixels or ip.min_pixels, ip.patch_size * ip.merge_size, self.engine_max_pixels)
        return {} if best is None else {"max_pixels": best}

    def __call__(self, messages, template_kwargs: Mapping[str, Any] | None = None) -> PromptInputs:
        template_messages, refs = parse_messages(messages)
        images = [self._image(i, ref) for i, ref in enumerate(refs)]
        return self.build(template_messages, images, template_kwargs)

    def _bound(self, own: int | None, engine: int | None, default: int) -> tuple[int, str]:
        """The value in effect for one image, and where it came from."""
        if own is not None:
            return own, "set on the image part"
        if engine is not None:
            return engine, "the engine's"
        return default, "the preprocessor default"

    def _image(self, index: int, ref: ImageRef) -> ImageInput:
        own = self.family.image_options(ref.options, f"image {index}: ")
        own_min, own_max = own.get("min_pixels"), own.get("max_pixels")
        pil = load_image(ref.source, max_image_pixels=self.max_image_pixels)
        ip = self.image_processor
        min_px, min_src = self._bound(own_min, self.min_pixels, ip.min_pixels)
        max_px, max_src = self._bound(own_max, self.max_pixels, ip.max_pixels)
        if min_px > max_px:
            raise InvalidRequestError(
                f"image {index}: min_pixels ({min_px}, {min_src}) is larger than max_pixels ({max_px}, "
                f"{max_src}); set min_pixels <= max_pixels.")
        self._check_tokens(index, pil.height, pil.width, min_px, min_src, max_px, max_src)
        image = ip(pil, min_pixels=min_px, max_pixels=max_px)
        image.source_size = (pil.height, pil.width)
        image.key = image_key(pil, min_pixels=min_px, max_pixels=max_px)  # the grid follows from these
        image.meta = dataclasses.replace(image.meta, own_max_pixels=own_max is not None, own_min_pixels=own_min)
        return image

    def _check_tokens(self, index: int, height: int, width: int, min_px: int, min_src: str, max_px: int,
                      max_src: str) -> None:
        """Refuse, before resizing, an image whose own min_pixels / max_pixels give it more tokens
        than `max_image_tokens`."""
        limit = self.max_image_tokens
        if limit is None:
            return
        ip = self.image_processor
        tokens = ip.num_image_tokens(height, width, min_pixels=min_px, max_pixels=max_px)
        if tokens <= limit:
            return
        factor = ip.patch_size * ip.merge_size
        rounded = round(height / factor) * factor * (round(width / factor) * factor)
        upsized = rounded < min_px  # min_pixels sets the size; otherwise max_pixels (or the image) does
        name, src = ("min_pixels", min_src) if upsized else ("max_pixels", max_src)
        if src != "set on the image part":
            return  # engine-level bounds: the engine's prompt check reports it, with fixes
        fix = ""
        if upsized:
            best = _largest(lambda v: ip.num_image_tokens(height, width, min_pixels=v, max_pixels=max_px) <= limit,
                            min_px)
            if best is not None:
                fix = f"Lower the image part's min_pixels to at most {best}, or leave it out."
        if not fix:
            best = _largest(lambda v: ip.num_image_tokens(height, width, min_pixels=min(min_px, v),
                                                          max_pixels=v) <= limit, max_px)
            if best is None:
                fix = "Crop or shrink the image."
            else:
                also = f" and min_pixels to at most {best}" if best < min_px else ""
                fix = f"Lower the image part's max_pixels to at most {best}{also}."
        raise InvalidImageError(
            f"image {index} is {width}x{height} (width x height); with min_pixels={min_px} ({min_src}) and "
            f"max_pixels={max_px} ({max_src}) it would become {tokens} image tokens, more than the "
            f"{limit} one image may take (max_model_len); refused before resizing because of its {name}. {fix}")

    def build(self, template_messages: list[dict], images: list[ImageInput],
              template_kwargs: Mapping[str, Any] | None = None) -> PromptInputs:
        text = self.tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True,
                                                  **(template_kwargs or {}))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        token_ids, positions = expand_image_placeholders(ids, images, self.image_token_id, "<|image_pad|>")
        mrope, delta = mrope_positions(token_ids, [im.meta.grid_thw for im in images], self.image_token_id,
                                       self.merge_size)  # [3, len(token_ids)]
        return PromptInputs(token_ids=token_ids, images=images, image_positions=positions,
                            positions=MRopePositions(mrope, delta))

    def text_prompt(self, token_ids: list[int]) -> PromptInputs:
        """Text positions on all three M-RoPE axes (rope_delta 0), as `build` gives a prompt without images."""
        refuse_placeholders(token_ids, self.image_token_id, "<|image_pad|>")
        mrope, delta = mrope_positions(token_ids, [], self.image_token_id, self.merge_size)  # [3, len(token_ids)]
        return PromptInputs(token_ids=list(token_ids), positions=MRopePositions(mrope, delta))

    def image_tokens_with_max_pixels(self, prompt: PromptInputs, max_pixels: int) -> list[int]:
        """Each image's token count if the engine's max_pixels were `max_pixels` (images whose part
        sets its own max_pixels keep theirs; each image keeps its effective min_pixels, which must
        not exceed `max_pixels`)."""
        counts = []
        for image in prompt.images:
            if image.meta.own_max_pixels or image.source_size is None:
                counts.append(image.num_tokens)
                continue
            h, w = image.source_size
            min_px = image.meta.own_min_pixels if image.meta.own_min_pixels is not None else self.min_pixels
            counts.append(self.image_processor.num_image_tokens(h, w, min_pixels=min_px, max_pixels=max_pixels))
        return counts


def _largest(fits, top: int) -> int | None:
    """The largest v in [1, top] with fits(v), for fits monotone (true up to some value); None if
    fits(1) is false."""
    if not fits(1):
        return None
    lo, hi = 1, top + 1  # fits(lo); hi is past the range or does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
