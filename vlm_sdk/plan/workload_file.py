"""Reading `vlm-sdk plan --workload FILE`: the requests a service receives, as sizes only (nothing decoded).

Either JSONL, one OpenAI chat body a line:

    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"width": 1280, "height": 720}},
                                              {"type": "text", "text": "..."}]}],
     "max_tokens": 256, "prompt_tokens": 40}

  an image part gives its size as {"width", "height"} (in the part or its image_url), or a real source: a
  file path, file:// or data: URL, whose header alone is read (PIL opens it lazily: no pixels decoded); an
  http(s) URL is refused (the planner fetches nothing: give its size). Text tokens: the line's
  "prompt_tokens" (ours: the text and template tokens, images excluded) when given; else counted by the
  checkpoint's tokenizer over the chat template of the text alone (each image's own wrapper tokens, a few,
  are not counted); else refused, naming both. Output tokens: "max_tokens" / "max_completion_tokens", else
  `default_output`.

  a video part ({"type": "video_url", "video_url": {...}} or {"type": "video", "video": ...}) gives its
  container as {"width", "height", "fps", "frames"} (or "seconds" instead of "frames": frames =
  round(seconds * fps)), or a real source (a path, file:// or data: URL) whose header and packet index alone
  are read (multimodal/video_io.open_video: no frame decoded); its other keys are the part's video options
  (fps, max_frames, max_pixels, ...), as a chat request's. The family's processor arithmetic
  (`ImageLimits.video_for`) gives its frames, vision-tower items and tokens; the text it writes around
  each item (a Qwen3-VL patch's timestamp, an InternVL frame's label) is counted by the checkpoint's
  tokenizer (a line's prompt_tokens does not include it).

or one JSON object, a compact histogram of independent distributions ([value, weight] pairs):

    {"histogram": {"prompt_tokens": [[40, 3], [400, 1]], "output_tokens": [[256, 1]],
                   "images": [[0, 1], [1, 2]], "image_sizes": [[1280, 720, 1], [448, 448, 1]]}}

  a request draws its text tokens, output tokens and image count, and each image a size.

Either way: `Request`s with weights (`read_workload`), image tokens from the family's `ImageLimits.tokens_for`.
"""
from __future__ import annotations

import base64
import io
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vlm_sdk.errors import InvalidRequestError

MAX_COMBINATIONS = 1_000_000  # a histogram's requests enumerated exactly, up to this many kinds


@dataclass(frozen=True)
class Video:
    """One video part as the engine would run it: the frames it samples, its vision-tower items (encoder-
    cache entries), the tokens the tower fills, and its prompt tokens (those and the text and wrappers
    the processor writes around each item)."""
    frames: int
    items: int
    vision_tokens: int
    prompt_tokens: int


@dataclass(frozen=True)
class Request:
    text_tokens: int
    image_tokens: tuple[int, ...]
    output_tokens: int
    weight: float = 1.0
    videos: tuple[Video, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return self.text_tokens + sum(self.image_tokens) + sum(v.prompt_tokens for v in self.videos)

    @property
    def beside_images(self) -> int:
        """Its tokens other than its images': text, videos, output (what a smaller image setting leaves)."""
        return self.total_tokens - sum(self.image_tokens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def read_workload(path, image_tokens: Callable[[int, int], int], default_output: int,
                  tokenizer_dir=None, video_for: Callable | None = None) -> list[Request]:
    """The requests of `path` (JSONL chat bodies or a histogram, above). `image_tokens(width, height)`:
    the family's count; `tokenizer_dir`: where a tokenizer may be found for lines without prompt_tokens
    (and a video's item text); `video_for`: the family's `ImageLimits.video_for` (None: it takes no video)."""
    text = Path(path).expanduser().read_text()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:  # JSONL of several lines
        whole = None
    if isinstance(whole, dict) and "histogram" in whole:
        return _histogram(whole["histogram"], image_tokens)
    counter = _TextCounter(tokenizer_dir)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{path} line {n}: not JSON ({e.msg}); each line is one chat body") from None
        out.append(_request(body, image_tokens, default_output, counter, f"{path} line {n}", video_for))
    if not out:
        raise InvalidRequestError(f"{path} holds no request: one chat body a line, or {{\"histogram\": ...}}")
    return out


def _request(body, image_tokens, default_output: int, counter: "_TextCounter", where: str,
             video_for: Callable | None = None) -> Request:
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise InvalidRequestError(f"{where}: a chat body with 'messages' is needed")
    images, videos = [], []
    for m in body["messages"]:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                w, h = _image_size(part, where)
                images.append(image_tokens(w, h))
            elif isinstance(part, dict) and part.get("type") in ("video", "video_url"):
                videos.append(_video(part, video_for, counter, f"{where} video {len(videos)}"))
    out = body.get("max_tokens", body.get("max_completion_tokens"))
    out = default_output if out is None else out
    text = body.get("prompt_tokens")
    if text is None:
        text = counter.count(body["messages"], where)
    for name, v in (("prompt_tokens", text), ("max_tokens", out)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise InvalidRequestError(f"{where}: {name} must be a non-negative integer, got {v!r}")
    return Request(text, tuple(images), out, videos=tuple(videos))


def _video(part: dict, video_for: Callable | None, counter: "_TextCounter", where: str) -> Video:
    """One video part priced by the family's processor arithmetic, from its container's numbers."""
    if video_for is None:
        raise InvalidRequestError(f"{where}: this checkpoint's family takes no video input")
    inner = part.get("video_url") if isinstance(part.get("video_url"), dict) else {}
    options = {k: v for k, v in part.items() if k not in ("type", "video", "video_url")}
    given = next((d for d in (inner, part) if "width" in d or "height" in d), None)
    if given is not None:
        w, h, fps = given.get("width"), given.get("height"), given.get("fps")
        frames = given.get("frames")
        if frames is None and isinstance(given.get("seconds"), (int, float)) and isinstance(fps, (int, float)):
            frames = round(given["seconds"] * fps)
        if not (all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (w, h, frames))
                and isinstance(fps, (int, float)) and not isinstance(fps, bool) and fps > 0):
            raise InvalidRequestError(f"{where}: a video's size is {{\"width\", \"height\", \"fps\", \"frames\" (or "
                                      f"\"seconds\")}}, positive numbers (width, height and frames integers), got "
                                      f"{ {k: given.get(k) for k in ('width', 'height', 'fps', 'frames', 'seconds')} }")
    else:
        source = inner.get("url") if inner else part.get("video_url", part.get("video"))
        if not isinstance(source, str):
            raise InvalidRequestError(f"{where}: a video part needs {{\"width\", \"height\", \"fps\", \"frames\"}} "
                                      f"or a file / data: URL")
        if source.startswith(("http://", "https://")):
            raise InvalidRequestError(f"{where}: {source[:80]} is a web URL; the planner fetches nothing: give the "
                                      f"video's {{\"width\", \"height\", \"fps\", \"frames\"}} instead")
        from vlm_sdk.multimodal.video_io import open_video
        info = open_video(source.removeprefix("file://") if source.startswith("file://") else source).info
        w, h, frames, fps = info.width, info.height, info.num_frames, info.fps  # the header and packet index only
    count = video_for(w, h, frames, float(fps), options)
    text = sum(counter.count_text(t, where) for t in count.texts)
    return Video(count.frames, count.items, count.tokens, count.tokens + text + count.special)


def _image_size(part: dict, where: str) -> tuple[int, int]:
    """(width, height) of an image part: given, or read from its source's header."""
    inner = part.get("image_url") if isinstance(part.get("image_url"), dict) else {}
    for d in (part, inner):
        if "width" in d or "height" in d:
            w, h = d.get("width"), d.get("height")
            if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (w, h)):
                raise InvalidRequestError(f"{where}: an image's width and height must be positive integers, "
                                          f"got {w!r} x {h!r}")
            return w, h
    source = inner.get("url") if inner else part.get("image_url", part.get("image"))
    if not isinstance(source, str):
        raise InvalidRequestError(f"{where}: an image part needs {{\"width\", \"height\"}} or a file / data: URL")
    from PIL import Image
    if source.startswith(("http://", "https://")):
        raise InvalidRequestError(f"{where}: {source[:80]} is a web URL; the planner fetches nothing: give the "
                                  f"image's {{\"width\", \"height\"}} instead")
    if source.startswith("data:"):
        opened = io.BytesIO(base64.b64decode(source.split(",", 1)[-1]))
    else:
        opened = Path(source.removeprefix("file://")).expanduser()
    try:
        with Image.open(opened) as im:  # the header only: PIL decodes nothing until asked
            return im.size
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"{where}: cannot read the image size of {source[:80]}: {e}") from None


class _TextCounter:
    """Text tokens of a line without prompt_tokens: the tokenizer beside the config, loaded once."""

    def __init__(self, directory):
        self.directory, self.tokenizer = directory, None

    def count(self, messages: list, where: str) -> int:
        if self.tokenizer is None:
            self.tokenizer = self._load(where)
        text_only = [{"role": m.get("role", "user"), "content": m["content"] if isinstance(m.get("content"), str) else
                      "".join(p.get("text", "") for p in m.get("content") or () if isinstance(p, dict))}
                     for m in messages if isinstance(m, dict)]
        text = self.tokenizer.apply_chat_template(text_only, add_generation_prompt=True, tokenize=False)
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def count_text(self, text: str, where: str) -> int:
        """Tokens of a piece of text the processor writes (as it encodes it: no special tokens added)."""
        if self.tokenizer is None:
            self.tokenizer = self._load(where, "a video's item text (timestamps, frame labels)")
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _load(self, where: str, what: str = ""):
        directory = Path(self.directory) if self.directory is not None else None
        if directory is not None and directory.is_file():
            directory = directory.parent
        if directory is None or not any((directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            if what:
                raise InvalidRequestError(f"{where}: {what} is counted by the checkpoint's tokenizer, and none is "
                                          f"beside the config: plan a checkpoint directory that has its tokenizer")
            raise InvalidRequestError(f"{where}: no prompt_tokens, and no tokenizer beside the config to count the "
                                      f"text: add \"prompt_tokens\" (text and template tokens) to each line, or plan "
                                      f"a checkpoint directory that has its tokenizer")
        from vlm_sdk.model_loader import load_tokenizer
        return load_tokenizer(str(directory))


def _pairs(h: dict, name: str, width: int, default) -> list[tuple]:
    rows = h.get(name, default)
    if not isinstance(rows, list) or not rows or any(not isinstance(r, list) or len(r) != width for r in rows):
        raise InvalidRequestError(f"histogram {name!r} must be a list of [{'value' if width == 2 else 'width, height'}"
                                  f", weight] pairs, got {str(rows)[:80]}")
    for r in rows:
        if any(not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 for v in r) or r[-1] <= 0:
            raise InvalidRequestError(f"histogram {name!r}: values are non-negative and weights positive, got {r}")
    return [tuple(r) for r in rows]


def _histogram(h, image_tokens) -> list[Request]:
    if not isinstance(h, dict):
        raise InvalidRequestError("'histogram' must be an object of distributions")
    unknown = set(h) - {"prompt_tokens", "output_tokens", "images", "image_sizes"}
    if unknown:
        raise InvalidRequestError(f"histogram: unknown key(s) {sorted(unknown)}; known: prompt_tokens, output_tokens, "
                                  f"images, image_sizes")
    prompts, outputs = _pairs(h, "prompt_tokens", 2, None), _pairs(h, "output_tokens", 2, [[0, 1]])
    counts = _pairs(h, "images", 2, [[0, 1]])
    sizes = _pairs(h, "image_sizes", 3, [[1, 1, 1]]) if any(c for c, _ in counts) else [(1, 1, 1)]
    sized = [(image_tokens(int(w), int(hh)), wt / sum(s[2] for s in sizes)) for w, hh, wt in sizes]
    kinds = len(prompts) * len(outputs) * sum(len(sized) ** int(c) for c, _ in counts)
    if kinds > MAX_COMBINATIONS:
        raise InvalidRequestError(f"the histogram makes {kinds:,} kinds of request, more than {MAX_COMBINATIONS:,}: "
                                  f"use fewer bins")
    total = {name: sum(r[-1] for r in rows) for name, rows in (("p", prompts), ("o", outputs), ("c", counts))}
    out = []
    for (p, pw), (o, ow), (c, cw) in itertools.product(prompts, outputs, counts):
        for combo in itertools.product(sized, repeat=int(c)):
            weight = pw / total["p"] * ow / total["o"] * cw / total["c"]
            for _, sw in combo:
                weight *= sw
            out.append(Request(int(p), tuple(t for t, _ in combo), int(o), weight))
    return out
