"""Gemma 3 prompt builder: messages -> `PromptInputs`, as transformers' `Gemma3Processor` builds them.

The chat template renders each image part as <start_of_image>; each of those, in order, is replaced in the
TEXT (before tokenizing, so "\\n\\n" merges with its neighbours exactly as in transformers) by

    no crops:  "\\n\\n<start_of_image>" + "<image_soft_token>" x tokens_per_image + "<end_of_image>\\n\\n"
    n crops:   "Here is the original image " + that + " and here are some crops to help you see better "
               + " ".join([that] * n)

and the text is tokenized as one. Every frame (the whole image, then each pan-and-scan crop) is one
`ImageInput` of `tokens_per_image` tokens: one 896x896 picture through the tower, one run of soft tokens
in the prompt, one encoder-cache entry (`image_key` of the decoded image, the frame and the crop grid).
Special-token text a user typed was escaped before the template (engine/input/special_text.py), so only
the template's <start_of_image> are expanded. Positions are plain 1-D RoPE.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from vlm_sdk.errors import CheckpointError, InvalidImageError, InvalidRequestError
from vlm_sdk.model_loader import config_field
from vlm_sdk.multimodal.image_io import open_image, oriented_size
from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs, refuse_placeholders
from vlm_sdk.multimodal.messages import ImageRef, VideoRef, parse_messages
from vlm_sdk.models.base import MediaPart, PromptProcessor
from vlm_sdk.models.gemma3.image_processor import Gemma3ImageProcessor, PanAndScan, gemma3_image_pixels

# engine / image-part setting -> PanAndScan field
_FIELDS = {"do_pan_and_scan": "enabled", "pan_and_scan_max_num_crops": "max_num_crops",
           "pan_and_scan_min_crop_size": "min_crop_size", "pan_and_scan_min_ratio_to_activate": "min_ratio_to_activate"}


def engine_pan_and_scan(image_processor: Gemma3ImageProcessor, options: Mapping[str, Any]) -> PanAndScan:
    """The preprocessor's pan-and-scan options with the engine's (or an image part's) settings over them."""
    return dataclasses.replace(image_processor.pan_and_scan,
                               **{_FIELDS[k]: v for k, v in options.items() if k in _FIELDS and v is not None})


@dataclass(frozen=True)
class Gemma3Frame:
    """`ImageInput.meta` of one frame: the whole image (`frame` 0) or crop `frame` of `crops`."""
    image: int  # which image of the request
    frame: int
    crops: int
    own_settings: bool = False  # the image part set its own pan-and-scan options (the engine's fixes skip it)
    pixel_lut: torch.Tensor | None = field(default=None, compare=False, repr=False)  # [3, 256] for uint8 data


class Gemma3Processor(PromptProcessor):
    """`pan_and_scan`: the engine's settings (`_FIELDS` names) over the preprocessor's. `max_image_tokens`
    (None: no limit) refuses, before any resize, an image whose frames would take more tokens than one
    sequence may hold; the engine sets it to max_model_len."""

    def __init__(self, tokenizer, image_processor: Gemma3ImageProcessor, hf_config, *,
                 pan_and_scan: Mapping[str, Any] | None = None, max_image_pixels: int = 64_000_000,
                 max_image_tokens: int | None = None, family):
        self.family, self.tokenizer, self.image_processor = family, tokenizer, image_processor
        self.boi, self.eoi, self.soft, ids = _image_tokens(tokenizer, hf_config)
        self.boi_id, self.image_token_id = ids
        self.tokens_per_image = int(config_field(hf_config, "mm_tokens_per_image") or 256)
        wrapped = f"\n\n{self.boi}{self.soft * self.tokens_per_image}{self.eoi}\n\n"
        self.full_image_sequence = wrapped
        self.pan_and_scan = engine_pan_and_scan(image_processor, pan_and_scan or {})
        self.max_image_pixels = max_image_pixels
        self.max_image_tokens = max_image_tokens

    @classmethod
    def settings_kwargs(cls, options: dict) -> dict:
        return {"pan_and_scan": dict(options)}

    def largest_image(self) -> ImageInput:
        """Zero pixels of one frame: every frame is one tower call of one image size."""
        s = self.image_processor.size
        return ImageInput(torch.zeros(1, 3, s, s, dtype=torch.uint8), self.tokens_per_image,
                          Gemma3Frame(0, 0, 0, pixel_lut=self.image_processor.pixel_lut))

    def __call__(self, messages, template_kwargs: Mapping[str, Any] | None = None) -> PromptInputs:
        template_messages, refs = parse_messages(messages)
        frames: list[list[ImageInput]] = []
        for ref in refs:
            if isinstance(ref, VideoRef):
                self.family.video_options(ref.options, f"video {len(frames)}: ")  # refused: no video settings
            frames.append(self._image(len(frames), ref))
        text = self.tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True,
                                                  **(template_kwargs or {}))
        return self.build(text, frames)

    def _image(self, index: int, ref: ImageRef) -> list[ImageInput]:
        own = self.family.image_options(ref.options, f"image {index}: ")
        pas = engine_pan_and_scan(self.image_processor, {**self._engine_options(), **own})
        opened = open_image(ref.source, max_image_pixels=self.max_image_pixels)
        height, width = oriented_size(opened)
        rows, cols = pas.grid(width, height)
        crops = rows * cols
        self._check_tokens(index, width, height, pas, crops, bool(own))
        # [1 + crops, 3, S, S] uint8, (height, width), one key per frame
        data, size, keys = self.run_pixels(opened, self.max_image_pixels, gemma3_image_pixels, self.image_processor, pas)
        if data.shape[0] != 1 + crops:  # the header's size and the decoded image's gave other grids
            crops = data.shape[0] - 1
        lut = self.image_processor.pixel_lut
        return [ImageInput(data[f:f + 1], self.tokens_per_image, Gemma3Frame(index, f, crops, bool(own), lut),
                           source_size=size, key=keys[f]) for f in range(1 + crops)]

    def _engine_options(self) -> dict[str, Any]:
        p = self.pan_and_scan
        return {k: getattr(p, f) for k, f in _FIELDS.items()}

    def _check_tokens(self, index: int, width: int, height: int, pas: PanAndScan, crops: int, own: bool) -> None:
        limit = self.max_image_tokens
        tokens = (1 + crops) * self.tokens_per_image
        if limit is None or tokens <= limit:
            return
        fewer = (limit // self.tokens_per_image) - 1
        fix = (f"set pan_and_scan_max_num_crops to at most {fewer}" if fewer >= 1 else "set do_pan_and_scan to false"
               ) if crops and limit >= self.tokens_per_image else "no setting fits: raise max_model_len"
        where = "the image part's" if own else "the engine's"
        raise InvalidImageError(f"image {index} is {width}x{height} (width x height); with {where} pan-and-scan "
                                f"settings it becomes 1 + {crops} crops = {tokens} image tokens, more than the {limit} "
                                f"one image may take (max_model_len); refused before resizing: {fix}",
                                param="pan_and_scan_max_num_crops")

    def replacement(self, crops: int) -> str:
        """The text one <start_of_image> becomes (transformers' `Gemma3Processor.replace_image_token`)."""
        if not crops:
            return self.full_image_sequence
        return (f"Here is the original image {self.full_image_sequence} and here are some crops to help you see better "
                + " ".join([self.full_image_sequence] * crops))

    def build(self, text: str, frames: list[list[ImageInput]]) -> PromptInputs:
        """The rendered template `text` with each <start_of_image> expanded (the i-th by image i's frames),
        tokenized."""
        parts = text.split(self.boi)
        if len(parts) - 1 != len(frames):
            raise InvalidRequestError(f"the chat template rendered {len(parts) - 1} image placeholders for "
                                      f"{len(frames)} images; the model's chat template must render every image part")
        out = [parts[0]]
        for image, rest in zip(frames, parts[1:]):
            out += [self.replacement(len(image) - 1), rest]
        ids = self.tokenizer.encode("".join(out), add_special_tokens=False)
        images = [f for image in frames for f in image]
        positions = _runs(ids, self.image_token_id)
        if [n for _, n in positions] != [self.tokens_per_image] * len(images):
            raise CheckpointError(f"the tokenizer turned {len(images)} images of {self.tokens_per_image} "
                                  f"{self.soft} tokens into runs of {[n for _, n in positions]}: it must read "
                                  f"{self.soft} as one special token")
        return PromptInputs(token_ids=ids, images=images, image_positions=[p for p, _ in positions])

    def text_prompt(self, token_ids: list[int]) -> PromptInputs:
        """1-D positions; the soft image token (an image's embedding slot) is refused."""
        refuse_placeholders(token_ids, self.image_token_id, self.soft)
        return PromptInputs(token_ids=list(token_ids))

    def media_parts(self, prompt: PromptInputs) -> list[MediaPart]:
        """An image's frames (the whole image, then its pan-and-scan crops) one part (grid (frames,))."""
        by_image: dict[int, list[int]] = {}
        for i, im in enumerate(prompt.images):
            by_image.setdefault(im.meta.image, []).append(i)
        return [MediaPart("image", tuple(items), 1, (len(items),)) for items in by_image.values()]

    def image_setting_fixes(self, prompt: PromptInputs, capacity: int) -> dict[str, int]:
        """{"pan_and_scan_max_num_crops": k} (the most crops that make the prompt fit), else
        {"do_pan_and_scan": False} when the whole images alone fit; images whose part set its own options
        keep them. {} when no engine setting fits or none applies."""
        follow = [im for im in prompt.images if not im.meta.own_settings and im.source_size is not None]
        if not any(im.meta.crops for im in follow):
            return {}
        whole = [im for im in follow if im.meta.frame == 0]
        fixed = len(prompt.token_ids) - sum(im.num_tokens for im in follow)

        def fits(pas: PanAndScan) -> bool:
            crops = sum(_crops(pas, im) for im in whole)
            return fixed + (len(whole) + crops) * self.tokens_per_image <= capacity
        for k in range(self.pan_and_scan.max_num_crops - 1, 0, -1):
            if fits(dataclasses.replace(self.pan_and_scan, max_num_crops=k)):
                return {"pan_and_scan_max_num_crops": k}
        return {"do_pan_and_scan": False} if fits(dataclasses.replace(self.pan_and_scan, enabled=False)) else {}


def _crops(pas: PanAndScan, image: ImageInput) -> int:
    rows, cols = pas.grid(image.source_size[1], image.source_size[0])
    return rows * cols


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in `ids`."""
    out, start = [], None
    for i, t in enumerate(ids + [None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            out.append((start, i - start))
            start = None
    return out


def _image_tokens(tokenizer, hf_config) -> tuple[str, str, str, tuple[int, int]]:
    """(<start_of_image>, <end_of_image>, <image_soft_token> as text, (boi id, soft token id)) from config.json's
    boi / eoi / image token indices, each checked to be one of the tokenizer's tokens."""
    names = {"boi_token_index": 255_999, "eoi_token_index": 256_000, "image_token_index": 262_144}  # Gemma3Config's
    ids = {k: int(config_field(hf_config, k) if config_field(hf_config, k) is not None else d) for k, d in names.items()}
    texts = {k: tokenizer.convert_ids_to_tokens(i) for k, i in ids.items()}
    bad = [f"{k}={ids[k]}" for k, t in texts.items() if not t or tokenizer.convert_tokens_to_ids(t) != ids[k]]
    if bad:
        raise CheckpointError(f"config.json {', '.join(bad)}: not a token of the checkpoint's tokenizer; Gemma 3 "
                              f"prompts need <start_of_image>, <end_of_image> and <image_soft_token>")
    return (texts["boi_token_index"], texts["eoi_token_index"], texts["image_token_index"],
            (ids["boi_token_index"], ids["image_token_index"]))
