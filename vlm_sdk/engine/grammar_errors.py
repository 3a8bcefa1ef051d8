"""What a grammar that cannot be served tells its client: a `Refusal`, made once where the grammar was
compiled, then turned into each asking request's `InvalidRequestError`, named by that request's own
field. Grammars are compiled and cached by their content (engine/structured_output.py), so one compile
may answer several requests whose same text came from different fields; and a grammar built from
several fields (a request's tool schemas, one per line) names the field of the line llguidance
points at.

llguidance's messages reach the client on one line, clipped, without its parser state; an internal
failure (a Rust panic, which carries source paths and a backtrace) is named, not echoed.
"""
from __future__ import annotations

import logging
import re
from typing import Sequence

from vlm_sdk.errors import InvalidRequestError

logger = logging.getLogger("vlm_sdk")

_INTERNAL = re.compile(r"panic|backtrace|RUST_BACKTRACE|\.rs:\d", re.IGNORECASE)
# llguidance's Lark errors: "at LINE(COLUMN): message", then numbered lines of the grammar around it
_AT_LINE = re.compile(r"\s*at (\d+)\(\d+\): ")
_CONTEXT_LINE = re.compile(r"^\s*\d+ \| ", re.MULTILINE)


class Refusal(Exception):
    """Why a grammar cannot be served, without the field it came from: `text` follows the field's name in
    the message; `line`: the grammar's line llguidance reported (1-based), if it did, and `line_text` the
    message for when that line's own field is named (its place in a grammar the client never wrote left
    out)."""

    def __init__(self, text: str, line: int | None = None, line_text: str | None = None):
        super().__init__(text)
        self.text, self.line, self.line_text = text, line, line_text or text

    def error(self, param: str, line_params: Sequence[str] | None = None) -> InvalidRequestError:
        """The refusal as a request's error: named by the field of the reported line when `line_params`
        (one field per line of the grammar text) says which, else by `param`."""
        if line_params is not None and self.line is not None and 1 <= self.line <= len(line_params):
            param = line_params[self.line - 1]
            return InvalidRequestError(f"'{param}': {self.line_text}", param=param)
        return InvalidRequestError(f"'{param}': {self.text}", param=param)


def compile_refusal(what: str, error: str) -> Refusal:
    """llguidance could not compile a `what` ("JSON Schema", "grammar", ...): its message with the grammar
    lines it quotes left out, and the line it points at kept."""
    at = _AT_LINE.match(error)
    if at is None:
        return Refusal(f"this {what} cannot be compiled: {clean_error(error)}")
    message = error[at.end():]
    quoted = _CONTEXT_LINE.search(message)
    message = clean_error(message[:quoted.start()] if quoted is not None else message)
    line = int(at.group(1))
    return Refusal(f"this {what} cannot be compiled: at line {line}: {message}", line, f"cannot be compiled: {message}")


def clean_error(text: str) -> str:
    """llguidance's message for the client: one line, clipped; an internal failure is named, not echoed."""
    if _INTERNAL.search(text):
        logger.warning("structured outputs: llguidance failed internally: %s", one_line(text, 2000))
        return "the grammar compiler failed on it (an internal error of llguidance, logged)"
    return one_line(text)


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
