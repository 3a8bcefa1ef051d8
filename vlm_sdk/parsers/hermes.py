"""Hermes-style tool calls, as the Qwen2.5 and Qwen3(-VL) chat templates ask for them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Two readings of a model's text, each in a whole-text form and a streaming one that gives the same
result however the text is split:

- free (`tool_choice` "auto"): a call counts only once its closing tag has come and its body is a JSON
  object whose "name" is one of the request's tools and whose "arguments" is an object; anything
  else (broken JSON, an unknown name) stays content, tags and all; a whole call the output ends with
  counts without its closing tag (as vLLM reads it), a part of one is text. The arguments are the
  model's own JSON text (as vLLM streams them); arguments it wrote as a JSON string holding an
  object are that string, decoded once. So the stream holds a call back until it is complete and
  sends it in one piece. A run of calls leaves one separator between the texts around it (see
  `HermesStream`); with `parallel` False only the first valid call is kept.
- forced (`tool_choice` "required" or a named function): the grammar (`hermes_grammar.py`) wrote
  exactly this format, so the stream sends each name as soon as it is complete and the arguments in
  fragments as they arrive, the model's own JSON text; an output cut by max_tokens ends in a call
  with partial arguments, as OpenAI's does. There is no content.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Callable, Collection

from vlm_sdk.outputs import ToolCall, ToolCallDelta
from vlm_sdk.parsers.types import ParsedDelta, partial_tag

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# what the grammar writes around a forced call's name and arguments
HEAD, ARGS_PREFIX, TAIL = '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"
_HEAD = re.compile(r'\s*' + re.escape(HEAD) + r'([^"]*)(?=")')  # the name; its closing quote begins ARGS_PREFIX
_SCALAR = frozenset("0123456789+-.eEtruefalsn")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex}"


_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


def _arguments_text(body: str) -> str | None:
    """The text of the top-level "arguments" value of `body`, a JSON object already known valid (the
    last one when the key repeats, as json.loads reads it); None without one."""
    i = _WS.match(body).end() + 1  # past the "{"
    found = None
    while True:
        i = _WS.match(body, i).end()
        if body[i] == "}":
            return found
        key, i = _DECODER.raw_decode(body, i)
        i = _WS.match(body, _WS.match(body, i).end() + 1).end()  # past the ":"
        _, end = _DECODER.raw_decode(body, i)
        if key == "arguments":
            found = body[i:end]
        i = _WS.match(body, end).end()
        i += body[i] == ","


def _valid_call(body: str, names: Collection[str]) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a free call's body, or None when it is not a call to one of `names`.
    The arguments are the model's own text (an object); arguments it wrote as a JSON string holding an
    object are that string's text, decoded once."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name, args = obj.get("name"), obj.get("arguments")
    if isinstance(args, str):  # arguments the model serialised itself: decoded once
        text = args
        try:
            args = json.loads(args)
        except ValueError:
            return None
    else:
        text = _arguments_text(body)
    if not isinstance(name, str) or name not in names or not isinstance(args, dict):
        return None
    return name, text.strip()


# -- free calls ("auto") ----------------------------------------------------------------------------
ReadCall = Callable[[str], "tuple[str, str] | None"]  # a call's body -> (name, arguments JSON) or None


def parse(text: str, names: Collection[str], parallel: bool = True,
          make_id: Callable[[], str] = new_call_id, read: ReadCall | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output. `read`: how a body between the tags is read (default: Hermes'
    JSON, `_valid_call`); another format with the same tags (Qwen3-Coder's XML) passes its own."""
    read = read or (lambda body: _valid_call(body, names))
    pieces: list = []  # text and (name, arguments) in order, consecutive texts merged
    pos = 0

    def text_piece(piece: str) -> None:
        if pieces and isinstance(pieces[-1], str):
            pieces[-1] += piece
        else:
            pieces.append(piece)
    while (i := text.find(OPEN, pos)) >= 0 and (j := text.find(CLOSE, i + len(OPEN))) >= 0:
        call = read(text[i + len(OPEN):j])
        text_piece(text[pos:i] if call is not None else text[pos:j + len(CLOSE)])
        if call is not None:
            pieces.append(call)
        pos = j + len(CLOSE)
    last = text.find(OPEN, pos)
    if last >= 0 and (call := read(text[last + len(OPEN):])) is not None:  # the output ended
        text_piece(text[pos:last])  # after a whole call without its closing tag
        pieces.append(call)
        pos = len(text)
    text_piece(text[pos:])
    content, calls = [], []
    run, pending, sent = None, "", False  # see HermesStream
    for k, piece in enumerate(pieces):
        if not isinstance(piece, str):
            if run is None:
                run = pending
            if parallel or not calls:
                calls.append(ToolCall(make_id(), *piece))
            continue
        body, lead, pending = piece, "", ""
        if k > 0:  # after a call: its leading whitespace is the run's
            body = piece.lstrip()
            lead = piece[:len(piece) - len(body)]
        if k + 1 < len(pieces):  # before a call: its trailing whitespace too
            stripped = body.rstrip()
            body, pending = stripped, body[len(stripped):]
        if body:
            if run is not None:
                content.append((run or lead) if sent else "")
                run = None
            content.append(body)
            sent = True
    return "".join(content), calls


class HermesStream:
    """The streaming form of `parse`: `feed(text)` and `finish()` -> `ParsedDelta`.

    A run of valid calls (and the whitespace around and between them) leaves one separator in the
    content: none at its start or end, else the whitespace before the run's first call, or, when there
    was none, the whitespace after its last (`Let me check.\n<call>\nDone` -> `Let me check.\nDone`).
    So whitespace before a call is held until the call is read, and after a run until text follows."""

    def __init__(self, names: Collection[str], parallel: bool = True, make_id: Callable[[], str] = new_call_id,
                 read: ReadCall | None = None):
        self.names, self.parallel, self.make_id = names, parallel, make_id
        self.read = read or (lambda body: _valid_call(body, names))
        self._buf = ""  # text not sent yet: in a call, the call from its opening tag on
        self._in_call = False
        self._ws = ""  # whitespace before the call being read
        self._run: str | None = None  # in a run of calls: the whitespace before its first call
        self._sent = False  # content with more than whitespace was sent
        self.num_calls = 0  # calls sent

    def _text(self, text: str, lead: str = "") -> str:
        """Content `text` (not only whitespace) after `lead` whitespace: a run of calls before it
        leaves its separator."""
        sep = lead
        if self._run is not None:
            sep = (self._run or lead) if self._sent else ""
            self._run = None
        self._sent = True
        return sep + text

    def _call(self, raw: str, body: str) -> ParsedDelta:
        """The call `raw` (its opening tag on; `body` inside the tags) just read."""
        call = self.read(body)
        ws, self._ws, self._in_call = self._ws, "", False
        if call is None:  # text, tags and all
            return ParsedDelta(content=self._text(raw, ws))
        if self._run is None:
            self._run = ws
        if not (self.parallel or not self.num_calls):
            return ParsedDelta()
        self.num_calls += 1
        return ParsedDelta(tool_calls=[ToolCallDelta(self.num_calls - 1, self.make_id(), *call)])

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while True:
            if self._in_call:
                j = self._buf.find(CLOSE, len(OPEN))
                if j < 0:
                    return out
                raw, self._buf = self._buf[:j + len(CLOSE)], self._buf[j + len(CLOSE):]
                out += self._call(raw, raw[len(OPEN):j])
                continue
            i = self._buf.find(OPEN)
            # what may precede a call is held: trailing whitespace, and a part of the tag
            end = i if i >= 0 else len(self._buf) - partial_tag(self._buf, OPEN)
            before = self._buf[:end]
            body = before.strip()
            if body:
                start = before.index(body[0])
                out.content += self._text(before[start:start + len(body)], before[:start])
                before = before[start + len(body):]
                self._buf = self._buf[start + len(body):]
            if i < 0:
                return out
            self._ws = before  # whitespace before the call: the run's if the call is valid
            self._buf, self._in_call = self._buf[len(before):], True

    def finish(self) -> ParsedDelta:
        held, self._buf = self._buf, ""
        if self._in_call:  # never closed: a call if its body is whole, else text
            return self._call(held, held[len(OPEN):])
        body = held.lstrip()
        if not body:  # whitespace: dropped after a run, else the content's end
            return ParsedDelta(content=held if self._run is None else "")
        return ParsedDelta(content=self._text(body, held[:len(held) - len(body)]))


# -- forced calls ("required", a named function) ------------------------------------------------------
def parse_forced(text: str, make_id: Callable[[], str] = new_call_id) -> list[ToolCall]:
    """The calls of an output the tool grammar wrote (possibly cut short), arguments as written."""
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while (m := _HEAD.match(text, pos)) is not None:
        rest = m.end()
        if not text.startswith(ARGS_PREFIX, rest):  # cut before the arguments
            calls.append(ToolCall(make_id(), m.group(1), ""))
            break
        start = rest + len(ARGS_PREFIX)
        value = len(text[start:]) - len(text[start:].lstrip()) + start
        try:
            _, end = decoder.raw_decode(text, value)
        except ValueError:  # cut inside the arguments
            calls.append(ToolCall(make_id(), m.group(1), text[start:]))
            break
        calls.append(ToolCall(make_id(), m.group(1), text[start:end]))
        if not text.startswith(TAIL, end):
            break
        pos = end + len(TAIL)
    return calls


class _JsonEnd:
    """Where one JSON value ends, fed its text in pieces (strings, nesting, bare scalars)."""

    def __init__(self):
        self.depth, self.in_string, self.escape, self.started, self.scalar = 0, False, False, False, False

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the value's end, or None while it goes on."""
        for k, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return k + 1
            elif not self.started:
                if ch in " \t\n\r":
                    continue
                self.started = True
                self.in_string = ch == '"'
                self.depth = 1 if ch in "{[" else 0
                self.scalar = not self.in_string and not self.depth
            elif self.scalar:
                if ch not in _SCALAR:
                    return k
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return k + 1
        return None


class HermesForcedStream:
    """The streaming form of `parse_forced`: names as soon as complete, arguments in fragments."""

    _HEAD, _PREFIX, _ARGS, _TAIL, _DONE = range(5)

    def __init__(self, make_id: Callable[[], str] = new_call_id):
        self.make_id = make_id
        self._state, self._buf, self._scan = self._HEAD, "", None
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while self._buf:
            if self._state == self._HEAD:
                m = _HEAD.match(self._buf)
                if m is None:
                    if not HEAD.startswith(self._buf.lstrip()[:len(HEAD)]):
                        self._state = self._DONE  # not the grammar's text (cannot happen under it)
                    return out
                out.tool_calls.append(ToolCallDelta(self.num_calls, self.make_id(), m.group(1)))
                self._buf, self._state = self._buf[m.end():], self._PREFIX
            elif self._state in (self._PREFIX, self._TAIL):
                lit = ARGS_PREFIX if self._state == self._PREFIX else TAIL
                if len(self._buf) < len(lit):
                    if not lit.startswith(self._buf):
                        self._state = self._DONE
                    return out
                if not self._buf.startswith(lit):
                    self._state = self._DONE
                    return out
                self._buf = self._buf[len(lit):]
                if self._state == self._PREFIX:
                    self._state, self._scan = self._ARGS, _JsonEnd()
                else:
                    self._state, self.num_calls = self._HEAD, self.num_calls + 1
            elif self._state == self._ARGS:
                end = self._scan.feed(self._buf)
                piece = self._buf if end is None else self._buf[:end]
                if piece:
                    out.tool_calls.append(ToolCallDelta(self.num_calls, arguments=piece))
                self._buf = "" if end is None else self._buf[end:]
                if end is not None:
                    self._state = self._TAIL
            else:
                self._buf = ""
        return out

    def finish(self) -> ParsedDelta:
        self._buf = ""
        return ParsedDelta()
