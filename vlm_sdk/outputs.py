"""What a caller receives: one `RequestOutput` per stream update, and the final one."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    prompt_tokens: int = 0
    image_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache when the request was first scheduled
    preprocess_time: float = 0.0  # seconds spent decoding images and building the prompt

    def snapshot(self) -> "RequestMetrics":
        """A copy (the engine keeps updating its own); a third of `dataclasses.replace`'s cost, which
        counts at every step for every request."""
        copy = object.__new__(RequestMetrics)
        copy.__dict__.update(self.__dict__)
        return copy

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_time(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True)
class ToolCall:
    """One complete call: `arguments` is the JSON text of the arguments (OpenAI's `function.arguments`)."""
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index` as OpenAI streams it: the first piece carries `id` and `name`, every piece
    a fragment of `arguments` (the fragments of a call concatenate to its arguments)."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and the `SamplingParams.logprobs` most likely tokens (best first),
    in the distribution it was drawn from: after penalties, temperature, top-k and top-p (a token they
    cut has logprob -inf). A greedy token's distribution is the softmax of its penalized logits."""
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]  # (token id, logprob), best first


class LogprobColumns:
    """One sequence's logprobs, compact: two flat arrays holding a row of `width` = k + 1 entries per
    token, the drawn token's id and logprob first, then its k alternatives best first. 8 bytes an
    entry, where a `TokenLogprob` per token held a tuple per alternative (~3 KB a token at k = 20:
    the outputs of one n=8 x 4,000-token request held 89-98 MiB of small objects, which cost
    garbage collections and took the GIL for a while to free).
    Append-only, so a `LogprobsView` of its first tokens stays valid while it grows."""
    __slots__ = ("width", "ids", "values")

    def __init__(self, k: int):
        self.width = k + 1
        self.ids = array("i")  # [tokens * width] token ids
        self.values = array("f")  # [tokens * width] logprobs: float32, the sampler's dtype, so exact

    def append(self, lp: TokenLogprob) -> None:
        if len(lp.top_logprobs) != self.width - 1:
            raise ValueError(f"this token's logprobs have {len(lp.top_logprobs)} alternatives; its sequence "
                             f"keeps {self.width - 1} per token")
        self.ids.append(lp.token_id)
        self.values.append(lp.logprob)
        if lp.top_logprobs:
            ids, values = zip(*lp.top_logprobs)
            self.ids.extend(ids)
            self.values.extend(values)

    def __len__(self) -> int:
        return len(self.ids) // self.width

    def view(self) -> "LogprobsView":
        return LogprobsView(self, len(self))


@dataclass(frozen=True, slots=True, eq=False)
class LogprobsView:
    """The first `length` tokens of a `LogprobColumns`: what each `RequestOutput` of a stream holds, so
    that no output copies the tokens before it. Equal to another view of the same values."""
    columns: LogprobColumns
    length: int

    # tokens read from the arrays at a time: their Python numbers live only that long, and a body's
    # writer hands the GIL back between blocks (server/logprobs.py)
    BLOCK = 16

    def __len__(self) -> int:
        return self.length

    def __eq__(self, other) -> bool:
        if not isinstance(other, LogprobsView):
            return NotImplemented
        a, b, end = self.columns, other.columns, self.length * self.columns.width
        return (a.width, self.length) == (b.width, other.length) and a.ids[:end] == b.ids[:end] \
            and a.values[:end] == b.values[:end]

    def blocks(self, start: int = 0) -> Iterator[tuple[list[int], list[float]]]:
        """The rows of tokens `start`.. (ids, logprobs: `columns.width` entries a token), `BLOCK` tokens
        at a time."""
        w, cols = self.columns.width, self.columns
        for first in range(start, self.length, self.BLOCK):
            end = min(first + self.BLOCK, self.length) * w
            yield cols.ids[first * w:end].tolist(), cols.values[first * w:end].tolist()

    def rows(self, start: int = 0) -> Iterator[tuple[int, float, list[int], list[float]]]:
        """(token id, logprob, the alternatives' ids, their logprobs) of each token from `start` on."""
        w = self.columns.width
        for ids, values in self.blocks(start):
            for i in range(0, len(ids), w):
                yield ids[i], values[i], ids[i + 1:i + w], values[i + 1:i + w]

    def tokens(self, start: int = 0) -> list[TokenLogprob]:
        """Tokens `start`.. as `TokenLogprob`s."""
        return [TokenLogprob(t, v, tuple(zip(ids, values))) for t, v, ids, values in self.rows(start)]


class PromptLogprobs:
    """A prompt's logprobs (`SamplingParams(prompt_logprobs=k)`): at each position i >= 1, the logprob of
    prompt token i given the tokens before it, its rank there (1: the most likely; ties count as above,
    as vLLM ranks) and the k most likely tokens with theirs; position 0 has none (nothing comes before
    it). Of the model's raw distribution: log-softmax of its logits, no penalty, bias or temperature (no
    token is sampled at a prompt position). Compact: numpy arrays filled as the prompt is computed."""
    __slots__ = ("token_ids", "logprobs", "ranks")

    def __init__(self, num_tokens: int, k: int):
        self.token_ids = np.zeros((num_tokens, k + 1), np.int32)  # row i: prompt token i, then the k most likely
        self.logprobs = np.zeros((num_tokens, k + 1), np.float32)
        self.ranks = np.zeros(num_tokens, np.int64)  # of prompt token i

    def write(self, start: int, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> None:
        """Rows `start`.. (a computed chunk of the prompt; a recomputed one writes the same values again)."""
        end = start + len(ranks)
        self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end] = token_ids, logprobs, ranks

    def __len__(self) -> int:
        return len(self.ranks)

    def entries(self) -> list[dict[int, tuple[float, int]] | None]:
        """vLLM's shape: None for position 0, then per position {token id: (logprob, rank)}, the prompt
        token first, then the k most likely (ranks 1..k; the prompt token, if among them, once)."""
        out: list[dict[int, tuple[float, int]] | None] = [None]
        ids, values, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        for i in range(1, len(ranks)):
            row = {ids[i][0]: (values[i][0], ranks[i])}
            for j in range(1, len(ids[i])):
                row.setdefault(ids[i][j], (values[i][j], j))
            out.append(row)
        return out


@dataclass
class RequestOutput:
    """`text` and `token_ids` hold everything generated so far; `delta_text` what is new since the
    previous output of this request. `finish_reason` is None while running, then "stop", "length",
    "abort", or "tool_calls" (it stopped after calling tools). With `SamplingParams(n=k)` a stream interleaves the k samples, told apart by `index`; the
    output `chat` returns is sample 0 with all k final samples in `outputs` (index order)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    finish_reason: str | None
    metrics: RequestMetrics = field(repr=False, default=None)
    # with SamplingParams(logprobs=k): every token's logprobs so far, compact (`logprobs` reads them as
    # `TokenLogprob`s); None otherwise
    token_logprobs: LogprobsView | None = field(repr=False, default=None)
    index: int = 0  # which of the request's n samples
    outputs: list["RequestOutput"] | None = field(repr=False, default=None)  # set by chat(): every sample
    # the text read by the prompt's output format (tools, a reasoning model): the answer without its
    # reasoning and tool-call markup, the reasoning (None: no reasoning block), the calls so far (a
    # forced call's arguments grow while it streams); without a format, content is `text`
    content: str = ""
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    # what each of those gained with this output (a call's first piece has its id and name)
    delta_content: str = ""
    delta_reasoning_content: str = ""
    delta_tool_calls: list[ToolCallDelta] = field(default_factory=list)
    # with SamplingParams(prompt_logprobs=k): the prompt's (sample 0 of n; set from its first output on)
    prompt_logprobs: PromptLogprobs | None = field(repr=False, default=None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def reasoning(self) -> str | None:
        """`reasoning_content` under vLLM's newer name."""
        return self.reasoning_content

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """With SamplingParams(logprobs=k): one `TokenLogprob` per token of `token_ids` (built on first
        read, from `token_logprobs`); None otherwise."""
        if self.token_logprobs is None:
            return None
        built = self.__dict__.get("_logprobs")
        if built is None:
            built = self.__dict__["_logprobs"] = self.token_logprobs.tokens()
        return built

    def set_whole(self) -> None:
        """Make this final output the only one of its request: every delta is all of it."""
        self.delta_text, self.delta_content = self.text, self.content
        self.delta_reasoning_content = self.reasoning_content or ""
        self.delta_tool_calls = [ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(self.tool_calls)]

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache (vLLM's name); 0 until first scheduled."""
        return self.metrics.cached_tokens if self.metrics is not None else 0


# bidirectional-text controls: shown as escapes too, so a model cannot reorder what the terminal shows
_BIDI = frozenset(range(0x202A, 0x202F)) | frozenset(range(0x2066, 0x206A))


def terminal_text(text: str) -> str:
    """Model text made safe to write to a terminal: newlines and tabs kept; every other control
    character (C0, DEL, C1: \\x1c, \\x05, \\x1b of escape sequences, \\r), bidi controls, lone
    surrogates and U+FFFD (what the detokenizer puts where the model's bytes were not valid UTF-8)
    are written as visible Python-style escapes (\\x1c, \\u202e, \\ufffd). Per character, so stream
    deltas may be escaped one by one."""
    out = []
    for ch in text:
        c = ord(ch)
        if ch in "\n\t" or (0x20 <= c < 0x7F) or (c >= 0xA0 and c not in _BIDI and c != 0xFFFD
                                                   and not 0xD800 <= c <= 0xDFFF):
            out.append(ch)
        elif c < 0x100:
            out.append(f"\\x{c:02x}")
        else:
            out.append(f"\\u{c:04x}")
    return "".join(out)
