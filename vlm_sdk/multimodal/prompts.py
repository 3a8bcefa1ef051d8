"""Prompts without a chat template: a raw text or token ids (OpenAI's legacy /v1/completions `prompt`,
`LLM.generate`, `AsyncLLM.generate`). No images: a prompt with images is chat messages.

    "Once upon a time"                 -> [TextPrompt]
    ["Once upon", "In a galaxy"]       -> [TextPrompt, TextPrompt]
    [9707, 11, 1879]                   -> [TokensPrompt]
    [[9707, 11], [641, 264]]           -> [TokensPrompt, TokensPrompt]

The shapes are OpenAI's; ids are checked against the vocabulary by the engine, which knows it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.multimodal.messages import check_text


@dataclass(frozen=True)
class TextPrompt:
    """A text the tokenizer reads as it is: special-token text in it (`<|im_start|>`) is the special
    token, since no chat template puts a turn around it to escape from."""
    text: str


@dataclass(frozen=True)
class TokensPrompt:
    """Token ids given directly, each an integer >= 0."""
    token_ids: tuple[int, ...]


RawPrompt = TextPrompt | TokensPrompt


def parse_prompts(value: Any, param: str = "prompt") -> list[RawPrompt]:
    """Every prompt of `value` (OpenAI's four shapes, or `TextPrompt` / `TokensPrompt` objects and
    lists of them), each non-empty; `InvalidRequestError` naming `param` otherwise."""
    if isinstance(value, (str, TextPrompt, TokensPrompt)) or _is_ids(value):
        return [as_prompt(value, param)]
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidRequestError(f"'{param}' must be a non-empty string, a list of strings, a list of token ids or "
                                  f"a list of lists of token ids, got {_short(value)}", param=param)
    return [as_prompt(p, f"{param}[{i}]", param) for i, p in enumerate(value)]


def as_prompt(value: Any, where: str = "prompt", param: str | None = None) -> RawPrompt:
    """One prompt: a string, a list of token ids, a `TextPrompt` or a `TokensPrompt`."""
    param = param or where
    if isinstance(value, TextPrompt):
        value = value.text
    elif isinstance(value, TokensPrompt):
        value = value.token_ids
    if isinstance(value, str):
        if not value:
            raise InvalidRequestError(f"'{where}' is an empty string; give the text to complete", param=param)
        check_text(value, f"'{where}'")
        return TextPrompt(value)
    if not _is_ids(value):
        raise InvalidRequestError(f"'{where}' must be a non-empty string or a non-empty list of token ids "
                                  f"(integers >= 0), got {_short(value)}", param=param)
    bad = next((i for i, t in enumerate(value) if t < 0), None)
    if bad is not None:
        raise InvalidRequestError(f"'{where}' token {bad} is {value[bad]}; token ids are integers >= 0", param=param)
    return TokensPrompt(tuple(value))


def _is_ids(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
