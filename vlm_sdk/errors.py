"""Typed errors. Every error a user can cause is a `VLMError`; its message says what was wrong,
with the numbers involved, and which setting changes the outcome."""
from __future__ import annotations

import re


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


class InputTooLongError(InvalidRequestError):
    """A prompt that can never fit this engine as configured.

    `prompt_tokens` counts every prompt token, image tokens included; `image_tokens` lists the tokens
    of each image in order; `capacity_tokens` is how many tokens one sequence may hold; `fixes` maps
    a setting name to a value, each of which alone would make this request fit; `together` (possibly
    empty) maps settings that must all be applied at once to make it fit.
    """

    def __init__(self, prompt_tokens: int, image_tokens: list[int], capacity_tokens: int,
                 fixes: dict[str, int], limit_reason: str, conversation_index: int | None = None,
                 together: dict[str, int] | None = None):
        self.prompt_tokens = prompt_tokens
        self.image_tokens = list(image_tokens)
        self.capacity_tokens = capacity_tokens
        self.fixes = dict(fixes)
        self.limit_reason = limit_reason
        self.conversation_index = conversation_index
        self.together = dict(together or {})
        super().__init__(self._message())

    def _message(self) -> str:
        where = "" if self.conversation_index is None else f"conversation {self.conversation_index}: "
        text_tokens = self.prompt_tokens - sum(self.image_tokens)
        if self.image_tokens:
            imgs = ", ".join(str(n) for n in self.image_tokens)
            parts = f"{text_tokens} text tokens + {len(self.image_tokens)} image(s) of [{imgs}] tokens"
        else:
            parts = f"{text_tokens} text tokens, no images"
        msg = (f"{where}prompt is {self.prompt_tokens} tokens ({parts}) but this engine holds at most "
               f"{self.capacity_tokens} tokens per sequence ({self.limit_reason}).")
        both = ", ".join(f"{k}={v}" for k, v in self.together.items())
        if self.fixes:
            opts = "; ".join(f"{k}={v}" for k, v in self.fixes.items())
            msg += f" Any one of these settings makes it fit: {opts}."
            if both:
                msg += f" So do these together: {both}."
        elif both:
            msg += f" No single setting makes it fit; these together do: {both}."
        else:
            msg += " No single setting makes it fit: shorten the prompt or use fewer images."
        return msg

    def with_conversation(self, index: int) -> "InputTooLongError":
        return InputTooLongError(self.prompt_tokens, self.image_tokens, self.capacity_tokens,
                                 self.fixes, self.limit_reason, index, together=self.together)


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


class EngineDeadError(VLMError):
    """The engine loop stopped after an internal failure; the message carries the original cause."""


def without_reprs(text: str) -> str:
    """`text` with Python object reprs ("<_io.BytesIO object at 0x7f...>") removed: they mean nothing
    to whoever sent the request and leak addresses into error messages."""
    return re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", text).strip()
