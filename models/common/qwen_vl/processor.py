"""The Qwen-VL prompt builder: messages -> `PromptInputs`. Qwen2.5-VL's as is; the Qwen3-VL tower's families
subclass it for their videos (qwen3_processor.py).

Images are decoded and preprocessed, the chat template renders one `<|image_pad|>` per image, and
each is expanded to the image's token count (grid_t*grid_h*grid_w / merge^2), so the prompt's
length is final before scheduling. A video (video_processor.py) is sampled and decoded the same way,
its `<|video_pad|>` expanded to its temporal patches' tokens back to back, one item per patch
(`expand_video`: Qwen3-VL puts a timestamp before each). M-RoPE positions are computed here, once per
request (`PromptInputs.positions` is an `MRopePositions`, read by the model's `positions()`); a video's
patches sit tokens_per_second * 2 / sample_fps apart in time, as transformers' `get_rope_index` puts them.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from vlm_sdk.errors import InvalidImageError, InvalidRequestError, InvalidVideoError
from vlm_sdk.multimodal.image_io import open_image, oriented_size
from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs, refuse_placeholders
from vlm_sdk.multimodal.messages import ImageRef, VideoRef, parse_messages
from vlm_sdk.multimodal.video_io import open_video
from vlm_sdk.models.base import MediaPart, PromptProcessor
from vlm_sdk.models.common.qwen_vl.fixes import max_pixels_fix
from vlm_sdk.models.common.qwen_vl.image_processor import (QwenImage, Qwen2VLImageProcessor, max_image_grid,
                                                             qwen_image_pixels)
from vlm_sdk.models.common.qwen_vl.rope_index import MRopePositions, VisionSpan, video_time_offsets, vision_positions
from vlm_sdk.models.common.qwen_vl.video_fixes import video_fixes
from vlm_sdk.models.common.qwen_vl.video_processor import QwenVideo, QwenVideoProcessor


class QwenVLProcessor(PromptProcessor):
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
        self.video_token_id = getattr(hf_config, "video_token_id", None)
        self.merge_size = hf_config.vision_config.spatial_merge_size
        self.video_processor = QwenVideoProcessor(image_processor)
        # Qwen2.5-VL's time axis: position units per second of video (Qwen3-VL writes timestamps instead)
        self.tokens_per_second = getattr(hf_config.vision_config, "tokens_per_second", None) or 2
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
        """Zero pixels of the largest vision item: the largest image the engine's max_pixels allows, or a
        video's largest temporal patch when that is larger, for the memory profile and the vision
        tower's per-call patch cap: bytes, as the processor hands out (so the profile runs the
        device-side normalisation too)."""
        image = self.largest_still_image()
        patch = self.video_processor.largest_patch()
        return patch if patch.size > image.size else image

    def largest_still_image(self) -> ImageInput:
        """Zero pixels of the largest image the engine's max_pixels allows (videos aside)."""
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
        media, counts = [], {ImageRef: 0, VideoRef: 0}  # images and videos are numbered apart, as the template does
        for ref in refs:
            index = counts[type(ref)]
            counts[type(ref)] += 1
            media.append(self._image(index, ref) if isinstance(ref, ImageRef) else self._video(index, ref))
        return self.build(template_messages, media, template_kwargs)

    def _video(self, index: int, ref: VideoRef) -> QwenVideo:
        if self.video_token_id is None:
            raise InvalidRequestError("this checkpoint's config.json has no video_token_id: it takes no video")
        options = self.family.video_options(ref.options, f"video {index}: ")
        video = open_video(ref.source, max_image_pixels=self.max_image_pixels)
        sampling = self.video_processor.sample(video, options)
        self._check_frame_size(index, options, sampling)
        self._check_video_tokens(index, video, options, sampling)
        return self.video_processor(video, options, self.place_patches, sampling)

    def _check_frame_size(self, index: int, options: dict, sampling) -> None:
        """Refuse frames larger than qwen-vl-utils' 768 tokens per frame (a part's min_pixels can ask for
        more): the memory plan counts a video's items at that size (`FamilySpec.video_item_tokens`)."""
        f = self.video_processor.factor
        tokens = (sampling.height // f) * (sampling.width // f)
        cap = self.video_processor.largest_patch().num_tokens
        if tokens > cap:
            raise InvalidVideoError(f"video {index}: frames of {sampling.width}x{sampling.height} are {tokens} tokens "
                                    f"each, more than the {cap} a video frame may have (qwen-vl-utils' largest, which "
                                    f"the engine's memory plan counts); lower the video part's min_pixels (it is "
                                    f"{options.get('min_pixels')})", param="min_pixels")

    def _check_video_tokens(self, index: int, video, options: dict, sampling) -> None:
        """Refuse, before decoding, a video that alone has more tokens than one sequence may hold, naming
        the settings of its part that would make it fit."""
        limit = self.max_image_tokens
        tokens = self.video_processor.tokens(sampling)
        if limit is None or tokens <= limit:
            return
        fixes = video_fixes([self.video_processor.source(video, options)], 0, limit, self.video_processor.factor)
        fix = (f"Any one of these on the video part makes it fit: {', '.join(f'{k}={v!r}' for k, v in fixes.items())}."
               if fixes else "No frame or pixel setting makes it fit; send a shorter video.")
        raise InvalidVideoError(
            f"video {index} ({video.info.num_frames} frames of {video.info.width}x{video.info.height} at "
            f"{video.info.fps:g} fps) would be {len(sampling.indices)} frames of {sampling.width}x{sampling.height} = "
            f"{tokens} tokens, more than the {limit} one sequence may hold (max_model_len); refused before "
            f"decoding. {fix}")

    def video_setting_fixes(self, prompt: PromptInputs, capacity: int) -> dict[str, int | float]:
        """{"total_pixels" / "max_frames" / "fps": v}: each a video part setting that alone, set on every
        video part, makes the prompt fit `capacity` tokens (video_fixes.py)."""
        videos = list({id(im.meta.video): im.meta.video for im in prompt.images if im.meta.video is not None}.values())
        other = len(prompt.token_ids) - sum(im.num_tokens for im in prompt.images if im.meta.video is not None)
        return video_fixes(videos, other, capacity, self.video_processor.factor)

    def media_parts(self, prompt: PromptInputs) -> list[MediaPart]:
        """Images one item each (grid (1, h, w)); a video's temporal patches one part, up to the patch that
        ends its run and the video (grid (patches, h, w), its frames temporal_patch_size per patch): Qwen3-VL's
        patches are runs of their own, one video still one part."""
        parts, run = [], []
        images = prompt.images
        for i, im in enumerate(images):
            meta = im.meta
            if meta.video is None and meta.frames == 1:
                parts.append(MediaPart("image", (i,), 1, tuple(meta.grid_thw)))
                continue
            run.append(i)
            after = images[i + 1].meta if i + 1 < len(images) else None
            if meta.ends_run and (after is None or meta.video is None or after.video is not meta.video):
                first = prompt.images[run[0]].meta
                parts.append(MediaPart("video", tuple(run), sum(prompt.images[j].meta.frames for j in run),
                                       (len(run), first.grid_thw[1], first.grid_thw[2])))
                run = []
        return parts

    def place_patches(self, num_patches: int, sampling) -> list[tuple[int, bool]]:
        """Each temporal patch's (temporal offset, ends its run): one run per video, its patches
        tokens_per_second * 2 / sample_fps apart in time."""
        offsets = video_time_offsets(num_patches, sampling.sample_fps, self.video_processor.temporal_patch_size,
                                     self.tokens_per_second)
        return [(offset, k == num_patches - 1) for k, offset in enumerate(offsets)]

    def expand_video(self, video: QwenVideo) -> list[tuple[list[int], ImageInput, list[int]]]:
        """(tokens before, patch, tokens after) for each temporal patch: Qwen2.5-VL's patches follow each
        other with nothing between."""
        return [([], patch, []) for patch in video.patches]

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
        opened = open_image(ref.source, max_image_pixels=self.max_image_pixels)
        height, width = oriented_size(opened)
        ip = self.image_processor
        min_px, min_src = self._bound(own_min, self.min_pixels, ip.min_pixels)
        max_px, max_src = self._bound(own_max, self.max_pixels, ip.max_pixels)
        if min_px > max_px:
            raise InvalidRequestError(
                f"image {index}: min_pixels ({min_px}, {min_src}) is larger than max_pixels ({max_px}, "
                f"{max_src}); set min_pixels <= max_pixels.")
        self._check_tokens(index, height, width, min_px, min_src, max_px, max_src)
        data, grid, tokens, size, key = self.run_pixels(opened, self.max_image_pixels, qwen_image_pixels, ip,
                                                        min_px, max_px)
        return ImageInput(data, tokens, QwenImage(grid, own_max_pixels=own_max is not None, own_min_pixels=own_min,
                                                  pixel_lut=ip.pixel_lut), source_size=size, key=key)

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

    def build(self, template_messages: list[dict], media: list[ImageInput | QwenVideo],
              template_kwargs: Mapping[str, Any] | None = None) -> PromptInputs:
        """The rendered prompt with each `<|image_pad|>` / `<|video_pad|>` expanded to its item's tokens;
        `media`: the images and videos in prompt order."""
        text = self.tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True,
                                                  **(template_kwargs or {}))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        token_ids, items, starts = [], [], []
        images = iter(m for m in media if isinstance(m, ImageInput))
        videos = iter(m for m in media if isinstance(m, QwenVideo))
        for tok in ids:
            if tok == self.image_token_id:
                placed = [([], _next(images, "image", "<|image_pad|>"), [])]
            elif tok == self.video_token_id:
                placed = self.expand_video(_next(videos, "video", "<|video_pad|>"))
            else:
                token_ids.append(tok)
                continue
            for before, item, after in placed:
                token_ids.extend(before)
                starts.append(len(token_ids))
                token_ids.extend([tok] * item.num_tokens)
                token_ids.extend(after)
                items.append(item)
        rendered = len(starts)
        expected = sum(1 if isinstance(m, ImageInput) else len(m.patches) for m in media)
        if rendered != expected:
            raise InvalidRequestError(f"the chat template rendered placeholders for {rendered} vision items where the "
                                      f"{len(media)} images and videos need {expected}; the model's chat template must "
                                      f"render every image and video part")
        m = self.merge_size
        spans = [VisionSpan(start, (im.meta.grid_thw[0], im.meta.grid_thw[1] // m, im.meta.grid_thw[2] // m), im.meta.t_offset,
                            im.meta.ends_run) for start, im in zip(starts, items)]
        mrope, delta = vision_positions(len(token_ids), spans)  # [3, len(token_ids)]
        return PromptInputs(token_ids=token_ids, images=items, image_positions=starts,
                            positions=MRopePositions(mrope, delta))

    def text_prompt(self, token_ids: list[int]) -> PromptInputs:
        """Text positions on all three M-RoPE axes (rope_delta 0), as `build` gives a prompt without images."""
        refuse_placeholders(token_ids, self.image_token_id, "<|image_pad|>")
        if self.video_token_id is not None:
            refuse_placeholders(token_ids, self.video_token_id, "<|video_pad|>")
        mrope, delta = vision_positions(len(token_ids), [])  # [3, len(token_ids)]
        return PromptInputs(token_ids=list(token_ids), positions=MRopePositions(mrope, delta))

    def image_tokens_with_max_pixels(self, prompt: PromptInputs, max_pixels: int) -> list[int]:
        """Each image's token count if the engine's max_pixels were `max_pixels` (images whose part
        sets its own max_pixels keep theirs; each image keeps its effective min_pixels, which must
        not exceed `max_pixels`)."""
        counts = []
        for image in prompt.images:
            if image.meta.own_max_pixels or image.source_size is None or image.meta.frames > 1:
                counts.append(image.num_tokens)
                continue
            h, w = image.source_size
            min_px = image.meta.own_min_pixels if image.meta.own_min_pixels is not None else self.min_pixels
            counts.append(self.image_processor.num_image_tokens(h, w, min_pixels=min_px, max_pixels=max_pixels))
        return counts


def _next(it, kind: str, placeholder: str):
    item = next(it, None)
    if item is None:
        raise InvalidRequestError(f"the prompt text contains more {kind} placeholders than {kind}s were given; "
                                  f"do not write {placeholder} in text parts")
    return item


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
