"""OpenAI-style chat messages: validate them and separate the images and videos from the text.

Content is a string or a list of parts: `{"type": "text", "text"}`, `{"type": "image", "image": src}`
or `{"type": "image_url", "image_url": {"url": src}}` (an object, as OpenAI's schema requires: a bare
string is refused, as vLLM refuses it), and likewise `{"type": "video", "video": src}` or
`{"type": "video_url", "video_url": {"url": src}}` (vLLM's part; src may also be a list of frames). Any
other key of an image or video part, on the part or inside its url object, is an option for that item
alone (`ImageRef.options` / `VideoRef.options`, e.g. a size bound or qwen-vl-utils' `fps`): the model
family reads its image or video settings from them (an image part's keys that no family declares are
ignored). OpenAI's `detail` is ignored.

Roles are OpenAI's: `developer` (OpenAI's name for system instructions since its o1 models) is given to
the chat template as `system`, the only instruction role the served families' templates know. An
assistant message's `content` may be null or left out (the openai types allow it), which is an empty
turn.

Tool turns (OpenAI's shape): an assistant message may carry `tool_calls` ([{"id", "type": "function",
"function": {"name", "arguments"}}], its content then optional) and its reasoning (`reasoning`, vLLM's
name, or `reasoning_content`, its older one; the template gets it under both); a `tool` message
answers one of the calls of the assistant message before it (`tool_call_id`). The chat template gets
each call's arguments as an object (decoded from OpenAI's JSON string; "" or null, a call without
arguments, is {} as vLLM reads it), which is how the templates render them (`tojson`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from vlm_sdk.errors import InvalidRequestError

ROLES = ("system", "user", "assistant", "tool", "developer")
# what each role is called in the chat template (see the module docstring)
_TEMPLATE_ROLE = {"developer": "system"}


@dataclass(frozen=True)
class ImageRef:
    source: Any  # PIL.Image | path | bytes | data: URL
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # the family's image settings


@dataclass(frozen=True)
class VideoRef:
    source: Any  # path | bytes | data: URL | list of frames (after the prompt guard: an OpenedVideo)
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # the family's video settings


def parse_messages(messages: Any) -> tuple[list[dict], list[ImageRef | VideoRef]]:
    """Return (messages for the chat template, with image parts reduced to `{"type": "image"}` and
    video parts to `{"type": "video"}`, the images and videos in prompt order)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, "
                                  f"got {_short(messages)}")
    out, images = [], []
    call_ids: set = set()  # the calls of the assistant message just before, which tool messages answer
    for i, msg in enumerate(messages):
        assistant = isinstance(msg, dict) and msg.get("role") == "assistant"
        calls = msg.get("tool_calls") if assistant else None
        if not isinstance(msg, dict) or "role" not in msg or ("content" not in msg and not assistant):
            raise InvalidRequestError(f"message {i} must be a dict with 'role' and 'content', got {_short(msg)}")
        role = msg["role"]
        if role not in ROLES:
            raise InvalidRequestError(f"message {i} has role {_short(role)}; supported roles are {list(ROLES)}")
        role = _TEMPLATE_ROLE.get(role, role)
        content = msg.get("content")
        if content is None and assistant:  # null or left out: an empty turn (the openai types allow it)
            content = ""
        if isinstance(content, str):
            check_text(content, f"message {i}")
            parsed = {"role": role, "content": content}
        elif isinstance(content, (list, tuple)):
            parsed = {"role": role, "content": [_parse_part(part, f"message {i} part {j}", images)
                                                for j, part in enumerate(content)]}
        else:
            raise InvalidRequestError(f"message {i} content must be a string or a list of parts, "
                                      f"got {type(content).__name__}")
        if role == "assistant":
            _reasoning(msg, parsed, i)
            call_ids = _assistant_extras(msg, parsed, i) if calls is not None else set()
        elif role == "tool":
            parsed["tool_call_id"] = _answered_call(msg, call_ids, i)
        else:  # tool messages follow the assistant message whose calls they answer
            call_ids = set()
        out.append(parsed)
    return out, images


def _assistant_extras(msg: dict, parsed: dict, i: int) -> set:
    """Copy an assistant message's `tool_calls` (arguments decoded) into `parsed`; the ids of its calls."""
    calls = msg["tool_calls"]
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, (list, tuple)):
        raise InvalidRequestError(f"{where} must be a list of calls, got {_short(calls)}", param=where)
    out, ids = [], {}
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(f"{where}[{j}] must be {{'id', 'type': 'function', 'function': {{'name', "
                                      f"'arguments'}}}}, got {_short(call)}", param=f"{where}[{j}]")
        check_text(fn["name"], f"{where}[{j}].function.name")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequestError(f"{where}[{j}].id must be a string, got {_short(call_id)}",
                                      param=f"{where}[{j}].id")
        if call_id is not None:
            check_text(call_id, f"{where}[{j}].id")
            if call_id in ids:  # a tool message could not say which of them it answers
                raise InvalidRequestError(f"{where}[{j}].id is {_short(call_id)}, the id of call {ids[call_id]} too; "
                                          f"each call of a message has its own id", param=f"{where}[{j}].id")
            ids[call_id] = j
        out.append({"id": call_id, "type": "function",
                    "function": {"name": fn["name"], "arguments": _arguments(fn, f"{where}[{j}].function.arguments")}})
    parsed["tool_calls"] = out
    return set(ids)


def _reasoning(msg: dict, parsed: dict, i: int) -> None:
    """An assistant message's reasoning (`reasoning`, else `reasoning_content`), for the template under both
    names, as vLLM gives it."""
    field = "reasoning" if msg.get("reasoning") is not None else "reasoning_content"
    value = msg.get(field)
    if value is None:
        return
    if not isinstance(value, str):
        raise InvalidRequestError(f"messages[{i}].{field} must be a string, got {_short(value)}",
                                  param=f"messages[{i}].{field}")
    check_text(value, f"messages[{i}].{field}")
    parsed["reasoning_content"] = parsed["reasoning"] = value


# how deep a call's arguments may nest: a request body's own limit (server/body.py), since they are a
# JSON text inside one, decoded here and walked by the template (and by Python code that recurses)
MAX_ARGUMENT_DEPTH = 64


def _arguments(fn: dict, where: str) -> dict:
    """A call's arguments decoded (OpenAI sends them as JSON text) and checked: an object, nested at most
    MAX_ARGUMENT_DEPTH deep, in valid Unicode (a JSON "\\ud800" decodes to a lone surrogate). None or ""
    (a call without arguments; some clients send it so) is {}, as vLLM reads it."""
    args = fn.get("arguments")
    if args is None or args == "":
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except RecursionError:  # Python's decoder gives up near 1,000 levels
            args = None
            deep = True
        except ValueError as e:
            raise InvalidRequestError(f"{where} is not JSON ({e}); send the call's arguments as the model gave "
                                      f"them", param=where)
        else:
            deep = False
        if deep or _deeper_than(args, MAX_ARGUMENT_DEPTH):
            raise InvalidRequestError(f"{where} nests deeper than {MAX_ARGUMENT_DEPTH} levels (the limit of a "
                                      f"request body, which the arguments' JSON text is held to)", param=where)
    if not isinstance(args, dict):
        raise InvalidRequestError(f"{where} must be a JSON object, got {_short(args)}", param=where)
    try:
        json.dumps(args, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{where}: the arguments hold a lone surrogate U+{ord(e.object[e.start]):04X} "
                                  f"(half of a pair, e.g. from a JSON \"\\ud800\"), which is not a character; send "
                                  f"valid Unicode", param=where) from None
    except (TypeError, ValueError, RecursionError) as e:  # built in Python: not JSON values, or too deep
        raise InvalidRequestError(f"{where} must hold JSON values only ({type(e).__name__})", param=where) from None
    return args


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether dicts and lists nest more than `limit` levels, level by level (never recursing)."""
    level, depth = [value], 1
    while level:
        if depth > limit:
            return True
        level = [x for node in level for x in (node.values() if isinstance(node, dict) else node)
                 if isinstance(x, (dict, list))]
        depth += 1
    return False


def _answered_call(msg: dict, call_ids: set, i: int) -> str:
    """A tool message's `tool_call_id`, which must name a call of the assistant message before it."""
    call_id = msg.get("tool_call_id")
    where = f"messages[{i}].tool_call_id"
    if not isinstance(call_id, str):
        raise InvalidRequestError(f"{where} must be the id of the call this message answers, got "
                                  f"{_short(call_id)}", param=where)
    if call_id not in call_ids:
        known = f"the calls there are {sorted(call_ids)}" if call_ids else "there is none"
        raise InvalidRequestError(f"{where} is {call_id!r}, which is not a call of the assistant message before it "
                                  f"({known}); a tool message answers one of those calls", param=where)
    return call_id


def _parse_part(part: Any, where: str, media: list[ImageRef | VideoRef]) -> dict:
    if not isinstance(part, dict) or "type" not in part:
        raise InvalidRequestError(f"{where} must be a dict with a 'type', got {_short(part)}")
    kind = part["type"]
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where}: a text part needs a string 'text', got {_short(text)}")
        check_text(text, where)
        return {"type": "text", "text": text}
    if kind in _MEDIA:
        base = _MEDIA[kind]
        if kind == base:
            source = part.get(base)
        else:
            url = part.get(kind)
            if not isinstance(url, dict):
                raise InvalidRequestError(f"{where}: an {kind} part's '{kind}' must be an object "
                                          f"{{\"url\": ...}} (OpenAI's schema), got {_short(url)}; write "
                                          f"{{\"type\": \"{kind}\", \"{kind}\": {{\"url\": ...}}}}")
            source = url.get("url")
        if source is None:
            raise InvalidRequestError(f"{where}: an {kind} part needs {f'a {base}' if kind == base else f'{kind}.url'}")
        ref = ImageRef if base == "image" else VideoRef
        media.append(ref(source, MappingProxyType(_options(part, kind))))
        return {"type": base}
    raise InvalidRequestError(f"{where} has type {kind!r}; supported: 'text', {', '.join(map(repr, _MEDIA))}")


def check_text(text: str, where: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (half of a pair, e.g. from a JSON "\\ud800")
    would fail deep inside the template or the tokenizer."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{where}: the text holds a lone surrogate U+{ord(text[e.start]):04X} at character "
                                  f"{e.start}, which is not a character; send valid Unicode (the two halves of a "
                                  f"surrogate pair together, or the character itself)") from None


# part type -> the kind of item it carries
_MEDIA = {"image": "image", "image_url": "image", "video": "video", "video_url": "video"}
_PART_KEYS = frozenset({"type", *_MEDIA})
_URL_KEYS = frozenset({"url", "detail"})  # OpenAI's detail: ignored


def _options(part: dict, kind: str) -> dict[str, Any]:
    """The image or video part's other keys (the part's own win over those inside its url object)."""
    url = part.get(kind) if kind.endswith("_url") else None
    inner = {k: v for k, v in url.items() if k not in _URL_KEYS} if isinstance(url, dict) else {}
    return {**inner, **{k: v for k, v in part.items() if k not in _PART_KEYS and k != "detail"}}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def map_parts(messages: Any, text: Callable[[str], str] | None = None,
              image: Callable[[Any], Any] | None = None, video: Callable[[Any], Any] | None = None) -> Any:
    """A copy of `messages` with each text (string content or text part) replaced by `text(t)`, each
    image source by `image(source)` and each video source by `video(source)`, in prompt order.
    Anything malformed is passed through as it is, for `parse_messages` to refuse with its own message."""
    if not isinstance(messages, (list, tuple)):
        return messages
    out = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            out.append({**msg, "content": text(content)} if text else msg)
        elif isinstance(content, (list, tuple)):
            out.append({**msg, "content": [_map_part(p, text, {"image": image, "video": video}) for p in content]})
        else:
            out.append(msg)
    return out


def _map_part(part: Any, text, media: dict) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and text and isinstance(part.get("text"), str):
        return {**part, "text": text(part["text"])}
    fn = media.get(_MEDIA.get(kind))
    if fn is None:
        return part
    if kind in media and part.get(kind) is not None:  # {"type": "image", "image": src}
        return {**part, kind: fn(part[kind])}
    url = part.get(kind)
    if isinstance(url, dict) and url.get("url") is not None:
        return {**part, kind: {**url, "url": fn(url["url"])}}
    return part


def measure(messages: Any) -> tuple[int, int]:
    """(characters of text, image and video parts) of `messages`, without copying anything. The text
    counts what the template renders of each message: its content (a tool result's too) and an assistant
    message's reasoning and tool calls (name and arguments as sent)."""
    chars, images, videos = count_parts(messages)
    return chars, images + videos


def count_parts(messages: Any) -> tuple[int, int, int]:
    """(characters of text, as `measure` counts them, image parts, video parts) of `messages`, without
    copying or reading any part: what AsyncLLM sorts a request into a prompt-building pool by before
    any work."""
    chars = images = videos = 0
    for msg in messages if isinstance(messages, (list, tuple)) else ():
        chars += _call_chars(msg)
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, (list, tuple)):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    chars += len(part["text"])
                elif kind in _MEDIA:
                    if _MEDIA[kind] == "video":
                        videos += 1
                    else:
                        images += 1
    return chars, images, videos


def _call_chars(msg: Any) -> int:
    """Characters of an assistant message's reasoning and tool calls (names, arguments given as text)."""
    if not isinstance(msg, dict):
        return 0
    reasoning, calls = msg.get("reasoning") or msg.get("reasoning_content"), msg.get("tool_calls")
    chars = len(reasoning) if isinstance(reasoning, str) else 0
    for call in calls if isinstance(calls, (list, tuple)) else ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            chars += sum(len(v) for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str))
    return chars
