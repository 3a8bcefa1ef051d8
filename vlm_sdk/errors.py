"""Typed errors. Every error a user can cause is a `VLMError`; its message says what was wrong,
with the numbers involved, and which setting changes the outcome."""
from __future__ import annotations

import re
from typing import Mapping


# -- settings as messages print them -------------------------------------------------------------

def format_size(n: int) -> str:
    """Bytes as the exact size string `parse_bytes` reads back: "8GiB", "168MiB", "12KiB", "1000B"."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


# settings whose values are sizes: printed with a unit, so that a fix pastes into LLM(...), vlm-sdk serve
# and vlm-sdk plan alike (each of which refuses a size string without a unit)
SIZE_SETTINGS = ("kv_cache_memory", "device_memory", "max_grammar_memory", "grammar_cache_memory")


def setting_text(name: str, value) -> str:
    """One setting as `LLM(...)` takes it: num_blocks=30, kv_cache_memory='168MiB'."""
    if name in SIZE_SETTINGS and isinstance(value, int) and not isinstance(value, bool):
        return f"{name}={format_size(value)!r}"
    return f"{name}={value!r}"


def flag_text(name: str, value) -> str:
    """The same setting as a `vlm-sdk serve` / `vlm-sdk plan` flag: --num-blocks 30, --kv-cache-memory 168MiB;
    a switch is --name or --no-name."""
    if isinstance(value, bool):
        return f"--{'' if value else 'no-'}{name.replace('_', '-')}"
    if name in SIZE_SETTINGS and isinstance(value, int) and not isinstance(value, bool):
        value = format_size(value)
    return f"--{name.replace('_', '-')} {value}"


def limit_text(name: str, value) -> str:
    """An engine limit as a message names it: "max_logit_bias=300, flag --max-logit-bias"."""
    return f"engine setting {setting_text(name, value)}, flag {flag_text(name, value).split(' ')[0]}"


def fixes_text(fixes: Mapping[str, object], sep: str = "; ") -> str:
    """Settings for messages, in both spellings: "num_blocks=30; kv_cache_memory='168MiB' (flags:
    --num-blocks 30 | --kv-cache-memory 168MiB)"."""
    if not fixes:
        return ""
    return (sep.join(setting_text(k, v) for k, v in fixes.items())
            + " (flags: " + " | ".join(flag_text(k, v) for k, v in fixes.items()) + ")")


class VLMError(Exception):
    """Base class of every error the SDK raises on purpose."""


class InvalidRequestError(VLMError, ValueError):
    """A malformed request: bad message structure, bad sampling parameters, unknown content part.
    `param` names the offending field when there is one (the HTTP server reports it as OpenAI's
    `error.param`)."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class UnknownArgumentError(InvalidRequestError, TypeError):
    """A keyword the API does not know (a typo like `num_blokcs`); the message lists the accepted ones."""


class InvalidImageError(InvalidRequestError):
    """An image that cannot be used: unreadable bytes, unsupported source, too many pixels, bad aspect."""


class InvalidVideoError(InvalidImageError):
    """A video that cannot be used: unreadable or not a video, an unknown codec, too few frames, over a
    limit (bytes, seconds, sampled frames, pixels to decode), or a bad sampling setting. A media error
    like an image's (HTTP 400), with its own code."""


class InputTooLongError(InvalidRequestError):
    """A prompt that can never fit this engine as configured.

    `prompt_tokens` counts every prompt token, image tokens included; `image_tokens` lists the tokens
    of each image in order; `capacity_tokens` is how many tokens one sequence may hold; `fixes` maps
    a setting name to a value, each of which alone would make this request fit; `together` (possibly
    empty) maps settings that must all be applied at once to make it fit. The fixes fit the whole
    request: the prompt and `output_tokens` more (the request's `max_tokens`; when that is None, i.e.
    not set, a default room the message names; fewer only where max_position_embeddings allows no
    more). `output_tokens` None: fixes sized for the prompt alone (no output room stated).
    `at_least`: the text was refused before it was tokenized whole, so `prompt_tokens` is a lower
    bound and no fix is offered. `video_fixes`: settings of the request's video parts (the model
    family's, e.g. total_pixels, max_frames, fps), each of which alone, set on every video part, would
    make it fit (a video's tokens count among `image_tokens`, one entry per temporal patch or frame).
    """

    def __init__(self, prompt_tokens: int, image_tokens: list[int], capacity_tokens: int,
                 fixes: dict[str, int], limit_reason: str, conversation_index: int | None = None,
                 together: dict[str, int] | None = None, max_tokens: int | None = None,
                 output_tokens: int | None = None, at_least: bool = False, index_noun: str = "conversation",
                 video_fixes: dict[str, int | float] | None = None):
        self.video_fixes = dict(video_fixes or {})
        self.index_noun = index_noun  # what `conversation_index` counts: "conversation" (chat) or "prompt"
        self.prompt_tokens = prompt_tokens
        self.at_least = at_least
        self.image_tokens = list(image_tokens)
        self.capacity_tokens = capacity_tokens
        self.fixes = dict(fixes)
        self.limit_reason = limit_reason
        self.conversation_index = conversation_index
        self.together = dict(together or {})
        self.max_tokens = max_tokens
        self.output_tokens = output_tokens
        super().__init__(self._message())

    def _room(self) -> str:
        """What output the fixes leave room for, in words ("" when not stated)."""
        out, asked = self.output_tokens, self.max_tokens
        if out is None:
            return ""
        if asked is None:
            return (f" with room for {out} output tokens (max_tokens is not set; set it to size these "
                    f"for your output)")
        if out >= asked:
            return f" with its max_tokens={asked} output tokens"
        return (f" with room for {out} of its max_tokens={asked} output tokens (the model's "
                f"max_position_embeddings allows no more)")

    def _message(self) -> str:
        where = "" if self.conversation_index is None else f"{self.index_noun} {self.conversation_index}: "
        if self.at_least:
            return (f"{where}prompt text is more than {self.prompt_tokens} tokens (counting stopped there, before "
                    f"the whole text was tokenized) but this engine holds at most {self.capacity_tokens} tokens per "
                    f"sequence ({self.limit_reason}). Shorten the text: it is too long to count in full, so no "
                    f"setting is offered.")
        text_tokens = self.prompt_tokens - sum(self.image_tokens)
        if self.image_tokens:
            imgs = ", ".join(str(n) for n in self.image_tokens)
            parts = f"{text_tokens} text tokens + {len(self.image_tokens)} image(s) of [{imgs}] tokens"
        else:
            parts = f"{text_tokens} text tokens, no images"
        msg = (f"{where}prompt is {self.prompt_tokens} tokens ({parts}) but this engine holds at most "
               f"{self.capacity_tokens} tokens per sequence ({self.limit_reason}).")
        both = ", ".join(setting_text(k, v) for k, v in self.together.items())
        room = self._room()
        video = ", ".join(f"{k}={v!r}" for k, v in self.video_fixes.items())
        if self.fixes:
            msg += f" Any one of these settings makes it fit{room}: {fixes_text(self.fixes)}."
            if both:
                msg += f" So do these together: {both}."
        elif both:
            msg += f" No single setting makes it fit; these together do{room}: {both}."
        elif not video:
            msg += (" No single setting makes it fit: shorten the prompt"
                    + (" or use fewer images." if self.image_tokens else "."))
        if video:
            msg += (f" {'Or any' if self.fixes or both else 'Any'} one of these on its video parts (set on every "
                    f"video part) makes it fit{room}: {video}.")
        return msg

    def with_conversation(self, index: int, noun: str = "conversation") -> "InputTooLongError":
        """The same error, its message naming which of a batch's conversations (or prompts) it was."""
        return InputTooLongError(self.prompt_tokens, self.image_tokens, self.capacity_tokens,
                                 self.fixes, self.limit_reason, index, together=self.together,
                                 max_tokens=self.max_tokens, output_tokens=self.output_tokens,
                                 at_least=self.at_least, index_noun=noun, video_fixes=self.video_fixes)


class UnfitImagesError(InvalidRequestError):
    """The engine cannot start: the largest image its image settings allow (`image_tokens`) cannot fit
    in one sequence of `max_model_len` tokens, so every request with such an image would be refused.
    `fixes` maps each setting to a value that alone makes it fit (the family's image setting: the
    largest value whose image fits; max_model_len or the cache settings); `together`: settings that
    only do it all at once. `EngineArgs.allow_unfit_images` turns the refusal into a warning."""

    def __init__(self, message: str, image_tokens: int, max_model_len: int, fixes: dict[str, int | float],
                 together: dict[str, int | float] | None = None, param: str | None = None):
        super().__init__(message, param=param)
        self.image_tokens = image_tokens
        self.max_model_len = max_model_len
        self.fixes = dict(fixes)
        self.together = dict(together or {})


class CacheTooSmallError(InvalidRequestError):
    """The engine cannot start: `max_model_len` does not fit once in the KV cache. `fixes` maps each
    setting to a value that alone makes it start (max_model_len: the largest that fits)."""

    def __init__(self, message: str, max_model_len: int, needed_blocks: int, num_blocks: int,
                 fixes: dict[str, int | float]):
        super().__init__(message, param="max_model_len")
        self.max_model_len = max_model_len
        self.needed_blocks = needed_blocks
        self.num_blocks = num_blocks
        self.fixes = dict(fixes)


class CheckpointError(VLMError):
    """A checkpoint directory that cannot be loaded: missing file, unknown architecture, missing,
    unexpected or mis-shaped tensor. The message names the file or tensor."""


class ModelNotFoundError(CheckpointError):
    """A model given as a Hugging Face Hub id ("Org/Name") that cannot be had: not in the hub cache
    while offline, not on the Hub, gated, or at an unknown revision. The message says where it looked
    (`cache_dir`) and what to do."""

    def __init__(self, message: str, repo_id: str, revision: str | None, cache_dir: str):
        super().__init__(message)
        self.repo_id = repo_id
        self.revision = revision
        self.cache_dir = cache_dir


class EngineDeadError(VLMError):
    """The engine loop stopped after an internal failure; the message carries the original cause."""


class ReplicaLostError(VLMError):
    """A data-parallel replica (vlm_sdk.replicas) died while it held the request; the other replicas go
    on serving and Ray Serve starts a replacement, so the request may be retried."""


class RayNotInstalledError(VLMError):
    """A Ray feature (`--data-parallel-size`, `--distributed-executor-backend ray`) without Ray installed;
    the message says how to install it."""


def without_reprs(text: str) -> str:
    """`text` with Python object reprs ("<_io.BytesIO object at 0x7f...>") removed: they mean nothing
    to whoever sent the request and leak addresses into error messages."""
    return re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", text).strip()
