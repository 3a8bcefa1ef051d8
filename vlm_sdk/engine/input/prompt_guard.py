"""What `LLMEngine.build_prompt` does to a request's messages before the model family's processor sees
them: refuse what cannot fit before doing its work, keep typed special tokens text, and size up every
image from its header before any is decoded.

    text:   at least LONG_TEXT_CHARS characters and more than max_model_len * chars_per_token of them
            -> PromptTooLong (a lower bound), before any template or tokenizer runs; counted: message
            text, tool results, assistant tool calls and reasoning, and the tools' definitions
            special-token text -> escaped (engine/input/special_text.py), read back as plain text
    images: each read and its header checked against max_image_pixels, their pixels summed against
            max_request_image_pixels -> InvalidImageError before the first decode; each becomes an
            `OpenedImage`, decoded by the processor one at a time (unless the request was cancelled)
    videos: each read, its container header and packet index checked against the video limits
            (bytes, seconds) -> InvalidVideoError before any frame is decoded; each becomes an
            `OpenedVideo`, whose sampled frames the processor decodes (frames and decoded pixels checked
            first), stopping between frames once the request is cancelled
"""
from __future__ import annotations

import threading

from vlm_sdk.engine.input.prompt_tokenizer import PromptTokenizer
from vlm_sdk.errors import InvalidImageError
from vlm_sdk.multimodal.image_io import OpenedImage, open_image
from vlm_sdk.multimodal.messages import map_parts, measure
from vlm_sdk.multimodal.video_io import OpenedVideo, VideoLimits, open_video


_RENDERED_EXTRAS = ("tool_calls", "reasoning_content")


class PromptGuard:
    def __init__(self, tokenizer: PromptTokenizer, max_image_pixels: int, max_request_image_pixels: int | None,
                 video_limits: VideoLimits = VideoLimits()):
        self.tokenizer = tokenizer
        self.max_image_pixels = max_image_pixels
        self.max_request_image_pixels = max_request_image_pixels
        self.video_limits = video_limits

    def prepare(self, messages, cancelled: threading.Event | None = None, extra_chars: int = 0):
        """`messages` with special-token text escaped, images and videos opened; raises `PromptTooLong`
        (a lower bound), `InvalidImageError` or `InvalidVideoError` first when the request cannot be served.
        `extra_chars`: text the template adds besides the messages' (the tools' definitions)."""
        chars, _ = measure(messages)
        self.tokenizer.check_length(chars + extra_chars)
        special = self.tokenizer.special_text
        images = _RequestImages(self.max_image_pixels, self.max_request_image_pixels, cancelled)
        mapped = map_parts(messages, text=special.escape if special else None, image=images.open,
                           video=lambda source: self.open_video(source, cancelled))
        if special is None or not isinstance(mapped, list):
            return mapped
        # an assistant turn's calls and reasoning are rendered into the prompt too
        return [{**m, **{k: special.escape_tree(m[k]) for k in _RENDERED_EXTRAS if k in m}} if isinstance(m, dict)
                else m for m in mapped]


    def open_video(self, source, cancelled: threading.Event | None) -> OpenedVideo:
        return open_video(source, self.video_limits, max_image_pixels=self.max_image_pixels, cancelled=cancelled)


class _RequestImages:
    """Opens one request's images in order, keeping the sum of their pixels."""

    def __init__(self, max_image_pixels: int, budget: int | None, cancelled: threading.Event | None):
        self.max_image_pixels, self.budget, self.cancelled = max_image_pixels, budget, cancelled
        self.count = 0
        self.pixels = 0

    def open(self, source) -> OpenedImage:
        image = open_image(source, max_image_pixels=self.max_image_pixels, cancelled=self.cancelled)
        self.count += 1
        self.pixels += image.pixels
        if self.budget is not None and self.pixels > self.budget:
            w, h = image.image.size
            raise InvalidImageError(
                f"image {self.count - 1} ({w}x{h}) brings this request's images to {self.pixels:,} pixels, over "
                f"the limit of {self.budget:,} pixels per request (setting max_request_image_pixels, flag "
                f"--max-request-image-pixels); send fewer or smaller images, or raise the setting.")
        return image
