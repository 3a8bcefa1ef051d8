"""Raw HTTP helpers for the server tests: what any client would send, no SDK code in between."""
from __future__ import annotations

import base64
import io
import json
import time
import urllib.error
import urllib.request

from PIL import Image

API_KEY = "test-key"


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(url: str, text: str = "What is in this image?", **pixels) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, **pixels}},
                                         {"type": "text", "text": text}]}]


def post(url: str, body, *, key: str | None = API_KEY, raw: bytes | None = None,
         timeout: float = 60.0) -> tuple[int, dict | str]:
    """POST /v1/chat/completions; returns (status, decoded JSON or the SSE text)."""
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + "/v1/chat/completions", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def get(url: str, path: str, key: str | None = API_KEY) -> tuple[int, str]:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sse_events(text: str) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final [DONE]."""
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
