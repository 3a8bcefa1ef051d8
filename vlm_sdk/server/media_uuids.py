"""vLLM's media `uuid`s (its multi_modal_uuids) over HTTP: a client that sent an image or video once need
not send it again.

    {"type": "image_url", "image_url": {"url": "data:..."}, "uuid": "cat-1"}   the image, kept under cat-1
    {"type": "image_url", "image_url": null, "uuid": "cat-1"}                   the image kept under cat-1
    (also {"url": ""}, the url left out, and the same for "image", "video", "video_url" parts)

A part with a source and a uuid keeps that source (as fetched: the data: URL, or the bytes of an http(s)
or file URL, the media policy applied) under the uuid, replacing what it held; a part with a uuid and no
source takes it back, and is then read as if it had been sent again: the same header checks, image
limits and pixel budgets, and the encoder and prefix caches hit by content as they would. An unknown
uuid is a 400 naming it and the part. Unlike vLLM, a uuid never stands for the image's content in the
caches (the server hashes the pixels as for any image, so a client cannot make another image's cache
entries its own), and uuids are kept per `cache_salt`: tenants kept apart by their salts cannot reach
each other's images by guessing a uuid. What is kept is bounded (`max_bytes`, least recently used out
first; --media-uuid-cache).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vlm_sdk.errors import format_size
from vlm_sdk.server.protocol import bad_request, clip

_KINDS = {"image": "image", "image_url": "image", "video": "video", "video_url": "video"}
MAX_UUID_CHARS = 256


@dataclass
class _Slot:
    message: int
    part: int
    kind: str  # the part's type
    uuid: str
    referred: bool  # no source: the kept one is wanted


class MediaUUIDs:
    """The kept sources, by (cache_salt, image | video, uuid); all use is on the event loop."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._kept: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()  # key -> (source, bytes)
        self.num_bytes = 0

    def strip(self, messages: Any) -> tuple[Any, list[_Slot]]:
        """A copy of `messages` without the parts' uuids (nothing else reads them), and where they were:
        `fill` puts the kept sources in once the others are fetched."""
        if not isinstance(messages, list):
            return messages, []
        out, slots = [], []
        for i, msg in enumerate(messages):
            content = msg.get("content") if isinstance(msg, dict) else None
            if not isinstance(content, list) or not any(isinstance(p, dict) and "uuid" in p for p in content):
                out.append(msg)
                continue
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and "uuid" in part and part.get("type") in _KINDS:
                    part = dict(part)
                    uuid = part.pop("uuid")
                    if uuid is not None:
                        where = f"messages[{i}].content[{j}].uuid"
                        if not isinstance(uuid, str) or not 0 < len(uuid) <= MAX_UUID_CHARS:
                            raise bad_request(f"'{where}' must be a string of 1 to {MAX_UUID_CHARS} characters, got "
                                              f"{clip(repr(uuid))}", where)
                        referred = _source(part) is None
                        if referred:  # no source ("" too): the fetcher skips it, `fill` puts the kept one in
                            _set_source(part, None)
                        slots.append(_Slot(i, j, part["type"], uuid, referred))
                parts.append(part)
            out.append({**msg, "content": parts})
        return out, slots

    def fill(self, messages: list, slots: list[_Slot], salt: str | None) -> list:
        """`messages` (as fetched) with each referring part's kept source put in, and each sending part's
        source kept (in `slots`' order: a uuid sent and referred to in one request is that source)."""
        for slot in slots:
            part = messages[slot.message]["content"][slot.part]
            kind = _KINDS[slot.kind]
            key = (salt or "", kind, slot.uuid)
            if not slot.referred:
                self._keep(key, _source(part))
                continue
            hit = self._kept.get(key)
            if hit is None:
                where = f"messages[{slot.message}].content[{slot.part}]"
                kept = f"the last {format_size(self.max_bytes)} of them" if self.max_bytes else "none (it is 0)"
                raise bad_request(
                    f"{where}: no {kind} with uuid {slot.uuid!r} is known to this server{' for this cache_salt' if salt else ''}; "
                    f"send the {kind} with its uuid (this server keeps {kept}: --media-uuid-cache)", where,
                    "unknown_media_uuid")
            self._kept.move_to_end(key)
            _set_source(part, hit[0])
        return messages

    def _keep(self, key: tuple, source: Any) -> None:
        size = _size(source)
        old = self._kept.pop(key, None)
        if old is not None:
            self.num_bytes -= old[1]
        if size > self.max_bytes:
            return
        self._kept[key] = (source, size)
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, (_, freed) = self._kept.popitem(last=False)
            self.num_bytes -= freed


def _source(part: dict) -> Any:
    """A media part's source; None when it has none (null, "", or left out)."""
    kind = part["type"]
    value = part.get(kind)
    if kind.endswith("_url"):
        value = value.get("url") if isinstance(value, dict) else value
    return None if value is None or value == "" else value


def _set_source(part: dict, source: Any) -> None:
    kind = part["type"]
    if kind.endswith("_url"):
        url = part.get(kind)
        part[kind] = {**(url if isinstance(url, dict) else {}), "url": source}
    else:
        part[kind] = source


def _size(source: Any) -> int:
    if isinstance(source, (list, tuple)):  # a video as its frames
        return sum(_size(s) for s in source)
    return len(source) if isinstance(source, (str, bytes)) else 0
