"""Per-request sampling and stopping settings."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from vlm_sdk.errors import InvalidRequestError

# below this a temperature would overflow float32 logits / T; it means "greedy" in practice
MIN_TEMPERATURE = 1e-5
# the smallest normal float32: the sampler compares top_p as a float32, where a smaller value can
# become 0 (and 0 masks every token); nobody means a nucleus that small
MIN_TOP_P = 1.1754943508222875e-38
# a signed 64-bit integer, as vLLM's OpenAI server takes it (torch.Generator.manual_seed would also take
# 2**63 to 2**64-1, but a client that sends one to vLLM gets a 400, and the two ranges draw alike mod 2**64)
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
# output tokens of a request that does not say; None ("not set") runs to max_model_len instead, and the
# too-long error then sizes its fixes for this many
DEFAULT_MAX_TOKENS = 256
# OpenAI's limits: top_logprobs 0-20, presence/frequency penalties in [-2, 2], logit_bias in [-100, 100]
MAX_LOGPROBS = 20
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# nesting of a JSON Schema, as of a request body (vlm_sdk/server/body.py MAX_JSON_DEPTH): a schema sent
# as a JSON string, or built in Python, is held to what an inline one could reach; deeper ones would
# exhaust Python's recursion (json.loads, json.dumps) and the grammar compiler's stack
MAX_SCHEMA_DEPTH = 64


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _refuse(name: str, rule: str, value) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:80] + "..."  # a megabyte string stays out of the message
    raise InvalidRequestError(f"'{name}' {rule}, got {shown}", param=name)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below 1e-5) is greedy. A `seed` gives this request its own random stream, so
    its samples do not depend on which other requests share the batch."""
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # None: no logprobs; k (0-20): each generated token's logprob and the k most likely alternatives,
    # of the distribution the token was drawn from (after penalties, temperature, top-k and top-p)
    logprobs: int | None = None
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was already generated
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in prompt or output (vLLM's / HF's)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    # token id -> bias added to its logit; stored as sorted (id, bias) pairs so the dataclass stays hashable
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # parallel samples of one prompt, built (and its image encoded) once; sample i draws from seed + i
    n: int = 1
    # constrained output (engine/structured_output.py, README "Structured outputs"): OpenAI's
    # {"type": "json_object"} / {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}, or
    # one of {"json": schema} | {"json_object": True} | {"regex": str} | {"choice": [str, ...]} |
    # {"grammar": Lark or GBNF text}. Either is stored as a `StructuredOutputs`; at most one may be set.
    response_format: "dict | StructuredOutputs | None" = None
    structured_outputs: "dict | StructuredOutputs | None" = None
    # None: none; k (0-20): each prompt token's logprob given the tokens before it, its rank, and the k
    # most likely tokens there (vLLM's prompt_logprobs), of the model's raw distribution: nothing was
    # sampled at a prompt position, so no penalty or temperature applies. The prompt is computed whole
    # (no prefix-cache hit), and of n samples only the first computes them (`RequestOutput.prompt_logprobs`)
    prompt_logprobs: int | None = None

    def __post_init__(self):
        # accept lists and a single string for convenience, keep the dataclass hashable
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
            _refuse("stop", "must be a non-empty string or a list of them", self.stop)
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids or ()
        if not isinstance(ids, (list, tuple)) or any(not _is_int(t) or t < 0 for t in ids):
            _refuse("stop_token_ids", "must be a list of token ids (integers >= 0)", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _refuse("max_tokens", "must be an integer >= 1 (or None: up to max_model_len)", self.max_tokens)
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            _refuse("temperature", "must be a finite number >= 0 (0 = greedy)", self.temperature)
        if not _is_number(self.top_p) or not MIN_TOP_P <= self.top_p <= 1.0:
            _refuse("top_p", f"must be a number in (0, 1], at least {MIN_TOP_P:.4g} (below it float32 sampling "
                             f"rounds it to 0)", self.top_p)
        if not _is_int(self.top_k) or self.top_k < -1:
            _refuse("top_k", "must be an integer >= 0 (0 or -1 disables it)", self.top_k)
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            _refuse("seed", f"must be an integer from {SEED_MIN} to {SEED_MAX} or None", self.seed)
        if not isinstance(self.ignore_eos, bool):
            _refuse("ignore_eos", "must be True or False", self.ignore_eos)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                _refuse(name, f"must be an integer from 0 to {MAX_LOGPROBS} or None", value)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                _refuse(name, f"must be a number from {-MAX_PENALTY:g} to {MAX_PENALTY:g}", value)
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            _refuse("repetition_penalty", "must be a finite number > 0 (1 = off)", self.repetition_penalty)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _refuse("min_tokens", "must be an integer >= 0", self.min_tokens)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if not _is_int(self.n) or self.n < 1:
            _refuse("n", "must be an integer >= 1", self.n)
        fmt = _from_response_format(self.response_format)
        structured = _from_structured_outputs(self.structured_outputs)
        if fmt is not None and structured is not None:
            _refuse("structured_outputs", "cannot be combined with a response_format other than text",
                    self.response_format)
        object.__setattr__(self, "response_format", fmt)
        object.__setattr__(self, "structured_outputs", structured)
        if self.min_tokens and self.grammar is not None:  # a complete grammar allows only EOS, which it masks
            _refuse("min_tokens", "cannot be combined with structured outputs (the output ends where the grammar "
                                  "does); leave min_tokens out", self.min_tokens)

    @property
    def grammar(self) -> "StructuredOutputs | None":
        """The constraint on the output, from either field; None: free text."""
        return self.response_format or self.structured_outputs

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def sample(self, i: int) -> "SamplingParams":
        """The params of sample i of n: one sample, seed + i (wrapped into the seed range), so n seeded
        samples differ from each other and each is reproducible; the prompt's logprobs only for sample 0
        (they are the same for all, and the others may then share its cached prompt blocks)."""
        seed = self.seed
        if seed is not None and i:
            seed = (seed + i - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN
        return replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if i == 0 else None)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """A logit_bias dict (or pairs) as sorted (token id, bias) pairs, each checked: every bad key or value
    is named in one error (the first five and a count), as vLLM reports them together."""
    if bias is None:
        return ()
    items = bias.items() if isinstance(bias, dict) else bias
    if not isinstance(items, (list, tuple)) and not isinstance(bias, dict):
        _refuse("logit_bias", "must map token ids to numbers", bias)
    pairs, bad_keys, bad_values = {}, [], []
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            _refuse("logit_bias", "must map token ids to numbers", bias)
        token, value = item
        if not _is_int(token) or token < 0:
            bad_keys.append(token)
        elif not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            bad_values.append((token, value))
        else:
            pairs[token] = float(value)
    if bad_keys:
        raise InvalidRequestError(f"'logit_bias' keys must be token ids (integers >= 0); these are not: "
                                  f"{listed(bad_keys)}", param="logit_bias")
    if bad_values:
        raise InvalidRequestError(f"'logit_bias' values must be numbers from {-MAX_LOGIT_BIAS:g} to "
                                  f"{MAX_LOGIT_BIAS:g}; these are not: "
                                  f"{listed([f'{t}: {v!r}' for t, v in bad_values], repr_items=False)}",
                                  param="logit_bias")
    return tuple(sorted(pairs.items()))


SHOWN_ITEMS = 5  # bad items an error lists before it counts the rest


def listed(items: list, repr_items: bool = True) -> str:
    """The first `SHOWN_ITEMS` of `items` (each cut to 40 characters) and a count of the rest."""
    shown = []
    for item in items[:SHOWN_ITEMS]:
        text = repr(item) if repr_items else str(item)
        shown.append(text if len(text) <= 40 else text[:40] + "...")
    more = f" and {len(items) - SHOWN_ITEMS} more" if len(items) > SHOWN_ITEMS else ""
    return ", ".join(shown) + more


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match, as text the grammar engine compiles. `kind`: "json" (`text` is a
    JSON Schema serialised compactly; json_object is {"type":"object"}), "regex", "choice" (`text`
    is the JSON list of the allowed strings) or "grammar" (Lark or GBNF). `param`: the request field
    it came from, which errors name."""
    kind: str
    text: str
    param: str = "structured_outputs"
    # Lark text of what comes before this grammar, naming it `@answer` (free reasoning up to its end
    # tag: engine/input/chat_setup.py); None: the output starts with it
    prefix: str | None = None


_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _schema_text(schema, name: str) -> str:
    if isinstance(schema, str):  # already JSON text
        try:
            schema = json.loads(schema)
        except RecursionError:  # Python's decoder gives up near 1,000 levels
            _refuse(name, f"nests deeper than {MAX_SCHEMA_DEPTH} levels (the limit of a request body, which a "
                          f"schema sent as a string is held to)", schema)
        except ValueError as e:
            _refuse(name, f"must be a JSON Schema (an object), and this string is not JSON ({e})", schema)
    if schema is True:  # the schema that accepts any JSON value
        schema = {}
    if schema is False:
        _refuse(name, "is false, the schema no value matches; send an object (or true for any JSON value)", schema)
    if not isinstance(schema, dict):
        _refuse(name, "must be a JSON Schema (an object)", schema)
    if _deeper_than(schema, MAX_SCHEMA_DEPTH):
        _refuse(name, f"nests deeper than {MAX_SCHEMA_DEPTH} levels (the limit of a request body, which a schema "
                      f"sent as a string or built in Python is held to)", "...")
    try:  # key order kept: it is the order properties are generated in
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        _refuse(name, f"must hold JSON values only ({e})", schema)


def _deeper_than(value, limit: int) -> bool:
    """Whether dicts and lists nest more than `limit` levels; level by level, never recursing (the
    value may be 100,000 levels deep, or, built in Python, share or cycle through its parts: each
    object is looked at once per level)."""
    level, depth = [value], 1
    while level:
        if depth > limit:
            return True
        below = {}
        for node in level:
            for x in node.values() if isinstance(node, dict) else node:
                if isinstance(x, (dict, list)):
                    below[id(x)] = x
        level, depth = list(below.values()), depth + 1
    return False


def _from_response_format(value) -> StructuredOutputs | None:
    """OpenAI's response_format; {"type": "text"} (or None) is free text."""
    if value is None or isinstance(value, StructuredOutputs):
        return value
    name = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        _refuse(name, 'must be an object like {"type": "json_object"}', value)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs("json", '{"type":"object"}', name)
    if kind != "json_schema":
        _refuse(f"{name}.type", 'must be "text", "json_object" or "json_schema"', kind)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        _refuse(f"{name}.json_schema", 'must be an object {"name", "schema", "strict"}', spec)
    if not isinstance(spec.get("name", ""), str):
        _refuse(f"{name}.json_schema.name", "must be a string", spec.get("name"))
    if spec.get("strict") not in (None, True, False):
        _refuse(f"{name}.json_schema.strict", "must be true or false", spec.get("strict"))
    # no schema: any JSON value (OpenAI makes it optional); strict or not, the schema is enforced
    schema = spec.get("schema", {})
    return StructuredOutputs("json", _schema_text(schema, f"{name}.json_schema.schema"), name)


def _from_structured_outputs(value) -> StructuredOutputs | None:
    if value is None or isinstance(value, StructuredOutputs):
        return value
    name = "structured_outputs"
    if not isinstance(value, dict):
        _refuse(name, f"must be an object with one of the keys {', '.join(_KINDS)}", value)
    unknown = [k for k in value if k not in _KINDS]
    if unknown:
        _refuse(name, f"takes one of the keys {', '.join(_KINDS)}; unknown key {unknown[0]!r}", value)
    given = [k for k in _KINDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        _refuse(name, f"must set exactly one of {', '.join(_KINDS)}", value)
    kind = given[0]
    arg, field_name = value[kind], f"{name}.{kind}"
    if kind == "json":
        return StructuredOutputs("json", _schema_text(arg, field_name), name)
    if kind == "json_object":
        if arg is not True:
            _refuse(field_name, "must be true", arg)
        return StructuredOutputs("json", '{"type":"object"}', name)
    if kind == "choice":
        if not isinstance(arg, (list, tuple)) or not arg or any(not isinstance(c, str) or not c for c in arg):
            _refuse(field_name, "must be a non-empty list of non-empty strings", arg)
        return StructuredOutputs("choice", json.dumps(list(arg), ensure_ascii=False), name)
    if not isinstance(arg, str) or not arg:
        _refuse(field_name, "must be a non-empty string", arg)
    return StructuredOutputs(kind, arg, name)
