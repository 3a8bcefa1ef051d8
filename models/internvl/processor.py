"""InternVL prompt builder: messages -> `PromptInputs`.

Each image is tiled (`InternVLImageProcessor`), the chat template renders one `<IMG_CONTEXT>` per
image, and that token is expanded in place to

    <img> <IMG_CONTEXT> x (tokens_per_tile * tiles) </img>
    tokens_per_tile = (tile_size / patch_size)^2 * downsample_ratio^2   (448 / 14, 0.5 -> 256)

so the prompt's length is final before scheduling. Positions are plain 1-D RoPE (no M-RoPE).

Two checkpoint layouts, two templates: transformers' (`model_type` "internvl") ships a chat template
that renders an image part as `<IMG_CONTEXT>\\n` itself; the original remote-code layout
(`internvl_chat`) ships the LLM's plain chat template, which takes string content, so image parts
are written into the string as `<IMG_CONTEXT>\\n` where they stand, as InternVL's own `chat()`
writes `<image>\\n` before the question.

A video part becomes its frames' text and image parts before either template renders ("Frame1: "
<image> ...: video.py), each frame one tile.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from vlm_sdk.errors import CheckpointError, InvalidImageError, InvalidRequestError, InvalidVideoError
from vlm_sdk.multimodal.image_io import open_image, oriented_size
from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs, expand_image_placeholders, refuse_placeholders
from vlm_sdk.multimodal.messages import ImageRef, VideoRef, parse_messages
from vlm_sdk.multimodal.video_io import open_video
from vlm_sdk.models.base import MediaPart, PromptProcessor
from vlm_sdk.model_loader import config_field, text_config
from vlm_sdk.models.internvl.image_processor import InternVLImageProcessor, internvl_image_pixels
from vlm_sdk.models.internvl.video import DEFAULT_FRAMES, frame_parts, video_frames
from vlm_sdk.models.internvl.vision import InternVisionConfig

IMG_CONTEXT, IMG_START, IMG_END = "<IMG_CONTEXT>", "<img>", "</img>"


@dataclass(frozen=True)
class InternVLImage:
    """`ImageInput.meta` of an InternVL image (its `data` is `[tiles, 3, S, S]`)."""
    tiles: int  # the thumbnail included
    own_max_num: bool = False  # the image part set its own max_num (engine max_dynamic_patch does not apply)
    # [3, 256] float32 when `data` is uint8 tiles: the normalised value of each (channel, byte)
    pixel_lut: torch.Tensor | None = field(default=None, compare=False, repr=False)
    video: int | None = None  # a video's frame: which video of the request (its frames share it)


def _tokens_per_tile(hf_config, tile_size: int) -> int:
    """Image tokens one tile becomes, as the vision tower computes them."""
    vision = InternVisionConfig.from_hf(hf_config, text_config(hf_config).hidden_size)
    try:
        return vision.tokens_per_tile(tile_size)
    except ValueError as e:
        raise CheckpointError(f"InternVL tiles of {tile_size} pixels (preprocessor_config.json): {e}") from e


class InternVLProcessor(PromptProcessor):
    """`max_num` (None: the checkpoint's) is the engine's tile cap per image; an image part's own
    `max_num` wins. `max_image_tokens` (None: no limit) refuses, before resizing, an image whose own
    max_num gives it more tokens than one sequence may hold; the engine sets it to max_model_len."""

    def __init__(self, tokenizer, image_processor: InternVLImageProcessor, hf_config, *,
                 max_num: int | None = None, max_image_pixels: int = 64_000_000,
                 max_image_tokens: int | None = None, family):
        self.family = family  # the FamilySpec: per-image settings are checked by it
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.original_layout = config_field(hf_config, "model_type") == "internvl_chat"
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (IMG_CONTEXT, IMG_START, IMG_END)}
        unk = getattr(tokenizer, "unk_token_id", None)
        missing = [t for t, i in ids.items() if i is None or (unk is not None and i == unk)]
        if missing:
            raise CheckpointError(f"the tokenizer has no {', '.join(missing)} token(s); InternVL prompts need "
                                  f"{IMG_START}, {IMG_CONTEXT} and {IMG_END} as added tokens")
        self.image_token_id, self.start_id, self.end_id = ids[IMG_CONTEXT], ids[IMG_START], ids[IMG_END]
        configured = config_field(hf_config, "image_token_id")
        if not self.original_layout and configured is not None and int(configured) != self.image_token_id:
            raise CheckpointError(f"config.json image_token_id is {configured} but the tokenizer gives "
                                  f"{IMG_CONTEXT} id {self.image_token_id}")
        self.tokens_per_tile = _tokens_per_tile(hf_config, image_processor.image_size)
        if max_num is not None:
            _check_min_num(max_num, "max_dynamic_patch", "max_dynamic_patch", image_processor.min_num)
        self.max_num = max_num
        self.max_image_pixels = max_image_pixels
        self.max_image_tokens = max_image_tokens

    @classmethod
    def settings_kwargs(cls, options: dict) -> dict:
        return {"max_num": options.get("max_dynamic_patch")}

    @property
    def engine_max_num(self) -> int:
        return self.image_processor.max_num if self.max_num is None else self.max_num

    def num_tiles(self, height: int, width: int, max_num: int) -> int:
        return self.image_processor.num_tiles(width, height, max_num)

    def largest_image(self) -> ImageInput:
        """Zero pixels of the most tiles one image gets under the engine's max_num (the thumbnail
        included), for the memory profile and the vision tower's per-call tile cap."""
        tiles = self.image_processor.tiles_of_grid(self.engine_max_num)
        s = self.image_processor.image_size
        return ImageInput(torch.zeros(tiles, 3, s, s, dtype=torch.uint8), tiles * self.tokens_per_tile,
                          InternVLImage(tiles, pixel_lut=self.image_processor.pixel_lut))  # bytes, as images come

    def __call__(self, messages, template_kwargs: Mapping[str, Any] | None = None) -> PromptInputs:
        template_messages, refs = parse_messages(messages)
        images, frame_counts = [], []
        for ref in refs:
            if isinstance(ref, VideoRef):
                frames = self._video(len(frame_counts), ref)
                frame_counts.append(len(frames))
                images.extend(frames)
            else:
                images.append(self._image(len(images) - sum(frame_counts), ref))
        if frame_counts:
            template_messages = _videos_as_frames(template_messages, iter(frame_counts))
        return self.build(template_messages, images, template_kwargs)

    def _video(self, index: int, ref: VideoRef) -> list[ImageInput]:
        options = self.family.video_options(ref.options, f"video {index}: ")
        frames = options.get("max_frames", DEFAULT_FRAMES)
        limit = self.max_image_tokens
        if limit is not None and frames * self.tokens_per_tile > limit:  # before anything is read
            fit = limit // self.tokens_per_tile
            fix = f"set the video part's max_frames to at most {fit}" if fit else "no frame count fits"
            raise InvalidVideoError(f"video {index}: {frames} frames of {self.tokens_per_tile} tokens are "
                                    f"{frames * self.tokens_per_tile} tokens, more than the {limit} one sequence may "
                                    f"hold (max_model_len); {fix}", param="max_frames")
        video = open_video(ref.source, max_image_pixels=self.max_image_pixels)
        return video_frames(video, options, self.image_processor, self.tokens_per_tile,
                            lambda tiles: InternVLImage(tiles, True, pixel_lut=self.image_processor.pixel_lut,
                                                        video=index))

    def video_setting_fixes(self, prompt: PromptInputs, capacity: int) -> dict[str, int]:
        """{"max_frames": m}: the most frames per video (on every video part) that make the prompt fit."""
        frames: dict[int, int] = {}
        for im in prompt.images:
            if im.meta.video is not None:
                frames[im.meta.video] = frames.get(im.meta.video, 0) + 1
        if not frames:
            return {}
        other = len(prompt.token_ids) - sum(frames.values()) * self.tokens_per_tile
        best = (capacity - other) // (len(frames) * self.tokens_per_tile)
        return {"max_frames": best} if 1 <= best < max(frames.values()) else {}

    def _image(self, index: int, ref: ImageRef) -> ImageInput:
        own_max_num = self.family.image_options(ref.options, f"image {index}: ").get("max_num")
        own = own_max_num is not None
        if own:
            _check_min_num(own_max_num, f"image {index}: max_num", "max_num", self.image_processor.min_num)
        max_num = own_max_num if own else self.engine_max_num
        opened = open_image(ref.source, max_image_pixels=self.max_image_pixels)
        if own:
            self._check_tokens(index, *oriented_size(opened), max_num)
        # [tiles, 3, S, S] uint8: normalised on the device
        pixels, size, key = self.run_pixels(opened, self.max_image_pixels, internvl_image_pixels,
                                            self.image_processor, max_num)
        tiles = pixels.shape[0]
        return ImageInput(pixels, tiles * self.tokens_per_tile,
                          InternVLImage(tiles, own, pixel_lut=self.image_processor.pixel_lut),
                          source_size=size, key=key)

    def _check_tokens(self, index: int, height: int, width: int, max_num: int) -> None:
        """Refuse an image whose own max_num gives it more tokens than `max_image_tokens`, before resizing."""
        limit = self.max_image_tokens
        if limit is None:
            return
        tokens = self.num_tiles(height, width, max_num) * self.tokens_per_tile
        if tokens <= limit:
            return
        best = self._largest_max_num(max_num,
                                     lambda v: self.num_tiles(height, width, v) * self.tokens_per_tile <= limit)
        fix = (f"Lower the image part's max_num to at most {best}." if best is not None
               else "No max_num fits: even the fewest tiles are too many tokens for max_model_len.")
        raise InvalidImageError(
            f"image {index} is {width}x{height} (width x height); with max_num={max_num} (set on the image part) it "
            f"would become {tokens // self.tokens_per_tile} tiles = {tokens} image tokens, more than the {limit} "
            f"one image may take (max_model_len); refused before resizing. {fix}", param="max_num")

    def _render(self, template_messages: list[dict], template_kwargs: Mapping[str, Any] | None = None) -> str:
        if self.original_layout:
            template_messages = [
                {**m, "content": "".join(f"{IMG_CONTEXT}\n" if p["type"] == "image" else p["text"]
                                         for p in m["content"])}
                if not isinstance(m["content"], str) else m
                for m in template_messages]
        return self.tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True,
                                                  **(template_kwargs or {}))

    def build(self, template_messages: list[dict], images: list[ImageInput],
              template_kwargs: Mapping[str, Any] | None = None) -> PromptInputs:
        ids = self.tokenizer.encode(self._render(template_messages, template_kwargs), add_special_tokens=False)
        token_ids, positions = expand_image_placeholders(ids, images, self.image_token_id, IMG_CONTEXT,
                                                         before=(self.start_id,), after=(self.end_id,))
        return PromptInputs(token_ids=token_ids, images=images, image_positions=positions)

    def text_prompt(self, token_ids: list[int]) -> PromptInputs:
        """1-D positions, as for any InternVL prompt."""
        refuse_placeholders(token_ids, self.image_token_id, IMG_CONTEXT)
        return PromptInputs(token_ids=list(token_ids))

    def media_parts(self, prompt: PromptInputs) -> list[MediaPart]:
        """An image one item (grid (tiles,), its thumbnail included); a video's frames, one tile each, one part."""
        parts: list[MediaPart] = []
        for i, im in enumerate(prompt.images):
            video = im.meta.video
            last = parts[-1] if parts else None
            if video is not None and last is not None and last.kind == "video" and \
                    prompt.images[last.items[0]].meta.video == video:
                parts[-1] = MediaPart("video", (*last.items, i), last.frames + 1)
            elif video is not None:
                parts.append(MediaPart("video", (i,), 1))
            else:
                parts.append(MediaPart("image", (i,), 1, (im.meta.tiles,)))
        return parts

    def image_setting_fixes(self, prompt: PromptInputs, capacity: int) -> dict[str, int]:
        """{"max_dynamic_patch": v}: the largest engine max_num below the current one that makes the
        prompt fit `capacity` tokens (images whose part sets its own max_num keep theirs); {} if none."""
        follow = [im for im in prompt.images if not im.meta.own_max_num and im.source_size is not None]
        if not follow:
            return {}
        fixed = len(prompt.token_ids) - sum(im.num_tokens for im in follow)
        best = self._largest_max_num(self.engine_max_num, lambda v: fixed + self.tokens_per_tile * sum(
            self.num_tiles(*im.source_size, v) for im in follow) <= capacity)
        return {} if best is None else {"max_dynamic_patch": best}

    def _largest_max_num(self, below: int, fits) -> int | None:
        """The largest max_num under `below` (and not under the checkpoint's min) with `fits(max_num)`.
        Scanned down one by one: tile counts need not shrink with max_num."""
        return next((v for v in range(below - 1, self.image_processor.min_num - 1, -1) if fits(v)), None)


def _videos_as_frames(template_messages: list[dict], frame_counts) -> list[dict]:
    """Each `{"type": "video"}` part replaced by its frames' parts ("Frame1: ", an image, ...)."""
    out = []
    for message in template_messages:
        content = message["content"]
        if isinstance(content, list) and any(p["type"] == "video" for p in content):
            parts = []
            for part in content:
                parts.extend(frame_parts(next(frame_counts)) if part["type"] == "video" else [part])
            message = {**message, "content": parts}
        out.append(message)
    return out


def _check_min_num(value: int, name: str, param: str, min_num: int) -> None:
    """`value` passed the setting's schema (1..MAX_NUM_LIMIT); it may not go below the checkpoint's min."""
    if value < min_num:
        raise InvalidRequestError(f"{name}={value} is below the checkpoint's min_dynamic_patch ({min_num}); "
                                  f"use at least {min_num}", param=param)
