"""Speculative decoding settings: vLLM's `speculative_config` dict and field names, checked once.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    vlm-sdk serve MODEL --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

`method`: "ngram" (prompt lookup over the request's prompt and output tokens: no draft weights),
"eagle3" (a draft head over the target's hidden states, `model` its checkpoint) or "mtp" (the
checkpoint's own multi-token-prediction layer). What this build runs is `RUNNABLE_METHODS`; the others
are refused by name, with what to use instead, never accepted and ignored.

Importing this module imports no torch (the CLI builds its flags from EngineArgs).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from vlm_sdk.errors import InvalidRequestError

METHODS = ("ngram", "eagle3", "mtp")
RUNNABLE_METHODS = ("ngram", "eagle3")
FIELDS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max")
PARAM = "speculative_config"
MAX_SPECULATIVE_TOKENS = 16  # a verification step's rows per sequence are 1 + k; beyond this acceptance never pays


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft checkpoint (eagle3)
    prompt_lookup_min: int = 1  # n-gram: the shortest suffix matched (vLLM's defaults)
    prompt_lookup_max: int = 1  # ... and the longest

    @property
    def has_draft_model(self) -> bool:
        return self.method in ("eagle3", "mtp")

    def as_dict(self) -> dict:
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            out |= {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        if self.model is not None:
            out["model"] = self.model
        return out


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """`value`: None, a mapping of vLLM's fields, its JSON text (the flag's), or a SpeculativeConfig.
    `InvalidRequestError` (param "speculative_config") naming the field, the value and the fix."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"speculative_config is not JSON ({e.msg} at character {e.pos}): write e.g. "
                                      f"--speculative-config '{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}'",
                                      param=PARAM) from None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"speculative_config must be a dict of {list(FIELDS)}, got {type(value).__name__}",
                                  param=PARAM)
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise InvalidRequestError(f"speculative_config has unknown field(s) {unknown}; accepted: {list(FIELDS)}",
                                  param=PARAM)
    method = value.get("method")
    if method not in METHODS:
        raise InvalidRequestError(f"speculative_config method={method!r} is not one of {list(METHODS)} ('ngram': "
                                  f"prompt lookup, no draft weights; 'eagle3': a draft head, with 'model'; 'mtp': "
                                  f"the checkpoint's own MTP layer)", param=PARAM)
    if method not in RUNNABLE_METHODS:
        raise InvalidRequestError(f"speculative_config method={method!r} is not built yet in vlm_sdk (issue 45: "
                                  f"{list(RUNNABLE_METHODS)} runs today); use {{\"method\": \"ngram\", ...}} or leave "
                                  f"speculative_config out", param=PARAM)
    k = value.get("num_speculative_tokens")
    if not _int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise InvalidRequestError(f"speculative_config num_speculative_tokens must be an integer in 1.."
                                  f"{MAX_SPECULATIVE_TOKENS} (the draft tokens verified per step), got {k!r}",
                                  param=PARAM)
    model = value.get("model")
    if method == "ngram":
        if model is not None:
            raise InvalidRequestError(f"speculative_config method='ngram' looks its drafts up in the request's own "
                                      f"tokens and takes no draft model (got model={model!r}): leave 'model' out",
                                      param=PARAM)
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        # vLLM's rule: neither given, both 5; one given, the other takes its value
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _int(v) or v < 1:
                raise InvalidRequestError(f"speculative_config {name} must be a positive integer (n-gram length), "
                                          f"got {v!r}", param=PARAM)
        if lo > hi:
            raise InvalidRequestError(f"speculative_config prompt_lookup_min={lo} is above prompt_lookup_max={hi}: "
                                      f"the n-grams matched run from min to max; set min <= max", param=PARAM)
        return SpeculativeConfig(method, k, None, lo, hi)
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        if value.get(name) is not None:
            raise InvalidRequestError(f"speculative_config {name} applies to method='ngram' only (method={method!r})",
                                      param=PARAM)
    if method == "eagle3" and (not isinstance(model, str) or not model):
        raise InvalidRequestError(f"speculative_config method='eagle3' needs 'model': the draft checkpoint's directory "
                                  f"(config.json + safetensors in the published EAGLE-3 layout), got {model!r}",
                                  param=PARAM)
    return SpeculativeConfig(method, k, model)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_speculation(config: SpeculativeConfig, layer_specs, model: str) -> None:
    """Refuse what cannot verify drafts, before anything is sized (the engine at start-up, `vlm-sdk plan`
    alike): a model with a state layer that keeps no state per draft (`CacheLayout.specs`: a `StateSpec`
    without `draft_states`), whose state after a rejected draft could not be left behind. Gated DeltaNet
    keeps them (Qwen3.5: layers/draft_states.py)."""
    layers = [i for i, s in enumerate(layer_specs) if getattr(s, "kind", None) == "state"
              and not getattr(s, "draft_states", False)]
    if layers:
        raise InvalidRequestError(
            f"speculative_config (method={config.method!r}) rolls a rejected draft's state back to the draft's own "
            f"slot; {model} has state layers ({len(layers)}: {layers[:8]}{' ...' if len(layers) > 8 else ''}) that "
            f"keep no state per draft, so what they hold after a rejected draft could not be restored. Leave "
            f"speculative_config out for this model", param=PARAM)
